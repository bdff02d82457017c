/* The module walk: one native walk over an nn.Module tree, filling a
 * ModelIndex (model_index.c) and recording its trace (walk_cache.c).
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
#include "walk.h"

/* The prefixes of one module, each "" or ending with ".". */
typedef struct {
    PyObject *iter_raw;   /* _iterate_valid_model_state naming */
    PyObject *iter_canon; /* canonical form of iter_raw */
    PyObject *iter_load;  /* load_state_dict form of iter_raw */
    PyObject *full_raw;   /* named_modules() naming */
    PyObject *full_canon; /* canonical form of full_raw */
    int under_fsdp1;      /* entered through FSDP1 _fsdp_wrapped_module */
} dcp_prefixes;
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
    long flags = dcp_type_flags_compute(w->st, w->ctx, module, 0);
    if (flags < 0) {
        return -1;
    }
    PyObject *value = PyLong_FromLong(flags);
    if (value == NULL) {
        return -1;
    }
    rc = PyDict_SetItem(w->type_flags, (PyObject *)tp, value);
    Py_DECREF(value);
    return rc < 0 ? -1 : flags;
}

/* ----------------------------------------------------------------------
 * Trace recording (see "Replaying a walk" in walk_cache.c)
 */

/* Stops recording: the tree is not replayable. */
static void
rec_off(dcp_walker *w)
{
    w->rec.on = 0;
}

/* Appends one event.  0, or -1 with MemoryError set. */
static int
rec_ev(dcp_walker *w, Py_ssize_t value)
{
    dcp_trace_rec *r = &w->rec;
    if (!r->on) {
        return 0;
    }
    if (value < INT32_MIN || value > INT32_MAX) {
        r->on = 0; /* not for real trees; such a walk is just not replayed */
        return 0;
    }
    if (r->len == r->cap) {
        /* 1024 events: a small model's whole trace; doubling after. */
        Py_ssize_t cap = r->cap ? r->cap * 2 : 1024;
        int32_t *ev = PyMem_Realloc(r->ev, (size_t)cap * sizeof(int32_t));
        if (ev == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->ev = ev;
        r->cap = cap;
    }
    r->ev[r->len++] = (int32_t)value;
    return 0;
}

/* Appends a member name.  Only exact str names are replayable (hashing
 * or comparing anything else may run user code).  0 or -1. */
static int
rec_name(dcp_walker *w, PyObject *name)
{
    if (!w->rec.on) {
        return 0;
    }
    if (!PyUnicode_CheckExact(name)) {
        rec_off(w);
        return 0;
    }
    return PyList_Append(w->rec.names, name);
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
    rec_off(w); /* the hook is user code */
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
walker_record(dcp_walker *w,
              PyObject *raw,
              PyObject *fqns,
              PyObject *loads,
              PyObject *value,
              char kind)
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
        if (!present &&
            (PyList_Append(have, fqn) < 0 ||
             PyList_Append(have_loads, PyList_GET_ITEM(loads, i)) < 0)) {
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
    list = dcp_as_list(w->st, names, "FlatParameter._fqns");
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
            PyErr_Format(w->st->err_type,
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
walker_record_tensors(dcp_walker *w,
                      const dcp_prefixes *pre,
                      PyObject *items,
                      PyObject *non_persistent,
                      char kind)
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
        if (rec_name(w, name) < 0) {
            goto done;
        }
        if (value == Py_None) {
            if (rec_ev(w, TR_SKIP_NONE) < 0) {
                goto done;
            }
            continue;
        }
        Py_ssize_t dup = dedup ? dcp_ptrmap_setdefault(&seen, value, i) : -1;
        if (dup == -2) {
            goto done;
        }
        if (dup >= 0) {
            if (rec_ev(w, TR_SKIP_DUP) < 0) {
                goto done;
            }
            continue;
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(st->err_module_name,
                         "module member names must be str, got %.200s in "
                         "module '%S'",
                         Py_TYPE(name)->tp_name,
                         pre->full_raw);
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
                if (rec_ev(w, TR_SKIP_NONPERSISTENT) < 0) {
                    goto done;
                }
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
            fqn = pre->iter_canon == pre->iter_raw
                      ? Py_NewRef(raw)
                      : PyUnicode_Concat(pre->iter_canon, name);
            load = pre->iter_load == pre->iter_raw
                       ? Py_NewRef(raw)
                       : PyUnicode_Concat(pre->iter_load, name);
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
        if (w->rec.on &&
            (rec_ev(w, TR_TAKE) < 0 ||
             rec_ev(w, dcp_ptrmap_get(&w->index->tensor_map, value)) < 0)) {
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
walker_members(dcp_walker *w,
               PyObject *module,
               PyObject *attr,
               PyObject *method,
               int custom)
{
    if (!custom) {
        PyObject *container = PyObject_GetAttr(module, attr);
        if (container == NULL) {
            return NULL;
        }
        if (!PyDict_CheckExact(container)) {
            rec_off(w); /* items() of a mapping subclass is user code */
        }
        PyObject *items = dcp_items_list(w->st, container);
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
    if (dcp_unpack_pairs(
            w->st, list, "%S() of %.200s", method, Py_TYPE(module)->tp_name) <
        0) {
        Py_DECREF(list);
        return NULL;
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
        if (rec_name(w, name) < 0) {
            return -1;
        }
        if (param == Py_None || !PyUnicode_Check(name)) {
            if (rec_ev(w, TR_SKIP_NONE) < 0) {
                return -1;
            }
            continue;
        }
        Py_ssize_t slot = PyList_GET_SIZE(ix->np_params);
        Py_ssize_t found = dcp_ptrmap_setdefault(&ix->param_map, param, slot);
        if (found == -2) {
            return -1;
        }
        if (found >= 0) {
            if (rec_ev(w, TR_SKIP_DUP) < 0) {
                return -1;
            }
            continue;
        }
        if (rec_ev(w, TR_TAKE) < 0) {
            return -1;
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
            fqn = pre->full_canon == pre->full_raw
                      ? Py_NewRef(raw)
                      : PyUnicode_Concat(pre->full_canon, name);
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
walker_token_rules(dcp_walker *w,
                   long parent_flags,
                   PyObject *name,
                   int *skip_canon,
                   int *skip_load,
                   int *enters_fsdp1)
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
            PyErr_Format(
                PyExc_AssertionError, "Expected 'module', got '%S'", name);
            return -1;
        }
        *skip_canon = 1;
        return 0;
    }
    if (parent_flags & TF_COMPILED) {
        if (PyUnicode_Compare(name, st->str_orig_mod) != 0) {
            PyErr_Format(
                PyExc_AssertionError, "Expected '_orig_mod', got '%S'", name);
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

static int walker_visit(dcp_walker *w,
                        PyObject *module,
                        const dcp_prefixes *pre);

/* len(module.<name>) for a hook registry: the number of hooks, 1 for a
 * container whose length cannot be read, 0 when the attribute is missing;
 * -1 on error. */
static Py_ssize_t
walker_hook_count(dcp_walker *w, PyObject *module, PyObject *name)
{
    PyObject *hooks = PyObject_GetAttr(module, name);
    if (hooks == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        rec_off(w); /* nn.Module.__getattr__ answered */
        return 0;
    }
    if (!dcp_plain_len(hooks)) {
        rec_off(w); /* len() may be user code */
    }
    Py_ssize_t n = PyObject_Length(hooks);
    Py_DECREF(hooks);
    if (n < 0) {
        PyErr_Clear();
        n = 1; /* unknown container: assume hooks */
    }
    return n;
}

/* Records `module` in index->load_modules when its type has load rules
 * of its own (TF_LOAD_RULES) or it has load_state_dict pre- or post
 * hooks; the Python layer decides which of them torch's own load must
 * judge.  Sets index->custom_load when it has pre-hooks (they may rename
 * keys, so the keys cannot be validated up front); the
 * activation-checkpoint wrapper's own hook only re-inserts its token,
 * which the load keys account for.  0 / -1. */
static int
walker_load_hooks(dcp_walker *w, PyObject *module, long flags)
{
    dcp_state *st = w->st;
    Py_ssize_t npost = walker_hook_count(w, module, st->str_post_hooks);
    Py_ssize_t n =
        npost < 0 ? -1 : walker_hook_count(w, module, st->str_load_pre_hooks);
    if (n < 0) {
        return -1;
    }
    if (((flags & TF_LOAD_RULES) || npost > 0 || n > 0) &&
        PyList_Append(w->index->load_modules, module) < 0) {
        return -1;
    }
    if (n == 0 || w->index->custom_load) {
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
        rec_off(w);
    }
    if (!is_ckpt || n > 1) {
        w->index->custom_load = 1;
    }
    return 0;
}

/* Visits the children of `module` (already pinned). Returns 0 or -1. */
static int
walker_visit_children(dcp_walker *w,
                      PyObject *module,
                      long flags,
                      const dcp_prefixes *pre)
{
    dcp_state *st = w->st;
    int rc = -1;
    PyObject *children = NULL, *hidden = NULL;
    dcp_ptrmap seen = {NULL, 0, 0}; /* named_children dedup */
    dcp_prefixes child = {NULL, NULL, NULL, NULL, NULL, 0};

    children = walker_members(w,
                              module,
                              st->str_modules,
                              st->str_named_children,
                              (flags & TF_CUSTOM_CHILDREN) != 0);
    if (children == NULL || rec_ev(w, PyList_GET_SIZE(children)) < 0) {
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
        if (rec_name(w, name) < 0) {
            goto done;
        }
        if (sub == Py_None) {
            if (rec_ev(w, TR_SKIP_NONE) < 0) {
                goto done;
            }
            continue;
        }
        if (!PyUnicode_Check(name)) {
            PyErr_Format(st->err_module_name,
                         "child module names must be str, got %.200s under "
                         "'%S'",
                         Py_TYPE(name)->tp_name,
                         pre->full_raw);
            goto done;
        }
        Py_ssize_t dup = dcp_ptrmap_setdefault(&seen, sub, i);
        if (dup == -2) {
            goto done;
        }
        if (dup >= 0 || dcp_ptrmap_get(&w->visited, sub) >= 0) {
            w->index->shared_modules = 1;
            if (rec_ev(w, TR_SKIP_DUP) < 0) {
                goto done;
            }
            continue;
        }
        int skip_canon, skip_load, enters_fsdp1;
        if (walker_token_rules(
                w, flags, name, &skip_canon, &skip_load, &enters_fsdp1) < 0) {
            goto done;
        }
        int is_hidden = PySequence_Contains(hidden, name);
        if (is_hidden < 0) {
            goto done;
        }
        /* Prefixes that are equal share one str (the usual case: no
         * wrapper level, no hidden child), which also lets the names
         * below share theirs. */
        child.full_raw = dcp_child_prefix(st, pre->full_raw, name);
        child.full_canon =
            pre->full_canon == pre->full_raw && !skip_canon
                ? Py_XNewRef(child.full_raw)
                : prefix_extend(st, pre->full_canon, name, skip_canon);
        child.iter_raw =
            pre->iter_raw == pre->full_raw && !is_hidden
                ? Py_XNewRef(child.full_raw)
                : prefix_extend(st, pre->iter_raw, name, is_hidden);
        child.iter_canon =
            pre->iter_canon == pre->iter_raw && !skip_canon
                ? Py_XNewRef(child.iter_raw)
                : prefix_extend(
                      st, pre->iter_canon, name, is_hidden || skip_canon);
        child.iter_load =
            pre->iter_load == pre->iter_raw && !skip_load
                ? Py_XNewRef(child.iter_raw)
                : prefix_extend(
                      st, pre->iter_load, name, is_hidden || skip_load);
        child.under_fsdp1 = enters_fsdp1;
        if (child.full_raw == NULL || child.full_canon == NULL ||
            child.iter_raw == NULL || child.iter_canon == NULL ||
            child.iter_load == NULL || rec_ev(w, TR_TAKE) < 0) {
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
    if (!(flags & TF_PLAIN) || (flags & TF_UNCACHEABLE)) {
        rec_off(w);
    }
    if (rec_ev(w, flags) < 0) {
        goto done;
    }
    if ((flags & TF_FSDP1) &&
        PyList_Append(w->index->fsdp1_modules, module) < 0) {
        goto done;
    }
    if (walker_load_hooks(w, module, flags) < 0) {
        goto done;
    }
    /* named_parameters() is pre-order over `_parameters` of each module. */
    np_params = walker_members(
        w, module, st->str_parameters, st->str_named_parameters, 0);
    if (np_params == NULL || rec_ev(w, PyList_GET_SIZE(np_params)) < 0 ||
        walker_record_np(w, pre, np_params) < 0) {
        goto done;
    }
    if (walker_visit_children(w, module, flags, pre) < 0) {
        goto done;
    }
    buffers = walker_members(w,
                             module,
                             st->str_buffers,
                             st->str_named_buffers,
                             (flags & TF_CUSTOM_BUFFERS) != 0);
    if (buffers == NULL || rec_ev(w, PyList_GET_SIZE(buffers)) < 0) {
        goto done;
    }
    if (flags & TF_CUSTOM_PARAMS) {
        params = walker_members(
            w, module, st->str_parameters, st->str_named_parameters, 1);
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
        if (!PySet_CheckExact(non_persistent)) {
            rec_off(w);
        }
    }
    if (walker_record_tensors(
            w, pre, buffers, non_persistent, DCP_KIND_BUFFER) < 0 ||
        walker_record_tensors(w, pre, params, non_persistent, DCP_KIND_PARAM) <
            0) {
        goto done;
    }
    if (flags & TF_EXTRA_STATE) {
        PyObject *raw = PyUnicode_Concat(pre->iter_raw, st->str_extra_state);
        PyObject *fqn = PyUnicode_Concat(pre->iter_canon, st->str_extra_state);
        PyObject *load = PyUnicode_Concat(pre->iter_load, st->str_extra_state);
        PyObject *marker = NULL, *fqns = NULL, *loads = NULL;
        int ok = raw != NULL && fqn != NULL && load != NULL;
        if (ok) {
            marker = PyObject_CallNoArgs(w->ctx->extra_state_marker);
            fqns = PyList_New(0);
            loads = PyList_New(0);
            ok = marker != NULL && fqns != NULL && loads != NULL &&
                 PyList_Append(fqns, fqn) == 0 &&
                 PyList_Append(loads, load) == 0 &&
                 walker_record(w, raw, fqns, loads, marker, DCP_KIND_EXTRA) ==
                     0;
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
    if (rc < 0 && !w->noted && !PyErr_ExceptionMatches(PyExc_RecursionError)) {
        /* Name the innermost module only; outer levels add nothing. */
        w->noted = 1;
        Py_ssize_t len = PyUnicode_GET_LENGTH(pre->full_raw);
        dcp_note_format("while walking module '%S' (%.200s)",
                        len ? pre->full_raw : st->str_empty,
                        Py_TYPE(module)->tp_name);
    }
    return rc;
}

static PyObject *
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
    ix = dcp_index_create(st, args[0], args[1], args[2]);
    if (ix == NULL) {
        goto done;
    }
    w.index = ix;
    w.visited_keep = PyList_New(0);
    w.type_flags = PyDict_New();
    w.rec.names = PyList_New(0);
    w.rec.on = 1;
    if (w.visited_keep == NULL || w.type_flags == NULL ||
        w.rec.names == NULL) {
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
    if (w.rec.on) {
        PyObject *trace = dcp_walktrace_new(st, &w, ix);
        if (trace == NULL) {
            goto done;
        }
        Py_SETREF(ix->trace, trace);
    }
    result = Py_NewRef(ix);
done:
    prefixes_clear(&root);
    dcp_ptrmap_free(&w.visited);
    Py_XDECREF(w.visited_keep);
    Py_XDECREF(w.type_flags);
    Py_XDECREF(w.rec.names);
    PyMem_Free(w.rec.ev);
    Py_XDECREF(ix);
    return result;
}

PyMethodDef dcp_walk_methods[] = {
    {"walk_model",
     DCP_FASTCALL(dcp_walk_model),
     METH_FASTCALL,
     "walk_model(ctx, model, modifiers_name, /)\n--\n\n"
     "Walk `model` once and return a ModelIndex."},
    {NULL, NULL, 0, NULL},
};
