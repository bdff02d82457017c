/* The walk-trace cache: WalkTrace, the record of one walk (every name
 * read and every decision taken), and its replay on an unchanged tree,
 * which builds the ModelIndex a walk would without running user code
 * (the Python layer keeps one trace per model, dcp_optim/_engine/checks.py).
 */
#include "walk.h"

/* ----------------------------------------------------------------------
 * Replaying a walk
 *
 * A training loop calls get/set_*_state_dict on the same, unchanged model
 * again and again, and the walk (walk.c) rebuilds every FQN string each
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
PyObject *
dcp_walktrace_new(dcp_state *st, dcp_walker *w, dcp_ModelIndex *ix)
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
    return dcp_type_flags_cached(r->st, r->ctx, &r->types, module);
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
    rc = dcp_dict_attr_exact(inst, st->str_modules, &children);
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
    PyObject *name, *value;
    int rc = -1, m, more;
    dcp_dict_iter it;
    dcp_dict_iter_init(&it, members);
    while ((more = dcp_dict_iter_next(&it, &name, &value)) == 1) {
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
    if (more < 0) {
        /* the dict changed size: not the recorded tree, walk it instead */
        PyErr_Clear();
        rc = 0;
        goto done;
    }
    rc = 1;
done:
    dcp_dict_iter_clear(&it);
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
    dcp_dict_iter it = {NULL, 0, 0, NULL, NULL};
    int rc = -1, more;

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
    if ((rc = dcp_dict_attr_exact(inst, st->str_parameters, &params)) <= 0) {
        goto done;
    }
    rc = 0;
    const Py_ssize_t nparams = PyDict_GET_SIZE(params);
    if (!rp_expect(r, nparams)) {
        goto done;
    }
    PyObject *name, *value;
    dcp_dict_iter_init(&it, params);
    while ((more = dcp_dict_iter_next(&it, &name, &value)) == 1) {
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
    if (more < 0) {
        PyErr_Clear(); /* changed size: "differs" */
        goto done;
    }
    /* children */
    if ((rc = dcp_dict_attr_exact(inst, st->str_modules, &children)) <= 0) {
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
    dcp_dict_iter_init(&it, children);
    while ((more = dcp_dict_iter_next(&it, &name, &value)) == 1) {
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
            rc = rp_visit(r, value); /* value: pinned by the iterator */
            if (rc <= 0) {
                goto done;
            }
            rc = 0;
        }
    }
    if (more < 0) {
        PyErr_Clear(); /* changed size: "differs" */
        goto done;
    }
    /* the module's own buffers, then parameters */
    if ((rc = dcp_dict_attr_exact(inst, st->str_buffers, &buffers)) <= 0) {
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
    dcp_dict_iter_clear(&it);
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
    r.ix = dcp_index_create(st, args[0], args[1], args[2]);
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

int
dcp_walktrace_init_type(PyObject *module, dcp_state *st)
{
    st->WalkTrace_Type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &WalkTrace_spec, NULL);
    return st->WalkTrace_Type == NULL ? -1 : 0;
}
