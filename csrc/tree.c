/* State-dict trees: collect the tensor leaves, then rebuild the containers
 * around replacement leaves.
 *
 * Upstream's _iterate_state_dict walks the tree in Python and calls a
 * per-tensor function (one blocking collective per DTensor for a full
 * gather, one .to("cpu") per tensor for offloading).  Splitting the walk
 * into "collect leaves" and "rebuild" lets the Python layer process all
 * tensors of the tree at once -- bucketed gathers, batched copies --
 * while the per-node container work stays native.
 *
 * Container rules are upstream's: dict (any dict subclass) -> new dict in
 * the same key order; list -> list; tuple (including named tuples) ->
 * tuple; int/float/str/bytes/io.BytesIO/None stay as they are; anything
 * else raises ValueError("Unexpected value type ...") when type checking,
 * or is deep-copied otherwise.
 *
 * One deliberate difference: a set or frozenset of plain values (numbers,
 * strings, bytes, None, tuples of them) is a value too -- heavyball keeps
 * the set of a parameter's initialised state indices beside its tensors,
 * and upstream's full and offloaded gets raise on it.  A set is copied
 * (the optimizer adds to its own at every step), a frozenset kept; a set
 * holding a tensor still raises (no gather would reach it).
 */
#include "dcp.h"

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    int type_check;
    PyObject *leaves;     /* collect: output list */
    PyObject *new_leaves; /* rebuild: replacement list */
    Py_ssize_t next;      /* rebuild: next replacement */
} dcp_tree;

/* 1 for values kept as they are, 0 otherwise, -1 on error. */
static int
is_plain_leaf(dcp_tree *t, PyObject *obj)
{
    if (obj == Py_None || PyLong_Check(obj) || PyFloat_Check(obj) ||
        PyUnicode_Check(obj) || PyBytes_Check(obj)) {
        return 1;
    }
    if (t->ctx->bytesio_type == Py_None) {
        return 0;
    }
    return PyObject_IsInstance(obj, t->ctx->bytesio_type);
}

/* 1 when every element of `obj` (a set, a frozenset or a tuple inside
 * one) is a number, string, bytes, None or such a tuple; 0 otherwise; -1
 * on error.  Elements are hashable, so a tuple's contents are too and a
 * set cannot hold a list or a dict. */
static int
plain_elements(PyObject *obj, int depth)
{
    if (depth > 32) {
        return 0;
    }
    PyObject *it = PyObject_GetIter(obj);
    if (it == NULL) {
        return -1;
    }
    int rc = 1;
    PyObject *item;
    while (rc == 1 && (item = PyIter_Next(it)) != NULL) {
        if (PyTuple_Check(item)) {
            rc = plain_elements(item, depth + 1);
        }
        else if (!(item == Py_None || PyLong_Check(item) ||
                   PyFloat_Check(item) || PyComplex_Check(item) ||
                   PyUnicode_Check(item) || PyBytes_Check(item))) {
            rc = 0;
        }
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (rc == 1 && PyErr_Occurred()) {
        rc = -1;
    }
    return rc;
}

int
dcp_is_plain_set(PyObject *obj)
{
    if (!PyAnySet_Check(obj)) {
        return 0;
    }
    return plain_elements(obj, 0);
}

/* Collect (t->leaves != NULL): returns a new reference to Py_None.
 * Rebuild: returns the rebuilt object.  NULL on error. */
static PyObject *
tree_visit(dcp_tree *t, PyObject *obj)
{
    PyObject *result = NULL;
    int rc = PyObject_IsInstance(obj, t->ctx->tensor_type);
    if (rc < 0) {
        return NULL;
    }
    if (rc) {
        if (t->leaves != NULL) {
            return PyList_Append(t->leaves, obj) < 0 ? NULL
                                                     : Py_NewRef(Py_None);
        }
        if (t->next >= PyList_GET_SIZE(t->new_leaves)) {
            PyErr_SetString(PyExc_ValueError,
                            "tree_rebuild: fewer replacement tensors than "
                            "tensor leaves");
            return NULL;
        }
        return Py_NewRef(PyList_GET_ITEM(t->new_leaves, t->next++));
    }
    rc = is_plain_leaf(t, obj);
    if (rc < 0) {
        return NULL;
    }
    if (rc) {
        return Py_NewRef(t->leaves != NULL ? Py_None : obj);
    }
    rc = dcp_is_plain_set(obj);
    if (rc < 0) {
        return NULL;
    }
    if (rc) {
        if (t->leaves != NULL || PyFrozenSet_CheckExact(obj)) {
            return Py_NewRef(t->leaves != NULL ? Py_None : obj);
        }
        /* a set (or a subclass of one), copied as a plain set: what
         * deepcopy gives of a set of immutable values */
        return PyFrozenSet_Check(obj) ? PyFrozenSet_New(obj) : PySet_New(obj);
    }
    if (Py_EnterRecursiveCall(" while walking a state dict")) {
        return NULL;
    }
    if (PyDict_Check(obj)) {
        PyObject *items = dcp_items_list(t->st, obj);
        PyObject *out = NULL;
        if (items == NULL) {
            goto done;
        }
        if (t->leaves == NULL && (out = PyDict_New()) == NULL) {
            Py_DECREF(items);
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            PyObject *sub = tree_visit(t, PyTuple_GET_ITEM(pair, 1));
            if (sub == NULL ||
                (out != NULL &&
                 PyDict_SetItem(out, PyTuple_GET_ITEM(pair, 0), sub) < 0)) {
                if (sub == NULL) {
                    dcp_note_key(PyTuple_GET_ITEM(pair, 0));
                }
                Py_XDECREF(sub);
                Py_DECREF(items);
                Py_XDECREF(out);
                goto done;
            }
            Py_DECREF(sub);
        }
        Py_DECREF(items);
        result = out != NULL ? out : Py_NewRef(Py_None);
    }
    else if (PyList_Check(obj) || PyTuple_Check(obj)) {
        /* Snapshot: visiting may run user code (isinstance hooks). */
        PyObject *seq = PySequence_List(obj);
        PyObject *out = NULL;
        if (seq == NULL) {
            goto done;
        }
        Py_ssize_t n = PyList_GET_SIZE(seq);
        if (t->leaves == NULL && (out = PyList_New(n)) == NULL) {
            Py_DECREF(seq);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *sub = tree_visit(t, PyList_GET_ITEM(seq, i));
            if (sub == NULL) {
                Py_DECREF(seq);
                Py_XDECREF(out);
                goto done;
            }
            if (out != NULL) {
                PyList_SET_ITEM(out, i, sub);
            }
            else {
                Py_DECREF(sub);
            }
        }
        Py_DECREF(seq);
        if (out == NULL) {
            result = Py_NewRef(Py_None);
        }
        else if (PyTuple_Check(obj)) {
            result = PyList_AsTuple(out);
            Py_DECREF(out);
        }
        else {
            result = out;
        }
    }
    else if (t->type_check) {
        PyErr_Format(PyExc_ValueError,
                     "Unexpected value type %R",
                     (PyObject *)Py_TYPE(obj));
    }
    else if (t->leaves != NULL) {
        result = Py_NewRef(Py_None);
    }
    else {
        result = PyObject_CallOneArg(t->ctx->deepcopy, obj);
    }
done:
    Py_LeaveRecursiveCall();
    return result;
}

PyDoc_STRVAR(dcp_tree_leaves__doc__,
             "tree_leaves(ctx, obj, type_check, /)\n--\n\n"
             "The tensor leaves of a state-dict tree, in traversal order.");

/* tree_leaves(ctx, obj, type_check) -> list of tensor leaves */
static PyObject *
dcp_tree_leaves(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("tree_leaves", nargs, 3) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    int type_check = PyObject_IsTrue(args[2]);
    if (type_check < 0) {
        return NULL;
    }
    dcp_tree t = {
        st, (dcp_Context *)args[0], type_check, PyList_New(0), NULL, 0};
    if (t.leaves == NULL) {
        return NULL;
    }
    PyObject *none = tree_visit(&t, args[1]);
    if (none == NULL) {
        Py_DECREF(t.leaves);
        return NULL;
    }
    Py_DECREF(none);
    return t.leaves;
}

PyDoc_STRVAR(
    dcp_tree_rebuild__doc__,
    "tree_rebuild(ctx, obj, new_leaves, type_check, /)\n--\n\n"
    "Copy the containers of a tree around replacement tensor leaves.");

/* tree_rebuild(ctx, obj, new_leaves, type_check) -> rebuilt tree */
static PyObject *
dcp_tree_rebuild(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("tree_rebuild", nargs, 4) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    if (!PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "tree_rebuild(): new_leaves must be a list");
        return NULL;
    }
    int type_check = PyObject_IsTrue(args[3]);
    if (type_check < 0) {
        return NULL;
    }
    dcp_tree t = {st, (dcp_Context *)args[0], type_check, NULL, args[2], 0};
    PyObject *out = tree_visit(&t, args[1]);
    if (out != NULL && t.next != PyList_GET_SIZE(args[2])) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError,
                        "tree_rebuild: more replacement tensors than tensor "
                        "leaves");
        return NULL;
    }
    return out;
}

PyDoc_STRVAR(dcp_tensors_to__doc__,
             "tensors_to(tensors, device, /)\n--\n\n"
             "[t.to(device) for t in tensors].");

/* tensors_to(tensors, device) -> [t.to(device) for t in tensors]
 * (the per-tensor loop of cpu_offload, kept native). */
static PyObject *
dcp_tensors_to(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("tensors_to", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *seq = dcp_as_list(st, args[0], "tensors");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *moved =
            dcp_call_method1(st->str_to, PyList_GET_ITEM(seq, i), args[1]);
        if (moved == NULL) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, moved);
    }
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(dcp_tensor_devices__doc__,
             "tensor_devices(ctx, values, /)\n--\n\n"
             "Distinct devices of the tensors with dim() > 0 among values.");

/* tensor_devices(ctx, values) -> list of distinct devices of the tensors
 * with dim() > 0 among `values`, in first-seen order (upstream's device
 * detection for full and broadcast model loads). */
static PyObject *
dcp_tensor_devices(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("tensor_devices", nargs, 2) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)args[0];
    PyObject *values = dcp_as_list(st, args[1], "values");
    PyObject *out = values ? PyList_New(0) : NULL;
    if (out == NULL) {
        Py_XDECREF(values);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        int is_tensor = PyObject_IsInstance(v, ctx->tensor_type);
        if (is_tensor < 0) {
            goto error;
        }
        if (!is_tensor) {
            continue;
        }
        PyObject *dim = PyObject_CallMethodNoArgs(v, st->str_dim);
        if (dim == NULL) {
            goto error;
        }
        long d = PyLong_AsLong(dim);
        Py_DECREF(dim);
        if (d == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (d <= 0) {
            continue;
        }
        PyObject *device = PyObject_GetAttr(v, st->str_device);
        if (device == NULL) {
            goto error;
        }
        int seen = PySequence_Contains(out, device);
        if (seen < 0 || (!seen && PyList_Append(out, device) < 0)) {
            Py_DECREF(device);
            goto error;
        }
        Py_DECREF(device);
    }
    Py_DECREF(values);
    return out;
error:
    Py_DECREF(values);
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(dcp_indices_of__doc__,
             "indices_of(values, cls, /)\n--\n\n"
             "Positions of the values that are instances of cls.");

/* indices_of(values, cls) -> [i for i, v in enumerate(values) if
 * isinstance(v, cls)] */
static PyObject *
dcp_indices_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("indices_of", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(args[0], "values must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < PySequence_Fast_GET_SIZE(seq);
         i++) {
        int rc =
            PyObject_IsInstance(PySequence_Fast_GET_ITEM(seq, i), args[1]);
        PyObject *index = rc > 0 ? PyLong_FromSsize_t(i) : NULL;
        if (rc < 0 ||
            (rc > 0 && (index == NULL || PyList_Append(out, index) < 0))) {
            Py_CLEAR(out);
        }
        Py_XDECREF(index);
    }
    Py_DECREF(seq);
    return out;
}

/* Appends the dotted paths of the tensor leaves under `obj` to `out`. */
static int
tree_paths_visit(dcp_state *st,
                 dcp_Context *ctx,
                 PyObject *obj,
                 PyObject *prefix,
                 PyObject *out)
{
    int rc = PyObject_IsInstance(obj, ctx->tensor_type);
    if (rc != 0) {
        return rc < 0 ? -1 : PyList_Append(out, prefix);
    }
    PyObject *items = NULL;
    if (PyDict_Check(obj)) {
        items = dcp_items_list(st, obj);
    }
    else if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Size(obj);
        items = n >= 0 ? PyList_New(n) : NULL;
        for (Py_ssize_t i = 0; items && i < n; i++) {
            PyObject *v = PySequence_GetItem(obj, i);
            PyObject *k = v ? PyLong_FromSsize_t(i) : NULL;
            PyObject *pair = k ? PyTuple_Pack(2, k, v) : NULL;
            Py_XDECREF(v);
            Py_XDECREF(k);
            if (pair == NULL) {
                Py_CLEAR(items);
                break;
            }
            PyList_SET_ITEM(items, i, pair);
        }
    }
    else {
        return 0;
    }
    if (items == NULL) {
        return -1;
    }
    if (Py_EnterRecursiveCall(" while naming state-dict leaves")) {
        Py_DECREF(items);
        return -1;
    }
    rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyObject_Str(PyTuple_GET_ITEM(pair, 0));
        PyObject *path = NULL;
        if (key != NULL) {
            path = PyUnicode_GET_LENGTH(prefix)
                       ? PyUnicode_FromFormat("%S.%S", prefix, key)
                       : Py_NewRef(key);
        }
        rc = path ? tree_paths_visit(
                        st, ctx, PyTuple_GET_ITEM(pair, 1), path, out)
                  : -1;
        Py_XDECREF(key);
        Py_XDECREF(path);
    }
    Py_LeaveRecursiveCall();
    Py_DECREF(items);
    return rc;
}

PyDoc_STRVAR(dcp_tree_paths__doc__,
             "tree_paths(ctx, obj, /)\n--\n\n"
             "Dotted paths of the tensor leaves, in tree_leaves order.");

/* tree_paths(ctx, obj) -> dotted paths of the tensor leaves, in the order
 * tree_leaves returns them (only error messages need them). */
static PyObject *
dcp_tree_paths(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("tree_paths", nargs, 2) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    if (tree_paths_visit(
            st, (dcp_Context *)args[0], args[1], st->str_empty, out) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* DCP's load writes a non-tensor leaf back along its saved path, whose
 * keys are all str(key) (torch's set_element): below a dict key that is
 * not a str (heavyball's per-view index 0, AggMo's beta 0.9), the value
 * lands under a new key "0" beside the template's 0, which keeps the
 * template's value.  A dict holding both a key k that is not a str and
 * the str str(k) is that "twin".  (No state a DCP save accepted has one:
 * both keys flatten to the same path, which the save refuses.) */

/* 1 if the dict `d` or a dict below it (through dict values) holds a
 * twin, 0 if none, -1 on error. */
static int
has_str_twin(PyObject *d)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int nonstr = 0, nested = 0, found = 0;
    /* first a pass that calls no Python code: most entries end here */
    while (PyDict_Next(d, &pos, &key, &value)) {
        nonstr |= !PyUnicode_Check(key);
        nested |= PyDict_Check(value);
    }
    if (!nonstr && !nested) {
        return 0;
    }
    if (Py_EnterRecursiveCall(" while looking for DCP's string keys")) {
        return -1;
    }
    /* str() of a key runs Python code, which may change the dict: work
     * on snapshots (new references) of its keys and values */
    PyObject *keys = nonstr ? PyDict_Keys(d) : NULL;
    PyObject *values = nested ? PyDict_Values(d) : NULL;
    if ((nonstr && keys == NULL) || (nested && values == NULL)) {
        found = -1;
        goto done;
    }
    for (Py_ssize_t i = 0;
         keys != NULL && found == 0 && i < PyList_GET_SIZE(keys);
         i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (PyUnicode_Check(k)) {
            continue;
        }
        PyObject *text = PyObject_Str(k);
        if (text == NULL) {
            /* a key without a str() has no path: DCP never saved it, so
             * no twin (torch's load decides what it makes of the key) */
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                found = -1;
                goto done;
            }
            PyErr_Clear();
            continue;
        }
        found = PyDict_Contains(d, text);
        Py_DECREF(text);
    }
    for (Py_ssize_t i = 0;
         values != NULL && found == 0 && i < PyList_GET_SIZE(values);
         i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        if (PyDict_Check(v)) {
            found = has_str_twin(v);
        }
    }
done:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_LeaveRecursiveCall();
    return found;
}

PyDoc_STRVAR(dcp_str_key_twins__doc__,
             "str_key_twins(state, /)\n--\n\n"
             "The keys of `state` whose value is a dict holding, at any depth "
             "through dicts, a key k that is not a str beside the str str(k) "
             "(what dcp.load leaves); [] when none does.");

static PyObject *
dcp_str_key_twins(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dcp_check_nargs("str_key_twins", nargs, 1) < 0) {
        return NULL;
    }
    PyObject *state = args[0];
    if (!PyDict_Check(state)) {
        PyErr_Format(PyExc_TypeError,
                     "str_key_twins() expects a dict, not %.100s",
                     Py_TYPE(state)->tp_name);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    PyObject *items = PyDict_Items(state); /* snapshot: see has_str_twin */
    if (out == NULL || items == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *entry = PyTuple_GET_ITEM(pair, 1);
        if (!PyDict_Check(entry)) {
            continue;
        }
        int found = has_str_twin(entry);
        if (found < 0 ||
            (found && PyList_Append(out, PyTuple_GET_ITEM(pair, 0)) < 0)) {
            goto error;
        }
    }
    Py_DECREF(items);
    return out;
error:
    Py_XDECREF(out);
    Py_XDECREF(items);
    return NULL;
}

PyMethodDef dcp_tree_methods[] = {
    {"tree_leaves",
     DCP_FASTCALL(dcp_tree_leaves),
     METH_FASTCALL,
     dcp_tree_leaves__doc__},
    {"tree_rebuild",
     DCP_FASTCALL(dcp_tree_rebuild),
     METH_FASTCALL,
     dcp_tree_rebuild__doc__},
    {"tensors_to",
     DCP_FASTCALL(dcp_tensors_to),
     METH_FASTCALL,
     dcp_tensors_to__doc__},
    {"tensor_devices",
     DCP_FASTCALL(dcp_tensor_devices),
     METH_FASTCALL,
     dcp_tensor_devices__doc__},
    {"indices_of",
     DCP_FASTCALL(dcp_indices_of),
     METH_FASTCALL,
     dcp_indices_of__doc__},
    {"tree_paths",
     DCP_FASTCALL(dcp_tree_paths),
     METH_FASTCALL,
     dcp_tree_paths__doc__},
    {"str_key_twins",
     DCP_FASTCALL(dcp_str_key_twins),
     METH_FASTCALL,
     dcp_str_key_twins__doc__},
    {NULL, NULL, 0, NULL},
};
