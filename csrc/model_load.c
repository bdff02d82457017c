/* Model loading: re-keying a canonical state dict the way
 * model.load_state_dict() expects it (wrapper prefixes such as DDP's
 * "module." put back), without touching the caller's dict (D11 in
 * docs/differences.md).
 */
#include "dcp.h"

/* A shallow copy of `sd` that keeps its type and the `_metadata`
 * attribute model.load_state_dict reads version information from. */
static PyObject *
copy_state_dict(dcp_state *st, PyObject *sd)
{
    if (PyDict_CheckExact(sd)) {
        return PyDict_Copy(sd);
    }
    PyObject *copy = PyObject_CallMethodNoArgs(sd, st->str_copy);
    if (copy == NULL) {
        return NULL;
    }
    PyObject *meta = PyObject_GetAttr(sd, st->str_metadata);
    if (meta == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_DECREF(copy);
            return NULL;
        }
        PyErr_Clear();
        return copy;
    }
    int rc = PyObject_SetAttr(copy, st->str_metadata, meta);
    Py_DECREF(meta);
    if (rc < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    return copy;
}

/* 0 when every key of the dict `sd` is a str; else -1 with the context's
 * TypeError subclass set, naming the first other key.  torch's
 * load_state_dict fails on such a key with `strict` either way
 * (key.startswith), upstream's set_model_state_dict too ("_flat_param" in
 * key), both only after some checks ran or tensors were copied. */
static int
check_str_keys(dcp_Context *ctx, PyObject *sd)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(sd, &pos, &key, &value)) {
        if (PyUnicode_Check(key)) {
            continue;
        }
        Py_INCREF(key); /* repr() may run code that drops it */
        PyErr_Format(dcp_get_state_by_type(Py_TYPE(ctx))->err_type,
                     "model state dict keys must be str (FQNs), got the "
                     "%.200s key %R; nothing was loaded",
                     Py_TYPE(key)->tp_name,
                     key);
        Py_DECREF(key);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(
    dcp_rename_for_load__doc__,
    "rename_for_load(index, state_dict, strict, rename, want_local, /)"
    "\n--\n\n"
    "Key a canonical model state dict the way model.load_state_dict "
    "expects, without mutating it.");

/* rename_for_load(index, state_dict, strict, rename, want_local)
 *   -> (state_dict_for_load, local_state or None)
 *
 * For every entry of the walk whose load key differs from its FQN
 * (upstream: fqn != fqn_with_prefix), the value under the FQN moves to the
 * load key (to the end, as upstream's pop + insert does); a missing or
 * None value is E13 under strict.  A key that is not a str is a TypeError
 * (check_str_keys), before anything else.  The input is returned unchanged
 * when nothing needs renaming, else a private copy is renamed.  `local_state`
 * maps every load key to the live tensor (or _extra_state marker). */
static PyObject *
dcp_rename_for_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *out = NULL, *local = NULL, *result = NULL;

    if (dcp_check_nargs("rename_for_load", nargs, 5) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *sd = args[1];
    /* one at a time: IsTrue runs Python code, never with an error set */
    int strict = PyObject_IsTrue(args[2]);
    int rename = strict < 0 ? -1 : PyObject_IsTrue(args[3]);
    int want_local = rename < 0 ? -1 : PyObject_IsTrue(args[4]);
    if (strict < 0 || rename < 0 || want_local < 0) {
        return NULL;
    }
    if (!PyDict_Check(sd)) {
        PyErr_Format(st->err_type,
                     "model state dict must be a dict, not %.200s",
                     Py_TYPE(sd)->tp_name);
        return NULL;
    }
    if (check_str_keys((dcp_Context *)ix->ctx, sd) < 0 ||
        (want_local && (local = PyDict_New()) == NULL)) {
        goto done;
    }
    out = Py_NewRef(sd);
    int copied = 0;
    Py_ssize_t n = PyList_GET_SIZE(ix->fqns);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *fqn = PyList_GET_ITEM(ix->fqns, i);
        PyObject *load = PyList_GET_ITEM(ix->load_keys, i);
        if (local != NULL &&
            PyDict_SetItem(local, load, PyList_GET_ITEM(ix->values, i)) < 0) {
            goto done;
        }
        if (!rename || PyUnicode_Compare(fqn, load) == 0) {
            continue;
        }
        PyObject *value = NULL;
        int found = dcp_dict_get_ref(out, fqn, &value);
        if (found < 0) {
            goto done;
        }
        if (!found || value == Py_None) {
            Py_XDECREF(value);
            if (strict) {
                PyErr_Format(PyExc_RuntimeError, "Missing key: %S.", fqn);
                goto done;
            }
            continue;
        }
        if (!copied) {
            PyObject *copy = copy_state_dict(st, sd);
            if (copy == NULL) {
                Py_DECREF(value);
                goto done;
            }
            Py_SETREF(out, copy);
            copied = 1;
        }
        if (PyObject_DelItem(out, fqn) < 0 ||
            PyObject_SetItem(out, load, value) < 0) {
            Py_DECREF(value);
            goto done;
        }
        Py_DECREF(value);
    }
    result = PyTuple_Pack(2, out, local ? local : Py_None);
done:
    Py_XDECREF(out);
    Py_XDECREF(local);
    return result;
}

PyDoc_STRVAR(
    dcp_full_load_merge__doc__,
    "full_load_merge(ctx, full_sd, local, device, /)\n--\n\n"
    "Merge a full model state dict into the local one (private copy).");

/* full_load_merge(ctx, full_sd, local, device)
 *   -> (merged dict, dtensor jobs)
 *
 * Upstream's _distribute_state_dict followed by state_dict.update(local)
 * for a full model state dict held by every rank, on a private copy:
 *   non-tensor values   replace the local entry (even unknown keys);
 *   0-dim tensors       .cpu();
 *   tensors with a plain local counterpart   .detach().to(device);
 *   tensors whose local counterpart is a DTensor   left to the caller as
 *       jobs (key, full tensor, local DTensor), to be sliced locally;
 *   local keys the full dict lacks keep their live value.
 * The merged dict keeps the full dict's key order, then local-only keys. */
static PyObject *
dcp_full_load_merge(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *items = NULL, *merged = NULL, *jobs = NULL, *result = NULL;
    if (dcp_check_nargs("full_load_merge", nargs, 4) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)args[0];
    PyObject *full = args[1], *local = args[2], *device = args[3];
    if (!PyDict_Check(full) || !PyDict_Check(local)) {
        PyErr_SetString(PyExc_TypeError,
                        "full_load_merge(): state dicts must be dicts");
        return NULL;
    }
    items = dcp_items_list(st, full);
    merged = items ? copy_state_dict(st, full) : NULL;
    jobs = merged ? PyList_New(0) : NULL;
    if (jobs == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        PyObject *new_value = NULL;
        int is_tensor = PyObject_IsInstance(value, ctx->tensor_type);
        if (is_tensor < 0) {
            goto done;
        }
        if (!is_tensor) {
            if (PyDict_SetItem(local, key, value) < 0) {
                goto done;
            }
            continue;
        }
        PyObject *dim = PyObject_CallMethodNoArgs(value, st->str_dim);
        long d = dim ? PyLong_AsLong(dim) : -1;
        Py_XDECREF(dim);
        if (d == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (d == 0) {
            new_value = PyObject_CallMethodNoArgs(value, st->str_cpu);
        }
        else {
            PyObject *lv = NULL;
            int found = dcp_dict_get_ref(local, key, &lv);
            if (found < 0) {
                goto done;
            }
            if (!found || lv == Py_None) {
                Py_XDECREF(lv);
                continue;
            }
            int is_dt = ctx->dtensor_type == Py_None
                            ? 0
                            : PyObject_IsInstance(lv, ctx->dtensor_type);
            if (is_dt < 0) {
                Py_DECREF(lv);
                goto done;
            }
            if (is_dt) {
                PyObject *job = PyTuple_Pack(3, key, value, lv);
                Py_DECREF(lv);
                if (job == NULL || PyList_Append(jobs, job) < 0) {
                    Py_XDECREF(job);
                    goto done;
                }
                Py_DECREF(job);
                continue;
            }
            Py_DECREF(lv);
            PyObject *detached =
                PyObject_CallMethodNoArgs(value, st->str_detach);
            if (detached != NULL) {
                new_value = dcp_call_method1(st->str_to, detached, device);
                Py_DECREF(detached);
            }
        }
        if (new_value == NULL) {
            dcp_note_key(key);
            goto done;
        }
        int rc = PyDict_SetItem(local, key, new_value);
        Py_DECREF(new_value);
        if (rc < 0) {
            goto done;
        }
    }
    if (PyDict_Update(merged, local) < 0) {
        goto done;
    }
    result = PyTuple_Pack(2, merged, jobs);
done:
    Py_XDECREF(items);
    Py_XDECREF(merged);
    Py_XDECREF(jobs);
    return result;
}

PyDoc_STRVAR(
    dcp_check_model_load__doc__,
    "check_model_load(index, state_dict, strict, check_keys, /)\n--\n\n"
    "What model.load_state_dict would reject, before anything is copied.");

/* check_model_load(index, state_dict, strict, check_keys)
 *   -> (missing, unexpected, errors)
 *
 * What model.load_state_dict(state_dict, strict) will complain about,
 * found before anything is copied (torch copies tensor by tensor and
 * raises at the end, leaving a half-loaded model).  `state_dict` is keyed
 * by load keys.  errors are torch's own texts (size mismatch, non-tensor
 * values), in walk order; missing/unexpected are only computed with
 * check_keys (models whose load hooks rename keys cannot be checked). */
static PyObject *
dcp_check_model_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("check_model_load", nargs, 4) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    dcp_Context *ctx = (dcp_Context *)ix->ctx;
    PyObject *sd = args[1];
    int strict = PyObject_IsTrue(args[2]);
    int check_keys = strict < 0 ? -1 : PyObject_IsTrue(args[3]);
    if (strict < 0 || check_keys < 0) {
        return NULL;
    }
    if (!PyDict_Check(sd)) {
        PyErr_SetString(st->err_type, "state_dict must be a dict");
        return NULL;
    }
    PyObject *missing = PyList_New(0), *unexpected = PyList_New(0);
    PyObject *errs = PyList_New(0), *expected = PySet_New(NULL);
    PyObject *result = NULL, *items = NULL;
    if (!missing || !unexpected || !errs || !expected) {
        goto done;
    }
    const char *kinds = PyByteArray_AS_STRING(ix->kinds);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ix->load_keys); i++) {
        PyObject *key = PyList_GET_ITEM(ix->load_keys, i);
        PyObject *live = PyList_GET_ITEM(ix->values, i);
        if (PySet_Add(expected, key) < 0) {
            goto done;
        }
        PyObject *value = NULL;
        int found = dcp_dict_get_ref(sd, key, &value);
        if (found < 0) {
            goto done;
        }
        if (!found) {
            if (strict && check_keys && PyList_Append(missing, key) < 0) {
                goto done;
            }
            continue;
        }
        if (kinds[i] == DCP_KIND_EXTRA) {
            Py_DECREF(value);
            continue;
        }
        int is_tensor = PyObject_IsInstance(value, ctx->tensor_type);
        if (is_tensor < 0) {
            Py_DECREF(value);
            goto done;
        }
        PyObject *msg = NULL;
        if (!is_tensor) {
            msg = PyUnicode_FromFormat(
                "While copying the parameter named \"%S\", expected "
                "torch.Tensor or Tensor-like object from checkpoint but "
                "received %R",
                key,
                (PyObject *)Py_TYPE(value));
        }
        else {
            PyObject *ls = PyObject_GetAttr(live, st->str_shape);
            PyObject *vs = ls ? PyObject_GetAttr(value, st->str_shape) : NULL;
            Py_ssize_t lnd = ls ? PyObject_Length(ls) : -1;
            Py_ssize_t vnd = vs ? PyObject_Length(vs) : -1;
            int eq = (lnd >= 0 && vnd >= 0)
                         ? PyObject_RichCompareBool(ls, vs, Py_EQ)
                         : -1;
            /* torch's backward compatibility: a shape-(1,) value for a
             * 0-dim parameter is loaded from its only element (a longer
             * one is a size mismatch, as in torch) */
            if (eq == 0 && lnd == 0 && vnd == 1) {
                PyObject *first = PySequence_GetItem(vs, 0);
                long n0 = first ? PyLong_AsLong(first) : -1;
                Py_XDECREF(first);
                if (n0 == -1 && PyErr_Occurred()) {
                    eq = -1;
                }
                else {
                    eq = n0 == 1;
                }
            }
            if (eq == 0) {
                msg = PyUnicode_FromFormat(
                    "size mismatch for %S: copying a param with shape %R "
                    "from checkpoint, the shape in current model is %R.",
                    key,
                    vs,
                    ls);
            }
            Py_XDECREF(ls);
            Py_XDECREF(vs);
            if (eq < 0) {
                Py_DECREF(value);
                goto done;
            }
        }
        Py_DECREF(value);
        if (msg != NULL && PyList_Append(errs, msg) < 0) {
            Py_DECREF(msg);
            goto done;
        }
        Py_XDECREF(msg);
        if (PyErr_Occurred()) {
            goto done;
        }
    }
    if (strict && check_keys) {
        items = dcp_items_list(st, sd);
        if (items == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
            int known = PySet_Contains(expected, key);
            if (known < 0 || (!known && PyList_Append(unexpected, key) < 0)) {
                goto done;
            }
        }
    }
    result = PyTuple_Pack(3, missing, unexpected, errs);
done:
    Py_XDECREF(missing);
    Py_XDECREF(unexpected);
    Py_XDECREF(errs);
    Py_XDECREF(expected);
    Py_XDECREF(items);
    return result;
}

/* ----------------------------------------------------------------------
 * aliased_load: the sharded load that writes nothing
 *
 * A DCP resume loads into the tensors get_state_dict returned, which are
 * views of the model's own parameters and buffers (detached aliases);
 * set_state_dict then hands them back.  torch's load_state_dict copies
 * each onto its parameter -- a copy_ that aten returns from early
 * because source and destination are the same data (same storage
 * address, sizes, strides, dtype, device, conj/neg bits; for DTensors,
 * the same mesh, placements and global shape, so that the copy stays
 * local) -- after walking the module tree with a per-child filter of
 * the whole dict.  When every entry is such a copy, the load's only
 * effects are its hooks and the parameters' version counters: the
 * caller runs those instead.
 */

/* 1 when `t` is strided, of one of the exact types `plain_types`; 0 if
 * not; -1 on error. */
static int
plain_strided(dcp_state *st,
              PyObject *t,
              PyObject *plain_types,
              PyObject *strided)
{
    int known = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(plain_types); i++) {
        if ((PyObject *)Py_TYPE(t) == PyTuple_GET_ITEM(plain_types, i)) {
            known = 1;
            break;
        }
    }
    if (!known) {
        return 0;
    }
    PyObject *layout = PyObject_GetAttr(t, st->str_layout);
    if (layout == NULL) {
        return -1;
    }
    int ok = layout == strided;
    Py_DECREF(layout);
    return ok;
}

/* 1 when attribute (or, with `call`, method result) `name` of `a` and `b`
 * compare equal; 0 if not; -1 on error. */
static int
same_attr(PyObject *a, PyObject *b, PyObject *name, int call)
{
    PyObject *x =
        call ? PyObject_CallMethodNoArgs(a, name) : PyObject_GetAttr(a, name);
    if (x == NULL) {
        return -1;
    }
    PyObject *y =
        call ? PyObject_CallMethodNoArgs(b, name) : PyObject_GetAttr(b, name);
    if (y == NULL) {
        Py_DECREF(x);
        return -1;
    }
    int eq = x == y ? 1 : PyObject_RichCompareBool(x, y, Py_EQ);
    Py_DECREF(x);
    Py_DECREF(y);
    return eq;
}

/* 1 when copying `value` onto `live` is a copy of the same data onto
 * itself (see above); 0 if not; -1 on error. */
static int
same_data(dcp_state *st,
          PyObject *live,
          PyObject *value,
          PyObject *dtensor_cls,
          PyObject *plain_types,
          PyObject *strided)
{
    if (live == value) {
        return 1;
    }
    int dl = PyObject_IsInstance(live, dtensor_cls);
    int dv = dl < 0 ? -1 : PyObject_IsInstance(value, dtensor_cls);
    if (dv < 0) {
        return -1;
    }
    if (dl != dv) {
        return 0;
    }
    PyObject *a = NULL, *b = NULL;
    int rc = 1;
    if (dl) {
        PyObject *names[3] = {
            st->str_device_mesh, st->str_placements, st->str_shape};
        for (int i = 0; rc == 1 && i < 3; i++) {
            rc = same_attr(live, value, names[i], 0);
        }
        if (rc != 1) {
            return rc;
        }
        a = PyObject_GetAttr(live, st->str_local_tensor);
        b = a ? PyObject_GetAttr(value, st->str_local_tensor) : NULL;
        if (b == NULL) {
            Py_XDECREF(a);
            return -1;
        }
    }
    else {
        a = Py_NewRef(live);
        b = Py_NewRef(value);
    }
    if (a == b) {
        goto done;
    }
    rc = plain_strided(st, a, plain_types, strided);
    if (rc == 1) {
        rc = plain_strided(st, b, plain_types, strided);
    }
    /* attributes first, then the methods (data_ptr last: it raises on
     * tensors without storage, which the checks before turn away) */
    PyObject *attrs[3] = {st->str_dtype, st->str_device, st->str_shape};
    for (int i = 0; rc == 1 && i < 3; i++) {
        rc = same_attr(a, b, attrs[i], 0);
    }
    PyObject *methods[4] = {
        st->str_is_neg, st->str_is_conj, st->str_stride, st->str_data_ptr};
    for (int i = 0; rc == 1 && i < 4; i++) {
        rc = same_attr(a, b, methods[i], 1);
    }
done:
    Py_DECREF(a);
    Py_DECREF(b);
    return rc;
}

/* aliased_load(index, state_dict, dtensor_cls, plain_types, strided)
 *   -> list of the live tensors, one per entry, or None
 *
 * The list when `state_dict` (keyed for load_state_dict) has exactly the
 * model's entries, every one a tensor entry whose value holds the same
 * data as the live tensor (same_data); None otherwise (extra state,
 * missing or unexpected keys, any other value). */
PyDoc_STRVAR(
    dcp_aliased_load__doc__,
    "aliased_load(index, state_dict, dtensor_cls, plain_types, strided, /)"
    "\n--\n\n"
    "The live tensors a sharded load would copy onto themselves, or None.");

static PyObject *
dcp_aliased_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("aliased_load", nargs, 5) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *sd = args[1], *dtensor_cls = args[2];
    PyObject *plain_types = args[3], *strided = args[4];
    if (!PyDict_Check(sd) || !PyTuple_Check(plain_types)) {
        PyErr_SetString(PyExc_TypeError,
                        "aliased_load needs a dict and a tuple of types");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ix->load_keys);
    if (PyDict_GET_SIZE(sd) != n) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *live = PyList_GET_ITEM(ix->values, i);
        PyObject *value = NULL;
        int rc = 0;
        if (PyByteArray_AS_STRING(ix->kinds)[i] != DCP_KIND_EXTRA) {
            rc = dcp_dict_get_ref(
                sd, PyList_GET_ITEM(ix->load_keys, i), &value);
        }
        if (rc == 1) {
            rc = same_data(st, live, value, dtensor_cls, plain_types, strided);
            Py_DECREF(value);
        }
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (rc == 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyList_SET_ITEM(out, i, Py_NewRef(live));
    }
    return out;
}

PyMethodDef dcp_model_load_methods[] = {
    {"rename_for_load",
     DCP_FASTCALL(dcp_rename_for_load),
     METH_FASTCALL,
     dcp_rename_for_load__doc__},
    {"full_load_merge",
     DCP_FASTCALL(dcp_full_load_merge),
     METH_FASTCALL,
     dcp_full_load_merge__doc__},
    {"check_model_load",
     DCP_FASTCALL(dcp_check_model_load),
     METH_FASTCALL,
     dcp_check_model_load__doc__},
    {"aliased_load",
     DCP_FASTCALL(dcp_aliased_load),
     METH_FASTCALL,
     dcp_aliased_load__doc__},
    {NULL, NULL, 0, NULL},
};
