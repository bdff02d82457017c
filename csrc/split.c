/* Set side: match a combined FQN-keyed optimizer state dict to each live
 * optimizer, and install the result.
 *
 * view_from_nested  the nested format as a "loaded view" (see flat.c);
 * split_optim       per optimizer, the dict Optimizer.load_state_dict
 *                   expects (FQNs standing in for IDs, groups in the live
 *                   order and sizes), matched by FQN, never by position;
 * prepare_install   Optimizer.load_state_dict's state and groups, built
 *                   without its per-tensor scan of every group's params
 *                   (quadratic in the parameter count) and with the
 *                   dtype/device policy of D9 in docs/differences.md.
 *
 * Matching rules (D5-D7, D10 in docs/differences.md):
 *   - a parameter takes the first of its FQNs (tied parameters have
 *     several) that the loaded dict mentions;
 *   - it gets state when the loaded dict has state for that FQN, whatever
 *     its requires_grad (presence decides); a trainable parameter of a
 *     stateful group without saved state is "missing" (E18 when strict);
 *   - a group takes the keys of every loaded group its parameters come
 *     from (in loaded order), then keeps its own keys the loaded groups
 *     lack; "params" comes first, as upstream leaves it.  Where two of
 *     those loaded groups give a key values that are not plainly equal,
 *     the pair is returned as a conflict, which the caller compares in
 *     full and refuses (one live group cannot hold both: upstream's load
 *     keeps the last, and some parameters train on another group's
 *     hyperparameters, silently);
 *   - the k-th empty live group takes the k-th empty loaded group (nested
 *     format) or the one with the same anchor identity (flat format);
 *   - loaded state for FQNs no optimizer owns is reported, not loaded.
 */
#include "dcp.h"

#include <stdlib.h> /* qsort */

PyDoc_STRVAR(dcp_view_from_nested__doc__,
             "view_from_nested(osd, /)\n--\n\n"
             "A nested optimizer dict as a loaded-state view.");

/* view_from_nested(osd) -> (state, groups, fqn_group, empties, unexpected)
 */
static PyObject *
dcp_view_from_nested(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *state = NULL, *groups = NULL, *glist = NULL;
    PyObject *fqn_group = NULL, *empties = NULL, *unexpected = NULL;
    PyObject *result = NULL;

    if (dcp_check_nargs("view_from_nested", nargs, 1) < 0) {
        return NULL;
    }
    PyObject *osd = args[0];
    if (!PyDict_Check(osd)) {
        PyErr_Format(st->err_type,
                     "optimizer state dict must be a dict, not %.200s",
                     Py_TYPE(osd)->tp_name);
        return NULL;
    }
    if (dcp_dict_get_ref(osd, st->str_state, &state) < 0 ||
        dcp_dict_get_ref(osd, st->str_param_groups, &groups) < 0) {
        goto done;
    }
    if (state == NULL) {
        state = PyDict_New();
    }
    else if (!PyDict_Check(state)) {
        PyErr_Format(st->err_optim_dict,
                     "optimizer state dict['state'] must be a dict, not "
                     "%.200s",
                     Py_TYPE(state)->tp_name);
        goto done;
    }
    glist = groups ? dcp_as_list(st,
                                 groups,
                                 "optimizer state dict "
                                 "['param_groups']")
                   : PyList_New(0);
    fqn_group = PyDict_New();
    empties = PyList_New(0);
    unexpected = PyList_New(0);
    if (state == NULL || glist == NULL || fqn_group == NULL ||
        empties == NULL || unexpected == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(glist); g++) {
        PyObject *group = PyList_GET_ITEM(glist, g);
        PyObject *params = NULL, *plist = NULL;
        if (!PyDict_Check(group)) {
            PyErr_Format(st->err_type,
                         "param_groups[%zd] must be a dict, not %.200s",
                         g,
                         Py_TYPE(group)->tp_name);
            goto done;
        }
        int rc = dcp_dict_get_ref(group, st->str_params, &params);
        if (rc < 0) {
            goto done;
        }
        plist = rc ? dcp_as_list(st, params, "param_group['params']")
                   : PyList_New(0);
        Py_XDECREF(params);
        if (plist == NULL) {
            goto done;
        }
        PyObject *gi = PyLong_FromSsize_t(g);
        if (gi == NULL) {
            Py_DECREF(plist);
            goto done;
        }
        if (PyList_GET_SIZE(plist) == 0) {
            PyObject *pair = PyTuple_Pack(2, Py_None, gi);
            rc = pair ? PyList_Append(empties, pair) : -1;
            Py_XDECREF(pair);
        }
        for (Py_ssize_t i = 0; rc >= 0 && i < PyList_GET_SIZE(plist); i++) {
            PyObject *fqn = PyList_GET_ITEM(plist, i);
            rc = PyDict_SetDefault(fqn_group, fqn, gi) ? 0 : -1;
        }
        Py_DECREF(gi);
        Py_DECREF(plist);
        if (rc < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(5, state, glist, fqn_group, empties, unexpected);
done:
    Py_XDECREF(state);
    Py_XDECREF(groups);
    Py_XDECREF(glist);
    Py_XDECREF(fqn_group);
    Py_XDECREF(empties);
    Py_XDECREF(unexpected);
    return result;
}

/* ----------------------------------------------------------------------
 * split_optim
 */

typedef struct {
    PyObject *state;      /* dict fqn -> state */
    PyObject *groups;     /* list of dicts */
    PyObject *fqn_group;  /* dict fqn -> int */
    PyObject *empties;    /* list of (identity | None, int) */
    PyObject *unexpected; /* list */
} dcp_view;

static int
view_unpack(PyObject *obj, dcp_view *v)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 5 ||
        !PyDict_Check(PyTuple_GET_ITEM(obj, 0)) ||
        !PyList_Check(PyTuple_GET_ITEM(obj, 1)) ||
        !PyDict_Check(PyTuple_GET_ITEM(obj, 2)) ||
        !PyList_Check(PyTuple_GET_ITEM(obj, 3)) ||
        !PyList_Check(PyTuple_GET_ITEM(obj, 4))) {
        PyErr_SetString(PyExc_TypeError, "malformed loaded-state view");
        return -1;
    }
    v->state = PyTuple_GET_ITEM(obj, 0);
    v->groups = PyTuple_GET_ITEM(obj, 1);
    v->fqn_group = PyTuple_GET_ITEM(obj, 2);
    v->empties = PyTuple_GET_ITEM(obj, 3);
    v->unexpected = PyTuple_GET_ITEM(obj, 4);
    return 0;
}

/* The FQN a live parameter answers to: the first of its FQNs the loaded
 * view mentions, else its named_parameters() FQN.  New reference. */
static PyObject *
choose_fqn(dcp_state *st,
           dcp_ModelIndex *ix,
           dcp_view *v,
           PyObject *param,
           Py_ssize_t opt_i,
           Py_ssize_t group_i)
{
    Py_ssize_t t = dcp_index_tensor_slot(ix, param);
    Py_ssize_t np = dcp_index_param_slot(ix, param);
    if (t < 0 && np < 0) {
        PyErr_Format(st->err_key,
                     "optimizer %zd, param group %zd holds a parameter "
                     "(%.200s) that is not a parameter of the model",
                     opt_i,
                     group_i,
                     Py_TYPE(param)->tp_name);
        return NULL;
    }
    if (t >= 0) {
        PyObject *names = PyList_GET_ITEM(ix->tensor_fqns, t);
        if (PyList_GET_SIZE(names) > 1) {
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(names); i++) {
                PyObject *name = PyList_GET_ITEM(names, i);
                int in_groups = PyDict_Contains(v->fqn_group, name);
                int in_state = in_groups ? 0 : PyDict_Contains(v->state, name);
                if (in_groups < 0 || in_state < 0) {
                    return NULL;
                }
                if (in_groups || in_state) {
                    return Py_NewRef(name);
                }
            }
        }
    }
    PyObject *fqn = np >= 0 ? PyList_GET_ITEM(ix->np_fqns, np) : Py_None;
    if (fqn == Py_None) {
        fqn = PyList_GET_ITEM(PyList_GET_ITEM(ix->tensor_fqns, t), 0);
    }
    return Py_NewRef(fqn);
}

/* Identity of the empty live group `g` (flat format anchoring), computed
 * over the chosen FQN lists `fqn_lists` of one optimizer. */
static PyObject *
empty_identity(PyObject *fqn_lists, Py_ssize_t g, Py_ssize_t opt_i)
{
    Py_ssize_t n = PyList_GET_SIZE(fqn_lists);
    for (Py_ssize_t j = g - 1; j >= 0; j--) {
        PyObject *fqns = PyList_GET_ITEM(fqn_lists, j);
        if (PyList_GET_SIZE(fqns) > 0) {
            return PyUnicode_FromFormat(
                "%S|after|%zd", PyList_GET_ITEM(fqns, 0), g - j);
        }
    }
    for (Py_ssize_t j = g + 1; j < n; j++) {
        PyObject *fqns = PyList_GET_ITEM(fqn_lists, j);
        if (PyList_GET_SIZE(fqns) > 0) {
            return PyUnicode_FromFormat(
                "%S|before|%zd", PyList_GET_ITEM(fqns, 0), j - g);
        }
    }
    return PyUnicode_FromFormat("__optimizer_%zd_empty_group_%zd__", opt_i, g);
}

/* Finds the loaded empty group for a live empty group: by identity when
 * the view has identities, else the k-th one.  Returns the group index,
 * -1 when none matches, -2 on error. */
static Py_ssize_t
match_empty(dcp_view *v, PyObject *identity, Py_ssize_t k)
{
    Py_ssize_t n = PyList_GET_SIZE(v->empties);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(v->empties, i);
        PyObject *id = PyTuple_GET_ITEM(pair, 0);
        if (id == Py_None) {
            if (i == k) {
                Py_ssize_t gi = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
                return gi == -1 && PyErr_Occurred() ? -2 : gi;
            }
            continue;
        }
        int eq = PyUnicode_Compare(id, identity);
        if (eq == -1 && PyErr_Occurred()) {
            return -2;
        }
        if (eq == 0) {
            Py_ssize_t gi = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
            return gi == -1 && PyErr_Occurred() ? -2 : gi;
        }
    }
    return -1;
}

/* Whether two group values are plainly equal: the same object, or
 * numbers, strings or None comparing equal, or tuples/lists of such.  1
 * equal, 0 not known to be (a tensor, an object, NaN: the caller compares
 * those in Python), -1 error.  Only types whose comparison cannot call
 * back into user code are compared here. */
static int
plainly_equal(PyObject *a, PyObject *b, int depth)
{
    if (a == b) {
        return 1;
    }
    if (depth > 8) {
        return 0;
    }
    int scalar_a = a == Py_None || PyBool_Check(a) || PyLong_CheckExact(a) ||
                   PyFloat_CheckExact(a) || PyUnicode_CheckExact(a);
    int scalar_b = b == Py_None || PyBool_Check(b) || PyLong_CheckExact(b) ||
                   PyFloat_CheckExact(b) || PyUnicode_CheckExact(b);
    if (scalar_a && scalar_b) {
        if (Py_TYPE(a) != Py_TYPE(b)) {
            return 0;
        }
        return PyObject_RichCompareBool(a, b, Py_EQ);
    }
    if ((PyTuple_CheckExact(a) && PyTuple_CheckExact(b)) ||
        (PyList_CheckExact(a) && PyList_CheckExact(b))) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
        if (n != PySequence_Fast_GET_SIZE(b)) {
            return 0;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            /* a list can change under a comparison only through user
             * code, which plainly_equal never calls; items pinned anyway */
            PyObject *x = PySequence_Fast_GET_ITEM(a, i);
            PyObject *y = PySequence_Fast_GET_ITEM(b, i);
            Py_INCREF(x);
            Py_INCREF(y);
            int r = plainly_equal(x, y, depth + 1);
            Py_DECREF(x);
            Py_DECREF(y);
            if (r != 1) {
                return r;
            }
            if (PySequence_Fast_GET_SIZE(a) != n ||
                PySequence_Fast_GET_SIZE(b) != n) {
                return 0;
            }
        }
        return 1;
    }
    return 0;
}

/* Stores `value` under `key` in `out`.  With `conflicts` (a later loaded
 * group of the same live group), a value `out` already holds that is not
 * plainly equal to it is recorded first as ("values", optimizer, live
 * group, key, held value, value, loaded group index).  0, or -1 with an
 * exception. */
static int
store_group_value(PyObject *out,
                  PyObject *key,
                  PyObject *value,
                  PyObject *conflicts,
                  Py_ssize_t o,
                  Py_ssize_t g,
                  Py_ssize_t gi)
{
    if (conflicts != NULL) {
        PyObject *held = PyDict_GetItemWithError(out, key);
        if (held == NULL && PyErr_Occurred()) {
            return -1;
        }
        if (held != NULL) {
            Py_INCREF(held);
            int same = plainly_equal(held, value, 0);
            PyObject *entry = NULL;
            if (same == 0) {
                entry = Py_BuildValue(
                    "(snnOOOn)", "values", o, g, key, held, value, gi);
            }
            int rc = same < 0 || (same == 0 &&
                                  (entry == NULL ||
                                   PyList_Append(conflicts, entry) < 0))
                         ? -1
                         : 0;
            Py_XDECREF(entry);
            Py_DECREF(held);
            if (rc < 0) {
                return -1;
            }
        }
    }
    return PyDict_SetItem(out, key, value);
}

/* Copies every key of loaded group `gi` except "params" into `out` (the
 * live group `g` of optimizer `o`); `conflicts`: see store_group_value. */
static int
apply_loaded_group(dcp_state *st,
                   dcp_view *v,
                   Py_ssize_t gi,
                   PyObject *out,
                   PyObject *conflicts,
                   Py_ssize_t o,
                   Py_ssize_t g)
{
    if (gi < 0 || gi >= PyList_GET_SIZE(v->groups)) {
        PyErr_SetString(PyExc_IndexError, "loaded group index out of range");
        return -1;
    }
    PyObject *group = PyList_GET_ITEM(v->groups, gi);
    if (PyDict_CheckExact(group)) {
        /* A flattened dict has one loaded group per parameter, all
         * applied to one live group: no items list per group.  Key and
         * value are pinned across the store (a replaced value is
         * released) and the size is checked after it. */
        Py_ssize_t pos = 0, n = PyDict_GET_SIZE(group);
        PyObject *key, *value;
        Py_INCREF(group);
        int rc = 0;
        while (rc == 0 && PyDict_Next(group, &pos, &key, &value)) {
            if (PyUnicode_CheckExact(key) && key == st->str_params) {
                continue;
            }
            Py_INCREF(key);
            Py_INCREF(value);
            if (!(PyUnicode_Check(key) &&
                  PyUnicode_Compare(key, st->str_params) == 0)) {
                rc = store_group_value(out, key, value, conflicts, o, g, gi);
            }
            Py_DECREF(key);
            Py_DECREF(value);
            if (rc == 0 && PyDict_GET_SIZE(group) != n) {
                PyErr_SetString(st->err_runtime,
                                "loaded param group changed size during "
                                "iteration");
                rc = -1;
            }
        }
        Py_DECREF(group);
        return rc;
    }
    PyObject *items = dcp_items_list(st, group);
    if (items == NULL) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        if (PyUnicode_Check(key) &&
            PyUnicode_Compare(key, st->str_params) == 0) {
            continue;
        }
        rc = store_group_value(
            out, key, PyTuple_GET_ITEM(pair, 1), conflicts, o, g, gi);
    }
    Py_DECREF(items);
    return rc;
}

/* Adds the keys of the live group that `out` lacks (D7 in
 * docs/differences.md). */
static int
keep_live_keys(dcp_state *st, PyObject *live, PyObject *out)
{
    PyObject *items = dcp_items_list(st, live);
    if (items == NULL) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        if (PyDict_SetDefault(out, key, PyTuple_GET_ITEM(pair, 1)) == NULL) {
            rc = -1;
        }
    }
    Py_DECREF(items);
    return rc;
}

static int
list_of_params(dcp_state *st,
               PyObject *optim,
               Py_ssize_t o,
               PyObject **groups_out,
               PyObject **params_out)
{
    PyObject *raw = PyObject_GetAttr(optim, st->str_param_groups);
    PyObject *groups =
        raw ? dcp_as_list(st, raw, "optimizer.param_groups") : NULL;
    Py_XDECREF(raw);
    if (groups == NULL) {
        return -1;
    }
    PyObject *plists = PyList_New(PyList_GET_SIZE(groups));
    if (plists == NULL) {
        Py_DECREF(groups);
        return -1;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        PyObject *group = PyList_GET_ITEM(groups, g);
        PyObject *params = NULL;
        if (!PyDict_Check(group) ||
            dcp_dict_get_ref(group, st->str_params, &params) <= 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(st->err_key,
                             "optimizer %zd param group %zd has no "
                             "'params'",
                             o,
                             g);
            }
            Py_DECREF(groups);
            Py_DECREF(plists);
            return -1;
        }
        PyObject *list = dcp_as_list(st, params, "param_group['params']");
        Py_DECREF(params);
        if (list == NULL) {
            Py_DECREF(groups);
            Py_DECREF(plists);
            return -1;
        }
        PyList_SET_ITEM(plists, g, list);
    }
    *groups_out = groups;
    *params_out = plists;
    return 0;
}

/* 1 if the parameter requires grad, 0 if not, -1 on error. */
static int
requires_grad(dcp_state *st, PyObject *param)
{
    PyObject *rg = PyObject_GetAttr(param, st->str_requires_grad);
    if (rg == NULL) {
        return -1;
    }
    int r = PyObject_IsTrue(rg);
    Py_DECREF(rg);
    return r;
}

/* The loaded groups one live group draws its keys from.  A flattened dict
 * has one loaded group per parameter, so a live group can touch as many
 * loaded groups as it has parameters: membership is a mark per loaded
 * group (O(1)), not a scan of the list of touched ones (O(n^2) overall).
 * The marks are cleared after each live group by walking `touched`. */
typedef struct {
    unsigned char *seen; /* one flag per loaded group */
    Py_ssize_t *touched; /* loaded group indices, first-touch order */
    Py_ssize_t n;        /* number of loaded groups */
} dcp_group_marks;

/* 0, or -1 with MemoryError set. */
static int
group_marks_init(dcp_group_marks *m, Py_ssize_t n)
{
    /* +1: PyMem_Calloc(0, ...) may return NULL */
    m->seen = PyMem_Calloc((size_t)n + 1, 1);
    m->touched = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    m->n = n;
    if (m->seen == NULL || m->touched == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
group_marks_free(dcp_group_marks *m)
{
    PyMem_Free(m->seen);
    PyMem_Free(m->touched);
    m->seen = NULL;
    m->touched = NULL;
}

/* Records loaded group `k` (from PyLong_AsSsize_t: -1 may carry an
 * error) once.  0, or -1 with an exception set. */
static int
touch_group(dcp_group_marks *m, Py_ssize_t k, Py_ssize_t *ntouched)
{
    if (k == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (k < 0 || k >= m->n) {
        PyErr_SetString(PyExc_IndexError, "loaded group index out of range");
        return -1;
    }
    if (!m->seen[k]) {
        m->seen[k] = 1;
        m->touched[(*ntouched)++] = k;
    }
    return 0;
}

static int
cmp_ssize(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

/* Splits for one optimizer; appends to `results`, `missing`; marks the
 * FQNs it claims in `claimed`.  `expect` is None (auto) or a sequence of
 * bools per group.  `*empty_k` counts empty groups across optimizers. */
static int
split_one(dcp_state *st,
          dcp_ModelIndex *ix,
          dcp_view *v,
          PyObject *optim,
          Py_ssize_t o,
          PyObject *expect,
          PyObject *results,
          PyObject *missing,
          PyObject *claimed,
          PyObject *conflicts,
          Py_ssize_t *empty_k)
{
    PyObject *groups = NULL, *plists = NULL, *fqn_lists = NULL;
    PyObject *out_state = NULL, *out_groups = NULL, *out = NULL;
    PyObject *expect_list = NULL;
    dcp_group_marks marks = {NULL, NULL, 0};
    int rc = -1;

    if (list_of_params(st, optim, o, &groups, &plists) < 0) {
        goto done;
    }
    Py_ssize_t ngroups = PyList_GET_SIZE(groups);
    if (expect != Py_None) {
        expect_list = dcp_as_list(st, expect, "expect_state");
        if (expect_list == NULL) {
            goto done;
        }
        if (PyList_GET_SIZE(expect_list) != ngroups) {
            PyErr_SetString(PyExc_ValueError,
                            "expect_state needs one flag per param group");
            goto done;
        }
    }
    /* Pass 1: chosen FQN of every live parameter. */
    fqn_lists = PyList_New(ngroups);
    if (fqn_lists == NULL) {
        goto done;
    }
    int any_saved = 0;
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        PyObject *params = PyList_GET_ITEM(plists, g);
        PyObject *fqns = PyList_New(PyList_GET_SIZE(params));
        if (fqns == NULL) {
            goto done;
        }
        PyList_SET_ITEM(fqn_lists, g, fqns);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *fqn =
                choose_fqn(st, ix, v, PyList_GET_ITEM(params, i), o, g);
            if (fqn == NULL) {
                goto done;
            }
            PyList_SET_ITEM(fqns, i, fqn);
            if (!any_saved) {
                int has = PyDict_Contains(v->state, fqn);
                if (has < 0) {
                    goto done;
                }
                any_saved = has;
            }
        }
    }
    /* Pass 2: state and groups. */
    out_state = PyDict_New();
    out_groups = PyList_New(0);
    if (out_state == NULL || out_groups == NULL ||
        group_marks_init(&marks, PyList_GET_SIZE(v->groups)) < 0) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        PyObject *params = PyList_GET_ITEM(plists, g);
        PyObject *fqns = PyList_GET_ITEM(fqn_lists, g);
        PyObject *new_group = PyDict_New();
        Py_ssize_t ntouched = 0;
        PyObject *ungrouped = NULL; /* borrowed from fqns */
        int group_rc = -1;
        if (new_group == NULL || PyList_Append(out_groups, new_group) < 0 ||
            PyDict_SetItem(new_group, st->str_params, fqns) < 0) {
            Py_XDECREF(new_group);
            goto done;
        }
        Py_DECREF(new_group); /* owned by out_groups */
        int expects = any_saved;
        if (expect_list != NULL) {
            expects = PyObject_IsTrue(PyList_GET_ITEM(expect_list, g));
            if (expects < 0) {
                goto done;
            }
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *fqn = PyList_GET_ITEM(fqns, i);
            PyObject *saved = NULL, *gi = NULL;
            if (PySet_Add(claimed, fqn) < 0) {
                goto group_done;
            }
            int has = dcp_dict_get_ref(v->state, fqn, &saved);
            if (has < 0) {
                goto group_done;
            }
            if (has) {
                int ok = PyDict_SetItem(out_state, fqn, saved);
                Py_DECREF(saved);
                if (ok < 0) {
                    goto group_done;
                }
            }
            else if (expects) {
                /* An empty parameter (FSDP1 use_orig_params: no piece of it
                 * on this rank) has no state to miss. */
                int trainable = requires_grad(st, PyList_GET_ITEM(params, i));
                if (trainable > 0) {
                    PyObject *n = PyObject_CallMethodNoArgs(
                        PyList_GET_ITEM(params, i), st->str_numel);
                    Py_ssize_t numel = n ? PyLong_AsSsize_t(n) : -1;
                    Py_XDECREF(n);
                    trainable = numel < 0 ? -1 : numel > 0;
                }
                if (trainable < 0 ||
                    (trainable && PyList_Append(missing, fqn) < 0)) {
                    goto group_done;
                }
            }
            int with_state = has;
            has = dcp_dict_get_ref(v->fqn_group, fqn, &gi);
            if (has < 0) {
                goto group_done;
            }
            if (!has && with_state && ungrouped == NULL) {
                ungrouped = fqn;
            }
            if (has) {
                Py_ssize_t k = PyLong_AsSsize_t(gi);
                Py_DECREF(gi);
                if (touch_group(&marks, k, &ntouched) < 0) {
                    goto group_done;
                }
            }
        }
        if (PyList_GET_SIZE(params) == 0) {
            PyObject *identity = empty_identity(fqn_lists, g, o);
            if (identity == NULL) {
                goto group_done;
            }
            Py_ssize_t gi = match_empty(v, identity, *empty_k);
            Py_DECREF(identity);
            (*empty_k)++;
            if (gi == -2) {
                goto group_done;
            }
            if (gi >= 0 && touch_group(&marks, gi, &ntouched) < 0) {
                goto group_done;
            }
        }
        /* A parameter with loaded state that no loaded group lists, in a
         * live group that takes another's values (a nested DCP template
         * built with other groups reads the checkpoint's groups by
         * position, and keeps none of this parameter's): its group's
         * values are unknown -- ("ungrouped", optimizer, group, fqn). */
        if (ungrouped != NULL && ntouched > 0) {
            PyObject *entry =
                Py_BuildValue("(snnO)", "ungrouped", o, g, ungrouped);
            int bad = entry == NULL || PyList_Append(conflicts, entry) < 0;
            Py_XDECREF(entry);
            if (bad) {
                goto group_done;
            }
        }
        /* Loaded groups apply in loaded order; where a later one gives a
         * key another value, the pair is a conflict. */
        qsort(marks.touched, (size_t)ntouched, sizeof(Py_ssize_t), cmp_ssize);
        for (Py_ssize_t j = 0; j < ntouched; j++) {
            if (apply_loaded_group(st,
                                   v,
                                   marks.touched[j],
                                   new_group,
                                   j ? conflicts : NULL,
                                   o,
                                   g) < 0) {
                goto group_done;
            }
        }
        if (keep_live_keys(st, PyList_GET_ITEM(groups, g), new_group) < 0) {
            goto group_done;
        }
        /* keep_live_keys set "params" only if absent; it is present. */
        group_rc = 0;
    group_done:
        for (Py_ssize_t j = 0; j < ntouched; j++) {
            marks.seen[marks.touched[j]] = 0;
        }
        if (group_rc < 0) {
            goto done;
        }
    }
    out = Py_BuildValue(
        "{sOsO}", "state", out_state, "param_groups", out_groups);
    if (out == NULL || PyList_Append(results, out) < 0) {
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(groups);
    Py_XDECREF(plists);
    Py_XDECREF(fqn_lists);
    Py_XDECREF(out_state);
    Py_XDECREF(out_groups);
    Py_XDECREF(out);
    Py_XDECREF(expect_list);
    group_marks_free(&marks);
    return rc;
}

PyDoc_STRVAR(dcp_split_optim__doc__,
             "split_optim(index, optimizers, view, expect_state, /)\n--\n\n"
             "Match a loaded-state view to each optimizer by FQN.");

/* split_optim(index, optimizers, view, expect_state)
 *   -> (per-optimizer dicts, missing fqns, unexpected keys, conflicts)
 *
 * conflicts: ("values", optimizer, live group, key, value held, other
 * value, loaded group of the other value) where a live group's parameters
 * come from loaded groups whose values of a key are not plainly equal;
 * ("ungrouped", optimizer, live group, fqn) where a parameter with loaded
 * state is in no loaded group but its live group takes another's values.
 *
 * expect_state: a list with, per optimizer, None (stateful iff the loaded
 * dict has state for any of its parameters) or a list of bools per group.
 */
static PyObject *
dcp_split_optim(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *optims = NULL, *expects = NULL, *results = NULL;
    PyObject *missing = NULL, *claimed = NULL, *unexpected = NULL;
    PyObject *items = NULL, *result = NULL, *conflicts = NULL;
    dcp_view v;

    if (dcp_check_nargs("split_optim", nargs, 4) < 0 ||
        !dcp_index_check(st, args[0]) || view_unpack(args[2], &v) < 0) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    optims = dcp_as_list(st, args[1], "optimizers");
    expects = optims ? dcp_as_list(st, args[3], "expect_state") : NULL;
    if (expects == NULL) {
        goto done;
    }
    if (PyList_GET_SIZE(expects) != PyList_GET_SIZE(optims)) {
        PyErr_SetString(PyExc_ValueError,
                        "expect_state needs one entry per optimizer");
        goto done;
    }
    results = PyList_New(0);
    missing = PyList_New(0);
    claimed = PySet_New(NULL);
    conflicts = PyList_New(0);
    if (results == NULL || missing == NULL || claimed == NULL ||
        conflicts == NULL) {
        goto done;
    }
    Py_ssize_t empty_k = 0;
    for (Py_ssize_t o = 0; o < PyList_GET_SIZE(optims); o++) {
        if (split_one(st,
                      ix,
                      &v,
                      PyList_GET_ITEM(optims, o),
                      o,
                      PyList_GET_ITEM(expects, o),
                      results,
                      missing,
                      claimed,
                      conflicts,
                      &empty_k) < 0) {
            goto done;
        }
    }
    /* Unexpected: saved state nobody claimed, then unparsable keys. */
    unexpected = PyList_New(0);
    items = unexpected ? dcp_items_list(st, v.state) : NULL;
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        int mine = PySet_Contains(claimed, key);
        if (mine < 0 || (!mine && PyList_Append(unexpected, key) < 0)) {
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v.unexpected); i++) {
        if (PyList_Append(unexpected, PyList_GET_ITEM(v.unexpected, i)) < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(4, results, missing, unexpected, conflicts);
done:
    Py_XDECREF(optims);
    Py_XDECREF(expects);
    Py_XDECREF(results);
    Py_XDECREF(missing);
    Py_XDECREF(claimed);
    Py_XDECREF(unexpected);
    Py_XDECREF(items);
    Py_XDECREF(conflicts);
    return result;
}

/* ----------------------------------------------------------------------
 * prepare_install: Optimizer.load_state_dict without the quadratic scan
 */

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    PyObject *param;
    PyObject *device;   /* param.device */
    int floating;       /* param.is_floating_point() */
    int step_on_device; /* STEP_ON_CPU / STEP_ON_DEVICE_F32 / STEP_ON_DEVICE */
    PyObject *live;     /* the param's current state dict, or NULL */
} dcp_cast_ctx;

/* Where a loaded `step` goes (dcp_cast_ctx.step_on_device). */
enum {
    STEP_ON_CPU = 0,        /* the default policy: on the CPU, dtype kept */
    STEP_ON_DEVICE_F32 = 1, /* capturable/fused: float32 on the param's
                               device (torch's load policy) */
    STEP_ON_DEVICE = 2      /* the schema keeps it on the param's device
                               whatever the flags (ASGD): dtype kept */
};

static PyObject *cast_value(dcp_cast_ctx *c,
                            PyObject *value,
                            PyObject *key,
                            PyObject *live);

/* The tensor `value` as the optimizer should hold it under `key`:
 *   step: a fresh optimizer's policy -- float32 on the param's device
 *         when the installed group is capturable/fused, on the param's
 *         device when the schema always puts it there (ASGD), else on the
 *         CPU (torch keeps whatever device it came with, which turns
 *         every step into a sync);
 *   others: on the param's device; for a floating parameter, the dtype
 *         of the state the optimizer already holds under that key (a
 *         deliberately low-precision state keeps its precision), else --
 *         nothing held, e.g. a never-stepped optimizer -- as torch does,
 *         a floating value takes the parameter's dtype (non-floating
 *         values keep theirs). */
static PyObject *
cast_tensor(dcp_cast_ctx *c, PyObject *value, PyObject *key, PyObject *live)
{
    dcp_state *st = c->st;
    int is_step = key != NULL && PyUnicode_Check(key) &&
                  PyUnicode_Compare(key, st->str_step) == 0;
    if (is_step) {
        if (c->step_on_device == STEP_ON_DEVICE_F32) {
            PyObject *args[3] = {value, c->device, c->ctx->float32};
            return PyObject_VectorcallMethod(
                st->str_to, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        return dcp_call_method1(st->str_to,
                                value,
                                c->step_on_device == STEP_ON_DEVICE
                                    ? c->device
                                    : c->ctx->cpu_device);
    }
    PyObject *dtype = NULL;
    if (c->floating && live != NULL) {
        int live_is_tensor = PyObject_IsInstance(live, c->ctx->tensor_type);
        if (live_is_tensor < 0) {
            return NULL;
        }
        if (live_is_tensor) {
            dtype = PyObject_GetAttr(live, st->str_dtype);
            if (dtype == NULL) {
                return NULL;
            }
        }
    }
    if (c->floating && dtype == NULL) {
        /* Nothing held under this key: torch's policy, a floating value
         * takes the parameter's dtype (the next step() computes in it). */
        PyObject *fl =
            PyObject_CallMethodNoArgs(value, st->str_is_floating_point);
        int value_floating = fl ? PyObject_IsTrue(fl) : -1;
        Py_XDECREF(fl);
        if (value_floating < 0) {
            return NULL;
        }
        if (value_floating) {
            dtype = PyObject_GetAttr(c->param, st->str_dtype);
            if (dtype == NULL) {
                return NULL;
            }
        }
    }
    PyObject *result;
    if (dtype != NULL) {
        PyObject *args[3] = {value, c->device, dtype};
        result = PyObject_VectorcallMethod(
            st->str_to, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(dtype);
    }
    else {
        result = dcp_call_method1(st->str_to, value, c->device);
    }
    return result;
}

static PyObject *
cast_dict(dcp_cast_ctx *c, PyObject *value, PyObject *live)
{
    PyObject *items = dcp_items_list(c->st, value);
    PyObject *out = items ? PyDict_New() : NULL;
    if (out == NULL) {
        Py_XDECREF(items);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        PyObject *sub_live = NULL;
        if (live != NULL && PyDict_Check(live) &&
            dcp_dict_get_ref(live, key, &sub_live) < 0) {
            goto error;
        }
        PyObject *cast =
            cast_value(c, PyTuple_GET_ITEM(pair, 1), key, sub_live);
        Py_XDECREF(sub_live);
        if (cast == NULL) {
            goto error;
        }
        int rc = PyDict_SetItem(out, key, cast);
        Py_DECREF(cast);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(items);
    return out;
error:
    Py_DECREF(items);
    Py_DECREF(out);
    return NULL;
}

/* Deep copy of containers with tensors cast, as torch's _cast does
 * (strings are kept as they are; torch would iterate them). */
static PyObject *
cast_value(dcp_cast_ctx *c, PyObject *value, PyObject *key, PyObject *live)
{
    PyObject *result = NULL;
    if (Py_EnterRecursiveCall(" while loading optimizer state")) {
        return NULL;
    }
    int is_tensor = PyObject_IsInstance(value, c->ctx->tensor_type);
    if (is_tensor < 0) {
        goto done;
    }
    if (is_tensor) {
        result = cast_tensor(c, value, key, live);
    }
    else if (PyDict_Check(value)) {
        result = cast_dict(c, value, live);
    }
    else if (PyList_Check(value) || PyTuple_Check(value)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
        PyObject *list = PyList_New(n);
        if (list == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item =
                cast_value(c, PySequence_Fast_GET_ITEM(value, i), NULL, NULL);
            if (item == NULL) {
                Py_DECREF(list);
                goto done;
            }
            PyList_SET_ITEM(list, i, item);
        }
        if (PyTuple_CheckExact(value)) {
            result = PyList_AsTuple(list);
            Py_DECREF(list);
        }
        else if (PyList_CheckExact(value)) {
            result = list;
        }
        else {
            /* namedtuple or list subclass: rebuild through the type */
            result = PyObject_CallOneArg((PyObject *)Py_TYPE(value), list);
            Py_DECREF(list);
        }
    }
    else {
        result = Py_NewRef(value);
    }
done:
    Py_LeaveRecursiveCall();
    return result;
}

/* One value of aliased_entry: 1 / 0 / -1. */
static int
aliased_value(dcp_cast_ctx *c, PyObject *key, PyObject *v, PyObject *live)
{
    dcp_state *st = c->st;
    dcp_Context *ctx = c->ctx;
    PyObject *held = NULL;
    int found = dcp_dict_get_ref(live, key, &held);
    if (found <= 0) {
        return found;
    }
    int same = held == v;
    Py_DECREF(held);
    if (!same) {
        return 0;
    }
    PyTypeObject *type = Py_TYPE(v);
    if (type != (PyTypeObject *)ctx->tensor_type &&
        (ctx->dtensor_type == Py_None ||
         type != (PyTypeObject *)ctx->dtensor_type)) {
        if (PyDict_Check(v) || PyList_Check(v) || PyTuple_Check(v)) {
            return 0; /* the cast copies containers */
        }
        int is_tensor = PyObject_IsInstance(v, ctx->tensor_type);
        return is_tensor < 0 ? -1 : !is_tensor;
    }
    int is_step = 0;
    if (PyUnicode_Check(key)) {
        int cmp = PyUnicode_Compare(key, st->str_step);
        if (cmp == -1 && PyErr_Occurred()) {
            return -1;
        }
        is_step = cmp == 0;
    }
    PyObject *want = (is_step && c->step_on_device == STEP_ON_CPU)
                         ? ctx->cpu_device
                         : c->device;
    PyObject *device = PyObject_GetAttr(v, st->str_device);
    if (device == NULL) {
        return -1;
    }
    same = PyObject_RichCompareBool(device, want, Py_EQ);
    Py_DECREF(device);
    if (same <= 0 || !is_step || c->step_on_device != STEP_ON_DEVICE_F32) {
        return same;
    }
    PyObject *dtype = PyObject_GetAttr(v, st->str_dtype);
    if (dtype == NULL) {
        return -1;
    }
    same = PyObject_RichCompareBool(dtype, ctx->float32, Py_EQ);
    Py_DECREF(dtype);
    return same;
}

/* Whether cast_value(c, value, NULL, live) would return a dict of the
 * very objects `value` holds, as torch's _cast does for the optimizer's
 * own state: `value` and `live` exact dicts, every value of `value` the
 * object `live` holds under the same key, and each a tensor of exactly
 * torch.Tensor or DTensor (no __torch_function__ of its own) that the
 * cast's .to() would return unchanged -- already on the device (and for
 * a capturable/fused `step` of the dtype) it would be cast to; the dtype
 * of the other keys is the live tensor's own, i.e. the same.  Non-tensor
 * values other than containers are kept as they are by the cast too.
 * The DCP resume: dcp.load writes in place into the tensors
 * get_optimizer_state_dict returned, which are the optimizer's own.
 * 1 (proven) / 0 (not proven: take the cast) / -1. */
static int
aliased_entry(dcp_cast_ctx *c, PyObject *value, PyObject *live)
{
    if (live == NULL || !PyDict_CheckExact(value) ||
        !PyDict_CheckExact(live) ||
        PyDict_GET_SIZE(value) != PyDict_GET_SIZE(live)) {
        return 0;
    }
    PyObject *key, *v;
    int more;
    dcp_dict_iter it; /* pinned: the checks below may run code */
    dcp_dict_iter_init(&it, value);
    while ((more = dcp_dict_iter_next(&it, &key, &v)) == 1) {
        int rc = aliased_value(c, key, v, live);
        if (rc <= 0) {
            dcp_dict_iter_clear(&it);
            return rc;
        }
    }
    return more < 0 ? -1 : 1;
}

/* Whether a group places `step` on the param's device. */
static int
group_step_on_device(dcp_state *st, PyObject *group)
{
    PyObject *names[2] = {st->str_capturable, st->str_fused};
    for (int i = 0; i < 2; i++) {
        PyObject *flag = NULL;
        int rc = dcp_dict_get_ref(group, names[i], &flag);
        if (rc < 0) {
            return -1;
        }
        if (rc) {
            int on = PyObject_IsTrue(flag);
            Py_DECREF(flag);
            if (on != 0) {
                return on;
            }
        }
    }
    return 0;
}

/* Whether the group's schema keeps `step` on the parameter's device
 * whatever the flags: expected["step"] == 3 (see _param_shaped in
 * dcp_optim/_engine/optim.py).  1 / 0 / -1. */
static int
schema_step_on_device(dcp_state *st, PyObject *expected)
{
    if (!PyDict_Check(expected)) {
        return 0;
    }
    PyObject *need = NULL;
    int rc = dcp_dict_get_ref(expected, st->str_step, &need);
    if (rc <= 0) {
        return rc;
    }
    long v = PyLong_AsLong(need);
    Py_DECREF(need);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    return v == 3;
}

/* validate_state's check of a value the schema wants shaped like the
 * parameter: a tensor of the parameter's shape `pshape`, floating (or
 * complex) when the parameter is.  0 / -1. */
static int
validate_shaped(dcp_state *st,
                dcp_Context *ctx,
                PyObject *fqn,
                PyObject *key,
                PyObject *v,
                PyObject *pshape,
                int param_floating)
{
    PyObject *err = st->err_value;
    int is_tensor = PyObject_IsInstance(v, ctx->tensor_type);
    if (is_tensor <= 0) {
        if (is_tensor == 0) {
            PyErr_Format(err,
                         "optimizer state '%S' of parameter '%S' must be "
                         "a tensor shaped like the parameter, got %.200s",
                         key,
                         fqn,
                         Py_TYPE(v)->tp_name);
        }
        return -1;
    }
    PyObject *vshape = PyObject_GetAttr(v, st->str_shape);
    int eq = vshape ? PyObject_RichCompareBool(vshape, pshape, Py_EQ) : -1;
    if (eq == 0) { /* compared as tuples, whatever sequence .shape is */
        PyObject *vt = PySequence_Tuple(vshape);
        PyObject *pt = vt ? PySequence_Tuple(pshape) : NULL;
        eq = pt ? PyObject_RichCompareBool(vt, pt, Py_EQ) : -1;
        if (eq == 0) {
            PyErr_Format(err,
                         "optimizer state '%S' of parameter '%S' has "
                         "shape %R, expected the parameter's shape %R",
                         key,
                         fqn,
                         vt,
                         pt);
        }
        Py_XDECREF(vt);
        Py_XDECREF(pt);
    }
    Py_XDECREF(vshape);
    if (eq != 1 || !param_floating) {
        return eq == 1 ? 0 : -1;
    }
    PyObject *fl = PyObject_CallMethodNoArgs(v, st->str_is_floating_point);
    int ok = fl ? PyObject_IsTrue(fl) : -1;
    Py_XDECREF(fl);
    if (ok == 0) { /* complex state of a floating parameter is accepted */
        PyObject *cx = PyObject_CallMethodNoArgs(v, st->str_is_complex);
        ok = cx ? PyObject_IsTrue(cx) : -1;
        Py_XDECREF(cx);
    }
    if (ok == 0) {
        PyObject *dt = PyObject_GetAttr(v, st->str_dtype);
        if (dt != NULL) {
            PyErr_Format(err,
                         "optimizer state '%S' of parameter '%S' "
                         "has dtype %R, expected a floating-point "
                         "tensor",
                         key,
                         fqn,
                         dt);
            Py_DECREF(dt);
        }
    }
    return ok == 1 ? 0 : -1;
}

/* Checks the loaded state of one parameter against its group's schema,
 * `expected`: dict state name -> 1 (the optimizer needs it), 2 (needs
 * it, a floating tensor shaped like the parameter) or 3 (needs it, kept
 * on the parameter's device), or None (no schema).
 * Torch installs anything and fails later, at step(), or trains on
 * garbage; here the whole load is refused up front, naming the FQN and
 * the state key.  Empty state (a pristine parameter) is always fine.
 * 0 / -1. */
static int
validate_state(dcp_state *st,
               dcp_Context *ctx,
               PyObject *fqn,
               PyObject *param,
               PyObject *value,
               PyObject *expected)
{
    if (expected == Py_None) {
        return 0;
    }
    PyObject *err = st->err_value;
    if (!PyDict_Check(value)) {
        PyErr_Format(err,
                     "optimizer state of parameter '%S' must be a dict, got "
                     "%.200s",
                     fqn,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    if (PyDict_GET_SIZE(value) == 0) {
        return 0;
    }
    PyObject *items = dcp_items_list(st, expected);
    /* shapes compare as torch.Size (a tuple); tuples only for messages */
    PyObject *pshape = items ? PyObject_GetAttr(param, st->str_shape) : NULL;
    PyObject *pfloat =
        pshape ? PyObject_CallMethodNoArgs(param, st->str_is_floating_point)
               : NULL;
    int param_floating = pfloat ? PyObject_IsTrue(pfloat) : -1;
    int rc = param_floating < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        long need =
            PyLong_AsLong(PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1));
        if ((need == -1 && PyErr_Occurred()) || !PyUnicode_Check(key)) {
            if (!PyErr_Occurred()) {
                PyErr_Format(st->err_type,
                             "optimizer state schema keys must be str, got %R",
                             key);
            }
            rc = -1;
            break;
        }
        PyObject *v = NULL;
        int found = dcp_dict_get_ref(value, key, &v);
        if (found <= 0) {
            if (found == 0) {
                PyObject *have = PySequence_List(value);
                PyErr_Format(err,
                             "optimizer state of parameter '%S' has no '%S' "
                             "(it has %R): is this a checkpoint of another "
                             "optimizer class?",
                             fqn,
                             key,
                             have ? have : Py_None);
                Py_XDECREF(have);
            }
            rc = -1;
            break;
        }
        if (need == 2) {
            rc = validate_shaped(st, ctx, fqn, key, v, pshape, param_floating);
        }
        Py_DECREF(v);
    }
    Py_XDECREF(items);
    Py_XDECREF(pshape);
    Py_XDECREF(pfloat);
    return rc;
}

PyDoc_STRVAR(
    dcp_prepare_install__doc__,
    "prepare_install(ctx, optimizer, split_dict, expected, aliased=False, "
    "first_dtypes=None, /)"
    "\n--\n\n"
    "The (state, param_groups) Optimizer.load_state_dict would install, "
    "without its quadratic scan.");

/* prepare_install(ctx, optimizer, split_dict, expected[, aliased[,
 *                 first_dtypes]])
 *   -> (state defaultdict, param_groups list)
 *
 * expected: None, or one entry per param group -- None or the dict
 * validate_state checks against (from the optimizer's schema).
 * aliased (optional, default False): where aliased_entry proves that a
 * parameter's loaded state is the optimizer's own state, which the cast
 * would return unchanged, its dict is copied without the cast (the
 * caller passes True only when no __torch_function__ mode is active,
 * which could intercept the cast's .to()).  The checks are the same.
 * first_dtypes (optional, None): {id(param): {key: tensor}} for
 * parameters that hold no state: the tensors whose dtypes a first step
 * gives those keys, where it is not the parameter's.  The cast reads
 * them as it reads held state (cast_tensor): the state the optimizer
 * would create keeps its precision.
 *
 * Exactly what Optimizer.load_state_dict would pass to __setstate__ for
 * `split_dict` (whose "params" are FQNs aligned with the live groups),
 * except the cast policy above.  Nothing is modified; the caller commits
 * with optimizer.__setstate__({"state": ..., "param_groups": ...}) once
 * every optimizer of the call has been prepared. */
static PyObject *
dcp_prepare_install(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *groups = NULL, *plists = NULL, *saved_state = NULL;
    PyObject *saved_groups = NULL, *id_map = NULL, *new_groups = NULL;
    PyObject *state = NULL, *live_items = NULL, *items = NULL;
    PyObject *result = NULL;
    dcp_ptrmap live_map = {NULL, 0, 0};

    if (nargs < 4 || nargs > 6) {
        PyErr_Format(PyExc_TypeError,
                     "prepare_install() takes 4 to 6 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    if (!dcp_context_check(st, args[0])) {
        return NULL;
    }
    int fast = nargs >= 5 ? PyObject_IsTrue(args[4]) : 0;
    if (fast < 0) {
        return NULL;
    }
    PyObject *first_dtypes = nargs == 6 ? args[5] : Py_None;
    if (first_dtypes != Py_None && !PyDict_Check(first_dtypes)) {
        PyErr_SetString(PyExc_TypeError,
                        "first_dtypes must be a dict or None");
        return NULL;
    }
    PyObject *expected = args[3];
    if (expected != Py_None && !PyList_Check(expected)) {
        PyErr_SetString(PyExc_TypeError, "expected must be a list or None");
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)args[0];
    PyObject *optim = args[1], *sd = args[2];
    if (list_of_params(st, optim, 0, &groups, &plists) < 0) {
        goto done;
    }
    if (!PyDict_Check(sd) ||
        dcp_dict_get_ref(sd, st->str_state, &saved_state) <= 0 ||
        dcp_dict_get_ref(sd, st->str_param_groups, &saved_groups) <= 0 ||
        !PyDict_Check(saved_state) || !PyList_Check(saved_groups)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError,
                            "prepare_install needs a split optimizer dict");
        }
        goto done;
    }
    Py_ssize_t ngroups = PyList_GET_SIZE(groups);
    if (PyList_GET_SIZE(saved_groups) != ngroups) {
        PyErr_SetString(PyExc_ValueError,
                        "loaded state dict has a different number of "
                        "parameter groups");
        goto done;
    }
    /* fqn -> (param, group index); str keys hash in C. */
    id_map = PyDict_New();
    new_groups = PyList_New(ngroups);
    if (id_map == NULL || new_groups == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        PyObject *sgroup = PyList_GET_ITEM(saved_groups, g);
        PyObject *live_group = PyList_GET_ITEM(groups, g);
        PyObject *params = PyList_GET_ITEM(plists, g);
        PyObject *fqns = NULL, *copy = NULL, *rest = NULL, *gi = NULL;
        if (!PyDict_Check(sgroup) ||
            dcp_dict_get_ref(sgroup, st->str_params, &fqns) <= 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(
                    st->err_key, "split param group %zd has no 'params'", g);
            }
            goto done;
        }
        if (!PyList_Check(fqns) ||
            PyList_GET_SIZE(fqns) != PyList_GET_SIZE(params)) {
            Py_DECREF(fqns);
            PyErr_SetString(PyExc_ValueError,
                            "loaded state dict contains a parameter group "
                            "that doesn't match the size of optimizer's "
                            "group");
            goto done;
        }
        gi = PyLong_FromSsize_t(g);
        for (Py_ssize_t i = 0; gi != NULL && i < PyList_GET_SIZE(fqns); i++) {
            PyObject *pair = PyTuple_Pack(2, PyList_GET_ITEM(params, i), gi);
            if (pair == NULL ||
                PyDict_SetItem(id_map, PyList_GET_ITEM(fqns, i), pair) < 0) {
                Py_XDECREF(pair);
                Py_CLEAR(gi);
                break;
            }
            Py_DECREF(pair);
        }
        Py_DECREF(fqns);
        if (gi == NULL) {
            goto done;
        }
        Py_DECREF(gi);
        /* Groups are deep-copied (a tensor lr must not alias the
         * checkpoint), with the live params list in "params". */
        rest = PyDict_Copy(sgroup);
        if (rest == NULL || PyDict_DelItem(rest, st->str_params) < 0) {
            Py_XDECREF(rest);
            goto done;
        }
        copy = PyObject_CallOneArg(ctx->deepcopy, rest);
        Py_DECREF(rest);
        if (copy == NULL) {
            goto done;
        }
        PyObject *new_group = PyDict_New();
        PyObject *live_params = NULL;
        if (new_group == NULL ||
            dcp_dict_get_ref(live_group, st->str_params, &live_params) <= 0 ||
            PyDict_SetItem(new_group, st->str_params, live_params) < 0 ||
            PyDict_Update(new_group, copy) < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(st->err_key, "params");
            }
            Py_XDECREF(new_group);
            Py_XDECREF(live_params);
            Py_DECREF(copy);
            goto done;
        }
        Py_DECREF(live_params);
        Py_DECREF(copy);
        PyList_SET_ITEM(new_groups, g, new_group);
    }
    /* Live state by parameter identity, for the dtype policy. */
    PyObject *live_state = PyObject_GetAttr(optim, st->str_state);
    live_items = live_state ? dcp_items_list(st, live_state) : NULL;
    Py_XDECREF(live_state);
    if (live_items == NULL ||
        dcp_ptrmap_init(&live_map, PyList_GET_SIZE(live_items)) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(live_items); i++) {
        PyObject *pair = PyList_GET_ITEM(live_items, i);
        if (dcp_ptrmap_setdefault(&live_map, PyTuple_GET_ITEM(pair, 0), i) ==
            -2) {
            goto done;
        }
    }
    PyObject *factory_args[1] = {ctx->dict_type};
    state = PyObject_Vectorcall(ctx->defaultdict_type, factory_args, 1, NULL);
    items = state ? dcp_items_list(st, saved_state) : NULL;
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        PyObject *target = NULL;
        int found = dcp_dict_get_ref(id_map, key, &target);
        if (found < 0) {
            goto done;
        }
        if (!found) {
            /* torch keeps state it cannot attribute, as is */
            if (PyObject_SetItem(state, key, value) < 0) {
                goto done;
            }
            continue;
        }
        if (!PyUnicode_Check(key)) {
            /* the messages below name the FQN with %S */
            PyErr_Format(st->err_type,
                         "optimizer state keys must be FQN strings, got %R",
                         key);
            Py_DECREF(target);
            goto done;
        }
        PyObject *param = PyTuple_GET_ITEM(target, 0);
        Py_ssize_t g = PyLong_AsSsize_t(PyTuple_GET_ITEM(target, 1));
        PyObject *group_expected =
            (expected != Py_None && g < PyList_GET_SIZE(expected))
                ? PyList_GET_ITEM(expected, g)
                : Py_None;
        if (validate_state(st, ctx, key, param, value, group_expected) < 0) {
            Py_DECREF(target);
            goto done;
        }
        dcp_cast_ctx c = {st, ctx, param, NULL, 0, 0, NULL};
        PyObject *cast = NULL;
        /* torch's policy reads the installed (saved) group's flags */
        int step_dev =
            group_step_on_device(st, PyList_GET_ITEM(new_groups, g));
        if (step_dev == 0) {
            step_dev = schema_step_on_device(st, group_expected);
            step_dev = step_dev > 0 ? STEP_ON_DEVICE : step_dev;
        }
        PyObject *fp = step_dev >= 0 ? PyObject_CallMethodNoArgs(
                                           param, st->str_is_floating_point)
                                     : NULL;
        c.device = fp ? PyObject_GetAttr(param, st->str_device) : NULL;
        if (c.device != NULL) {
            c.floating = PyObject_IsTrue(fp);
            c.step_on_device = step_dev;
            Py_ssize_t li = dcp_ptrmap_get(&live_map, param);
            PyObject *live =
                li >= 0 ? PyTuple_GET_ITEM(PyList_GET_ITEM(live_items, li), 1)
                        : NULL;
            /* No state held: a first step's dtypes, where given (a new
             * reference, released below; the live state is borrowed from
             * live_items, which this function holds). */
            PyObject *first = NULL;
            int have_first = 0;
            if (live == NULL && first_dtypes != Py_None) {
                PyObject *id = PyLong_FromVoidPtr(param);
                have_first =
                    id ? dcp_dict_get_ref(first_dtypes, id, &first) : -1;
                Py_XDECREF(id);
            }
            int aliased = (have_first < 0 || c.floating < 0) ? -1
                          : fast ? aliased_entry(&c, value, live)
                                 : 0;
            if (aliased > 0) {
                cast = PyDict_Copy(value);
            }
            else if (aliased == 0) {
                cast = cast_value(&c, value, NULL, first ? first : live);
            }
            Py_XDECREF(first);
        }
        Py_XDECREF(fp);
        Py_XDECREF(c.device);
        if (cast == NULL) {
            dcp_note_key(key);
            Py_DECREF(target);
            goto done;
        }
        int rc = PyObject_SetItem(state, param, cast);
        Py_DECREF(cast);
        Py_DECREF(target);
        if (rc < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(2, state, new_groups);
done:
    dcp_ptrmap_free(&live_map);
    Py_XDECREF(groups);
    Py_XDECREF(plists);
    Py_XDECREF(saved_state);
    Py_XDECREF(saved_groups);
    Py_XDECREF(id_map);
    Py_XDECREF(new_groups);
    Py_XDECREF(state);
    Py_XDECREF(live_items);
    Py_XDECREF(items);
    return result;
}

PyMethodDef dcp_split_methods[] = {
    {"view_from_nested",
     DCP_FASTCALL(dcp_view_from_nested),
     METH_FASTCALL,
     dcp_view_from_nested__doc__},
    {"split_optim",
     DCP_FASTCALL(dcp_split_optim),
     METH_FASTCALL,
     dcp_split_optim__doc__},
    {"prepare_install",
     DCP_FASTCALL(dcp_prepare_install),
     METH_FASTCALL,
     dcp_prepare_install__doc__},
    {NULL, NULL, 0, NULL},
};
