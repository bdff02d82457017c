/* Context: the torch classes and base methods the core compares against.
 *
 * Why a handed-in object instead of importing torch in the exec slot: the
 * module must import (and its refcount/sanitizer suites must run) on
 * interpreters where torch cannot load, e.g. a debug build of CPython; and
 * tests can drive every code path with fake module/optimizer classes by
 * building a Context over them.  The Python layer builds exactly one
 * Context over the real torch classes at import time.
 */
#include "dcp.h"

#include <stddef.h> /* offsetof */
#include <structmember.h>

static int
Context_traverse(PyObject *self, visitproc visit, void *arg)
{
    dcp_Context *ctx = (dcp_Context *)self;
    Py_VISIT(Py_TYPE(self));
#define DCP_VISIT_FIELD(name) Py_VISIT(ctx->name);
    DCP_CONTEXT_FIELDS(DCP_VISIT_FIELD)
#undef DCP_VISIT_FIELD
    return 0;
}

static int
Context_clear(PyObject *self)
{
    dcp_Context *ctx = (dcp_Context *)self;
#define DCP_CLEAR_FIELD(name) Py_CLEAR(ctx->name);
    DCP_CONTEXT_FIELDS(DCP_CLEAR_FIELD)
#undef DCP_CLEAR_FIELD
    return 0;
}

static void
Context_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)Context_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Fields that must be tuples of classes (possibly empty). */
static int
Context_is_tuple_field(const char *name)
{
    return strcmp(name, "ddp_types") == 0 ||
           strcmp(name, "compiled_types") == 0 ||
           strcmp(name, "fsdp1_types") == 0;
}

static PyObject *
Context_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static const char *const names[] = {
#define DCP_FIELD_NAME(name) #name,
        DCP_CONTEXT_FIELDS(DCP_FIELD_NAME)
#undef DCP_FIELD_NAME
    };
    static const Py_ssize_t offsets[] = {
#define DCP_FIELD_OFFSET(name) offsetof(dcp_Context, name),
        DCP_CONTEXT_FIELDS(DCP_FIELD_OFFSET)
#undef DCP_FIELD_OFFSET
    };
    const size_t nfields = sizeof(names) / sizeof(names[0]);
    dcp_Context *ctx = NULL;

    if (args != NULL && PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError,
                        "Context() takes keyword arguments only");
        return NULL;
    }
    ctx = (dcp_Context *)type->tp_alloc(type, 0);
    if (ctx == NULL) {
        return NULL;
    }
    Py_ssize_t consumed = 0;
    for (size_t i = 0; i < nfields; i++) {
        PyObject *value = NULL;
        PyObject **slot = (PyObject **)((char *)ctx + offsets[i]);
        if (kwargs != NULL) {
            PyObject *key = PyUnicode_FromString(names[i]);
            if (key == NULL) {
                goto error;
            }
            int rc = dcp_dict_get_ref(kwargs, key, &value);
            Py_DECREF(key);
            if (rc < 0) {
                goto error;
            }
        }
        if (value == NULL) {
            if (Context_is_tuple_field(names[i])) {
                value = PyTuple_New(0);
                if (value == NULL) {
                    goto error;
                }
                *slot = value;
            }
            else {
                *slot = Py_NewRef(Py_None);
            }
            continue;
        }
        consumed++;
        if (Context_is_tuple_field(names[i]) && !PyTuple_Check(value)) {
            PyErr_Format(PyExc_TypeError,
                         "Context(): %s must be a tuple of classes, not "
                         "%.200s",
                         names[i],
                         Py_TYPE(value)->tp_name);
            Py_DECREF(value);
            goto error;
        }
        *slot = value; /* owned reference from dcp_dict_get_ref */
    }
    if (kwargs != NULL && consumed != PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError,
                        "Context() got an unexpected keyword argument");
        goto error;
    }
    /* tp_alloc (PyType_GenericAlloc) already tracks the object. */
    return (PyObject *)ctx;

error:
    Py_DECREF(ctx);
    return NULL;
}

static PyMemberDef Context_members[] = {
#define DCP_FIELD_MEMBER(name) \
    {#name, T_OBJECT_EX, offsetof(dcp_Context, name), READONLY, NULL},
    DCP_CONTEXT_FIELDS(DCP_FIELD_MEMBER)
#undef DCP_FIELD_MEMBER
        {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Context_slots[] = {
    {Py_tp_new, Context_new},
    {Py_tp_dealloc, Context_dealloc},
    {Py_tp_traverse, Context_traverse},
    {Py_tp_clear, Context_clear},
    {Py_tp_members, Context_members},
    {Py_tp_doc,
     "Context(**torch_objects)\n--\n\n"
     "The torch classes and base methods the native core compares "
     "against."},
    {0, NULL},
};

static PyType_Spec Context_spec = {
    .name = "dcp_optim._dcp_optim.Context",
    .basicsize = sizeof(dcp_Context),
    .flags =
        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Context_slots,
};

int
dcp_context_init_type(PyObject *module, dcp_state *st)
{
    st->Context_Type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &Context_spec, NULL);
    if (st->Context_Type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->Context_Type);
}

int
dcp_context_check(dcp_state *st, PyObject *obj)
{
    if (Py_IS_TYPE(obj, st->Context_Type)) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError,
                 "expected a dcp_optim Context, got %.200s",
                 Py_TYPE(obj)->tp_name);
    return 0;
}
