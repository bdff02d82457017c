/* Module definition of dcp_optim._dcp_optim: per-module state, shared
 * helpers, the method table and multi-phase initialisation. */
#include "dcp.h"

#include <stdarg.h>

/* ======================================================================
 * Shared helpers
 */

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

PyObject *
dcp_items_list(dcp_state *st, PyObject *mapping)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *result = PyList_New(PyDict_GET_SIZE(mapping));
        if (result == NULL) {
            return NULL;
        }
        Py_ssize_t pos = 0, i = 0;
        PyObject *key, *value;
        /* PyDict_Next runs no Python code, so the dict cannot change
         * under us; the size check only guards against a miscount. */
        while (PyDict_Next(mapping, &pos, &key, &value)) {
            if (i >= PyList_GET_SIZE(result)) {
                break;
            }
            PyObject *pair = PyTuple_Pack(2, key, value);
            if (pair == NULL) {
                Py_DECREF(result);
                return NULL;
            }
            PyList_SET_ITEM(result, i, pair);
            i++;
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

/* ======================================================================
 * Method table: the entries no file owns yet (the other files' tables
 * are added by the exec slot)
 */

static PyMethodDef dcp_methods[] = {
    {"walk_model",
     DCP_FASTCALL(dcp_walk_model),
     METH_FASTCALL,
     "walk_model(ctx, model, modifiers_name, /)\n--\n\n"
     "Walk `model` once and return a ModelIndex."},
    {NULL, NULL, 0, NULL},
};

/* ======================================================================
 * Module state and multi-phase initialisation
 */

static int
dcp_module_traverse(PyObject *module, visitproc visit, void *arg)
{
    dcp_state *st = dcp_get_state(module);
    Py_VISIT(st->Context_Type);
    Py_VISIT(st->ModelIndex_Type);
    Py_VISIT(st->WalkTrace_Type);
    Py_VISIT(st->LoadPlan_Type);
    Py_VISIT(st->GatherPlan_Type);
#define DCP_VISIT_STR(name, text) Py_VISIT(st->str_##name);
    DCP_INTERNED_STRINGS(DCP_VISIT_STR)
#undef DCP_VISIT_STR
#define DCP_VISIT_ERR(name, text) Py_VISIT(st->err_##name);
    DCP_ERROR_CLASSES(DCP_VISIT_ERR)
#undef DCP_VISIT_ERR
    return 0;
}

static int
dcp_module_clear(PyObject *module)
{
    dcp_state *st = dcp_get_state(module);
    Py_CLEAR(st->Context_Type);
    Py_CLEAR(st->ModelIndex_Type);
    Py_CLEAR(st->WalkTrace_Type);
    Py_CLEAR(st->LoadPlan_Type);
    Py_CLEAR(st->GatherPlan_Type);
#define DCP_CLEAR_STR(name, text) Py_CLEAR(st->str_##name);
    DCP_INTERNED_STRINGS(DCP_CLEAR_STR)
#undef DCP_CLEAR_STR
#define DCP_CLEAR_ERR(name, text) Py_CLEAR(st->err_##name);
    DCP_ERROR_CLASSES(DCP_CLEAR_ERR)
#undef DCP_CLEAR_ERR
    return 0;
}

static void
dcp_module_free(void *module)
{
    (void)dcp_module_clear((PyObject *)module);
}

/* Exec-slot step: the exception classes of the contract in dcp.h, from
 * dcp_optim.errors; each must be an exception class.  A dcp_optim.errors
 * already in sys.modules is taken as it is: PyImport_ImportModule would
 * also import the package dcp_optim (to return the top-level module),
 * whose __init__ imports torch, and the torch-free suites load errors.py
 * and the core without the package. */
static int
dcp_errors_exec(dcp_state *st)
{
    PyObject *name = PyUnicode_FromString("dcp_optim.errors");
    if (name == NULL) {
        return -1;
    }
    PyObject *errors = PyImport_GetModule(name);
    if (errors == NULL && !PyErr_Occurred()) {
        errors = PyImport_Import(name);
    }
    Py_DECREF(name);
    if (errors == NULL) {
        return -1;
    }
    int rc = 0;
#define DCP_LOAD_ERR(name, text)                                    \
    if (rc == 0) {                                                  \
        st->err_##name = PyObject_GetAttrString(errors, text);      \
        if (st->err_##name == NULL) {                               \
            rc = -1;                                                \
        }                                                           \
        else if (!PyExceptionClass_Check(st->err_##name)) {         \
            PyErr_Format(PyExc_TypeError,                           \
                         "dcp_optim.errors.%s is not an exception", \
                         text);                                     \
            rc = -1;                                                \
        }                                                           \
    }
    DCP_ERROR_CLASSES(DCP_LOAD_ERR)
#undef DCP_LOAD_ERR
    Py_DECREF(errors);
    return rc;
}

static int
dcp_module_exec(PyObject *module)
{
    dcp_state *st = dcp_get_state(module);
    /* Fill every state slot now; nothing is filled lazily later. */
#define DCP_INTERN_STR(name, text)                     \
    st->str_##name = PyUnicode_InternFromString(text); \
    if (st->str_##name == NULL) {                      \
        return -1;                                     \
    }
    DCP_INTERNED_STRINGS(DCP_INTERN_STR)
#undef DCP_INTERN_STR
    if (dcp_errors_exec(st) < 0) {
        return -1;
    }
    if (dcp_context_init_type(module, st) < 0) {
        return -1;
    }
    if (dcp_walk_init_type(module, st) < 0) {
        return -1;
    }
    if (dcp_full_load_init_type(module, st) < 0 ||
        dcp_gather_init_type(module, st) < 0) {
        return -1;
    }
    PyMethodDef *tables[] = {
        dcp_fqn_methods,
        dcp_optim_methods,
        dcp_split_methods,
        dcp_flat_methods,
        dcp_tree_methods,
        dcp_model_load_methods,
        dcp_schema_methods,
        dcp_fsdp1_methods,
        dcp_shard_geometry_methods,
        dcp_pack_methods,
        dcp_full_load_methods,
        dcp_load_jobs_methods,
        dcp_gather_methods,
        dcp_reshard_plan_methods,
    };
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
        if (PyModule_AddFunctions(module, tables[i]) < 0) {
            return -1;
        }
    }
    /* A marker tests use to prove the compiled core is the one loaded. */
    if (PyModule_AddStringConstant(module, "BACKEND", "c") < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "ABI_VERSION", 1) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot dcp_slots[] = {
    {Py_mod_exec, dcp_module_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

PyModuleDef dcp_moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dcp_optim._dcp_optim",
    .m_doc =
        "Native core of dcp_optim: module walks, FQN mapping, "
        "optimizer state (un)flattening and splitting, resharding "
        "plans.",
    .m_size = sizeof(dcp_state),
    .m_methods = dcp_methods,
    .m_slots = dcp_slots,
    .m_traverse = dcp_module_traverse,
    .m_clear = dcp_module_clear,
    .m_free = dcp_module_free,
};

PyMODINIT_FUNC PyInit__dcp_optim(void);

PyMODINIT_FUNC
PyInit__dcp_optim(void)
{
    return PyModuleDef_Init(&dcp_moduledef);
}
