/* Helpers shared by every file of the core: names, items snapshots and
 * pinned dict iteration, type lookups that run no descriptors, exception
 * notes.  They call nothing else in the core (dcp.h declares them). */
#include "dcp.h"

#include <stdarg.h>

PyObject *
dcp_join_name(dcp_state *st, PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GET_LENGTH(prefix) == 0) {
        return Py_NewRef(name);
    }
    PyObject *with_dot = PyUnicode_Concat(prefix, st->str_dot);
    if (with_dot == NULL) {
        return NULL;
    }
    PyObject *joined = PyUnicode_Concat(with_dot, name);
    Py_DECREF(with_dot);
    return joined;
}

PyObject *
dcp_child_prefix(dcp_state *st, PyObject *prefix, PyObject *name)
{
    PyObject *joined = PyUnicode_Concat(prefix, name);
    if (joined == NULL) {
        return NULL;
    }
    PyObject *result = PyUnicode_Concat(joined, st->str_dot);
    Py_DECREF(joined);
    return result;
}

int
dcp_unpack_pairs(dcp_state *st, PyObject *list, const char *format, ...)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == 2) {
            continue;
        }
        /* Unpack it as `for a, b in ...` would: any iterable of exactly
         * two items is a pair. */
        Py_INCREF(item); /* pinned: iterating it runs arbitrary code */
        PyObject *pair = PySequence_Tuple(item);
        PyObject *cls = NULL;
        Py_ssize_t got = -1;
        if (pair == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                Py_DECREF(item);
                return -1;
            }
            PyErr_Clear();
            cls = st->err_type; /* upstream: cannot unpack non-iterable */
        }
        else if (PyTuple_GET_SIZE(pair) != 2) {
            got = PyTuple_GET_SIZE(pair);
            cls = st->err_value; /* upstream: wrong number of values */
        }
        if (cls == NULL) {
            Py_DECREF(item);
            if (i >= PyList_GET_SIZE(list)) { /* shrunk by user code */
                Py_DECREF(pair);
                break;
            }
            if (PyList_SetItem(list, i, pair) < 0) {
                return -1;
            }
            continue;
        }
        Py_XDECREF(pair);
        va_list vargs;
        va_start(vargs, format);
        PyObject *what = PyUnicode_FromFormatV(format, vargs);
        va_end(vargs);
        if (what != NULL) {
            if (got < 0) {
                PyErr_Format(cls,
                             "%U must yield pairs: item %zd is a "
                             "non-iterable %.200s",
                             what,
                             i,
                             Py_TYPE(item)->tp_name);
            }
            else {
                PyErr_Format(cls,
                             "%U must yield pairs: item %zd (%.200s) has "
                             "%zd values",
                             what,
                             i,
                             Py_TYPE(item)->tp_name,
                             got);
            }
            Py_DECREF(what);
        }
        Py_DECREF(item);
        return -1;
    }
    return 0;
}

int
dcp_dict_iter_next(dcp_dict_iter *it, PyObject **key, PyObject **value)
{
    Py_CLEAR(it->key);
    Py_CLEAR(it->value);
    if (it->dict == NULL) {
        return 0;
    }
    if (PyDict_GET_SIZE(it->dict) != it->size) {
        PyErr_SetString(PyExc_RuntimeError,
                        "dictionary changed size during iteration");
        dcp_dict_iter_clear(it);
        return -1;
    }
    PyObject *k, *v;
    if (!PyDict_Next(it->dict, &it->pos, &k, &v)) {
        dcp_dict_iter_clear(it);
        return 0;
    }
    /* Pinned before anything else can run: the caller's next allocation
     * may start a collection whose finalizers drop them from the dict. */
    it->key = Py_NewRef(k);
    it->value = Py_NewRef(v);
    *key = k;
    *value = v;
    return 1;
}

void
dcp_dict_iter_clear(dcp_dict_iter *it)
{
    Py_CLEAR(it->key);
    Py_CLEAR(it->value);
    Py_CLEAR(it->dict);
}

PyObject *
dcp_items_list(dcp_state *st, PyObject *mapping)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *result = PyList_New(0);
        if (result == NULL) {
            return NULL;
        }
        /* Each PyTuple_Pack and append allocates, which may run a
         * collection, and a finalizer may change the dict: the entries
         * are pinned (dcp_dict_iter) and the size is checked before each
         * step, as CPython's dict iterators do. */
        dcp_dict_iter it;
        dcp_dict_iter_init(&it, mapping);
        PyObject *key, *value;
        int rc;
        while ((rc = dcp_dict_iter_next(&it, &key, &value)) == 1) {
            PyObject *pair = PyTuple_Pack(2, key, value);
            if (pair == NULL || PyList_Append(result, pair) < 0) {
                Py_XDECREF(pair);
                rc = -1;
                break;
            }
            Py_DECREF(pair);
        }
        dcp_dict_iter_clear(&it);
        if (rc < 0) {
            Py_DECREF(result);
            return NULL;
        }
        return result;
    }
    PyObject *items = PyMapping_Items(mapping);
    if (items == NULL) {
        return NULL;
    }
    if (dcp_unpack_pairs(
            st, items, "items() of %.200s", Py_TYPE(mapping)->tp_name) < 0) {
        Py_DECREF(items);
        return NULL;
    }
    return items;
}

PyObject *
dcp_type_lookup(PyTypeObject *tp, PyObject *name)
{
    PyObject *mro = tp->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) {
        return NULL;
    }
    /* Hold the MRO: a metaclass could replace it while we look. */
    Py_INCREF(mro);
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyObject *base = PyTuple_GET_ITEM(mro, i);
        PyObject *dict = dcp_type_dict((PyTypeObject *)base);
        if (dict == NULL) {
            continue;
        }
        int rc = dcp_dict_get_ref(dict, name, &found);
        Py_DECREF(dict);
        if (rc < 0) {
            found = NULL;
            break;
        }
        if (rc == 1) {
            break;
        }
    }
    Py_DECREF(mro);
    return found;
}

PyObject *
dcp_lookup_hook(PyObject *obj, PyObject *name)
{
    PyObject *found = dcp_type_lookup(Py_TYPE(obj), name);
    if (found != NULL || PyErr_Occurred()) {
        if (found == NULL) {
            return NULL;
        }
        /* Bind it the way attribute access would (functions become
         * methods; staticmethods and plain callables stay as they are). */
        descrgetfunc get = Py_TYPE(found)->tp_descr_get;
        if (get != NULL) {
            PyObject *bound = get(found, obj, (PyObject *)Py_TYPE(obj));
            Py_DECREF(found);
            return bound;
        }
        return found;
    }
    PyObject *inst_dict = PyObject_GenericGetDict(obj, NULL);
    if (inst_dict == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
        }
        return NULL;
    }
    int rc = dcp_dict_get_ref(inst_dict, name, &found);
    Py_DECREF(inst_dict);
    return rc == 1 ? found : NULL;
}

void
dcp_note_format(const char *format, ...)
{
    /* Formatting runs with no exception pending: stash the one being
     * raised, build the note, restore it, then attach the note. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return;
    }
    va_list vargs;
    va_start(vargs, format);
    PyObject *note = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (note == NULL) {
        /* The original exception matters more than its note. */
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
    if (note != NULL) {
        dcp_add_note(note);
        Py_DECREF(note);
    }
}

void
dcp_note_key(PyObject *key)
{
    /* %S on anything but a str reads it as one: keys of state dicts and
     * optimizer state are arbitrary objects (ints, tuples, ...). */
    if (PyUnicode_Check(key)) {
        dcp_note_format("at key '%S'", key);
    }
    else {
        dcp_note_format("at key %R", key);
    }
}

PyObject *
dcp_as_list(dcp_state *st, PyObject *seq, const char *what)
{
    if (PyList_CheckExact(seq)) {
        return PyList_GetSlice(seq, 0, PyList_GET_SIZE(seq));
    }
    PyObject *result = PySequence_List(seq);
    if (result == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(st->err_type,
                     "%s must be a sequence, not %.200s",
                     what,
                     Py_TYPE(seq)->tp_name);
    }
    return result;
}
