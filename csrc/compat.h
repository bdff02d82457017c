/* Small shims so the extension builds unchanged on CPython 3.10 through
 * 3.13+.  Only public C-API is used; where a newer function exists we
 * call it, otherwise an equivalent built from older public calls.
 */
#ifndef DCP_COMPAT_H
#define DCP_COMPAT_H

#ifndef PY_SSIZE_T_CLEAN
#error "include Python.h (with PY_SSIZE_T_CLEAN) before compat.h"
#endif

/* Strong-reference dict lookup.  Returns 1 and a new reference in *result
 * when found, 0 and NULL when absent, -1 with an exception on error.
 * PyDict_GetItem swallows errors (a raising __eq__ or __hash__), so it is
 * never used in this code base. */
#if PY_VERSION_HEX >= 0x030D0000
#define dcp_dict_get_ref PyDict_GetItemRef
#else
static inline int
dcp_dict_get_ref(PyObject *dict, PyObject *key, PyObject **result)
{
    PyObject *item = PyDict_GetItemWithError(dict, key);
    if (item != NULL) {
        *result = Py_NewRef(item);
        return 1;
    }
    *result = NULL;
    return PyErr_Occurred() ? -1 : 0;
}
#endif

/* Attach a PEP 678 note to the exception currently being raised, e.g.
 * "while walking module 'layers.3'" (on 3.10, appended to __notes__ as
 * add_note would).  Failures to add the note are ignored: the original
 * exception matters more than the note. */
static inline void
dcp_add_note(PyObject *note)
{
    PyObject *exc = NULL, *res = NULL;
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type = NULL, *tb = NULL;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL) {
        (void)PyException_SetTraceback(exc, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    if (exc == NULL) {
        return;
    }
#if PY_VERSION_HEX >= 0x030B0000
    res = PyObject_CallMethod(exc, "add_note", "O", note);
#else
    /* 3.10 has no BaseException.add_note: do what it does (append to the
     * __notes__ list, creating it), so callers and tests read the same
     * notes on every version; 3.10's traceback printer does not show
     * them. */
    PyObject *notes = PyObject_GetAttrString(exc, "__notes__");
    if (notes == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        notes = PyList_New(0);
        if (notes != NULL &&
            PyObject_SetAttrString(exc, "__notes__", notes) < 0) {
            Py_CLEAR(notes);
        }
    }
    if (notes != NULL && PyList_Check(notes) &&
        PyList_Append(notes, note) == 0) {
        res = Py_NewRef(Py_None);
    }
    Py_XDECREF(notes);
#endif
    if (res == NULL) {
        PyErr_Clear();
    }
    Py_XDECREF(res);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)),
                  exc,
                  PyException_GetTraceback(exc));
#endif
}

/* PySequence_Fast, but never the caller's own list: PySequence_Fast
 * returns a list argument itself, and the loops over it call back into
 * Python (torch ops, factories, isinstance hooks) that may mutate it,
 * after which PySequence_Fast_GET_ITEM reads past the end.  Lists are
 * copied (pointers only); tuples are immutable and returned as they are.
 * New reference, or NULL with TypeError(`message`) for non-sequences. */
static inline PyObject *
dcp_sequence_fast(PyObject *obj, const char *message)
{
    if (PyList_Check(obj)) {
        return PyList_GetSlice(obj, 0, PyList_GET_SIZE(obj));
    }
    return PySequence_Fast(obj, message);
}

/* PyArg_ParseTuple for items that come from callers: on anything but a
 * tuple, PyArg_ParseTuple raises SystemError ("new style getargs format
 * but argument is not a tuple"), which reads as an interpreter bug; this
 * raises a TypeError naming the type instead.  1 / 0 like the original. */
static inline int
dcp_parse_tuple(PyObject *obj, const char *format, ...)
{
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "expected a tuple, not %.200s",
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    va_list vargs;
    va_start(vargs, format);
    int ok = PyArg_VaParse(obj, format, vargs);
    va_end(vargs);
    return ok;
}

/* A type's attribute dict, as a new reference (NULL without an exception
 * when the type has none yet).  From 3.12 the tp_dict slot of static
 * builtin types (object, int, ...) is always NULL: their dicts live on
 * the interpreter and PyType_GetDict is the only way to reach them. */
static inline PyObject *
dcp_type_dict(PyTypeObject *tp)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyType_GetDict(tp);
#else
    return Py_XNewRef(tp->tp_dict);
#endif
}

/* PyType_GetModuleByDef (3.11+): the module, defined by `def`, of the
 * first heap type in tp's MRO created with PyType_FromModuleAndSpec.
 * Borrowed reference, or NULL with TypeError.  On 3.10 the same walk is
 * made with PyType_GetModule (3.9+), skipping static types and heap
 * types without a module. */
#if PY_VERSION_HEX >= 0x030B0000
#define dcp_type_module_by_def PyType_GetModuleByDef
#else
static inline PyObject *
dcp_type_module_by_def(PyTypeObject *tp, PyModuleDef *def)
{
    PyObject *mro = tp->tp_mro;
    Py_ssize_t n = mro != NULL ? PyTuple_GET_SIZE(mro) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
        if (!PyType_HasFeature(base, Py_TPFLAGS_HEAPTYPE)) {
            continue;
        }
        PyObject *module = PyType_GetModule(base);
        if (module == NULL) {
            PyErr_Clear(); /* a heap type from a class statement */
            continue;
        }
        if (PyModule_GetDef(module) == def) {
            return module;
        }
    }
    PyErr_Format(PyExc_TypeError,
                 "PyType_GetModuleByDef: No superclass of '%s' has "
                 "the given module",
                 tp->tp_name);
    return NULL;
}
#endif

#endif /* DCP_COMPAT_H */
