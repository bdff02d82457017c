/* The ModelIndex type: what one walk of the module tree produced (FQNs,
 * load keys, tensors and their slots, parameters without state), its
 * read-only views for Python, and its registration with the module
 * (together with WalkTrace, walk_cache.c).  The walk that fills it is
 * walk.c's; the fields are described in dcp.h.
 */
#include "walk.h"

#include <structmember.h>

/* ----------------------------------------------------------------------
 * The ModelIndex type
 */

/* The containers Python reads through ModelIndex_view. */
#define MODEL_INDEX_VIEW_FIELDS(X) \
    X(raw_names)                   \
    X(fqns)                        \
    X(load_keys)                   \
    X(values)                      \
    X(kinds)                       \
    X(tensors)                     \
    X(tensor_fqns)                 \
    X(tensor_loads)                \
    X(np_params)                   \
    X(np_names)                    \
    X(np_fqns)                     \
    X(fsdp1_modules)               \
    X(load_modules)

/* Every object field (traverse and clear). */
#define MODEL_INDEX_OBJECT_FIELDS(X) \
    X(ctx)                           \
    X(model)                         \
    X(modifiers_name)                \
    MODEL_INDEX_VIEW_FIELDS(X)       \
    X(trace)                         \
    X(views)

static int
ModelIndex_traverse(PyObject *self, visitproc visit, void *arg)
{
    dcp_ModelIndex *ix = (dcp_ModelIndex *)self;
    Py_VISIT(Py_TYPE(self));
#define DCP_VISIT_IX(name) Py_VISIT(ix->name);
    MODEL_INDEX_OBJECT_FIELDS(DCP_VISIT_IX)
#undef DCP_VISIT_IX
    return 0;
}

static int
ModelIndex_clear(PyObject *self)
{
    dcp_ModelIndex *ix = (dcp_ModelIndex *)self;
#define DCP_CLEAR_IX(name) Py_CLEAR(ix->name);
    MODEL_INDEX_OBJECT_FIELDS(DCP_CLEAR_IX)
#undef DCP_CLEAR_IX
    /* The maps hold borrowed keys of the lists just cleared. */
    dcp_ptrmap_free(&ix->tensor_map);
    dcp_ptrmap_free(&ix->param_map);
    return 0;
}

static void
ModelIndex_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)ModelIndex_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* _iterate_valid_model_state as a list of (raw name, value) pairs. */
static PyObject *
ModelIndex_valid_state(PyObject *self, PyObject *unused)
{
    dcp_ModelIndex *ix = (dcp_ModelIndex *)self;
    Py_ssize_t n = PyList_GET_SIZE(ix->raw_names);
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    /* FSDP1 flat parameters fan out to several entries with one raw name;
     * upstream yields the raw name once. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *raw = PyList_GET_ITEM(ix->raw_names, i);
        PyObject *value = PyList_GET_ITEM(ix->values, i);
        if (i > 0 && PyList_GET_ITEM(ix->raw_names, i - 1) == raw &&
            PyList_GET_ITEM(ix->values, i - 1) == value) {
            continue;
        }
        PyObject *pair = PyTuple_Pack(2, raw, value);
        if (pair == NULL || PyList_Append(result, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return result;
}

/* Index of `tensor` in `tensors`, or None. */
static PyObject *
ModelIndex_slot_of(PyObject *self, PyObject *tensor)
{
    Py_ssize_t slot = dcp_index_tensor_slot((dcp_ModelIndex *)self, tensor);
    if (slot < 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromSsize_t(slot);
}

static PyMethodDef ModelIndex_methods[] = {
    {"valid_state",
     ModelIndex_valid_state,
     METH_NOARGS,
     "valid_state($self, /)\n--\n\n"
     "(name, value) pairs in _iterate_valid_model_state order."},
    {"slot_of",
     ModelIndex_slot_of,
     METH_O,
     "slot_of($self, tensor, /)\n--\n\n"
     "Position of `tensor` in `tensors`, or None."},
    {NULL, NULL, 0, NULL},
};

/* The containers the C core indexes with cached slot numbers (lists,
 * the kinds bytearray) are handed to Python as read-only copies: tuples
 * (inner lists as tuples too) and bytes.  Python code that cleared or
 * reordered the real lists would make every later C call read past
 * their ends.  The walk fills them before Python sees the index and
 * nothing changes them afterwards, so each copy is made once and cached
 * in ix->views. */
static PyObject *
frozen_copy(PyObject *obj)
{
    if (PyByteArray_Check(obj)) {
        return PyBytes_FromStringAndSize(PyByteArray_AS_STRING(obj),
                                         PyByteArray_GET_SIZE(obj));
    }
    if (!PyList_Check(obj)) {
        return Py_NewRef(obj);
    }
    Py_ssize_t n = PyList_GET_SIZE(obj);
    PyObject *result = PyTuple_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *item = PyList_GET_ITEM(obj, i);
        item = PyList_Check(item) ? PyList_AsTuple(item) : Py_NewRef(item);
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyTuple_SET_ITEM(result, i, item);
    }
    return result;
}

static PyObject *
ModelIndex_view(PyObject *self, void *closure)
{
    dcp_ModelIndex *ix = (dcp_ModelIndex *)self;
    const char *name = (const char *)closure;
    PyObject *field = NULL;
#define DCP_IX_FIELD(fname)          \
    if (strcmp(name, #fname) == 0) { \
        field = ix->fname;           \
    }
    MODEL_INDEX_VIEW_FIELDS(DCP_IX_FIELD)
#undef DCP_IX_FIELD
    if (field == NULL) {
        PyErr_Format(PyExc_AttributeError, "ModelIndex has no %s", name);
        return NULL;
    }
    if (ix->views == NULL && (ix->views = PyDict_New()) == NULL) {
        return NULL;
    }
    PyObject *key = PyUnicode_FromString(name);
    if (key == NULL) {
        return NULL;
    }
    PyObject *view = NULL;
    int rc = dcp_dict_get_ref(ix->views, key, &view);
    if (rc == 0) {
        view = frozen_copy(field);
        if (view != NULL && PyDict_SetItem(ix->views, key, view) < 0) {
            Py_CLEAR(view);
        }
    }
    Py_DECREF(key);
    return view;
}

static PyGetSetDef ModelIndex_getset[] = {
#define DCP_IX_GETSET(name) \
    {#name, ModelIndex_view, NULL, "read-only copy", (void *)#name},
    MODEL_INDEX_VIEW_FIELDS(DCP_IX_GETSET)
#undef DCP_IX_GETSET
        {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef ModelIndex_members[] = {
    {"ctx", T_OBJECT_EX, offsetof(dcp_ModelIndex, ctx), READONLY, NULL},
    {"model", T_OBJECT_EX, offsetof(dcp_ModelIndex, model), READONLY, NULL},
    {"modifiers_name",
     T_OBJECT_EX,
     offsetof(dcp_ModelIndex, modifiers_name),
     READONLY,
     NULL},
    {"trace", T_OBJECT_EX, offsetof(dcp_ModelIndex, trace), READONLY, NULL},
    {"custom_load",
     T_INT,
     offsetof(dcp_ModelIndex, custom_load),
     READONLY,
     NULL},
    {"shared_modules",
     T_INT,
     offsetof(dcp_ModelIndex, shared_modules),
     READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot ModelIndex_slots[] = {
    {Py_tp_dealloc, ModelIndex_dealloc},
    {Py_tp_traverse, ModelIndex_traverse},
    {Py_tp_clear, ModelIndex_clear},
    {Py_tp_methods, ModelIndex_methods},
    {Py_tp_members, ModelIndex_members},
    {Py_tp_getset, ModelIndex_getset},
    {Py_tp_doc, "The result of one native walk over a module tree."},
    {0, NULL},
};

static PyType_Spec ModelIndex_spec = {
    .name = "dcp_optim._dcp_optim.ModelIndex",
    .basicsize = sizeof(dcp_ModelIndex),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = ModelIndex_slots,
};

int
dcp_index_init_type(PyObject *module, dcp_state *st)
{
    st->ModelIndex_Type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &ModelIndex_spec, NULL);
    if (st->ModelIndex_Type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->ModelIndex_Type);
}

int
dcp_index_check(dcp_state *st, PyObject *obj)
{
    if (Py_IS_TYPE(obj, st->ModelIndex_Type)) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError,
                 "expected a ModelIndex, got %.200s",
                 Py_TYPE(obj)->tp_name);
    return 0;
}

Py_ssize_t
dcp_index_tensor_slot(dcp_ModelIndex *index, PyObject *tensor)
{
    return dcp_ptrmap_get(&index->tensor_map, tensor);
}

Py_ssize_t
dcp_index_param_slot(dcp_ModelIndex *index, PyObject *param)
{
    return dcp_ptrmap_get(&index->param_map, param);
}

dcp_ModelIndex *
dcp_index_create(dcp_state *st,
                 PyObject *ctx,
                 PyObject *model,
                 PyObject *modifiers)
{
    dcp_ModelIndex *ix = PyObject_GC_New(dcp_ModelIndex, st->ModelIndex_Type);
    if (ix == NULL) {
        return NULL;
    }
#define DCP_NULL_IX(name) ix->name = NULL;
    MODEL_INDEX_OBJECT_FIELDS(DCP_NULL_IX)
#undef DCP_NULL_IX
    ix->tensor_map = (dcp_ptrmap){NULL, 0, 0};
    ix->param_map = (dcp_ptrmap){NULL, 0, 0};
    ix->custom_load = 0;
    ix->shared_modules = 0;
    PyObject_GC_Track((PyObject *)ix);
    ix->trace = Py_NewRef(Py_None);
    ix->ctx = Py_NewRef(ctx);
    ix->model = Py_NewRef(model);
    ix->modifiers_name = Py_NewRef(modifiers);
    ix->kinds = PyByteArray_FromStringAndSize(NULL, 0);
    if (ix->kinds == NULL || (ix->raw_names = PyList_New(0)) == NULL ||
        (ix->fqns = PyList_New(0)) == NULL ||
        (ix->load_keys = PyList_New(0)) == NULL ||
        (ix->values = PyList_New(0)) == NULL ||
        (ix->tensors = PyList_New(0)) == NULL ||
        (ix->tensor_fqns = PyList_New(0)) == NULL ||
        (ix->tensor_loads = PyList_New(0)) == NULL ||
        (ix->np_params = PyList_New(0)) == NULL ||
        (ix->np_names = PyList_New(0)) == NULL ||
        (ix->np_fqns = PyList_New(0)) == NULL ||
        (ix->fsdp1_modules = PyList_New(0)) == NULL ||
        (ix->load_modules = PyList_New(0)) == NULL) {
        Py_DECREF(ix);
        return NULL;
    }
    return ix;
}
