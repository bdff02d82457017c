/* The flattened optimizer format (flatten_optimizer_state_dict=True).
 *
 *   state.<fqn>.<name>[.<nested>...]   one key per state leaf
 *   param_groups.<fqn>.<key>           every group key, for every param
 *
 * Keys are byte-identical to upstream's (torchtitan writes the same), in
 * the same order: all state keys (state order, then key order), then all
 * param_groups keys (group, param, key order).
 *
 * Empty param groups (D6 in docs/differences.md).  Upstream cannot represent
 * them: their hyperparameters have no parameter to hang on.  dcp_optim stores
 * them under a reserved key family anchored on a neighbouring group of the
 * same optimizer, so that keys stay unique across pipeline stages (each
 * FQN lives on one stage) and survive concatenating optimizers:
 *
 *   param_groups.<anchor>.__empty_group_after_<n>__.<key>
 *       the n-th group after the group whose first FQN is <anchor>;
 *   param_groups.<anchor>.__empty_group_before_<n>__.<key>
 *       when no non-empty group precedes it in its optimizer;
 *   param_groups.__optimizer_<o>_empty_group_<g>__.<key>
 *       for an optimizer without any parameter.
 *
 * They are emitted only when an empty group exists, so every other dict
 * is byte-identical to upstream's.
 *
 * Parsing flat keys back needs the FQNs: they contain dots themselves.
 * One parser, parse_flat_rest, serves unflatten_optim and (exported as
 * parse_flat_key) the Python tools; its grammar is documented in
 * docs/architecture.md ("Flat keys").
 * A key "state.a.b.c" is split at the right-most dot whose left side is a
 * parameter FQN of the model; no FQN can be a token prefix of another
 * (parameters, buffers and children share one namespace per module), so
 * the split is unique, and scanning from the right finds it in one probe
 * for ordinary (un-nested) keys.
 */
#include "dcp.h"

#include <string.h>

static const char EMPTY_AFTER[] = "__empty_group_after_";
static const char EMPTY_BEFORE[] = "__empty_group_before_";
static const char EMPTY_OPTIM[] = "__optimizer_";

/* ----------------------------------------------------------------------
 * Flatten
 *
 * The output has one key per state leaf and per (parameter, group key):
 * 140k keys for 10k Adam parameters, against 10k entries in the nested
 * form.  Building those strings and inserting them is the whole cost, so
 * each key is made with one allocation (the "<prefix><fqn>." part once
 * per parameter) and nothing else is allocated per key.
 */

/* a + b + c as one new str (one allocation).  New reference or NULL. */
static PyObject *
concat3(PyObject *a, PyObject *b, PyObject *c)
{
    PyObject *parts[3] = {a, b, c};
    Py_ssize_t len = 0;
    Py_UCS4 maxchar = 0;
    for (int i = 0; i < 3; i++) {
        if (!PyUnicode_Check(parts[i])) {
            PyErr_BadInternalCall();
            return NULL;
        }
        if (PyUnicode_GET_LENGTH(parts[i]) > PY_SSIZE_T_MAX - len) {
            return PyErr_NoMemory();
        }
        len += PyUnicode_GET_LENGTH(parts[i]);
        Py_UCS4 m = PyUnicode_MAX_CHAR_VALUE(parts[i]);
        maxchar = m > maxchar ? m : maxchar;
    }
    PyObject *out = PyUnicode_New(len, maxchar);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t at = 0;
    for (int i = 0; i < 3; i++) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(parts[i]);
        if (PyUnicode_CopyCharacters(out, at, parts[i], 0, n) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        at += n;
    }
    return out;
}

static int flatten_state(dcp_state *st,
                         dcp_Context *ctx,
                         PyObject *value,
                         PyObject *prefix,
                         PyObject *out);

/* Flattens one (key, leaf) of a state dict under `prefix`.  0 or -1. */
static int
flatten_leaf(dcp_state *st,
             dcp_Context *ctx,
             PyObject *key,
             PyObject *leaf,
             PyObject *prefix,
             PyObject *out)
{
    PyObject *skey = PyObject_Str(key);
    PyObject *full = skey ? PyUnicode_Concat(prefix, skey) : NULL;
    Py_XDECREF(skey);
    if (full == NULL) {
        return -1;
    }
    int ok;
    if (PyDict_Check(leaf)) {
        PyObject *sub = PyUnicode_Concat(full, st->str_dot);
        ok = sub != NULL && flatten_state(st, ctx, leaf, sub, out) == 0;
        Py_XDECREF(sub);
    }
    else {
        int allowed = PyLong_Check(leaf) || PyFloat_Check(leaf);
        if (!allowed) {
            allowed = PyObject_IsInstance(leaf, ctx->tensor_type);
        }
        if (allowed == 0) {
            /* a deliberate difference: a set of plain values (heavyball's
             * initialised indices) is flattened as a value, where
             * upstream raises */
            allowed = dcp_is_plain_set(leaf);
        }
        if (allowed == 0) {
            PyErr_Format(PyExc_NotImplementedError,
                         "Flattening optimizer state_dict only supports "
                         "tensor, int, float, dict states now. Type is "
                         "%R.",
                         (PyObject *)Py_TYPE(leaf));
            dcp_note_key(full);
        }
        ok = allowed == 1 && PyDict_SetItem(out, full, leaf) == 0;
    }
    Py_DECREF(full);
    return ok ? 0 : -1;
}

/* Flattens one state dict under `prefix` ("state.<fqn>.", ending with a
 * dot) into `out`.  Leaves must be Tensor, int, float or dict (upstream's
 * E15), or a set of plain values (dcp_is_plain_set). */
static int
flatten_state(dcp_state *st,
              dcp_Context *ctx,
              PyObject *value,
              PyObject *prefix,
              PyObject *out)
{
    int rc = -1;
    PyObject *items = NULL;
    if (Py_EnterRecursiveCall(" while flattening optimizer state")) {
        return -1;
    }
    if (PyDict_CheckExact(value)) {
        /* In place, without an items list: key and leaf are pinned while
         * they are used (isinstance() may run code), and the size is
         * checked after each. */
        Py_ssize_t pos = 0, n = PyDict_GET_SIZE(value);
        PyObject *key, *leaf;
        while (PyDict_Next(value, &pos, &key, &leaf)) {
            Py_INCREF(key);
            Py_INCREF(leaf);
            int r = flatten_leaf(st, ctx, key, leaf, prefix, out);
            Py_DECREF(key);
            Py_DECREF(leaf);
            if (r < 0) {
                goto done;
            }
            if (PyDict_GET_SIZE(value) != n) {
                PyErr_SetString(st->err_runtime,
                                "optimizer state changed size during "
                                "iteration");
                goto done;
            }
        }
        rc = 0;
        goto done;
    }
    items = dcp_items_list(st, value);
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (flatten_leaf(st,
                         ctx,
                         PyTuple_GET_ITEM(pair, 0),
                         PyTuple_GET_ITEM(pair, 1),
                         prefix,
                         out) < 0) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_LeaveRecursiveCall();
    Py_XDECREF(items);
    return rc;
}

/* ----------------------------------------------------------------------
 * Reusing keys
 *
 * The getter is called again and again on an unchanged model (every
 * checkpoint), and building the same key strings each time (700k of them
 * at 50k Adam parameters) was half of its cost: one fresh allocation per
 * key, spread over tens of MB that the previous result has just freed.
 * The caller may pass a `keys` dict kept between calls (one per model).
 * It maps an FQN to a pair of tuples (state, groups), each
 * (source, flat key, source, flat key, ...) in the order the keys were
 * last emitted.  The flat key at position j is reused only when the
 * source at j (the state key or group key, an exact str) equals this
 * call's, and the FQN is the dict key itself, so a reused key is always
 * the string that would be built: a changed model, state or group
 * rebuilds (and records) exactly the keys that differ.  Only exact str
 * sources and FQNs take part (str() of anything else may run code or
 * differ between calls); nested state dicts and empty groups are built
 * every time.  The records are tuples of strings, which the cyclic GC
 * stops tracking, so a large model's cache adds nothing to the
 * collections of the program; they hold no tensor and no value.
 */

/* The keys of one FQN's state or group, as they are emitted. */
typedef struct {
    PyObject *fqn;     /* exact str (pinned) */
    PyObject *old;     /* the recorded tuple (owned), or NULL */
    PyObject *scratch; /* list of this call's pairs after a difference */
    Py_ssize_t n;      /* keys emitted */
} dcp_reuse;

/* Starts reusing the record `which` (0 state, 1 groups) of `fqn`.  1 when
 * keys are reused (`r` set up; end with reuse_finish), 0 when not (no
 * cache, or `fqn` not an exact str), -1 on error. */
static int
reuse_begin(dcp_reuse *r, PyObject *keys, PyObject *fqn, int which)
{
    PyObject *entry = NULL;
    memset(r, 0, sizeof(*r));
    if (keys == NULL || !PyUnicode_CheckExact(fqn)) {
        return 0;
    }
    int rc = dcp_dict_get_ref(keys, fqn, &entry);
    if (rc < 0) {
        return -1;
    }
    if (rc == 1) {
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2 ||
            !PyTuple_CheckExact(PyTuple_GET_ITEM(entry, which))) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError,
                            "flatten_optim: malformed key cache");
            return -1;
        }
        r->old = Py_NewRef(PyTuple_GET_ITEM(entry, which));
        Py_DECREF(entry);
    }
    r->fqn = Py_NewRef(fqn);
    return 1;
}

static void
reuse_clear(dcp_reuse *r)
{
    Py_XDECREF(r->fqn);
    Py_XDECREF(r->old);
    Py_XDECREF(r->scratch);
    memset(r, 0, sizeof(*r));
}

/* The flat key `head` + fqn + "." + `src` (an exact str) for the next
 * position: the recorded one when its source equals `src`, else built
 * (with `*prefix`, "<head><fqn>.", made on first need).  New reference or
 * NULL. */
static PyObject *
reuse_key(dcp_state *st,
          dcp_reuse *r,
          PyObject *src,
          PyObject *head,
          PyObject **prefix)
{
    Py_ssize_t at = 2 * r->n;
    PyObject *full = NULL;
    if (r->old != NULL && at + 1 < PyTuple_GET_SIZE(r->old)) {
        PyObject *was = PyTuple_GET_ITEM(r->old, at);
        if (was == src ||
            (PyUnicode_CheckExact(was) && PyUnicode_Compare(was, src) == 0)) {
            full = Py_NewRef(PyTuple_GET_ITEM(r->old, at + 1));
        }
    }
    if (full == NULL) {
        if (*prefix == NULL) {
            *prefix = concat3(head, r->fqn, st->str_dot);
            if (*prefix == NULL) {
                return NULL;
            }
        }
        full = PyUnicode_Concat(*prefix, src);
        if (full == NULL) {
            return NULL;
        }
        if (r->scratch == NULL) {
            /* the first difference: the pairs so far, then this call's */
            PyObject *head_pairs =
                r->old ? PyTuple_GetSlice(r->old, 0, at) : PyTuple_New(0);
            r->scratch = head_pairs ? PySequence_List(head_pairs) : NULL;
            Py_XDECREF(head_pairs);
            if (r->scratch == NULL) {
                Py_DECREF(full);
                return NULL;
            }
        }
    }
    if (r->scratch != NULL && (PyList_Append(r->scratch, src) < 0 ||
                               PyList_Append(r->scratch, full) < 0)) {
        Py_DECREF(full);
        return NULL;
    }
    r->n++;
    return full;
}

/* Records this call's keys when they differ from the record (a changed
 * key, or fewer keys), and releases `r`.  0 or -1. */
static int
reuse_finish(dcp_reuse *r, PyObject *keys, int which)
{
    int rc = -1;
    PyObject *rec = NULL, *entry = NULL, *other = NULL, *pair = NULL;
    Py_ssize_t len = r->old ? PyTuple_GET_SIZE(r->old) : -1;
    if (r->scratch == NULL && len == 2 * r->n) {
        rc = 0; /* unchanged */
        goto done;
    }
    if (r->scratch != NULL) {
        rec = PyList_AsTuple(r->scratch);
    }
    else {
        rec = r->old ? PyTuple_GetSlice(r->old, 0, 2 * r->n) : PyTuple_New(0);
    }
    if (rec == NULL || dcp_dict_get_ref(keys, r->fqn, &entry) < 0) {
        goto done;
    }
    if (entry != NULL && PyTuple_CheckExact(entry) &&
        PyTuple_GET_SIZE(entry) == 2) {
        other = Py_NewRef(PyTuple_GET_ITEM(entry, 1 - which));
    }
    else {
        other = PyTuple_New(0);
        if (other == NULL) {
            goto done;
        }
    }
    pair =
        which == 0 ? PyTuple_Pack(2, rec, other) : PyTuple_Pack(2, other, rec);
    if (pair == NULL || PyDict_SetItem(keys, r->fqn, pair) < 0) {
        goto done;
    }
    rc = 0;
done:
    Py_XDECREF(rec);
    Py_XDECREF(entry);
    Py_XDECREF(other);
    Py_XDECREF(pair);
    reuse_clear(r);
    return rc;
}

/* The state of one parameter (an exact dict) with its keys reused through
 * `r` (see above).  0 or -1. */
static int
flatten_reused_state(dcp_state *st,
                     dcp_Context *ctx,
                     dcp_reuse *r,
                     PyObject *value,
                     PyObject *out)
{
    int rc = -1;
    PyObject *prefix = NULL;
    Py_ssize_t pos = 0, n = PyDict_GET_SIZE(value);
    PyObject *key, *leaf;
    while (PyDict_Next(value, &pos, &key, &leaf)) {
        Py_INCREF(key);
        Py_INCREF(leaf);
        int ok;
        int plain = PyUnicode_CheckExact(key) &&
                    (PyLong_Check(leaf) || PyFloat_Check(leaf) ||
                     Py_IS_TYPE(leaf, (PyTypeObject *)ctx->tensor_type));
        if (plain) {
            PyObject *full =
                reuse_key(st, r, key, st->str_state_prefix, &prefix);
            ok = full != NULL && PyDict_SetItem(out, full, leaf) == 0;
            Py_XDECREF(full);
        }
        else {
            /* nested dicts, tensor subclasses, errors: the general path */
            if (prefix == NULL) {
                prefix = concat3(st->str_state_prefix, r->fqn, st->str_dot);
            }
            ok = prefix != NULL &&
                 flatten_leaf(st, ctx, key, leaf, prefix, out) == 0;
        }
        Py_DECREF(key);
        Py_DECREF(leaf);
        if (!ok) {
            goto done;
        }
        if (PyDict_GET_SIZE(value) != n) {
            PyErr_SetString(PyExc_RuntimeError,
                            "optimizer state changed size during iteration");
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(prefix);
    return rc;
}

/* Flattens the state of one parameter under "state.<fqn>.".  0 or -1. */
static int
flatten_param_state(dcp_state *st,
                    dcp_Context *ctx,
                    PyObject *fqn,
                    PyObject *value,
                    PyObject *keys,
                    PyObject *out)
{
    if (keys != NULL && PyDict_CheckExact(value)) {
        dcp_reuse r;
        int on = reuse_begin(&r, keys, fqn, 0);
        if (on < 0) {
            return -1;
        }
        if (on == 1) {
            if (flatten_reused_state(st, ctx, &r, value, out) < 0) {
                reuse_clear(&r);
                return -1;
            }
            return reuse_finish(&r, keys, 0);
        }
    }
    PyObject *sfqn = PyObject_Str(fqn);
    PyObject *prefix =
        sfqn ? concat3(st->str_state_prefix, sfqn, st->str_dot) : NULL;
    Py_XDECREF(sfqn);
    if (prefix == NULL) {
        return -1;
    }
    int rc = flatten_state(st, ctx, value, prefix, out);
    Py_DECREF(prefix);
    return rc;
}

/* The keys of a group except "params", as (str(key), value) pairs: a new
 * list, or NULL. */
static PyObject *
group_key_pairs(dcp_state *st, PyObject *group)
{
    PyObject *items = dcp_items_list(st, group);
    PyObject *out = items ? PyList_New(0) : NULL;
    if (out == NULL) {
        Py_XDECREF(items);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        if (PyUnicode_Check(key) &&
            PyUnicode_Compare(key, st->str_params) == 0) {
            continue;
        }
        PyObject *skey = PyObject_Str(key);
        PyObject *kv =
            skey ? PyTuple_Pack(2, skey, PyTuple_GET_ITEM(pair, 1)) : NULL;
        Py_XDECREF(skey);
        if (kv == NULL || PyList_Append(out, kv) < 0) {
            Py_XDECREF(kv);
            Py_DECREF(items);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(kv);
    }
    Py_DECREF(items);
    return out;
}

/* Emits every pair of `pairs` (from group_key_pairs) under `prefix`. */
static int
flatten_group_keys(PyObject *pairs, PyObject *prefix, PyObject *out)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *full = PyUnicode_Concat(prefix, PyTuple_GET_ITEM(pair, 0));
        if (full == NULL) {
            return -1;
        }
        int rc = PyDict_SetItem(out, full, PyTuple_GET_ITEM(pair, 1));
        Py_DECREF(full);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* The params list of a packed group (owned list), validated. */
static PyObject *
packed_params(dcp_state *st, PyObject *group, Py_ssize_t g)
{
    PyObject *params = NULL;
    if (!PyDict_Check(group)) {
        PyErr_Format(st->err_type,
                     "param_groups[%zd] must be a dict, not "
                     "%.200s",
                     g,
                     Py_TYPE(group)->tp_name);
        return NULL;
    }
    int rc = dcp_dict_get_ref(group, st->str_params, &params);
    if (rc <= 0) {
        if (rc == 0) {
            PyErr_Format(
                st->err_key, "param_groups[%zd] has no 'params' entry", g);
        }
        return NULL;
    }
    PyObject *list = dcp_as_list(st, params, "param_group['params']");
    Py_DECREF(params);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        if (!PyUnicode_Check(PyList_GET_ITEM(list, i))) {
            PyErr_Format(st->err_type,
                         "param_groups[%zd]['params'] must hold FQN strings, "
                         "got %R",
                         g,
                         PyList_GET_ITEM(list, i));
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* Prefix "param_groups.<reserved>." for the empty group `g` of the
 * optimizer segment [lo, hi) of `plist` (a list of params lists). */
static PyObject *
empty_group_prefix(dcp_state *st,
                   PyObject *plist,
                   Py_ssize_t lo,
                   Py_ssize_t hi,
                   Py_ssize_t g,
                   Py_ssize_t opt_i)
{
    for (Py_ssize_t j = g - 1; j >= lo; j--) {
        PyObject *params = PyList_GET_ITEM(plist, j);
        if (PyList_GET_SIZE(params) > 0) {
            return PyUnicode_FromFormat("param_groups.%S.%s%zd__.",
                                        PyList_GET_ITEM(params, 0),
                                        EMPTY_AFTER,
                                        g - j);
        }
    }
    for (Py_ssize_t j = g + 1; j < hi; j++) {
        PyObject *params = PyList_GET_ITEM(plist, j);
        if (PyList_GET_SIZE(params) > 0) {
            return PyUnicode_FromFormat("param_groups.%S.%s%zd__.",
                                        PyList_GET_ITEM(params, 0),
                                        EMPTY_BEFORE,
                                        j - g);
        }
    }
    return PyUnicode_FromFormat(
        "param_groups.%s%zd_empty_group_%zd__.", EMPTY_OPTIM, opt_i, g - lo);
}

/* The group keys of every parameter of one non-empty group, reused from
 * `keys` (see "Reusing keys") when it is not NULL.  0 or -1. */
static int
flatten_param_groups(dcp_state *st,
                     PyObject *params,
                     PyObject *pairs,
                     PyObject *keys,
                     PyObject *out)
{
    for (Py_ssize_t p = 0; p < PyList_GET_SIZE(params); p++) {
        PyObject *fqn = PyList_GET_ITEM(params, p);
        PyObject *prefix = NULL;
        dcp_reuse r;
        Py_INCREF(fqn);
        int on = reuse_begin(&r, keys, fqn, 1);
        int rc = on < 0 ? -1 : 0;
        if (on == 0) {
            prefix = concat3(st->str_pg_prefix, fqn, st->str_dot);
            rc = prefix ? flatten_group_keys(pairs, prefix, out) : -1;
        }
        for (Py_ssize_t q = 0;
             on == 1 && rc == 0 && q < PyList_GET_SIZE(pairs);
             q++) {
            PyObject *pair = PyList_GET_ITEM(pairs, q);
            PyObject *src = PyTuple_GET_ITEM(pair, 0);
            PyObject *full = NULL;
            if (PyUnicode_CheckExact(src)) {
                full = reuse_key(st, &r, src, st->str_pg_prefix, &prefix);
            }
            else {
                if (prefix == NULL) {
                    prefix = concat3(st->str_pg_prefix, fqn, st->str_dot);
                }
                full = prefix ? PyUnicode_Concat(prefix, src) : NULL;
            }
            rc = full ? PyDict_SetItem(out, full, PyTuple_GET_ITEM(pair, 1))
                      : -1;
            Py_XDECREF(full);
        }
        if (on == 1) {
            if (rc == 0) {
                rc = reuse_finish(&r, keys, 1);
            }
            else {
                reuse_clear(&r);
            }
        }
        Py_XDECREF(prefix);
        Py_DECREF(fqn);
        if (rc < 0) {
            return -1;
        }
    }
    return 0;
}

/* flatten_optim(ctx, osd, group_counts[, keys]) -> dict
 *
 * group_counts: None (all groups form one optimizer) or a sequence with
 * the number of groups of each optimizer, in order.  keys: a dict kept
 * by the caller between calls, whose key strings are reused (see "Reusing
 * keys"), or None. */
PyDoc_STRVAR(dcp_flatten_optim__doc__,
             "flatten_optim(ctx, osd, group_counts, keys=None, /)\n--\n\n"
             "The flattened optimizer format of a nested FQN-keyed dict.");

static PyObject *
dcp_flatten_optim(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *out = NULL, *state = NULL, *groups = NULL, *items = NULL;
    PyObject *plist = NULL, *counts = NULL, *result = NULL;

    if (nargs != 4 && dcp_check_nargs("flatten_optim", nargs, 3) < 0) {
        return NULL;
    }
    if (!dcp_context_check(st, args[0])) {
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)args[0];
    PyObject *osd = args[1];
    PyObject *keys = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    if (keys != NULL && !PyDict_CheckExact(keys)) {
        PyErr_Format(PyExc_TypeError,
                     "flatten_optim: keys must be a dict or None, not %.200s",
                     Py_TYPE(keys)->tp_name);
        return NULL;
    }
    if (!PyDict_Check(osd)) {
        PyErr_Format(st->err_type,
                     "optimizer state dict must be a dict, not %.200s",
                     Py_TYPE(osd)->tp_name);
        return NULL;
    }
    /* The output has ~17 keys per parameter (140k for 10k Adam params)
     * and building it is the bulk of flattening: each insert probes a
     * table far larger than the caches.  A dict whose keys are all str
     * keeps no hashes in its entries, so every occupied slot probed costs
     * a read of the key object too; a placeholder non-str key (None,
     * removed at the end) makes it a general dict that compares stored
     * hashes.  Same keys, values and order: a third faster here. */
    out = PyDict_New();
    if (out == NULL || PyDict_SetItem(out, Py_None, Py_None) < 0) {
        goto done;
    }
    if (dcp_dict_get_ref(osd, st->str_state, &state) <= 0 ||
        dcp_dict_get_ref(osd, st->str_param_groups, &groups) <= 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(st->err_key,
                            "optimizer state dict needs 'state' and "
                            "'param_groups'");
        }
        goto done;
    }
    if (PyDict_CheckExact(state)) {
        /* In place rather than through an items list: a list of 10k
         * (fqn, state) tuples is 10k allocations the cyclic GC counts, and
         * each collection they trigger traverses the whole (young, growing)
         * output dict -- a third of the time at 10k parameters.  Entries
         * are pinned while used and the size is checked after each. */
        Py_ssize_t pos = 0, n = PyDict_GET_SIZE(state);
        PyObject *fqn, *value;
        while (PyDict_Next(state, &pos, &fqn, &value)) {
            Py_INCREF(fqn);
            Py_INCREF(value);
            int rc = flatten_param_state(st, ctx, fqn, value, keys, out);
            Py_DECREF(fqn);
            Py_DECREF(value);
            if (rc < 0) {
                goto done;
            }
            if (PyDict_GET_SIZE(state) != n) {
                PyErr_SetString(st->err_runtime,
                                "optimizer state changed size during "
                                "iteration");
                goto done;
            }
        }
    }
    else {
        items = dcp_items_list(st, state);
        if (items == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            PyObject *pair = PyList_GET_ITEM(items, i);
            if (flatten_param_state(st,
                                    ctx,
                                    PyTuple_GET_ITEM(pair, 0),
                                    PyTuple_GET_ITEM(pair, 1),
                                    keys,
                                    out) < 0) {
                goto done;
            }
        }
    }
    /* params lists of every group, for anchoring empty groups */
    PyObject *glist = dcp_as_list(st, groups, "param_groups");
    if (glist == NULL) {
        goto done;
    }
    Py_SETREF(groups, glist);
    Py_ssize_t ngroups = PyList_GET_SIZE(groups);
    plist = PyList_New(ngroups);
    if (plist == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < ngroups; g++) {
        PyObject *params = packed_params(st, PyList_GET_ITEM(groups, g), g);
        if (params == NULL) {
            goto done;
        }
        PyList_SET_ITEM(plist, g, params);
    }
    if (args[2] == Py_None) {
        counts = Py_BuildValue("[n]", ngroups);
    }
    else {
        counts = dcp_as_list(st, args[2], "group_counts");
    }
    if (counts == NULL) {
        goto done;
    }
    Py_ssize_t lo = 0;
    for (Py_ssize_t o = 0; o < PyList_GET_SIZE(counts); o++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(counts, o));
        if (n == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (n < 0 || n > ngroups - lo) {
            PyErr_SetString(PyExc_ValueError,
                            "group_counts do not add up to the number of "
                            "param groups");
            goto done;
        }
        Py_ssize_t hi = lo + n;
        for (Py_ssize_t g = lo; g < hi; g++) {
            PyObject *pairs = group_key_pairs(st, PyList_GET_ITEM(groups, g));
            PyObject *params = PyList_GET_ITEM(plist, g);
            int rc = 0;
            if (pairs == NULL) {
                goto done;
            }
            if (PyList_GET_SIZE(params) == 0) {
                PyObject *prefix = empty_group_prefix(st, plist, lo, hi, g, o);
                rc = prefix ? flatten_group_keys(pairs, prefix, out) : -1;
                Py_XDECREF(prefix);
            }
            if (rc == 0) {
                rc = flatten_param_groups(st, params, pairs, keys, out);
            }
            Py_DECREF(pairs);
            if (rc < 0) {
                goto done;
            }
        }
        lo = hi;
    }
    if (lo != ngroups) {
        PyErr_SetString(PyExc_ValueError,
                        "group_counts do not add up to the number of param "
                        "groups");
        goto done;
    }
    if (PyDict_DelItem(out, Py_None) < 0) {
        goto done;
    }
    result = Py_NewRef(out);
done:
    Py_XDECREF(out);
    Py_XDECREF(state);
    Py_XDECREF(groups);
    Py_XDECREF(items);
    Py_XDECREF(plist);
    Py_XDECREF(counts);
    return result;
}

/* ----------------------------------------------------------------------
 * Parse back: the "loaded view" shared with the nested format
 *
 * A view is the tuple (state, groups, fqn_group, empties, unexpected):
 *   state       dict fqn -> per-parameter state dict
 *   groups      list of hyperparameter dicts ("params" not used)
 *   fqn_group   dict fqn -> index into groups
 *   empties     list of (identity, group index) for empty groups; the
 *               identity is a str for the flat format, None for nested
 *   unexpected  list of keys that could not be attributed
 */

/* Splits `rest` at the right-most '.' whose left side is in `known`.
 * Returns 1 and new references in *fqn / *tail, 0 when no split works,
 * -1 on error. */
static int
split_known_prefix(PyObject *rest,
                   PyObject *known,
                   PyObject **fqn,
                   PyObject **tail)
{
    Py_ssize_t end = PyUnicode_GET_LENGTH(rest);
    *fqn = *tail = NULL;
    for (;;) {
        Py_ssize_t dot = PyUnicode_FindChar(rest, '.', 0, end, -1);
        if (dot == -2) {
            return -1;
        }
        if (dot <= 0) {
            return 0;
        }
        PyObject *candidate = PyUnicode_Substring(rest, 0, dot);
        if (candidate == NULL) {
            return -1;
        }
        int hit = PySet_Contains(known, candidate);
        if (hit < 0) {
            Py_DECREF(candidate);
            return -1;
        }
        if (hit) {
            *tail =
                PyUnicode_Substring(rest, dot + 1, PyUnicode_GET_LENGTH(rest));
            if (*tail == NULL) {
                Py_DECREF(candidate);
                return -1;
            }
            *fqn = candidate;
            return 1;
        }
        Py_DECREF(candidate);
        end = dot;
    }
}

/* root[key] = value, refusing to replace a nested dict (a flattened key
 * that collides with nested state).  0 or -1. */
static int
store_leaf(dcp_state *st,
           PyObject *root,
           PyObject *key,
           PyObject *value,
           PyObject *key_for_errors)
{
    PyObject *existing = NULL;
    int found = dcp_dict_get_ref(root, key, &existing);
    if (found < 0) {
        return -1;
    }
    if (found && PyDict_Check(existing)) {
        PyErr_Format(st->err_value,
                     "flattened optimizer key '%S' collides with nested "
                     "state under the same name",
                     key_for_errors);
        Py_DECREF(existing);
        return -1;
    }
    Py_XDECREF(existing);
    return PyDict_SetItem(root, key, value);
}

/* Stores `value` at the dotted `path` inside dict `root`. */
static int
nested_store(dcp_state *st,
             PyObject *root,
             PyObject *path,
             PyObject *value,
             PyObject *key_for_errors)
{
    PyObject *parts = PyUnicode_Split(path, st->str_dot, -1);
    if (parts == NULL) {
        return -1;
    }
    PyObject *curr = Py_NewRef(root);
    Py_ssize_t n = PyList_GET_SIZE(parts);
    int rc = -1;
    for (Py_ssize_t i = 0; i < n - 1; i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        PyObject *next = NULL;
        int found = dcp_dict_get_ref(curr, part, &next);
        if (found < 0) {
            goto done;
        }
        if (found == 0) {
            next = PyDict_New();
            if (next == NULL || PyDict_SetItem(curr, part, next) < 0) {
                Py_XDECREF(next);
                goto done;
            }
        }
        else if (!PyDict_Check(next)) {
            PyErr_Format(st->err_value,
                         "flattened optimizer key '%S' nests under a "
                         "non-dict state value",
                         key_for_errors);
            Py_DECREF(next);
            goto done;
        }
        Py_SETREF(curr, next);
    }
    rc = store_leaf(
        st, curr, PyList_GET_ITEM(parts, n - 1), value, key_for_errors);
done:
    Py_DECREF(curr);
    Py_DECREF(parts);
    return rc;
}

/* The split of the previous key, reused for the keys after it: they
 * come in runs that share "state.<fqn>." or "param_groups.<fqn>."
 * (flatten writes them so).  When a key starts with that prefix and has
 * no dot after it, the right-most dot with a known FQN on its left is the
 * one ending the prefix -- the split is the same, without the three
 * substrings and the set probe of split_known_prefix. */
typedef struct {
    PyObject *prefix; /* "state.<fqn>." or "param_groups.<fqn>." */
    PyObject *target; /* the state entry or group dict it fills */
    int is_state;
} dcp_last_split;

static void
last_split_set(dcp_last_split *ls,
               PyObject *prefix,
               PyObject *target,
               int is_state)
{
    Py_XSETREF(ls->prefix, prefix);
    Py_XSETREF(ls->target, Py_NewRef(target));
    ls->is_state = is_state;
}

static void
last_split_clear(dcp_last_split *ls)
{
    Py_CLEAR(ls->prefix);
    Py_CLEAR(ls->target);
}

/* 1 when `key` was stored through the previous split, 0 when it needs
 * the general path, -1 on error. */
static int
last_split_store(dcp_state *st,
                 dcp_last_split *ls,
                 PyObject *key,
                 Py_ssize_t len,
                 int is_state,
                 PyObject *value)
{
    if (ls->prefix == NULL || ls->is_state != is_state) {
        return 0;
    }
    Py_ssize_t plen = PyUnicode_GET_LENGTH(ls->prefix);
    if (len <= plen) {
        return 0;
    }
    Py_ssize_t starts = PyUnicode_Tailmatch(key, ls->prefix, 0, len, -1);
    if (starts <= 0) {
        return starts < 0 ? -1 : 0;
    }
    Py_ssize_t dot = PyUnicode_FindChar(key, '.', plen, len, 1);
    if (dot != -1) {
        return dot == -2 ? -1 : 0;
    }
    PyObject *tail = PyUnicode_Substring(key, plen, len);
    if (tail == NULL) {
        return -1;
    }
    int rc = is_state ? store_leaf(st, ls->target, tail, value, key)
                      : PyDict_SetItem(ls->target, tail, value);
    Py_DECREF(tail);
    return rc < 0 ? -1 : 1;
}

/* The group dict for identity/fqn `id` in (groups, ids), created on
 * first sight.  Returns a borrowed reference or NULL. */
static PyObject *
view_group(PyObject *groups, PyObject *ids, PyObject *id)
{
    PyObject *index = NULL;
    int found = dcp_dict_get_ref(ids, id, &index);
    if (found < 0) {
        return NULL;
    }
    if (found) {
        Py_ssize_t i = PyLong_AsSsize_t(index);
        Py_DECREF(index);
        return PyList_GET_ITEM(groups, i);
    }
    PyObject *group = PyDict_New();
    index = group ? PyLong_FromSsize_t(PyList_GET_SIZE(groups)) : NULL;
    if (index == NULL || PyList_Append(groups, group) < 0 ||
        PyDict_SetItem(ids, id, index) < 0) {
        Py_XDECREF(group);
        Py_XDECREF(index);
        return NULL;
    }
    Py_DECREF(index);
    Py_DECREF(group); /* the list keeps it */
    return group;
}

/* Parses the reserved empty-group tail "__empty_group_after_<n>__.<key>"
 * into identity "<anchor>|after|<n>" and key.  1 / 0 (not reserved) / -1.
 */
static int
parse_empty_tail(PyObject *anchor,
                 PyObject *tail,
                 PyObject **identity,
                 PyObject **key)
{
    const char *kinds[2] = {EMPTY_AFTER, EMPTY_BEFORE};
    const char *names[2] = {"after", "before"};
    *identity = *key = NULL;
    for (int k = 0; k < 2; k++) {
        PyObject *marker = PyUnicode_FromString(kinds[k]);
        if (marker == NULL) {
            return -1;
        }
        Py_ssize_t starts = PyUnicode_Tailmatch(
            tail, marker, 0, PyUnicode_GET_LENGTH(tail), -1);
        Py_ssize_t mlen = PyUnicode_GET_LENGTH(marker);
        Py_DECREF(marker);
        if (starts < 0) {
            return -1;
        }
        if (!starts) {
            continue;
        }
        /* digits, then "__." */
        Py_ssize_t len = PyUnicode_GET_LENGTH(tail);
        Py_ssize_t i = mlen;
        while (i < len && Py_UNICODE_ISDIGIT(PyUnicode_READ_CHAR(tail, i))) {
            i++;
        }
        if (i == mlen || i + 3 > len || PyUnicode_READ_CHAR(tail, i) != '_' ||
            PyUnicode_READ_CHAR(tail, i + 1) != '_' ||
            PyUnicode_READ_CHAR(tail, i + 2) != '.') {
            return 0;
        }
        PyObject *digits = PyUnicode_Substring(tail, mlen, i);
        if (digits == NULL) {
            return -1;
        }
        *identity = PyUnicode_FromFormat("%S|%s|%S", anchor, names[k], digits);
        Py_DECREF(digits);
        *key = *identity ? PyUnicode_Substring(tail, i + 3, len) : NULL;
        if (*key == NULL) {
            Py_CLEAR(*identity);
            return -1;
        }
        return 1;
    }
    return 0;
}

/* 1 when `s` holds the ASCII `lit` at `at`, else 0. */
static int
ascii_at(PyObject *s, Py_ssize_t at, const char *lit)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(s);
    for (Py_ssize_t i = 0; lit[i] != '\0'; i++) {
        if (at + i >= len ||
            PyUnicode_READ_CHAR(s, at + i) != (Py_UCS4)(unsigned char)lit[i]) {
            return 0;
        }
    }
    return 1;
}

/* The end of the run of decimal digits of `s` starting at `at`. */
static Py_ssize_t
digits_end(PyObject *s, Py_ssize_t at)
{
    Py_ssize_t len = PyUnicode_GET_LENGTH(s);
    while (at < len && Py_UNICODE_ISDIGIT(PyUnicode_READ_CHAR(s, at))) {
        at++;
    }
    return at;
}

/* Parses "__optimizer_<o>_empty_group_<g>__.<key>" into identity
 * "__optimizer_<o>_empty_group_<g>__" and key.  1 / 0 (not that form) /
 * -1. */
static int
parse_optim_empty(PyObject *rest, PyObject **identity, PyObject **key)
{
    *identity = *key = NULL;
    Py_ssize_t i = (Py_ssize_t)strlen(EMPTY_OPTIM);
    if (!ascii_at(rest, 0, EMPTY_OPTIM)) {
        return 0;
    }
    Py_ssize_t o_end = digits_end(rest, i);
    if (o_end == i || !ascii_at(rest, o_end, "_empty_group_")) {
        return 0;
    }
    i = o_end + (Py_ssize_t)strlen("_empty_group_");
    Py_ssize_t g_end = digits_end(rest, i);
    if (g_end == i || !ascii_at(rest, g_end, "__.")) {
        return 0;
    }
    *identity = PyUnicode_Substring(rest, 0, g_end + 2);
    *key = *identity ? PyUnicode_Substring(
                           rest, g_end + 3, PyUnicode_GET_LENGTH(rest))
                     : NULL;
    if (*key == NULL) {
        Py_CLEAR(*identity);
        return -1;
    }
    return 1;
}

/* The flat-key grammar (docs/architecture.md, "Flat keys"): `rest` is a
 * key without its "state." / "param_groups." prefix.
 *
 * With `known` (a set of parameter FQNs) the FQN is the longest known
 * one: `rest` splits at its right-most '.' whose left side is known.  A
 * param_groups tail "__empty_group_after|before_<n>__.<key>" is a reserved
 * empty-group key anchored on that FQN; a param_groups key with no known
 * FQN may be "__optimizer_<o>_empty_group_<g>__.<key>".
 *
 * With `known` None (FQNs unknown, param_groups keys only): a reserved
 * form wins (the right-most anchored one), else the key splits at its
 * last '.' (group keys without dots, the common case).
 *
 * Returns 1 with *a = fqn, *b = state path / group key; 2 with *a = the
 * empty group's identity ("<anchor>|after|<n>", "<anchor>|before|<n>" or
 * "__optimizer_<o>_empty_group_<g>__"), *b = group key; 0 when `rest`
 * parses as neither; -1 on error. */
static int
parse_flat_rest(
    PyObject *rest, PyObject *known, int is_state, PyObject **a, PyObject **b)
{
    *a = *b = NULL;
    if (known != Py_None) {
        int rc = split_known_prefix(rest, known, a, b);
        if (rc != 0 || is_state) {
            if (rc == 1 && !is_state) {
                PyObject *identity = NULL, *gkey = NULL;
                int reserved = parse_empty_tail(*a, *b, &identity, &gkey);
                if (reserved != 0) {
                    Py_CLEAR(*a);
                    Py_CLEAR(*b);
                    *a = identity;
                    *b = gkey;
                    return reserved < 0 ? -1 : 2;
                }
            }
            return rc;
        }
        int reserved = parse_optim_empty(rest, a, b);
        return reserved == 1 ? 2 : reserved;
    }
    if (is_state) {
        return 0;
    }
    int reserved = parse_optim_empty(rest, a, b);
    if (reserved != 0) {
        return reserved == 1 ? 2 : -1;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(rest);
    Py_ssize_t last = PyUnicode_FindChar(rest, '.', 0, len, -1);
    if (last == -2) {
        return -1;
    }
    for (Py_ssize_t end = last; end > 0;) {
        Py_ssize_t dot = PyUnicode_FindChar(rest, '.', 0, end, -1);
        if (dot == -2) {
            return -1;
        }
        if (dot <= 0) {
            break;
        }
        PyObject *anchor = PyUnicode_Substring(rest, 0, dot);
        PyObject *tail =
            anchor ? PyUnicode_Substring(rest, dot + 1, len) : NULL;
        reserved = tail ? parse_empty_tail(anchor, tail, a, b) : -1;
        Py_XDECREF(anchor);
        Py_XDECREF(tail);
        if (reserved != 0) {
            return reserved == 1 ? 2 : -1;
        }
        end = dot;
    }
    if (last <= 0) {
        return 0;
    }
    *a = PyUnicode_Substring(rest, 0, last);
    *b = *a ? PyUnicode_Substring(rest, last + 1, len) : NULL;
    if (*b == NULL) {
        Py_CLEAR(*a);
        return -1;
    }
    return 1;
}

/* parse_flat_key(key, known, /) -> ("state", fqn, path) |
 * ("param_groups", fqn, key) | ("empty_group", identity, key) | None:
 * one key of the flattened format, by parse_flat_rest's grammar (the
 * parser unflatten_optim uses), for the tools (convert, inspect, the
 * load planner).  `known`: a set or frozenset of parameter FQNs, or
 * None. */
PyDoc_STRVAR(dcp_parse_flat_key__doc__,
             "parse_flat_key(key, known, /)\n--\n\n"
             "One key of the flattened optimizer format, parsed as "
             "unflatten_optim does.");

static PyObject *
dcp_parse_flat_key(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *rest = NULL, *a = NULL, *b = NULL, *result = NULL;

    if (dcp_check_nargs("parse_flat_key", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *key = args[0];
    PyObject *known = args[1];
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError,
                     "parse_flat_key() key must be str, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    if (known != Py_None && !PyAnySet_Check(known)) {
        PyErr_Format(PyExc_TypeError,
                     "parse_flat_key() known must be a set, frozenset or "
                     "None, not %.200s",
                     Py_TYPE(known)->tp_name);
        return NULL;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(key);
    Py_ssize_t is_state =
        PyUnicode_Tailmatch(key, st->str_state_prefix, 0, len, -1);
    Py_ssize_t is_pg =
        is_state ? 0 : PyUnicode_Tailmatch(key, st->str_pg_prefix, 0, len, -1);
    if (is_state < 0 || is_pg < 0) {
        return NULL;
    }
    if (!is_state && !is_pg) {
        Py_RETURN_NONE;
    }
    PyObject *prefix = is_state ? st->str_state_prefix : st->str_pg_prefix;
    rest = PyUnicode_Substring(key, PyUnicode_GET_LENGTH(prefix), len);
    if (rest == NULL) {
        return NULL;
    }
    int rc = parse_flat_rest(rest, known, is_state != 0, &a, &b);
    if (rc < 0) {
        goto error;
    }
    result = rc == 0 ? Py_NewRef(Py_None)
                     : Py_BuildValue(
                           "(sOO)",
                           rc == 2 ? "empty_group"
                                   : (is_state ? "state" : "param_groups"),
                           a,
                           b);
error:
    Py_DECREF(rest);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return result;
}

PyDoc_STRVAR(dcp_unflatten_optim__doc__,
             "unflatten_optim(index, flat, /)\n--\n\n"
             "Parse a flattened optimizer dict into a loaded-state view.");

/* unflatten_optim(index, flat) -> view (see above). */
static PyObject *
dcp_unflatten_optim(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *known = NULL, *state = NULL, *groups = NULL, *fqn_group = NULL;
    PyObject *empty_ids = NULL, *empties = NULL, *unexpected = NULL;
    PyObject *items = NULL, *result = NULL;
    dcp_last_split last = {NULL, NULL, 0};

    if (dcp_check_nargs("unflatten_optim", nargs, 2) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *flat = args[1];
    if (!PyDict_Check(flat)) {
        PyErr_Format(st->err_type,
                     "flattened optimizer state dict must be a dict, not "
                     "%.200s",
                     Py_TYPE(flat)->tp_name);
        return NULL;
    }
    known = PySet_New(NULL);
    state = PyDict_New();
    groups = PyList_New(0);
    fqn_group = PyDict_New();
    empty_ids = PyDict_New();
    unexpected = PyList_New(0);
    if (known == NULL || state == NULL || groups == NULL ||
        fqn_group == NULL || empty_ids == NULL || unexpected == NULL) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(ix->tensor_fqns); t++) {
        PyObject *names = PyList_GET_ITEM(ix->tensor_fqns, t);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(names); j++) {
            if (PySet_Add(known, PyList_GET_ITEM(names, j)) < 0) {
                goto done;
            }
        }
    }
    items = dcp_items_list(st, flat);
    if (items == NULL) {
        goto done;
    }
    Py_ssize_t state_len = PyUnicode_GET_LENGTH(st->str_state_prefix);
    Py_ssize_t pg_len = PyUnicode_GET_LENGTH(st->str_pg_prefix);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        PyObject *rest = NULL, *fqn = NULL, *tail = NULL;
        int rc = 0;
        Py_ssize_t is_state = 0, is_pg = 0; /* PyUnicode_Tailmatch */
        if (!PyUnicode_Check(key)) {
            PyErr_Format(st->err_optim_dict,
                         "flattened optimizer state dict keys must be str, "
                         "got %R",
                         key);
            goto done;
        }
        Py_ssize_t len = PyUnicode_GET_LENGTH(key);
        is_state = PyUnicode_Tailmatch(key, st->str_state_prefix, 0, len, -1);
        if (is_state < 0) {
            goto done;
        }
        if (!is_state) {
            is_pg = PyUnicode_Tailmatch(key, st->str_pg_prefix, 0, len, -1);
            if (is_pg < 0) {
                goto done;
            }
        }
        if (!is_state && !is_pg) {
            if (PyList_Append(unexpected, key) < 0) {
                goto done;
            }
            continue;
        }
        int quick =
            last_split_store(st, &last, key, len, is_state != 0, value);
        if (quick != 0) {
            if (quick < 0) {
                goto done;
            }
            continue;
        }
        rest = PyUnicode_Substring(key, is_state ? state_len : pg_len, len);
        if (rest == NULL) {
            goto done;
        }
        /* fqn, tail: or an empty group's identity and key (rc 2) */
        rc = parse_flat_rest(rest, known, is_state != 0, &fqn, &tail);
        if (rc < 0) {
            Py_DECREF(rest);
            goto done;
        }
        if (rc == 0) {
            Py_DECREF(rest);
            if (PyList_Append(unexpected, key) < 0) {
                goto done;
            }
            continue;
        }
        if (rc == 2) {
            PyObject *group = view_group(groups, empty_ids, fqn);
            rc = (group && PyDict_SetItem(group, tail, value) == 0) ? 2 : -1;
        }
        else if (is_state) {
            PyObject *entry = NULL;
            int found = dcp_dict_get_ref(state, fqn, &entry);
            if (found == 0) {
                entry = PyDict_New();
                if (entry == NULL || PyDict_SetItem(state, fqn, entry) < 0) {
                    found = -1;
                }
            }
            PyObject *prefix = NULL;
            if (found < 0 || entry == NULL ||
                nested_store(st, entry, tail, value, key) < 0 ||
                (prefix = PyUnicode_Substring(
                     key, 0, len - PyUnicode_GET_LENGTH(tail))) == NULL) {
                Py_XDECREF(entry);
                rc = -1;
            }
            else {
                last_split_set(&last, prefix, entry, 1);
                Py_DECREF(entry);
            }
        }
        else {
            PyObject *group = view_group(groups, fqn_group, fqn);
            rc = (group && PyDict_SetItem(group, tail, value) == 0) ? 1 : -1;
            PyObject *prefix =
                rc == 1 ? PyUnicode_Substring(
                              key, 0, len - PyUnicode_GET_LENGTH(tail))
                        : NULL;
            if (prefix == NULL) {
                rc = -1;
            }
            else {
                last_split_set(&last, prefix, group, 0);
            }
        }
        Py_DECREF(rest);
        Py_XDECREF(fqn);
        Py_XDECREF(tail);
        if (rc < 0) {
            goto done;
        }
    }
    /* empties: (identity, group index), in order of first appearance */
    empties = PyList_New(0);
    if (empties == NULL) {
        goto done;
    }
    {
        PyObject *eitems = dcp_items_list(st, empty_ids);
        if (eitems == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(eitems); i++) {
            if (PyList_Append(empties, PyList_GET_ITEM(eitems, i)) < 0) {
                Py_DECREF(eitems);
                goto done;
            }
        }
        Py_DECREF(eitems);
    }
    result = PyTuple_Pack(5, state, groups, fqn_group, empties, unexpected);
done:
    Py_XDECREF(known);
    Py_XDECREF(state);
    Py_XDECREF(groups);
    Py_XDECREF(fqn_group);
    Py_XDECREF(empty_ids);
    Py_XDECREF(empties);
    Py_XDECREF(unexpected);
    Py_XDECREF(items);
    last_split_clear(&last);
    return result;
}

PyMethodDef dcp_flat_methods[] = {
    {"flatten_optim",
     DCP_FASTCALL(dcp_flatten_optim),
     METH_FASTCALL,
     dcp_flatten_optim__doc__},
    {"unflatten_optim",
     DCP_FASTCALL(dcp_unflatten_optim),
     METH_FASTCALL,
     dcp_unflatten_optim__doc__},
    {"parse_flat_key",
     DCP_FASTCALL(dcp_parse_flat_key),
     METH_FASTCALL,
     dcp_parse_flat_key__doc__},
    {NULL, NULL, 0, NULL},
};
