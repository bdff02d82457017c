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
    TF_CUSTOM_CHILDREN = 1 << 1, /* overrides named_children */
    TF_CUSTOM_BUFFERS = 1 << 2,  /* overrides named_buffers */
    TF_CUSTOM_PARAMS = 1 << 3,   /* overrides named_parameters */
    TF_EXTRA_STATE = 1 << 4,     /* overrides get_extra_state */
    TF_DDP = 1 << 6,
    TF_COMPILED = 1 << 7,
    TF_FSDP1 = 1 << 8,
    /* Attribute access on instances runs no user code: tp_getattro is
     * nn.Module's, __getattribute__ and __class__ are object's, __getattr__
     * is nn.Module's, and no class in the MRO defines one of the container
     * names the walk reads (so they come from the instance __dict__). */
    TF_PLAIN = 1 << 9,
    /* Loads by rules of its own: _load_from_state_dict differs from
     * nn.Module's, or get_extra_state and set_extra_state are not both
     * overridden or both inherited.  Recorded in index->load_modules. */
    TF_LOAD_RULES = 1 << 10,
};

/* Types whose walk calls user code or depends on more than the module
 * containers; a tree holding one is never replayed (see the trace notes
 * below). */
#define TF_UNCACHEABLE                                           \
    (TF_CUSTOM_CHILDREN | TF_CUSTOM_BUFFERS | TF_CUSTOM_PARAMS | \
     TF_EXTRA_STATE | TF_FSDP1)

/* Trace decisions for one member (see "Replaying a walk"). */
enum {
    TR_SKIP_NONE = 0,          /* value None (or a non-str name) */
    TR_SKIP_DUP = 1,           /* seen before (dedup by identity) */
    TR_SKIP_NONPERSISTENT = 2, /* a non-persistent buffer */
    TR_TAKE = 3,               /* recorded / visited */
};

/* The trace of a walk, recorded while walking (see "Replaying a walk").
 * `on` drops to 0 as soon as the tree turns out not to be replayable;
 * recording then stops. */
typedef struct {
    int32_t *ev; /* decisions and counts, in walk order */
    Py_ssize_t len;
    Py_ssize_t cap;
    PyObject *names; /* list: every member name the walk read, in order */
    int on;
} dcp_trace_rec;

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    dcp_ModelIndex *index;
    PyObject *modifiers_name;
    dcp_ptrmap visited;     /* module -> 1 */
    PyObject *visited_keep; /* list pinning every visited module */
    PyObject *type_flags;   /* dict: type -> int */
    int noted;              /* an error note was attached already */
    dcp_trace_rec rec;
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

/* 1 if looking `name` up on `tp` finds the same object as on `base`
 * (both absent counts as the same), 0 if not, -1 on error. */
static int
type_attr_same(PyTypeObject *tp, PyTypeObject *base, PyObject *name)
{
    PyObject *a = dcp_type_lookup(tp, name);
    if (a == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *b = dcp_type_lookup(base, name);
    if (b == NULL && PyErr_Occurred()) {
        Py_XDECREF(a);
        return -1;
    }
    int same = (a == b);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return same;
}

/* 1 if instances of `tp` get the attributes the walk reads from their
 * __dict__ without running user code (TF_PLAIN), 0 if not, -1 on error. */
static int
type_is_plain(dcp_state *st, dcp_Context *ctx, PyTypeObject *tp)
{
    if (!PyType_Check(ctx->module_type)) {
        return 0;
    }
    PyTypeObject *module_tp = (PyTypeObject *)ctx->module_type;
    if (tp->tp_getattro != module_tp->tp_getattro) {
        return 0;
    }
    int r;
    if ((r = type_attr_same(tp, &PyBaseObject_Type, st->str_getattribute)) <=
            0 ||
        (r = type_attr_same(tp, &PyBaseObject_Type, st->str_dunder_class)) <=
            0 ||
        (r = type_attr_same(tp, module_tp, st->str_getattr_hook)) <= 0) {
        return r;
    }
    PyObject *names[6] = {st->str_parameters,
                          st->str_modules,
                          st->str_buffers,
                          st->str_non_persistent,
                          st->str_load_pre_hooks,
                          st->str_post_hooks};
    for (int i = 0; i < 6; i++) {
        PyObject *found = dcp_type_lookup(tp, names[i]);
        if (found != NULL) {
            Py_DECREF(found);
            return 0;
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    return 1;
}

/* 1 if instances of `tp` load by rules of their own (TF_LOAD_RULES):
 * `_load_from_state_dict` is not nn.Module's, or set_extra_state is
 * overridden when get_extra_state is not (`get_overridden` = 0) or the
 * other way round.  0 if not, -1 on error. */
static int
type_has_load_rules(dcp_state *st,
                    dcp_Context *ctx,
                    PyTypeObject *tp,
                    int get_overridden)
{
    if (!PyType_Check(ctx->module_type)) {
        return 0;
    }
    PyTypeObject *module_tp = (PyTypeObject *)ctx->module_type;
    int same = type_attr_same(tp, module_tp, st->str_load_from_sd);
    if (same <= 0) {
        return same < 0 ? -1 : 1;
    }
    same = type_attr_same(tp, module_tp, st->str_set_extra_state);
    if (same < 0) {
        return -1;
    }
    return (!same) != (get_overridden != 0);
}

/* The TF_* flags of type(module) (>= TF_KNOWN), or -1 on error.  With
 * `plain_only`, a type without TF_PLAIN gets TF_KNOWN alone: the
 * isinstance() checks below read module.__class__, which such a type may
 * compute in Python, and a replay must not run user code. */
static long
type_flags_compute(dcp_state *st,
                   dcp_Context *ctx,
                   PyObject *module,
                   int plain_only)
{
    PyTypeObject *tp = Py_TYPE(module);
    long flags = TF_KNOWN;
    int r;
    if ((r = type_is_plain(st, ctx, tp)) < 0) {
        return -1;
    }
    if (!r && plain_only) {
        return TF_KNOWN;
    }
    flags |= r ? TF_PLAIN : 0;
    if ((r = type_overrides(
             tp, st->str_named_children, ctx->base_named_children)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_CHILDREN : 0;
    if ((r = type_overrides(
             tp, st->str_named_buffers, ctx->base_named_buffers)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_BUFFERS : 0;
    if ((r = type_overrides(
             tp, st->str_named_parameters, ctx->base_named_parameters)) < 0) {
        return -1;
    }
    flags |= r ? TF_CUSTOM_PARAMS : 0;
    if ((r = type_overrides(
             tp, st->str_get_extra_state, ctx->base_get_extra_state)) < 0) {
        return -1;
    }
    flags |= r ? TF_EXTRA_STATE : 0;
    if ((r = type_has_load_rules(st, ctx, tp, (flags & TF_EXTRA_STATE) != 0)) <
        0) {
        return -1;
    }
    flags |= r ? TF_LOAD_RULES : 0;
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
    return flags;
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
    long flags = type_flags_compute(w->st, w->ctx, module, 0);
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
 * Trace recording (see "Replaying a walk" below)
 */

/* 1 if len(obj) is dict's own length (a dict, or a subclass such as
 * OrderedDict that does not override __len__), else 0. */
static int
dcp_plain_len(PyObject *obj)
{
    PyMappingMethods *m = Py_TYPE(obj)->tp_as_mapping;
    PyMappingMethods *d = PyDict_Type.tp_as_mapping;
    return PyDict_Check(obj) && m != NULL && d != NULL &&
           m->mp_length == d->mp_length;
}

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
            PyErr_Format(st->err_type,
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
            PyErr_Format(w->st->err_type,
                         "%S() of %.200s must yield (name, value) pairs",
                         method,
                         Py_TYPE(module)->tp_name);
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
            PyErr_Format(st->err_type,
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

static int walktrace_init_type(PyObject *module, dcp_state *st);
static PyObject *walktrace_new(dcp_state *st,
                               dcp_walker *w,
                               dcp_ModelIndex *ix);

int
dcp_walk_init_type(PyObject *module, dcp_state *st)
{
    if (walktrace_init_type(module, st) < 0) {
        return -1;
    }
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

static dcp_ModelIndex *
ModelIndex_create(dcp_state *st,
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
        PyObject *trace = walktrace_new(st, &w, ix);
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

/* ----------------------------------------------------------------------
 * Replaying a walk
 *
 * A training loop calls get/set_*_state_dict on the same, unchanged model
 * again and again, and the walk above rebuilds every FQN string each
 * time.  The walk of a tree in which it runs no user code -- every module
 * type TF_PLAIN and not TF_UNCACHEABLE, no modifier hook on a module with
 * children, exact dict containers with exact str names, an exact set of
 * non-persistent names, dict-like load-hook registries -- is a function of
 * what it reads: the flags of each module's type, and the (name, value)
 * items of its _parameters, _modules and _buffers in order, plus which
 * names are non-persistent.  The strings depend on the names and flags
 * only; which entries exist depends also on value identities (None,
 * duplicates, modules already visited, tensors tied across modules).
 *
 * So the walk records a trace: every name it read (held as str) and every
 * decision it took (sizes, flags, skip reasons, tensor slots).  A replay
 * walks the live tree in the same order building only the identity-keyed
 * parts (values, tensors, parameters, their maps, custom_load,
 * load_modules) and
 * compares each name and decision with the trace.  Any difference -- a
 * parameter replaced or retied, a module added or renamed, a buffer made
 * non-persistent, a type patched, a hook added -- ends the replay; the
 * caller then walks afresh.  Equal inputs give equal strings, so a
 * completed replay returns the trace's string lists with the live
 * tensors: what a walk would have built.  The trace holds no reference to
 * a module or tensor (the Python layer keys it by a weak reference to the
 * model), so caching it keeps nothing alive.
 *
 * A replay runs no user code: it checks TF_PLAIN for every type before
 * reading an instance attribute (plain types serve them from the instance
 * __dict__), looks the modifier hook up without calling it, iterates exact
 * dicts only and probes exact sets with exact str keys.  It holds strong
 * references to the containers it iterates and re-checks their sizes
 * after visiting children.
 *
 * The string lists are shared, not copied: the trace holds the lists of
 * the walk's index, and every index a replay builds holds those same list
 * objects (raw_names, fqns, load_keys, kinds, tensor_fqns, tensor_loads,
 * np_names, np_fqns).  Copying them would touch every string's refcount,
 * twice per call -- most of a replay's time at 10k parameters.  ModelIndex
 * lists are read-only everywhere (dcp.h); test_perf_invariants checks
 * that the API leaves a trace's lists as a fresh walk builds them.
 */

#define WALK_TRACE_OBJECT_FIELDS(X) \
    X(ctx)                          \
    X(modifiers_name)               \
    X(names)                        \
    X(raw_names)                    \
    X(fqns)                         \
    X(load_keys)                    \
    X(kinds)                        \
    X(tensor_fqns)                  \
    X(tensor_loads)                 \
    X(np_names)                     \
    X(np_fqns)

typedef struct {
    PyObject_HEAD
#define DCP_TRACE_STRUCT_FIELD(name) PyObject *name;
    WALK_TRACE_OBJECT_FIELDS(DCP_TRACE_STRUCT_FIELD)
#undef DCP_TRACE_STRUCT_FIELD
    int32_t *ev; /* owned (PyMem) */
    Py_ssize_t n_ev;
    Py_ssize_t n_modules; /* modules visited, to size the replay's map */
} dcp_WalkTrace;

static int
WalkTrace_traverse(PyObject *self, visitproc visit, void *arg)
{
    dcp_WalkTrace *tr = (dcp_WalkTrace *)self;
    Py_VISIT(Py_TYPE(self));
#define DCP_VISIT_TR(name) Py_VISIT(tr->name);
    WALK_TRACE_OBJECT_FIELDS(DCP_VISIT_TR)
#undef DCP_VISIT_TR
    return 0;
}

static int
WalkTrace_clear(PyObject *self)
{
    dcp_WalkTrace *tr = (dcp_WalkTrace *)self;
#define DCP_CLEAR_TR(name) Py_CLEAR(tr->name);
    WALK_TRACE_OBJECT_FIELDS(DCP_CLEAR_TR)
#undef DCP_CLEAR_TR
    return 0;
}

static void
WalkTrace_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)WalkTrace_clear(self);
    PyMem_Free(((dcp_WalkTrace *)self)->ev);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The trace of the walk `w` just completed into `ix` (w->rec.on).  Takes
 * the event buffer from `w`.  New reference or NULL. */
static PyObject *
walktrace_new(dcp_state *st, dcp_walker *w, dcp_ModelIndex *ix)
{
    dcp_WalkTrace *tr = PyObject_GC_New(dcp_WalkTrace, st->WalkTrace_Type);
    if (tr == NULL) {
        return NULL;
    }
#define DCP_NULL_TR(name) tr->name = NULL;
    WALK_TRACE_OBJECT_FIELDS(DCP_NULL_TR)
#undef DCP_NULL_TR
    tr->ev = w->rec.ev;
    tr->n_ev = w->rec.len;
    tr->n_modules = PyList_GET_SIZE(w->visited_keep);
    w->rec.ev = NULL;
    w->rec.len = w->rec.cap = 0;
    PyObject_GC_Track((PyObject *)tr);
    tr->ctx = Py_NewRef(ix->ctx);
    tr->modifiers_name = Py_NewRef(ix->modifiers_name);
    tr->names = Py_NewRef(w->rec.names);
    tr->kinds = Py_NewRef(ix->kinds);
    tr->raw_names = Py_NewRef(ix->raw_names);
    tr->fqns = Py_NewRef(ix->fqns);
    tr->load_keys = Py_NewRef(ix->load_keys);
    tr->tensor_fqns = Py_NewRef(ix->tensor_fqns);
    tr->tensor_loads = Py_NewRef(ix->tensor_loads);
    tr->np_names = Py_NewRef(ix->np_names);
    tr->np_fqns = Py_NewRef(ix->np_fqns);
    return (PyObject *)tr;
}

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    dcp_WalkTrace *tr;
    dcp_ModelIndex *ix; /* being filled */
    Py_ssize_t evi;     /* next event */
    Py_ssize_t namei;   /* next name */
    dcp_ptrmap visited; /* module -> 1 */
    dcp_ptrmap types;   /* type -> TF_* flags */
} dcp_replay;

/* The replay helpers return 1 (matches so far), 0 (differs: no exception
 * set) or -1 (error). */

static inline int
rp_expect(dcp_replay *r, Py_ssize_t value)
{
    if (r->evi >= r->tr->n_ev) {
        return 0;
    }
    return r->tr->ev[r->evi++] == value;
}

static inline int
rp_name(dcp_replay *r, PyObject *name)
{
    if (!PyUnicode_CheckExact(name) ||
        r->namei >= PyList_GET_SIZE(r->tr->names)) {
        return 0;
    }
    PyObject *want = PyList_GET_ITEM(r->tr->names, r->namei);
    r->namei++;
    if (want == name) {
        return 1;
    }
    int cmp = PyUnicode_Compare(want, name); /* two exact str: no user code */
    if (cmp == -1 && PyErr_Occurred()) {
        return -1;
    }
    return cmp == 0;
}

/* TF_* flags of type(module), once per type and replay; -1 on error. */
static long
rp_type_flags(dcp_replay *r, PyObject *module)
{
    PyTypeObject *tp = Py_TYPE(module);
    Py_ssize_t cached = dcp_ptrmap_get(&r->types, tp);
    if (cached >= 0) {
        return (long)cached;
    }
    long flags = type_flags_compute(r->st, r->ctx, module, 1);
    if (flags < 0 || dcp_ptrmap_setdefault(&r->types, tp, flags) == -2) {
        return -1;
    }
    return flags;
}

/* module.<name>, read from the instance __dict__ `inst` -- what
 * getattr() returns for a TF_PLAIN type, whose classes define no such
 * name -- when it is an exact dict: 1 with a new reference in *out; 0 when
 * it is something else or missing (getattr would ask __getattr__); -1 on
 * error. */
static int
rp_dict_attr(PyObject *inst, PyObject *name, PyObject **out)
{
    int rc = dcp_dict_get_ref(inst, name, out);
    if (rc <= 0) {
        return rc;
    }
    if (!PyDict_CheckExact(*out)) {
        Py_CLEAR(*out);
        return 0;
    }
    return 1;
}

/* Identity dedup within one container (named_* yields a value once):
 * a short linear scan for the usual handful of members, a map beyond. */
#define RP_SMALL_DEDUP 16 /* scan cost stays below a map's calloc */

typedef struct {
    const void *small[RP_SMALL_DEDUP];
    Py_ssize_t n;
    dcp_ptrmap map;
} rp_dedup;

/* 1 if `obj` was seen before (recording it otherwise), 0 if not, -1 on
 * error. */
static int
rp_dedup_seen(rp_dedup *d, const void *obj)
{
    if (d->map.slots == NULL) {
        for (Py_ssize_t i = 0; i < d->n; i++) {
            if (d->small[i] == obj) {
                return 1;
            }
        }
        if (d->n < RP_SMALL_DEDUP) {
            d->small[d->n++] = obj;
            return 0;
        }
        if (dcp_ptrmap_init(&d->map, (size_t)4 * RP_SMALL_DEDUP) < 0) {
            return -1;
        }
        for (Py_ssize_t i = 0; i < d->n; i++) {
            if (dcp_ptrmap_setdefault(&d->map, d->small[i], i) == -2) {
                return -1;
            }
        }
    }
    Py_ssize_t found = dcp_ptrmap_setdefault(&d->map, obj, 0);
    return found == -2 ? -1 : found >= 0;
}

/* The number of hooks in the registry module.<name>, read from the
 * instance __dict__ `inst`: 1 with *n set, 0 when it is missing or not a
 * plain dict (the tree is then not replayable), -1 on error. */
static int
rp_hook_count(PyObject *inst, PyObject *name, Py_ssize_t *n)
{
    PyObject *hooks = NULL;
    int found = dcp_dict_get_ref(inst, name, &hooks);
    if (found <= 0) {
        return found;
    }
    int plain = dcp_plain_len(hooks);
    *n = plain ? PyDict_GET_SIZE(hooks) : 0;
    Py_DECREF(hooks);
    return plain;
}

/* walker_load_hooks, for replayable trees. */
static int
rp_load_hooks(dcp_replay *r, PyObject *inst, PyObject *module, long flags)
{
    dcp_state *st = r->st;
    Py_ssize_t npost = 0, n = 0;
    int rc = rp_hook_count(inst, st->str_post_hooks, &npost);
    if (rc > 0) {
        rc = rp_hook_count(inst, st->str_load_pre_hooks, &n);
    }
    if (rc <= 0) {
        return rc;
    }
    if (((flags & TF_LOAD_RULES) || npost > 0 || n > 0) &&
        PyList_Append(r->ix->load_modules, module) < 0) {
        return -1;
    }
    if (n == 0 || r->ix->custom_load) {
        return 1;
    }
    PyObject *children = NULL;
    rc = rp_dict_attr(inst, st->str_modules, &children);
    if (rc <= 0) {
        return rc;
    }
    int is_ckpt = PyDict_Contains(children, st->str_ckpt_wrapped);
    Py_DECREF(children);
    if (is_ckpt < 0) {
        return -1;
    }
    if (!is_ckpt || n > 1) {
        r->ix->custom_load = 1;
    }
    return 1;
}

/* The buffers or parameters of one module (walker_record_tensors). */
static int
rp_tensors(dcp_replay *r, PyObject *members, PyObject *non_persistent)
{
    dcp_ModelIndex *ix = r->ix;
    rp_dedup seen;
    seen.n = 0;
    seen.map = (dcp_ptrmap){NULL, 0, 0};
    const int dedup = PyDict_GET_SIZE(members) > 1;
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    int rc = -1, m;
    while (PyDict_Next(members, &pos, &name, &value)) {
        if ((m = rp_name(r, name)) <= 0) {
            rc = m;
            goto done;
        }
        Py_ssize_t code = TR_TAKE;
        if (value == Py_None) {
            code = TR_SKIP_NONE;
        }
        else {
            int dup = dedup ? rp_dedup_seen(&seen, value) : 0;
            if (dup < 0) {
                goto done;
            }
            if (dup) {
                code = TR_SKIP_DUP;
            }
            else if (non_persistent != NULL) {
                int skip = PySet_Contains(non_persistent, name);
                if (skip < 0) {
                    goto done;
                }
                code = skip ? TR_SKIP_NONPERSISTENT : TR_TAKE;
            }
        }
        if (!rp_expect(r, code)) {
            rc = 0;
            goto done;
        }
        if (code != TR_TAKE) {
            continue;
        }
        if (PyList_Append(ix->values, value) < 0) {
            goto done;
        }
        Py_ssize_t slot = PyList_GET_SIZE(ix->tensors);
        Py_ssize_t found = dcp_ptrmap_setdefault(&ix->tensor_map, value, slot);
        if (found == -2) {
            goto done;
        }
        if (found >= 0) {
            slot = found;
        }
        else if (PyList_Append(ix->tensors, value) < 0) {
            goto done;
        }
        if (!rp_expect(r, slot)) {
            rc = 0;
            goto done;
        }
    }
    rc = 1;
done:
    dcp_ptrmap_free(&seen.map);
    return rc;
}

/* walker_visit, for replayable trees. */
static int
rp_visit(dcp_replay *r, PyObject *module)
{
    dcp_state *st = r->st;
    dcp_ModelIndex *ix = r->ix;
    PyObject *params = NULL, *children = NULL, *buffers = NULL;
    PyObject *non_persistent = NULL, *inst = NULL;
    rp_dedup seen;
    seen.n = 0;
    seen.map = (dcp_ptrmap){NULL, 0, 0};
    int rc = -1;

    if (Py_EnterRecursiveCall(" while replaying the module tree walk")) {
        return -1;
    }
    if (dcp_ptrmap_setdefault(&r->visited, module, 1) == -2) {
        goto done;
    }
    long flags = rp_type_flags(r, module);
    if (flags < 0) {
        goto done;
    }
    rc = 0; /* from here on, `goto done` alone means "differs" */
    if (!(flags & TF_PLAIN) || (flags & TF_UNCACHEABLE) ||
        !rp_expect(r, flags)) {
        goto done;
    }
    /* TF_PLAIN: getattr() of the names below is the __dict__ entry. */
    inst = PyObject_GenericGetDict(module, NULL);
    if (inst == NULL || !PyDict_Check(inst)) {
        if (inst == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
            rc = -1;
        }
        PyErr_Clear();
        goto done;
    }
    if ((rc = rp_load_hooks(r, inst, module, flags)) <= 0) {
        goto done;
    }
    /* named_parameters() order */
    if ((rc = rp_dict_attr(inst, st->str_parameters, &params)) <= 0) {
        goto done;
    }
    rc = 0;
    const Py_ssize_t nparams = PyDict_GET_SIZE(params);
    if (!rp_expect(r, nparams)) {
        goto done;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(params, &pos, &name, &value)) {
        if ((rc = rp_name(r, name)) <= 0) {
            goto done;
        }
        rc = -1;
        Py_ssize_t code = TR_SKIP_NONE;
        if (value != Py_None) {
            Py_ssize_t slot = PyList_GET_SIZE(ix->np_params);
            Py_ssize_t found =
                dcp_ptrmap_setdefault(&ix->param_map, value, slot);
            if (found == -2) {
                goto done;
            }
            code = found >= 0 ? TR_SKIP_DUP : TR_TAKE;
            if (found < 0 && PyList_Append(ix->np_params, value) < 0) {
                goto done;
            }
        }
        rc = 0;
        if (!rp_expect(r, code)) {
            goto done;
        }
    }
    /* children */
    if ((rc = rp_dict_attr(inst, st->str_modules, &children)) <= 0) {
        goto done;
    }
    rc = 0;
    const Py_ssize_t nchildren = PyDict_GET_SIZE(children);
    if (!rp_expect(r, nchildren)) {
        goto done;
    }
    if (nchildren > 0) {
        PyObject *hook = dcp_lookup_hook(module, r->tr->modifiers_name);
        if (hook != NULL) {
            Py_DECREF(hook);
            goto done;
        }
        if (PyErr_Occurred()) {
            rc = -1;
            goto done;
        }
    }
    pos = 0;
    while (PyDict_Next(children, &pos, &name, &value)) {
        if ((rc = rp_name(r, name)) <= 0) {
            goto done;
        }
        Py_ssize_t code = TR_SKIP_NONE;
        if (value != Py_None) {
            int dup = rp_dedup_seen(&seen, value);
            if (dup < 0) {
                rc = -1;
                goto done;
            }
            code = (dup || dcp_ptrmap_get(&r->visited, value) >= 0)
                       ? TR_SKIP_DUP
                       : TR_TAKE;
            if (code == TR_SKIP_DUP) {
                r->ix->shared_modules = 1;
            }
        }
        rc = 0;
        if (!rp_expect(r, code)) {
            goto done;
        }
        if (code == TR_TAKE) {
            Py_INCREF(value);
            rc = rp_visit(r, value);
            Py_DECREF(value);
            if (rc <= 0) {
                goto done;
            }
            rc = 0;
            if (PyDict_GET_SIZE(children) != nchildren) {
                goto done;
            }
        }
    }
    /* the module's own buffers, then parameters */
    if ((rc = rp_dict_attr(inst, st->str_buffers, &buffers)) <= 0) {
        goto done;
    }
    rc = 0;
    if (!rp_expect(r, PyDict_GET_SIZE(buffers)) ||
        PyDict_GET_SIZE(params) != nparams) {
        goto done;
    }
    if (PyDict_GET_SIZE(buffers) + nparams > 0) {
        rc = dcp_dict_get_ref(inst, st->str_non_persistent, &non_persistent);
        if (rc <= 0) {
            goto done;
        }
        rc = 0;
        if (!PySet_CheckExact(non_persistent)) {
            goto done;
        }
    }
    if ((rc = rp_tensors(r, buffers, non_persistent)) <= 0 ||
        (rc = rp_tensors(r, params, non_persistent)) <= 0) {
        goto done;
    }
    rc = 1;
done:
    Py_LeaveRecursiveCall();
    dcp_ptrmap_free(&seen.map);
    Py_XDECREF(inst);
    Py_XDECREF(params);
    Py_XDECREF(children);
    Py_XDECREF(buffers);
    Py_XDECREF(non_persistent);
    return rc;
}

/* replay(ctx, model, modifiers_name) -> ModelIndex or None
 *
 * The index walk_model(ctx, model, modifiers_name) would return, when the
 * live tree matches the trace; None when it does not (walk it then). */
static PyObject *
WalkTrace_replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_WalkTrace *tr = (dcp_WalkTrace *)self;
    dcp_state *st = dcp_get_state_by_type(Py_TYPE(self));
    dcp_replay r = {st, NULL, tr, NULL, 0, 0, {NULL, 0, 0}, {NULL, 0, 0}};
    PyObject *result = NULL;

    if (dcp_check_nargs("replay", nargs, 3) < 0 ||
        !dcp_context_check(st, args[0]) ||
        dcp_check_str("replay", "modifiers_name", args[2]) < 0) {
        return NULL;
    }
    if (args[0] != tr->ctx) {
        Py_RETURN_NONE;
    }
    int cmp = PyUnicode_Compare(args[2], tr->modifiers_name);
    if (cmp == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (cmp != 0) {
        Py_RETURN_NONE;
    }
    r.ctx = (dcp_Context *)args[0];
    r.ix = ModelIndex_create(st, args[0], args[1], args[2]);
    /* Sized for the recorded tree: no rehashing while replaying. */
    if (r.ix == NULL ||
        dcp_ptrmap_init(&r.visited, (size_t)tr->n_modules) < 0 ||
        dcp_ptrmap_init(&r.ix->tensor_map,
                        (size_t)PyList_GET_SIZE(tr->tensor_fqns)) < 0 ||
        dcp_ptrmap_init(&r.ix->param_map,
                        (size_t)PyList_GET_SIZE(tr->np_fqns)) < 0) {
        goto done;
    }
    int rc = rp_visit(&r, args[1]);
    if (rc < 0) {
        goto done;
    }
    dcp_ModelIndex *ix = r.ix;
    if (rc == 0 || r.evi != tr->n_ev ||
        r.namei != PyList_GET_SIZE(tr->names) ||
        PyList_GET_SIZE(ix->values) != PyList_GET_SIZE(tr->fqns) ||
        PyList_GET_SIZE(ix->tensors) != PyList_GET_SIZE(tr->tensor_fqns) ||
        PyList_GET_SIZE(ix->np_params) != PyList_GET_SIZE(tr->np_fqns)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    /* Shared, read-only (see the notes above). */
    Py_SETREF(ix->kinds, Py_NewRef(tr->kinds));
    Py_SETREF(ix->raw_names, Py_NewRef(tr->raw_names));
    Py_SETREF(ix->fqns, Py_NewRef(tr->fqns));
    Py_SETREF(ix->load_keys, Py_NewRef(tr->load_keys));
    Py_SETREF(ix->tensor_fqns, Py_NewRef(tr->tensor_fqns));
    Py_SETREF(ix->tensor_loads, Py_NewRef(tr->tensor_loads));
    Py_SETREF(ix->np_names, Py_NewRef(tr->np_names));
    Py_SETREF(ix->np_fqns, Py_NewRef(tr->np_fqns));
    Py_SETREF(ix->trace, Py_NewRef(self));
    result = Py_NewRef(ix);
done:
    dcp_ptrmap_free(&r.visited);
    dcp_ptrmap_free(&r.types);
    Py_XDECREF(r.ix);
    return result;
}

static PyMethodDef WalkTrace_methods[] = {
    {"replay",
     (PyCFunction)(void (*)(void))WalkTrace_replay,
     METH_FASTCALL,
     "replay($self, ctx, model, modifiers_name, /)\n--\n\n"
     "walk_model(ctx, model, modifiers_name) when the tree still matches "
     "this trace, else None."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot WalkTrace_slots[] = {
    {Py_tp_dealloc, WalkTrace_dealloc},
    {Py_tp_traverse, WalkTrace_traverse},
    {Py_tp_clear, WalkTrace_clear},
    {Py_tp_methods, WalkTrace_methods},
    {Py_tp_doc, "What one walk read and decided, to replay it cheaply."},
    {0, NULL},
};

static PyType_Spec WalkTrace_spec = {
    .name = "dcp_optim._dcp_optim.WalkTrace",
    .basicsize = sizeof(dcp_WalkTrace),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = WalkTrace_slots,
};

static int
walktrace_init_type(PyObject *module, dcp_state *st)
{
    st->WalkTrace_Type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &WalkTrace_spec, NULL);
    return st->WalkTrace_Type == NULL ? -1 : 0;
}
