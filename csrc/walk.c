/* ModelIndex: one native walk over an nn.Module tree.
 *
 * The walk reproduces, in one pass, what upstream computes with several
 * Python passes and one getattr walk per name:
 *
 *   _iterate_valid_model_state   children first (deduplicated by identity,
 *                                each module once), then the module's
 *                                persistent buffers, then its parameters,
 *                                then an _extra_state marker when
 *                                get_extra_state is overridden;
 *   _get_fqns(name)              the canonical FQN: the name without the
 *                                wrapper levels torch strips (DDP
 *                                "module.", compile "_orig_mod.", FSDP1
 *                                "_fsdp_wrapped_module.", activation
 *                                checkpointing "_checkpoint_wrapped_module.")
 *                                and with FSDP1 flat parameters expanded;
 *   _get_fqns(..., skip_*=False) the key model.load_state_dict() expects
 *                                (DDP and compile prefixes kept);
 *   model.named_parameters()     pre-order, deduplicated, with the
 *                                canonical FQN of each first name.
 *
 * Modules hidden by the `_fqn_modifiers` hook (children whose attribute
 * name is one of the values of the dict the hook returns) contribute no
 * token to the iterate-style names, as upstream.
 *
 * Reentrancy.  Reading `_modules`, `_parameters`, `_buffers` and calling
 * the modifier hook or overridden named_* methods can run arbitrary Python
 * code (properties, __getattr__, hooks), which may mutate the containers
 * we walk or drop the last reference to a module.  So every container is
 * snapshotted into an owned list before it is iterated, every visited
 * module is pinned in `visited_keep` until the walk ends, and nothing
 * borrowed is held across a call back into Python.
 */
#include "dcp.h"

#include <structmember.h>

/* Per-type facts, cached for the duration of one walk. */
enum {
    TF_KNOWN = 1 << 0,
    TF_CUSTOM_CHILDREN = 1 << 1,  /* overrides named_children */
    TF_CUSTOM_BUFFERS = 1 << 2,   /* overrides named_buffers */
    TF_CUSTOM_PARAMS = 1 << 3,    /* overrides named_parameters */
    TF_EXTRA_STATE = 1 << 4,      /* overrides get_extra_state */
    TF_DDP = 1 << 6,
    TF_COMPILED = 1 << 7,
    TF_FSDP1 = 1 << 8,
};

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    dcp_ModelIndex *index;
    PyObject *modifiers_name;
    dcp_ptrmap visited;       /* module -> 1 */
    PyObject *visited_keep;   /* list pinning every visited module */
    PyObject *type_flags;     /* dict: type -> int */
    int noted;                /* an error note was attached already */
} dcp_walker;

/* The prefixes of one module, each "" or ending with ".". */
typedef struct {
    PyObject *iter_raw;   /* _iterate_valid_model_state naming */
    PyObject *iter_canon; /* canonical form of iter_raw */
    PyObject *iter_load;  /* load_state_dict form of iter_raw */
    PyObject *full_raw;   /* named_modules() naming */
    PyObject *full_canon; /* canonical form of full_raw */
    int under_fsdp1;      /* entered through FSDP1 _fsdp_wrapped_module */
} dcp_prefixes;

/* ----------------------------------------------------------------------
 * Type facts
 */

/* 1 if type(obj) defines `name` differently from `base`, 0 if the same
 * (or absent), -1 on error. */
static int
type_overrides(PyTypeObject *tp, PyObject *name, PyObject *base)
{
    if (base == Py_None) {
        return 0;
    }
    PyObject *found = dcp_type_lookup(tp, name);
    if (found == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    int differs = (found != base);
    Py_DECREF(found);
    return differs;
}

/* Returns the TF_* flags of `tp` (>= TF_KNOWN), or -1 on error. */
static long
walker_type_flags(dcp_walker *w, PyObject *module)
{
    PyTypeObject *tp = Py_TYPE(module);
    PyObject *cached = NULL;
    int rc = dcp_dict_get_ref(w->type_flags, (PyObject *)tp, &cached);
    if (rc < 0) {
        return -1;
    }
    if (rc == 1) {
        long flags = PyLong_AsLong(cached);
        Py_DECREF(cached);
        return flags;
    }
    dcp_state *st = w->st;
    dcp_Context *ctx = w->ctx;
    long flags = TF_KNOWN;
    int r;
    if ((r = type_overrides(tp, st->str_named_children,
                            ctx->base_named_children)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_CHILDREN : 0;
    if ((r = type_overrides(tp, st->str_named_buffers,
                            ctx->base_named_buffers)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_BUFFERS : 0;
    if ((r = type_overrides(tp, st->str_named_parameters,
                            ctx->base_named_parameters)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_PARAMS : 0;
    if ((r = type_overrides(tp, st->str_get_extra_state,
                            ctx->base_get_extra_state)) < 0) {
        return -1;
    }
    flags |= r ? TF_EXTRA_STATE : 0;
    if ((r = dcp_isinstance_any(module, ctx->ddp_types)) < 0) {
        return -1;
    }
    flags |= r ? TF_DDP : 0;
    if ((r = dcp_isinstance_any(module, ctx->compiled_types)) < 0) {
        return -1;
    }
    flags |= r ? TF_COMPILED : 0;
    if ((r = dcp_isinstance_any(module, ctx->fsdp1_types)) < 0) {
        return -1;
    }
    flags |= r ? TF_FSDP1 : 0;

    PyObject *value = PyLong_FromLong(flags);
    if (value == NULL) {
        return -1;
    }
    rc = PyDict_SetItem(w->type_flags, (PyObject *)tp, value);
    Py_DECREF(value);
    return rc < 0 ? -1 : flags;
}

/* The names of children hidden by the modifier hook: a new reference to a
 * list of str (possibly empty).  Upstream calls the hook when
 * hasattr(module, name); we honour class attributes and instance
 * attributes (module.__dict__), which is where such hooks live. */
static PyObject *
walker_hidden_children(dcp_walker *w, PyObject *module)
{
    PyObject *hook = NULL, *mapping = NULL, *result = NULL;
    hook = dcp_lookup_hook(module, w->modifiers_name);
    if (hook == NULL) {
        return PyErr_Occurred() ? NULL : PyList_New(0);
    }
    mapping = PyObject_CallNoArgs(hook);
    if (mapping != NULL) {
        result = PyMapping_Values(mapping);
    }
    Py_DECREF(hook);
    Py_XDECREF(mapping);
    return result;
}

/* ----------------------------------------------------------------------
 * Recording entries
 */

/* Appends one entry of _iterate_valid_model_state.  `fqns` is a list of
 * canonical FQNs (more than one only for FSDP1 flat parameters) aligned
 * with `loads`.  Returns 0 or -1. */
static int
walker_record(dcp_walker *w, PyObject *raw, PyObject *fqns, PyObject *loads,
              PyObject *value, char kind)
{
    dcp_ModelIndex *ix = w->index;
    Py_ssize_t n = PyList_GET_SIZE(fqns);
    /* One entry per FQN keeps the parallel lists aligned with the
     * (raw name, fqn, load key) triples upstream iterates over. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_Append(ix->raw_names, raw) < 0 ||
            PyList_Append(ix->fqns, PyList_GET_ITEM(fqns, i)) < 0 ||
            PyList_Append(ix->load_keys, PyList_GET_ITEM(loads, i)) < 0 ||
            PyList_Append(ix->values, value) < 0) {
            return -1;
        }
        /* bytearray growth is amortised O(1), unlike bytes concat. */
        Py_ssize_t len = PyByteArray_GET_SIZE(ix->kinds);
        if (PyByteArray_Resize(ix->kinds, len + 1) < 0) {
            return -1;
        }
        PyByteArray_AS_STRING(ix->kinds)[len] = kind;
    }
    if (kind == DCP_KIND_EXTRA) {
        return 0;
    }
    Py_ssize_t slot = PyList_GET_SIZE(ix->tensors);
    Py_ssize_t found = dcp_ptrmap_setdefault(&ix->tensor_map, value, slot);
    if (found == -2) {
        return -1;
    }
    if (found == -1) {
        PyObject *fqn_copy = PyList_GetSlice(fqns, 0, n);
        PyObject *load_copy = PyList_GetSlice(loads, 0, n);
        int rc = (fqn_copy == NULL || load_copy == NULL ||
                  PyList_Append(ix->tensors, value) < 0 ||
                  PyList_Append(ix->tensor_fqns, fqn_copy) < 0 ||
                  PyList_Append(ix->tensor_loads, load_copy) < 0)
                     ? -1
                     : 0;
        Py_XDECREF(fqn_copy);
        Py_XDECREF(load_copy);
        return rc;
    }
    /* A tied tensor: add the FQNs it did not have yet. */
    PyObject *have = PyList_GET_ITEM(ix->tensor_fqns, found);
    PyObject *have_loads = PyList_GET_ITEM(ix->tensor_loads, found);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *fqn = PyList_GET_ITEM(fqns, i);
        int present = PySequence_Contains(have, fqn);
        if (present < 0) {
            return -1;
        }
        if (!present && (PyList_Append(have, fqn) < 0 ||
                         PyList_Append(have_loads,
                                       PyList_GET_ITEM(loads, i)) < 0)) {
            return -1;
        }
    }
    return 0;
}

/* FSDP1 flat parameter: its canonical FQNs are the prefix plus each of
 * flat_param._fqns.  Returns a new list, or NULL with an exception. */
static PyObject *
walker_flat_param_fqns(dcp_walker *w, PyObject *prefix, PyObject *flat_param)
{
    PyObject *names = NULL, *result = NULL, *list = NULL;
    names = PyObject_GetAttr(flat_param, w->st->str_fqns);
    if (names == NULL) {
        goto done;
    }
    list = dcp_as_list(names, "FlatParameter._fqns");
    if (list == NULL) {
        goto done;
    }
    result = PyList_New(PyList_GET_SIZE(list));
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *name = PyList_GET_ITEM(list, i);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError,
                         "FlatParameter._fqns must hold str, got %.200s",
                         Py_TYPE(name)->tp_name);
            Py_CLEAR(result);
            goto done;
        }
        PyObject *full = PyUnicode_Concat(prefix, name);
        if (full == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, full);
    }
done:
    Py_XDECREF(names);
    Py_XDECREF(list);
    return result;
}

/* Records the buffers or parameters of one module (an items list of
 * (name, tensor) pairs).  Returns 0 or -1. */
static int
walker_record_tensors(dcp_walker *w, const dcp_prefixes *pre,
                      PyObject *items, PyObject *non_persistent, char kind)
{
    dcp_state *st = w->st;
    dcp_ptrmap seen = {NULL, 0, 0}; /* named_* dedup within the module */
    int rc = -1;
    const int dedup = PyList_GET_SIZE(items) > 1;
    PyObject *raw = NULL, *fqn = NULL, *load = NULL;
    PyObject *fqns = NULL, *loads = NULL;

    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        if (value == Py_None) {
            continue;
        }
        Py_ssize_t dup = dedup ? dcp_ptrmap_setdefault(&seen, value, i)
                               : -1;
        if (dup == -2) {
            goto done;
        }
        if (dup >= 0) {
            continue;
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError,
                         "module member names must be str, got %.200s in "
                         "module '%U'",
                         Py_TYPE(name)->tp_name, pre->full_raw);
            goto done;
        }
        if (non_persistent != NULL) {
            int skip = PySet_Check(non_persistent)
                           ? PySet_Contains(non_persistent, name)
                           : PySequence_Contains(non_persistent, name);
            if (skip < 0) {
                goto done;
            }
            if (skip) {
                continue;
            }
        }
        raw = PyUnicode_Concat(pre->iter_raw, name);
        if (raw == NULL) {
            goto done;
        }
        int is_flat = pre->under_fsdp1 && kind == DCP_KIND_PARAM &&
                      PyUnicode_Compare(name, st->str_flat_param) == 0;
        if (is_flat) {
            fqns = walker_flat_param_fqns(w, pre->iter_canon, value);
            loads = walker_flat_param_fqns(w, pre->iter_load, value);
            if (fqns == NULL || loads == NULL) {
                goto done;
            }
        }
        else {
            fqn = PyUnicode_Concat(pre->iter_canon, name);
            load = PyUnicode_Concat(pre->iter_load, name);
            if (fqn == NULL || load == NULL) {
                goto done;
            }
            fqns = PyList_New(1);
            loads = PyList_New(1);
            if (fqns == NULL || loads == NULL) {
                goto done;
            }
            PyList_SET_ITEM(fqns, 0, fqn);
            PyList_SET_ITEM(loads, 0, load);
            fqn = load = NULL;
        }
        if (walker_record(w, raw, fqns, loads, value, kind) < 0) {
            goto done;
        }
        Py_CLEAR(raw);
        Py_CLEAR(fqns);
        Py_CLEAR(loads);
    }
    rc = 0;
done:
    dcp_ptrmap_free(&seen);
    Py_XDECREF(raw);
    Py_XDECREF(fqn);
    Py_XDECREF(load);
    Py_XDECREF(fqns);
    Py_XDECREF(loads);
    return rc;
}

/* The (name, member) pairs of a module container attribute, or of an
 * overridden named_*(recurse=False) method.  New list or NULL. */
static PyObject *
walker_members(dcp_walker *w, PyObject *module, PyObject *attr,
               PyObject *method, int custom)
{
    if (!custom) {
        PyObject *container = PyObject_GetAttr(module, attr);
        if (container == NULL) {
            return NULL;
        }
        PyObject *items = dcp_items_list(container);
        Py_DECREF(container);
        return items;
    }
    PyObject *bound = PyObject_GetAttr(module, method);
    if (bound == NULL) {
        return NULL;
    }
    PyObject *iterable = NULL;
    if (method == w->st->str_named_children) {
        iterable = PyObject_CallNoArgs(bound);
    }
    else {
        PyObject *kwargs = Py_BuildValue("{s:O}", "recurse", Py_False);
        if (kwargs != NULL) {
            PyObject *noargs = PyTuple_New(0);
            if (noargs != NULL) {
                iterable = PyObject_Call(bound, noargs, kwargs);
                Py_DECREF(noargs);
            }
            Py_DECREF(kwargs);
        }
    }
    Py_DECREF(bound);
    if (iterable == NULL) {
        return NULL;
    }
    PyObject *list = PySequence_List(iterable);
    Py_DECREF(iterable);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *pair = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "%U() of %.200s must yield (name, value) pairs",
                         method, Py_TYPE(module)->tp_name);
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* Records the module's own parameters in named_parameters() order. */
static int
walker_record_np(dcp_walker *w, const dcp_prefixes *pre, PyObject *params)
{
    dcp_ModelIndex *ix = w->index;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject *pair = PyList_GET_ITEM(params, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        PyObject *param = PyTuple_GET_ITEM(pair, 1);
        if (param == Py_None || !PyUnicode_Check(name)) {
            continue;
        }
        Py_ssize_t slot = PyList_GET_SIZE(ix->np_params);
        Py_ssize_t found = dcp_ptrmap_setdefault(&ix->param_map, param, slot);
        if (found == -2) {
            return -1;
        }
        if (found >= 0) {
            continue;
        }
        PyObject *raw = PyUnicode_Concat(pre->full_raw, name);
        PyObject *fqn = NULL;
        if (raw == NULL) {
            return -1;
        }
        if (pre->under_fsdp1 &&
            PyUnicode_Compare(name, w->st->str_flat_param) == 0) {
            /* A flat parameter has several FQNs; upstream's ID -> FQN
             * mapping rejects it (it goes through FSDP's own APIs). */
            fqn = Py_NewRef(Py_None);
        }
        else {
            fqn = PyUnicode_Concat(pre->full_canon, name);
        }
        int rc = (fqn == NULL || PyList_Append(ix->np_params, param) < 0 ||
                  PyList_Append(ix->np_names, raw) < 0 ||
                  PyList_Append(ix->np_fqns, fqn) < 0)
                     ? -1
                     : 0;
        Py_DECREF(raw);
        Py_XDECREF(fqn);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* Whether the child token is a wrapper level for the canonical name, and
 * for the load key.  Returns 0 or -1 (E1/E2 as upstream). */
static int
walker_token_rules(dcp_walker *w, long parent_flags, PyObject *name,
                   int *skip_canon, int *skip_load, int *enters_fsdp1)
{
    dcp_state *st = w->st;
    *skip_canon = 0;
    *skip_load = 0;
    *enters_fsdp1 = 0;
    if (PyUnicode_Compare(name, st->str_ckpt_wrapped) == 0) {
        *skip_canon = *skip_load = 1;
        return 0;
    }
    if (parent_flags & TF_DDP) {
        if (PyUnicode_Compare(name, st->str_module) != 0) {
            PyErr_Format(PyExc_AssertionError, "Expected 'module', got '%U'",
                         name);
            return -1;
        }
        *skip_canon = 1;
        return 0;
    }
    if (parent_flags & TF_COMPILED) {
        if (PyUnicode_Compare(name, st->str_orig_mod) != 0) {
            PyErr_Format(PyExc_AssertionError,
                         "Expected '_orig_mod', got '%U'", name);
            return -1;
        }
        *skip_canon = 1;
        return 0;
    }
    if ((parent_flags & TF_FSDP1) &&
        PyUnicode_Compare(name, st->str_fsdp_wrapped) == 0) {
        *skip_canon = *skip_load = 1;
        *enters_fsdp1 = 1;
    }
    return 0;
}

static PyObject *
prefix_extend(dcp_state *st, PyObject *prefix, PyObject *name, int skip)
{
    return skip ? Py_NewRef(prefix) : dcp_child_prefix(st, prefix, name);
}

static void
prefixes_clear(dcp_prefixes *p)
{
    Py_CLEAR(p->iter_raw);
    Py_CLEAR(p->iter_canon);
    Py_CLEAR(p->iter_load);
    Py_CLEAR(p->full_raw);
    Py_CLEAR(p->full_canon);
}

static int walker_visit(dcp_walker *w, PyObject *module,
                        const dcp_prefixes *pre);

/* Sets index->custom_load when `module` has load_state_dict pre-hooks
 * (they may rename keys, so a load cannot be validated up front).  The
 * activation-checkpoint wrapper's own hook only re-inserts its token,
 * which the load keys account for.  0 / -1. */
static int
walker_has_load_hooks(dcp_walker *w, PyObject *module)
{
    dcp_state *st = w->st;
    PyObject *hooks = PyObject_GetAttr(module, st->str_load_pre_hooks);
    if (hooks == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t n = PyObject_Length(hooks);
    Py_DECREF(hooks);
    if (n < 0) {
        PyErr_Clear();
        n = 1; /* unknown container: assume hooks */
    }
    if (n == 0) {
        return 0;
    }
    PyObject *children = PyObject_GetAttr(module, st->str_modules);
    int is_ckpt = 0;
    if (children != NULL && PyDict_Check(children)) {
        is_ckpt = PyDict_Contains(children, st->str_ckpt_wrapped);
    }
    Py_XDECREF(children);
    if (is_ckpt < 0) {
        return -1;
    }
    if (children == NULL) {
        PyErr_Clear();
    }
    if (!is_ckpt || n > 1) {
        w->index->custom_load = 1;
    }
    return 0;
}

/* Visits the children of `module` (already pinned). Returns 0 or -1. */
static int
walker_visit_children(dcp_walker *w, PyObject *module, long flags,
                      const dcp_prefixes *pre)
{
    dcp_state *st = w->st;
    int rc = -1;
    PyObject *children = NULL, *hidden = NULL;
    dcp_ptrmap seen = {NULL, 0, 0}; /* named_children dedup */
    dcp_prefixes child = {NULL, NULL, NULL, NULL, NULL, 0};

    children = walker_members(w, module, st->str_modules,
                              st->str_named_children,
                              flags & TF_CUSTOM_CHILDREN);
    if (children == NULL) {
        goto done;
    }
    if (PyList_GET_SIZE(children) == 0) {
        rc = 0;
        goto done;
    }
    hidden = walker_hidden_children(w, module);
    if (hidden == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(children); i++) {
        PyObject *pair = PyList_GET_ITEM(children, i);
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        PyObject *sub = PyTuple_GET_ITEM(pair, 1);
        if (sub == Py_None) {
            continue;
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError,
                         "child module names must be str, got %.200s under "
                         "'%U'",
                         Py_TYPE(name)->tp_name, pre->full_raw);
            goto done;
        }
        Py_ssize_t dup = dcp_ptrmap_setdefault(&seen, sub, i);
        if (dup == -2) {
            goto done;
        }
        if (dup >= 0 || dcp_ptrmap_get(&w->visited, sub) >= 0) {
            continue;
        }
        int skip_canon, skip_load, enters_fsdp1;
        if (walker_token_rules(w, flags, name, &skip_canon, &skip_load,
                               &enters_fsdp1) < 0) {
            goto done;
        }
        int is_hidden = PySequence_Contains(hidden, name);
        if (is_hidden < 0) {
            goto done;
        }
        child.full_raw = dcp_child_prefix(st, pre->full_raw, name);
        child.full_canon =
            prefix_extend(st, pre->full_canon, name, skip_canon);
        child.iter_raw = prefix_extend(st, pre->iter_raw, name, is_hidden);
        child.iter_canon = prefix_extend(st, pre->iter_canon, name,
                                         is_hidden || skip_canon);
        child.iter_load = prefix_extend(st, pre->iter_load, name,
                                        is_hidden || skip_load);
        child.under_fsdp1 = enters_fsdp1;
        if (child.full_raw == NULL || child.full_canon == NULL ||
            child.iter_raw == NULL || child.iter_canon == NULL ||
            child.iter_load == NULL) {
            goto done;
        }
        if (walker_visit(w, sub, &child) < 0) {
            goto done;
        }
        prefixes_clear(&child);
    }
    rc = 0;
done:
    prefixes_clear(&child);
    dcp_ptrmap_free(&seen);
    Py_XDECREF(children);
    Py_XDECREF(hidden);
    return rc;
}

/* Visits one module: pre-order parameter naming, children, then the
 * module's own state.  Returns 0 or -1. */
static int
walker_visit(dcp_walker *w, PyObject *module, const dcp_prefixes *pre)
{
    dcp_state *st = w->st;
    int rc = -1;
    PyObject *params = NULL, *buffers = NULL, *non_persistent = NULL;
    PyObject *np_params = NULL;

    if (Py_EnterRecursiveCall(" while walking the module tree")) {
        return -1;
    }
    /* Pin the module: user code run later in the walk could otherwise
     * free it while its address is still a key of `visited`. */
    if (PyList_Append(w->visited_keep, module) < 0) {
        goto done;
    }
    if (dcp_ptrmap_setdefault(&w->visited, module, 1) == -2) {
        goto done;
    }
    long flags = walker_type_flags(w, module);
    if (flags < 0) {
        goto done;
    }
    if ((flags & TF_FSDP1) &&
        PyList_Append(w->index->fsdp1_modules, module) < 0) {
        goto done;
    }
    if (!w->index->custom_load && walker_has_load_hooks(w, module) < 0) {
        goto done;
    }
    /* named_parameters() is pre-order over `_parameters` of each module. */
    np_params = walker_members(w, module, st->str_parameters,
                               st->str_named_parameters, 0);
    if (np_params == NULL || walker_record_np(w, pre, np_params) < 0) {
        goto done;
    }
    if (walker_visit_children(w, module, flags, pre) < 0) {
        goto done;
    }
    buffers = walker_members(w, module, st->str_buffers,
                             st->str_named_buffers,
                             flags & TF_CUSTOM_BUFFERS);
    if (buffers == NULL) {
        goto done;
    }
    if (flags & TF_CUSTOM_PARAMS) {
        params = walker_members(w, module, st->str_parameters,
                                st->str_named_parameters, 1);
    }
    else {
        params = Py_NewRef(np_params);
    }
    if (params == NULL) {
        goto done;
    }
    if (PyList_GET_SIZE(buffers) + PyList_GET_SIZE(params) > 0) {
        non_persistent = PyObject_GetAttr(module, st->str_non_persistent);
        if (non_persistent == NULL) {
            goto done;
        }
    }
    if (walker_record_tensors(w, pre, buffers, non_persistent,
                              DCP_KIND_BUFFER) < 0 ||
        walker_record_tensors(w, pre, params, non_persistent,
                              DCP_KIND_PARAM) < 0) {
        goto done;
    }
    if (flags & TF_EXTRA_STATE) {
        PyObject *raw = PyUnicode_Concat(pre->iter_raw, st->str_extra_state);
        PyObject *fqn = PyUnicode_Concat(pre->iter_canon,
                                         st->str_extra_state);
        PyObject *load = PyUnicode_Concat(pre->iter_load,
                                          st->str_extra_state);
        PyObject *marker = NULL, *fqns = NULL, *loads = NULL;
        int ok = raw != NULL && fqn != NULL && load != NULL;
        if (ok) {
            marker = PyObject_CallNoArgs(w->ctx->extra_state_marker);
            fqns = PyList_New(0);
            loads = PyList_New(0);
            ok = marker != NULL && fqns != NULL && loads != NULL &&
                 PyList_Append(fqns, fqn) == 0 &&
                 PyList_Append(loads, load) == 0 &&
                 walker_record(w, raw, fqns, loads, marker,
                               DCP_KIND_EXTRA) == 0;
        }
        Py_XDECREF(raw);
        Py_XDECREF(fqn);
        Py_XDECREF(load);
        Py_XDECREF(marker);
        Py_XDECREF(fqns);
        Py_XDECREF(loads);
        if (!ok) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_LeaveRecursiveCall();
    Py_XDECREF(np_params);
    Py_XDECREF(params);
    Py_XDECREF(buffers);
    Py_XDECREF(non_persistent);
    if (rc < 0 && !w->noted &&
        !PyErr_ExceptionMatches(PyExc_RecursionError)) {
        /* Name the innermost module only; outer levels add nothing. */
        w->noted = 1;
        Py_ssize_t len = PyUnicode_GET_LENGTH(pre->full_raw);
        dcp_note_format("while walking module '%U' (%.200s)",
                        len ? pre->full_raw : st->str_empty,
                        Py_TYPE(module)->tp_name);
    }
    return rc;
}

/* ----------------------------------------------------------------------
 * The ModelIndex type
 */

#define MODEL_INDEX_OBJECT_FIELDS(X)                                     \
    X(ctx)                                                               \
    X(model)                                                             \
    X(modifiers_name)                                                    \
    X(raw_names)                                                         \
    X(fqns)                                                              \
    X(load_keys)                                                         \
    X(values)                                                            \
    X(kinds)                                                             \
    X(tensors)                                                           \
    X(tensor_fqns)                                                       \
    X(tensor_loads)                                                      \
    X(np_params)                                                         \
    X(np_names)                                                          \
    X(np_fqns)                                                           \
    X(fsdp1_modules)

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
    {"valid_state", ModelIndex_valid_state, METH_NOARGS,
     "valid_state($self, /)\n--\n\n"
     "(name, value) pairs in _iterate_valid_model_state order."},
    {"slot_of", ModelIndex_slot_of, METH_O,
     "slot_of($self, tensor, /)\n--\n\n"
     "Position of `tensor` in `tensors`, or None."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ModelIndex_members[] = {
#define DCP_IX_MEMBER(name)                                              \
    {#name, T_OBJECT_EX, offsetof(dcp_ModelIndex, name), READONLY, NULL},
    MODEL_INDEX_OBJECT_FIELDS(DCP_IX_MEMBER)
#undef DCP_IX_MEMBER
    {"custom_load", T_INT, offsetof(dcp_ModelIndex, custom_load), READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot ModelIndex_slots[] = {
    {Py_tp_dealloc, ModelIndex_dealloc},
    {Py_tp_traverse, ModelIndex_traverse},
    {Py_tp_clear, ModelIndex_clear},
    {Py_tp_methods, ModelIndex_methods},
    {Py_tp_members, ModelIndex_members},
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
dcp_walk_init_type(PyObject *module, dcp_state *st)
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
    PyErr_Format(PyExc_TypeError, "expected a ModelIndex, got %.200s",
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

static dcp_ModelIndex *
ModelIndex_create(dcp_state *st, PyObject *ctx, PyObject *model,
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
    PyObject_GC_Track((PyObject *)ix);
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
        (ix->fsdp1_modules = PyList_New(0)) == NULL) {
        Py_DECREF(ix);
        return NULL;
    }
    return ix;
}

PyObject *
dcp_walk_model(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    dcp_walker w = {0};
    dcp_prefixes root = {NULL, NULL, NULL, NULL, NULL, 0};
    dcp_ModelIndex *ix = NULL;
    PyObject *result = NULL;

    if (dcp_check_nargs("walk_model", nargs, 3) < 0 ||
        !dcp_context_check(st, args[0]) ||
        dcp_check_str("walk_model", "modifiers_name", args[2]) < 0) {
        return NULL;
    }
    w.st = st;
    w.ctx = (dcp_Context *)args[0];
    w.modifiers_name = args[2];
    ix = ModelIndex_create(st, args[0], args[1], args[2]);
    if (ix == NULL) {
        goto done;
    }
    w.index = ix;
    w.visited_keep = PyList_New(0);
    w.type_flags = PyDict_New();
    if (w.visited_keep == NULL || w.type_flags == NULL) {
        goto done;
    }
    root.iter_raw = Py_NewRef(st->str_empty);
    root.iter_canon = Py_NewRef(st->str_empty);
    root.iter_load = Py_NewRef(st->str_empty);
    root.full_raw = Py_NewRef(st->str_empty);
    root.full_canon = Py_NewRef(st->str_empty);
    if (walker_visit(&w, args[1], &root) < 0) {
        goto done;
    }
    result = Py_NewRef(ix);
done:
    prefixes_clear(&root);
    dcp_ptrmap_free(&w.visited);
    Py_XDECREF(w.visited_keep);
    Py_XDECREF(w.type_flags);
    Py_XDECREF(ix);
    return result;
}
