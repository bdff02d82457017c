/* Facts about module types that the walk (walk.c) and its replay
 * (walk_cache.c) both read: which base methods a type overrides, whether
 * its attribute access runs user code, which wrapper it is.  Below both
 * files: it calls neither.
 */
#include "walk.h"

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

/* dcp_type_flags_compute(st, ctx, module, 1) -- what a replay or the
 * native state dict may read: no user code -- once per type for as long as
 * `types` (type -> flags) lives; -1 on error. */
long
dcp_type_flags_cached(dcp_state *st,
                      dcp_Context *ctx,
                      dcp_ptrmap *types,
                      PyObject *module)
{
    PyTypeObject *tp = Py_TYPE(module);
    Py_ssize_t cached = dcp_ptrmap_get(types, tp);
    if (cached >= 0) {
        return (long)cached;
    }
    long flags = dcp_type_flags_compute(st, ctx, module, 1);
    if (flags < 0 || dcp_ptrmap_setdefault(types, tp, flags) == -2) {
        return -1;
    }
    return flags;
}

/* module.<name>, read from the instance __dict__ `inst` -- what
 * getattr() returns for a TF_PLAIN type, whose classes define no such
 * name -- when it is an exact dict: 1 with a new reference in *out; 0 when
 * it is something else or missing (getattr would ask __getattr__); -1 on
 * error. */
int
dcp_dict_attr_exact(PyObject *inst, PyObject *name, PyObject **out)
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

/* 1 if instances of `tp` save by rules of their own (TF_SAVE_RULES):
 * `state_dict` or `_save_to_state_dict` is not nn.Module's, or the class
 * defines `_state_dict_pre_hooks` or `_state_dict_hooks` (torch reads
 * them from the instance; a class attribute would shadow nothing and be
 * what torch iterates when the instance has none).  0 if not, -1 on
 * error.  Without the base methods in the Context (fake classes), every
 * type counts as saving by its own rules. */
static int
type_has_save_rules(dcp_state *st, dcp_Context *ctx, PyTypeObject *tp)
{
    if (ctx->base_state_dict == Py_None ||
        ctx->base_save_to_state_dict == Py_None) {
        return 1;
    }
    int r = type_overrides(tp, st->str_state_dict, ctx->base_state_dict);
    if (r == 0) {
        r = type_overrides(
            tp, st->str_save_to_sd, ctx->base_save_to_state_dict);
    }
    if (r != 0) {
        return r;
    }
    PyObject *names[2] = {st->str_sd_pre_hooks, st->str_sd_hooks};
    for (int i = 0; i < 2; i++) {
        PyObject *found = dcp_type_lookup(tp, names[i]);
        if (found != NULL) {
            Py_DECREF(found);
            return 1;
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* The TF_* flags of type(module) (>= TF_KNOWN), or -1 on error.  With
 * `plain_only`, a type without TF_PLAIN gets TF_KNOWN alone: the
 * isinstance() checks below read module.__class__, which such a type may
 * compute in Python, and a replay must not run user code. */
long
dcp_type_flags_compute(dcp_state *st,
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
    if ((r = type_has_save_rules(st, ctx, tp)) < 0) {
        return -1;
    }
    flags |= r ? TF_SAVE_RULES : 0;
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

/* 1 if len(obj) is dict's own length (a dict, or a subclass such as
 * OrderedDict that does not override __len__), else 0. */
int
dcp_plain_len(PyObject *obj)
{
    PyMappingMethods *m = Py_TYPE(obj)->tp_as_mapping;
    PyMappingMethods *d = PyDict_Type.tp_as_mapping;
    return PyDict_Check(obj) && m != NULL && d != NULL &&
           m->mp_length == d->mp_length;
}
