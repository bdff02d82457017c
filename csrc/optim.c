/* Optimizer parameter IDs <-> FQNs, get side.
 *
 * optim_pack builds, for each optimizer, exactly what upstream gets from
 * optimizer.state_dict() followed by its ID -> FQN renaming, without the
 * detour through integer IDs: groups are copied with "params" last and
 * holding FQNs, and `state` maps each FQN to the optimizer's own
 * per-parameter dict (aliased, as upstream).  It is used only for
 * optimizers whose class keeps Optimizer.state_dict and that have no
 * state_dict hooks (the Python layer checks); others go through their own
 * state_dict() and optim_remap.
 *
 * Parameters are looked up by identity in the ModelIndex's pointer map,
 * never through a dict keyed by tensors (Tensor.__hash__ is Python code).
 */
#include "dcp.h"

/* Raised when an optimizer holds a parameter the model does not have. */
static PyObject *
unknown_param_error(dcp_ModelIndex *ix,
                    Py_ssize_t opt_i,
                    Py_ssize_t group_i,
                    PyObject *param)
{
    dcp_state *st = dcp_get_state_by_type(Py_TYPE(ix));
    PyObject *exc_type = st->err_key;
    PyObject *shape = PyObject_GetAttr(param, st->str_shape);
    if (shape == NULL) {
        PyErr_Clear();
        shape = Py_NewRef(Py_None);
    }
    PyErr_Format(exc_type,
                 "optimizer %zd, param group %zd holds a parameter (shape "
                 "%R, %.200s) that is not a parameter of the model; every "
                 "optimized parameter must be reachable through "
                 "model.named_parameters()",
                 opt_i,
                 group_i,
                 shape,
                 Py_TYPE(param)->tp_name);
    Py_DECREF(shape);
    return NULL;
}

/* The groups of an optimizer as an owned list of dicts; validates shape. */
static PyObject *
optimizer_groups(dcp_state *st, PyObject *optim, Py_ssize_t opt_i)
{
    PyObject *raw = PyObject_GetAttr(optim, st->str_param_groups);
    if (raw == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(st->err_type,
                         "optimizer %zd (%.200s) has no 'param_groups'; pass "
                         "torch.optim.Optimizer instances (for a composite "
                         "optimizer, pass its sub-optimizers)",
                         opt_i,
                         Py_TYPE(optim)->tp_name);
        }
        return NULL;
    }
    PyObject *groups = dcp_as_list(st, raw, "optimizer.param_groups");
    Py_DECREF(raw);
    if (groups == NULL) {
        return NULL;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        if (!PyDict_Check(PyList_GET_ITEM(groups, g))) {
            PyErr_Format(st->err_optim_dict,
                         "optimizer %zd param group %zd must be a dict, not "
                         "%.200s",
                         opt_i,
                         g,
                         Py_TYPE(PyList_GET_ITEM(groups, g))->tp_name);
            Py_DECREF(groups);
            return NULL;
        }
    }
    return groups;
}

/* The "params" of one group: a new reference to the list object itself
 * when `pinned` and it is an exact list, else to a new list.  Copying an
 * exact list would write every parameter's refcount (a cache miss each,
 * the bulk of a pack at 10k parameters), so callers that iterate it
 * without running user code ask for it pinned.  NULL with KeyError when
 * the group has no "params". */
static PyObject *
group_params_list(dcp_state *st,
                  PyObject *group,
                  Py_ssize_t opt_i,
                  Py_ssize_t group_i,
                  int pinned)
{
    PyObject *params = NULL;
    int rc = dcp_dict_get_ref(group, st->str_params, &params);
    if (rc < 0) {
        return NULL;
    }
    if (rc == 0) {
        PyErr_Format(st->err_key,
                     "optimizer %zd param group %zd has no 'params' entry",
                     opt_i,
                     group_i);
        return NULL;
    }
    if (pinned && PyList_CheckExact(params)) {
        return params;
    }
    PyObject *list = dcp_as_list(st, params, "param_group['params']");
    Py_DECREF(params);
    return list;
}

static PyObject *
group_params(dcp_state *st,
             PyObject *group,
             Py_ssize_t opt_i,
             Py_ssize_t group_i)
{
    return group_params_list(st, group, opt_i, group_i, 0);
}

static PyObject *
group_params_pinned(dcp_state *st,
                    PyObject *group,
                    Py_ssize_t opt_i,
                    Py_ssize_t group_i)
{
    return group_params_list(st, group, opt_i, group_i, 1);
}

/* Slot of `param` in ix->np_params, or -1.  Tries `*cursor` first: an
 * optimizer usually lists the parameters in model order, so the next one
 * follows the last match and the identity map (a cache miss per probe)
 * is not needed. */
static Py_ssize_t
np_slot_near(dcp_ModelIndex *ix, PyObject *param, Py_ssize_t *cursor)
{
    Py_ssize_t c = *cursor, slot;
    if (c < PyList_GET_SIZE(ix->np_params) &&
        PyList_GET_ITEM(ix->np_params, c) == param) {
        slot = c;
    }
    else {
        slot = dcp_index_param_slot(ix, param);
    }
    if (slot >= 0) {
        *cursor = slot + 1;
    }
    return slot;
}

/* param_fqn with the slot of `param` given (-1: not in the model). */
static PyObject *
param_fqn_at(dcp_ModelIndex *ix,
             PyObject *param,
             Py_ssize_t slot,
             Py_ssize_t opt_i,
             Py_ssize_t group_i)
{
    if (slot < 0) {
        return unknown_param_error(ix, opt_i, group_i, param);
    }
    PyObject *fqn = PyList_GET_ITEM(ix->np_fqns, slot);
    if (fqn == Py_None) {
        Py_ssize_t t = dcp_index_tensor_slot(ix, param);
        Py_ssize_t n =
            t < 0 ? 0 : PyList_GET_SIZE(PyList_GET_ITEM(ix->tensor_fqns, t));
        PyErr_Format(PyExc_AssertionError,
                     "Expected 1 FQN for key '%S', got %zd",
                     PyList_GET_ITEM(ix->np_names, slot),
                     n);
        return NULL;
    }
    return fqn;
}

/* FQN of an optimized parameter (borrowed from the index), or NULL. */
static PyObject *
param_fqn(dcp_ModelIndex *ix,
          PyObject *param,
          Py_ssize_t opt_i,
          Py_ssize_t group_i)
{
    return param_fqn_at(
        ix, param, dcp_index_param_slot(ix, param), opt_i, group_i);
}

/* The parameters of one optimizer, for attributing its state entries.
 * Its state is usually keyed in parameter order (a step creates it in
 * that order), so entries are matched in lockstep with the chained
 * params lists; at the first entry out of order an identity map of all
 * positions is built and used from then on. */
typedef struct {
    PyObject *plists;     /* the groups' params lists, pinned */
    PyObject *fqns;       /* FQN of every position, groups chained */
    dcp_ptrmap map;       /* param -> first position; built on demand */
    Py_ssize_t g, i, pos; /* lockstep cursor */
    int lockstep;
} dcp_pack_members;

/* Position of `key` among the parameters, -1 when it is none of them,
 * -2 on error. */
static Py_ssize_t
pack_members_find(dcp_state *st, dcp_pack_members *pm, PyObject *key)
{
    Py_ssize_t ng = PyList_GET_SIZE(pm->plists);
    Py_ssize_t total = PyList_GET_SIZE(pm->fqns);
    if (pm->lockstep) {
        while (pm->g < ng &&
               pm->i >= PyList_GET_SIZE(PyList_GET_ITEM(pm->plists, pm->g))) {
            pm->g++;
            pm->i = 0;
        }
        if (pm->g < ng && pm->pos < total &&
            PyList_GET_ITEM(PyList_GET_ITEM(pm->plists, pm->g), pm->i) ==
                key) {
            pm->i++;
            return pm->pos++;
        }
        pm->lockstep = 0;
    }
    if (pm->map.slots == NULL) {
        Py_ssize_t pos = 0;
        if (dcp_ptrmap_init(&pm->map, (size_t)total) < 0) {
            return -2;
        }
        for (Py_ssize_t g = 0; g < ng; g++) {
            PyObject *list = PyList_GET_ITEM(pm->plists, g);
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++, pos++) {
                if (pos >= total ||
                    dcp_ptrmap_setdefault(
                        &pm->map, PyList_GET_ITEM(list, i), pos) == -2) {
                    break;
                }
            }
        }
        if (PyErr_Occurred()) {
            return -2;
        }
        if (pos != total) {
            PyErr_SetString(st->err_runtime,
                            "optimizer param groups changed during "
                            "state_dict");
            return -2;
        }
    }
    return dcp_ptrmap_get(&pm->map, key);
}

/* 1 if `state` (an optimizer's .state) iterates exactly like a dict: a
 * dict or a plain collections.defaultdict, so PyDict_Next gives .items()
 * order without running any code. */
static int
plain_state_dict(dcp_ModelIndex *ix, PyObject *state)
{
    dcp_Context *ctx = (dcp_Context *)ix->ctx;
    return PyDict_CheckExact(state) ||
           (PyObject *)Py_TYPE(state) == ctx->defaultdict_type;
}

/* Packs one group: its keys except "params" in order, then "params" as
 * FQNs.  Appends the params list and the FQNs to `pm`.  New dict or
 * NULL. */
static PyObject *
pack_group(dcp_state *st,
           dcp_ModelIndex *ix,
           PyObject *group,
           dcp_pack_members *pm,
           Py_ssize_t *np_cursor,
           Py_ssize_t opt_i,
           Py_ssize_t group_i)
{
    PyObject *packed = NULL, *params = NULL, *fqns = NULL, *items = NULL;
    items = dcp_items_list(st, group);
    if (items == NULL) {
        goto error;
    }
    packed = PyDict_New();
    if (packed == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        int is_params = PyUnicode_Check(key) &&
                        PyUnicode_Compare(key, st->str_params) == 0;
        if (!is_params &&
            PyDict_SetItem(packed, key, PyTuple_GET_ITEM(pair, 1)) < 0) {
            goto error;
        }
    }
    params = group_params_pinned(st, group, opt_i, group_i);
    if (params == NULL || PyList_Append(pm->plists, params) < 0) {
        goto error;
    }
    /* No user code runs below until the FQNs are in place (the pinned
     * list cannot change under us). */
    Py_ssize_t n = PyList_GET_SIZE(params);
    fqns = PyList_New(n);
    if (fqns == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(params, i);
        PyObject *fqn = param_fqn_at(
            ix, p, np_slot_near(ix, p, np_cursor), opt_i, group_i);
        if (fqn == NULL) {
            goto error;
        }
        PyList_SET_ITEM(fqns, i, Py_NewRef(fqn));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_Append(pm->fqns, PyList_GET_ITEM(fqns, i)) < 0) {
            goto error;
        }
    }
    if (PyDict_SetItem(packed, st->str_params, fqns) < 0) {
        goto error;
    }
    Py_DECREF(items);
    Py_DECREF(params);
    Py_DECREF(fqns);
    return packed;
error:
    Py_XDECREF(items);
    Py_XDECREF(packed);
    Py_XDECREF(params);
    Py_XDECREF(fqns);
    return NULL;
}

/* out_state[fqn of key] = value for one entry of an optimizer's state.
 * `wide`: NULL, or the dict that takes the optimizer-wide entries (str
 * keys, not parameters: MADGRAD's "k"; D29 in docs/differences.md).
 * 0 or -1. */
static int
pack_state_entry(dcp_state *st,
                 dcp_ModelIndex *ix,
                 dcp_pack_members *pm,
                 PyObject *out_state,
                 PyObject *wide,
                 Py_ssize_t opt_i,
                 PyObject *key,
                 PyObject *value)
{
    if (wide != NULL && PyUnicode_Check(key)) {
        return PyDict_SetItem(wide, key, value);
    }
    Py_ssize_t at = pack_members_find(st, pm, key);
    if (at == -2) {
        return -1;
    }
    if (at < 0) {
        /* Upstream: KeyError from Optimizer.state_dict's id map. */
        Py_ssize_t slot = dcp_index_param_slot(ix, key);
        PyObject *what = slot >= 0 ? PyList_GET_ITEM(ix->np_fqns, slot) : key;
        PyErr_Format(dcp_get_state_by_type(Py_TYPE(ix))->err_key,
                     "optimizer %zd has state for %R, which is not in any "
                     "of its param groups",
                     opt_i,
                     what);
        return -1;
    }
    return PyDict_SetItem(out_state, PyList_GET_ITEM(pm->fqns, at), value);
}

/* Adds the optimizer's own state to out_state keyed by FQN. 0 or -1. */
static int
pack_state(dcp_state *st,
           dcp_ModelIndex *ix,
           PyObject *optim,
           dcp_pack_members *pm,
           PyObject *out_state,
           PyObject *wide,
           Py_ssize_t opt_i)
{
    PyObject *state = PyObject_GetAttr(optim, st->str_state);
    if (state == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(st->err_type,
                         "optimizer %zd (%.200s) has no 'state'; pass "
                         "torch.optim.Optimizer instances (for a composite "
                         "optimizer, pass its sub-optimizers)",
                         opt_i,
                         Py_TYPE(optim)->tp_name);
        }
        return -1;
    }
    int rc = -1;
    PyObject *items = NULL;
    if (plain_state_dict(ix, state)) {
        /* No items list: iterate in place.  The store may release a
         * replaced value (two optimizers naming one FQN), so key and value
         * are pinned around it and the size is checked after it. */
        Py_ssize_t pos = 0, n = PyDict_GET_SIZE(state);
        PyObject *key, *value;
        while (PyDict_Next(state, &pos, &key, &value)) {
            Py_INCREF(key);
            Py_INCREF(value);
            int r = pack_state_entry(
                st, ix, pm, out_state, wide, opt_i, key, value);
            Py_DECREF(key);
            Py_DECREF(value);
            if (r < 0) {
                goto done;
            }
            if (PyDict_GET_SIZE(state) != n) {
                PyErr_Format(st->err_runtime,
                             "optimizer %zd state changed size during "
                             "iteration",
                             opt_i);
                goto done;
            }
        }
        rc = 0;
        goto done;
    }
    items = dcp_items_list(st, state);
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (pack_state_entry(st,
                             ix,
                             pm,
                             out_state,
                             wide,
                             opt_i,
                             PyTuple_GET_ITEM(pair, 0),
                             PyTuple_GET_ITEM(pair, 1)) < 0) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(state);
    Py_XDECREF(items);
    return rc;
}

PyDoc_STRVAR(
    dcp_optim_pack__doc__,
    "optim_pack(index, optimizers, extra_states, out_state, out_groups, "
    "out_wide=None, /)"
    "\n--\n\n"
    "FQN-keyed equivalent of Optimizer.state_dict() for each optimizer, "
    "merged into out_state / out_groups.");

/* optim_pack(index, optimizers, extra_states, out_state, out_groups
 *            [, out_wide])
 *
 * extra_states[i] is None or a dict {fqn: state} appended after
 * optimizer i's own state (the pristine entries of D2 in docs/differences.md).
 * out_wide: None (a str key in a state is an error, as before), or a list
 * that takes one dict per optimizer: its optimizer-wide entries (the
 * str-keyed entries of its state, D29).
 */
static PyObject *
dcp_optim_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *optims = NULL, *extras = NULL;
    PyObject *groups = NULL, *result = NULL;
    dcp_pack_members pm = {NULL, NULL, {NULL, 0, 0}, 0, 0, 0, 1};

    if (nargs != 5 && nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "optim_pack() takes 5 or 6 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    if (!dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *out_state = args[3], *out_groups = args[4];
    PyObject *out_wide = nargs == 6 && args[5] != Py_None ? args[5] : NULL;
    PyObject *wide = NULL;
    if (!PyDict_Check(out_state) || !PyList_Check(out_groups) ||
        (out_wide != NULL && !PyList_Check(out_wide))) {
        PyErr_SetString(PyExc_TypeError,
                        "optim_pack(): out_state must be a dict, "
                        "out_groups a list and out_wide None or a list");
        return NULL;
    }
    optims = dcp_as_list(st, args[1], "optimizers");
    extras = optims ? dcp_as_list(st, args[2], "extra_states") : NULL;
    if (extras == NULL) {
        goto done;
    }
    if (PyList_GET_SIZE(extras) != PyList_GET_SIZE(optims)) {
        PyErr_SetString(PyExc_ValueError,
                        "optim_pack(): one extra_states entry per optimizer");
        goto done;
    }
    for (Py_ssize_t o = 0; o < PyList_GET_SIZE(optims); o++) {
        PyObject *optim = PyList_GET_ITEM(optims, o);
        groups = optimizer_groups(st, optim, o);
        if (groups == NULL) {
            goto done;
        }
        Py_ssize_t np_cursor = 0;
        pm.plists = PyList_New(0);
        pm.fqns = PyList_New(0);
        if (pm.plists == NULL || pm.fqns == NULL) {
            goto done;
        }
        for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
            PyObject *packed = pack_group(
                st, ix, PyList_GET_ITEM(groups, g), &pm, &np_cursor, o, g);
            if (packed == NULL) {
                goto done;
            }
            int rc = PyList_Append(out_groups, packed);
            Py_DECREF(packed);
            if (rc < 0) {
                goto done;
            }
        }
        if (out_wide != NULL) {
            wide = PyDict_New();
            if (wide == NULL || PyList_Append(out_wide, wide) < 0) {
                goto done;
            }
        }
        if (pack_state(st, ix, optim, &pm, out_state, wide, o) < 0) {
            goto done;
        }
        Py_CLEAR(wide);
        PyObject *extra = PyList_GET_ITEM(extras, o);
        if (extra != Py_None && PyDict_Update(out_state, extra) < 0) {
            goto done;
        }
        dcp_ptrmap_free(&pm.map);
        Py_CLEAR(pm.plists);
        Py_CLEAR(pm.fqns);
        pm.g = pm.i = pm.pos = 0;
        pm.lockstep = 1;
        Py_CLEAR(groups);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(wide);
    dcp_ptrmap_free(&pm.map);
    Py_XDECREF(pm.plists);
    Py_XDECREF(pm.fqns);
    Py_XDECREF(groups);
    Py_XDECREF(optims);
    Py_XDECREF(extras);
    return result;
}

PyDoc_STRVAR(dcp_optim_remap__doc__,
             "optim_remap(index, optimizer, osd, /)\n--\n\n"
             "Re-key an integer-ID optimizer state dict by FQN, in place.");

/* optim_remap(index, optimizer, osd): re-key the integer-ID state dict an
 * optimizer's own state_dict() returned, in place: `state` keys become
 * FQNs (order kept) and each group's "params" a list of FQNs.  IDs are
 * positions in the chain of the live groups' params, as torch assigns
 * them. */
static PyObject *
dcp_optim_remap(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *groups = NULL, *id_fqns = NULL, *state = NULL;
    PyObject *items = NULL, *new_state = NULL, *saved_groups = NULL;
    PyObject *result = NULL;

    if (dcp_check_nargs("optim_remap", nargs, 3) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *osd = args[2];
    groups = optimizer_groups(st, args[1], 0);
    if (groups == NULL) {
        goto done;
    }
    /* id -> fqn, in chain order */
    id_fqns = PyList_New(0);
    if (id_fqns == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        PyObject *params = group_params(st, PyList_GET_ITEM(groups, g), 0, g);
        if (params == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *fqn = param_fqn(ix, PyList_GET_ITEM(params, i), 0, g);
            if (fqn == NULL || PyList_Append(id_fqns, fqn) < 0) {
                Py_DECREF(params);
                goto done;
            }
        }
        Py_DECREF(params);
    }
    if (!PyDict_Check(osd)) {
        PyErr_Format(st->err_type,
                     "optimizer.state_dict() returned %.200s, not a dict",
                     Py_TYPE(osd)->tp_name);
        goto done;
    }
    if (dcp_dict_get_ref(osd, st->str_state, &state) <= 0 ||
        dcp_dict_get_ref(osd, st->str_param_groups, &saved_groups) <= 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(st->err_key,
                            "optimizer.state_dict() must return 'state' and "
                            "'param_groups'");
        }
        goto done;
    }
    items = dcp_items_list(st, state);
    new_state = PyDict_New();
    if (items == NULL || new_state == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        Py_ssize_t id = PyLong_Check(key) ? PyLong_AsSsize_t(key) : -1;
        if (id == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (id < 0 || id >= PyList_GET_SIZE(id_fqns)) {
            PyErr_Format(st->err_key,
                         "optimizer state key %R is not a parameter ID of "
                         "the optimizer's param groups",
                         key);
            goto done;
        }
        if (PyDict_SetItem(new_state,
                           PyList_GET_ITEM(id_fqns, id),
                           PyTuple_GET_ITEM(pair, 1)) < 0) {
            goto done;
        }
    }
    if (PyDict_SetItem(osd, st->str_state, new_state) < 0) {
        goto done;
    }
    PyObject *glist = saved_groups;
    if (!PyList_Check(glist)) {
        PyErr_SetString(st->err_type, "'param_groups' must be a list");
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(glist); g++) {
        PyObject *group = PyList_GET_ITEM(glist, g);
        PyObject *ids = NULL, *names = NULL;
        if (!PyDict_Check(group) ||
            dcp_dict_get_ref(group, st->str_params, &ids) <= 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(
                    st->err_key, "param group %zd has no 'params'", g);
            }
            goto done;
        }
        PyObject *idlist = dcp_as_list(st, ids, "param_group['params']");
        Py_DECREF(ids);
        if (idlist == NULL) {
            goto done;
        }
        names = PyList_New(PyList_GET_SIZE(idlist));
        for (Py_ssize_t i = 0; names != NULL && i < PyList_GET_SIZE(idlist);
             i++) {
            PyObject *key = PyList_GET_ITEM(idlist, i);
            Py_ssize_t id = PyLong_Check(key) ? PyLong_AsSsize_t(key) : -1;
            if (id < 0 || id >= PyList_GET_SIZE(id_fqns)) {
                if (!PyErr_Occurred()) {
                    PyErr_Format(st->err_key,
                                 "param group %zd lists %R, which is not a "
                                 "parameter ID of the optimizer",
                                 g,
                                 key);
                }
                Py_CLEAR(names);
                break;
            }
            PyList_SET_ITEM(names, i, Py_NewRef(PyList_GET_ITEM(id_fqns, id)));
        }
        Py_DECREF(idlist);
        if (names == NULL ||
            PyDict_SetItem(group, st->str_params, names) < 0) {
            Py_XDECREF(names);
            goto done;
        }
        Py_DECREF(names);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(groups);
    Py_XDECREF(id_fqns);
    Py_XDECREF(state);
    Py_XDECREF(saved_groups);
    Py_XDECREF(items);
    Py_XDECREF(new_state);
    return result;
}

/* 1 when `state` (a plain dict) holds a non-empty entry for every
 * parameter of `groups`, in parameter order -- what a step leaves behind:
 * then nothing is missing.  0 otherwise (the caller takes the general
 * path), -1 on error. */
static int
all_params_have_state(dcp_state *st, PyObject *groups, PyObject *state)
{
    Py_ssize_t ng = PyList_GET_SIZE(groups), g = 0, i = 0, total = 0;
    PyObject *list = NULL;
    for (Py_ssize_t k = 0; k < ng; k++) {
        PyObject *params = NULL;
        int rc = dcp_dict_get_ref(
            PyList_GET_ITEM(groups, k), st->str_params, &params);
        if (rc <= 0 || !PyList_CheckExact(params)) {
            Py_XDECREF(params);
            return rc < 0 ? -1 : 0;
        }
        total += PyList_GET_SIZE(params);
        Py_DECREF(params);
    }
    if (PyDict_GET_SIZE(state) != total) {
        return 0;
    }
    /* The lookups of "params" compare keys, which may run a key's __eq__:
     * the entries are pinned and the size checked (dcp_dict_iter). */
    PyObject *key, *value;
    int all = 1, more = 0;
    dcp_dict_iter it;
    dcp_dict_iter_init(&it, state);
    while (all && (more = dcp_dict_iter_next(&it, &key, &value)) == 1) {
        while (list == NULL || i >= PyList_GET_SIZE(list)) {
            Py_CLEAR(list);
            if (g >= ng ||
                dcp_dict_get_ref(
                    PyList_GET_ITEM(groups, g), st->str_params, &list) <= 0 ||
                !PyList_CheckExact(list)) {
                Py_XDECREF(list);
                dcp_dict_iter_clear(&it);
                return PyErr_Occurred() ? -1 : 0;
            }
            g++;
            i = 0;
        }
        all = PyList_GET_ITEM(list, i) == key &&
              !(PyDict_Check(value) && PyDict_GET_SIZE(value) == 0);
        i++;
    }
    dcp_dict_iter_clear(&it);
    Py_XDECREF(list);
    return more < 0 ? -1 : all;
}

PyDoc_STRVAR(
    dcp_optim_missing__doc__,
    "optim_missing(index, optimizer, /)\n--\n\n"
    "(param, group_index, fqn) of trainable parameters without state.");

/* optim_missing(index, optimizer) -> list of (param, group_index, fqn)
 * for parameters with requires_grad=True that have no (or empty) state,
 * in param-group order. */
static PyObject *
dcp_optim_missing(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *groups = NULL, *state = NULL, *result = NULL, *out = NULL;
    PyObject *plists = NULL, *items = NULL;
    dcp_ptrmap seen = {NULL, 0, 0}, have = {NULL, 0, 0};

    if (dcp_check_nargs("optim_missing", nargs, 2) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    groups = optimizer_groups(st, args[1], 0);
    if (groups == NULL) {
        goto done;
    }
    state = PyObject_GetAttr(args[1], st->str_state);
    if (state == NULL) {
        goto done;
    }
    if (plain_state_dict(ix, state)) {
        int all = all_params_have_state(st, groups, state);
        if (all < 0) {
            goto done;
        }
        if (all) {
            result = PyList_New(0);
            goto done;
        }
    }
    /* Every group's params first: they stay pinned by these lists while
     * `have` is used, so no address in `have` can be reused by one of
     * them even if user code (a requires_grad property) frees state keys
     * later. */
    plists = PyList_New(PyList_GET_SIZE(groups));
    if (plists == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        PyObject *params = group_params(st, PyList_GET_ITEM(groups, g), 0, g);
        if (params == NULL) {
            goto done;
        }
        PyList_SET_ITEM(plists, g, params);
    }
    /* Which params have non-empty state, by identity: probing the
     * defaultdict with [] would insert, and .get() would hash tensors in
     * Python.  A dict or defaultdict is read in place (no code runs while
     * the map is built); anything else through an items list. */
    if (plain_state_dict(ix, state)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        if (dcp_ptrmap_init(&have, PyDict_GET_SIZE(state)) < 0) {
            goto done;
        }
        while (PyDict_Next(state, &pos, &key, &value)) {
            if (PyDict_Check(value) && PyDict_GET_SIZE(value) == 0) {
                continue;
            }
            if (dcp_ptrmap_setdefault(&have, key, 1) == -2) {
                goto done;
            }
        }
    }
    else {
        items = dcp_items_list(st, state);
        if (items == NULL ||
            dcp_ptrmap_init(&have, PyList_GET_SIZE(items)) < 0) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            PyObject *value = PyTuple_GET_ITEM(pair, 1);
            if (PyDict_Check(value) && PyDict_GET_SIZE(value) == 0) {
                continue;
            }
            if (dcp_ptrmap_setdefault(&have, PyTuple_GET_ITEM(pair, 0), i) ==
                -2) {
                goto done;
            }
        }
    }
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(plists); g++) {
        PyObject *params = PyList_GET_ITEM(plists, g);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *p = PyList_GET_ITEM(params, i);
            /* A parameter with state is never missing, wherever it
             * appears; the others count once, at their first place. */
            if (dcp_ptrmap_get(&have, p) >= 0) {
                continue;
            }
            Py_ssize_t dup = dcp_ptrmap_setdefault(&seen, p, 1);
            if (dup != -1) {
                if (dup == -2) {
                    goto done;
                }
                continue;
            }
            PyObject *rg = PyObject_GetAttr(p, st->str_requires_grad);
            int trainable = rg ? PyObject_IsTrue(rg) : -1;
            Py_XDECREF(rg);
            if (trainable < 0) {
                goto done;
            }
            if (!trainable) {
                continue;
            }
            /* A flat parameter (FSDP1) has no single FQN (np_fqns holds
             * None): the first of its originals' FQNs names the entry and
             * the FSDP1 layer maps it to all of them. */
            Py_ssize_t t = dcp_index_tensor_slot(ix, p);
            Py_ssize_t slot = dcp_index_param_slot(ix, p);
            int flat =
                t >= 0 && slot >= 0 &&
                PyList_GET_ITEM(ix->np_fqns, slot) == Py_None &&
                PyList_GET_SIZE(PyList_GET_ITEM(ix->tensor_fqns, t)) > 0;
            PyObject *fqn =
                flat ? PyList_GET_ITEM(PyList_GET_ITEM(ix->tensor_fqns, t), 0)
                     : param_fqn(ix, p, 0, g);
            PyObject *gi = fqn ? PyLong_FromSsize_t(g) : NULL;
            PyObject *item = gi ? PyTuple_Pack(3, p, gi, fqn) : NULL;
            Py_XDECREF(gi);
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                goto done;
            }
            Py_DECREF(item);
        }
    }
    result = Py_NewRef(out);
done:
    dcp_ptrmap_free(&seen);
    dcp_ptrmap_free(&have);
    Py_XDECREF(groups);
    Py_XDECREF(plists);
    Py_XDECREF(state);
    Py_XDECREF(items);
    Py_XDECREF(out);
    return result;
}

PyMethodDef dcp_optim_methods[] = {
    {"optim_pack",
     DCP_FASTCALL(dcp_optim_pack),
     METH_FASTCALL,
     dcp_optim_pack__doc__},
    {"optim_remap",
     DCP_FASTCALL(dcp_optim_remap),
     METH_FASTCALL,
     dcp_optim_remap__doc__},
    {"optim_missing",
     DCP_FASTCALL(dcp_optim_missing),
     METH_FASTCALL,
     dcp_optim_missing__doc__},
    {NULL, NULL, 0, NULL},
};
