/* The job lists of full loads: the (value, template, device) jobs of a
 * model broadcast (broadcast_jobs) and of an optimizer load
 * (optim_state_jobs), the shape
 * check before anything moves (shape_mismatches), and writing the loaded
 * values back into their containers (write_slots).
 */
#include "dcp.h"

/* DTensor.from_local(val, param.device_mesh, param.placements,
 *                    shape=pshape, run_check=False): a plain tensor that
 * already is the parameter's local shard, wrapped like the parameter.
 * Rare (D9 in docs/differences.md). */
static PyObject *
wrap_local_shard(dcp_state *st,
                 PyObject *val,
                 PyObject *param,
                 PyObject *pshape,
                 PyObject *from_local)
{
    PyObject *result = NULL;
    PyObject *args = NULL;
    PyObject *kwargs = NULL;
    PyObject *mesh = PyObject_GetAttr(param, st->str_device_mesh);
    PyObject *placements = PyObject_GetAttr(param, st->str_placements);
    if (mesh == NULL || placements == NULL) {
        goto error;
    }
    kwargs = Py_BuildValue("{sOsO}", "shape", pshape, "run_check", Py_False);
    if (kwargs == NULL) {
        goto error;
    }
    args = PyTuple_Pack(3, val, mesh, placements);
    if (args == NULL) {
        goto error;
    }
    result = PyObject_Call(from_local, args, kwargs);
error:
    Py_XDECREF(mesh);
    Py_XDECREF(placements);
    Py_XDECREF(kwargs);
    Py_XDECREF(args);
    return result;
}

/* The optimizer's current state tensor `held[key]` when it can stand as
 * the template of a full -> local load of that state (so that the loaded
 * shard may land in it, see plan_full_load's in_place): a DTensor on the
 * parameter's mesh with the parameter's placements.  New reference, NULL
 * with no error when it cannot, NULL with an error on failure. */
static PyObject *
held_state_template(dcp_state *st,
                    PyObject *held,
                    PyObject *key,
                    PyObject *param,
                    PyObject *dtensor_cls)
{
    PyObject *value = NULL, *a = NULL, *b = NULL;
    int ok = -1; /* -1 error, 0 no, 1 yes */
    if (!PyDict_Check(held)) {
        return NULL;
    }
    int found = dcp_dict_get_ref(held, key, &value);
    if (found <= 0) {
        return NULL; /* error set when found < 0 */
    }
    ok = PyObject_IsInstance(value, dtensor_cls);
    if (ok != 1) {
        goto done;
    }
    ok = -1;
    a = PyObject_GetAttr(value, st->str_device_mesh);
    b = a ? PyObject_GetAttr(param, st->str_device_mesh) : NULL;
    if (b == NULL || (ok = PyObject_RichCompareBool(a, b, Py_EQ)) != 1) {
        goto done;
    }
    ok = -1;
    Py_CLEAR(a);
    Py_CLEAR(b);
    a = PyObject_GetAttr(value, st->str_placements);
    b = a ? PyObject_GetAttr(param, st->str_placements) : NULL;
    if (b != NULL) {
        ok = PyObject_RichCompareBool(a, b, Py_EQ);
    }
done:
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (ok == 1) {
        return value;
    }
    Py_DECREF(value);
    return NULL; /* error set when ok < 0 */
}

/* The parameter's shape, device and (DTensors) local shape, as new
 * references (lshape stays NULL for plain parameters).  0 / -1. */
static int
param_geometry(dcp_state *st,
               PyObject *param,
               int param_dt,
               PyObject **pshape,
               PyObject **device,
               PyObject **lshape)
{
    *pshape = PyObject_GetAttr(param, st->str_shape);
    *device = *pshape ? PyObject_GetAttr(param, st->str_device) : NULL;
    if (*device == NULL) {
        return -1;
    }
    if (param_dt) {
        PyObject *local = PyObject_GetAttr(param, st->str_local_tensor);
        *lshape = local ? PyObject_GetAttr(local, st->str_shape) : NULL;
        Py_XDECREF(local);
        if (*lshape == NULL) {
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(dcp_optim_state_jobs__doc__,
             "optim_state_jobs(index, state, dtensor_cls, mode, from_local,"
             " existing=None, /)"
             "\n--\n\n"
             "Copy loaded optimizer state and list the tensors to localise.");

/* optim_state_jobs(index, state, dtensor_cls, mode, from_local
 *                  [, existing]) -> (new_state, jobs, slots, n_held)
 *
 * Copies the containers of a loaded optimizer `state` (fqn -> nested
 * dict) and lists the tensor leaves to localise for the parameters they
 * belong to:
 *   mode 0 (full loads): every leaf with a shape (tensors and stream
 *     metadata) except 0-dim ones; template = the parameter when it is a
 *     DTensor of the leaf's shape, else None (kept full); device = the
 *     parameter's (local) device.
 *   mode 1 (sharded loads, D9 in docs/differences.md): only plain
 *     tensors of DTensor parameters: of the parameter's global shape -> a
 *     slicing job; of its local shape -> wrapped here with from_local; any
 *     other shape -> ValueError naming the FQN and the state key.
 * slots[i] = (container, key) where jobs[i]'s result is to be stored.
 * existing (optional, mode 0): {fqn: the optimizer's current state dict};
 * where held_state_template accepts the current state tensor of a
 * top-level key, it is the job's template instead of the parameter (same
 * mesh and placements: the result is the same), so that an in-place load
 * can write the shard into it; n_held counts those jobs. */
static PyObject *
dcp_optim_state_jobs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if ((nargs != 6 && dcp_check_nargs("optim_state_jobs", nargs, 5) < 0) ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *state = args[1], *dtensor_cls = args[2], *from_local = args[4];
    PyObject *existing = nargs == 6 ? args[5] : Py_None;
    Py_ssize_t n_held = 0; /* jobs whose template is held state */
    if (existing != Py_None && !PyDict_Check(existing)) {
        PyErr_SetString(PyExc_TypeError, "existing must be a dict or None");
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)ix->ctx;
    long mode = PyLong_AsLong(args[3]);
    if (mode == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_Check(state)) {
        PyErr_SetString(PyExc_TypeError, "state must be a dict");
        return NULL;
    }
    PyObject *by_fqn = PyDict_New(), *new_state = PyDict_New();
    PyObject *jobs = PyList_New(0), *slots = PyList_New(0);
    PyObject *items = NULL, *result = NULL, *stack = NULL;
    if (!by_fqn || !new_state || !jobs || !slots) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < PyList_GET_SIZE(ix->tensors); t++) {
        PyObject *names = PyList_GET_ITEM(ix->tensor_fqns, t);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(names); j++) {
            if (PyDict_SetItem(by_fqn,
                               PyList_GET_ITEM(names, j),
                               PyList_GET_ITEM(ix->tensors, t)) < 0) {
                goto done;
            }
        }
    }
    items = dcp_items_list(st, state);
    if (items == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *fqn = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *entry = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        PyObject *param = NULL, *pshape = NULL, *lshape = NULL;
        PyObject *device = NULL, *held = NULL;
        int param_dt = 0, ok = 1;
        if (!PyDict_Check(entry)) {
            if (PyDict_SetItem(new_state, fqn, entry) < 0) {
                goto done;
            }
            continue;
        }
        int found = dcp_dict_get_ref(by_fqn, fqn, &param);
        if (found < 0) {
            goto done;
        }
        if (found && existing != Py_None &&
            dcp_dict_get_ref(existing, fqn, &held) < 0) {
            Py_DECREF(param);
            goto done;
        }
        if (found) {
            param_dt = PyObject_IsInstance(param, dtensor_cls);
            ok = param_dt >= 0;
            /* Sharded loads only convert plain tensors of DTensor
             * parameters: the parameter's shapes are read at the first
             * one (none in the DCP resume, all DTensors). */
            if (ok && mode == 0) {
                ok = param_geometry(
                         st, param, param_dt, &pshape, &device, &lshape) == 0;
            }
        }
        /* walk the entry (nested dicts), copying containers */
        PyObject *copy = ok ? PyDict_New() : NULL;
        ok = copy != NULL && PyDict_SetItem(new_state, fqn, copy) == 0;
        stack = ok ? Py_BuildValue("[(OO)]", entry, copy) : NULL;
        ok = stack != NULL;
        while (ok && PyList_GET_SIZE(stack) > 0) {
            Py_ssize_t top = PyList_GET_SIZE(stack) - 1;
            PyObject *pair = Py_NewRef(PyList_GET_ITEM(stack, top));
            ok = PyList_SetSlice(stack, top, top + 1, NULL) == 0;
            PyObject *src = PyTuple_GET_ITEM(pair, 0);
            PyObject *dst = PyTuple_GET_ITEM(pair, 1);
            PyObject *sub = ok ? dcp_items_list(st, src) : NULL;
            ok = sub != NULL;
            for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(sub); k++) {
                PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(sub, k), 0);
                PyObject *val = PyTuple_GET_ITEM(PyList_GET_ITEM(sub, k), 1);
                if (PyDict_Check(val)) {
                    PyObject *c2 = PyDict_New();
                    PyObject *p2 = c2 ? PyTuple_Pack(2, val, c2) : NULL;
                    ok = p2 && PyDict_SetItem(dst, key, c2) == 0 &&
                         PyList_Append(stack, p2) == 0;
                    Py_XDECREF(c2);
                    Py_XDECREF(p2);
                    continue;
                }
                ok = PyDict_SetItem(dst, key, val) == 0;
                if (!ok || !found) {
                    continue;
                }
                int is_tensor = PyObject_IsInstance(val, ctx->tensor_type);
                int is_meta = 0;
                if (is_tensor == 0 && mode == 0) {
                    /* stream metadata: anything with shape and dtype */
                    is_meta = PyObject_HasAttr(val, st->str_shape) &&
                              PyObject_HasAttr(val, st->str_dtype);
                }
                if (is_tensor < 0) {
                    ok = 0;
                    break;
                }
                if (!is_tensor && !is_meta) {
                    continue;
                }
                int val_dt =
                    is_tensor ? PyObject_IsInstance(val, dtensor_cls) : 0;
                if (val_dt < 0) {
                    ok = 0;
                    break;
                }
                if (val_dt || (mode == 1 && !param_dt)) {
                    continue; /* already sharded / nothing to shard */
                }
                PyObject *vshape = PyObject_GetAttr(val, st->str_shape);
                PyObject *vt = vshape ? PySequence_Tuple(vshape) : NULL;
                if (vt != NULL && mode == 1 && PyTuple_GET_SIZE(vt) == 0) {
                    Py_DECREF(vshape);
                    Py_DECREF(vt);
                    continue; /* a 0-dim value (`step`) is kept as is */
                }
                if (vt != NULL && pshape == NULL &&
                    param_geometry(
                        st, param, param_dt, &pshape, &device, &lshape) < 0) {
                    Py_CLEAR(vt);
                }
                PyObject *pt =
                    (vt && pshape) ? PySequence_Tuple(pshape) : NULL;
                Py_XDECREF(vshape);
                if (pt == NULL) {
                    Py_XDECREF(vt);
                    ok = 0;
                    break;
                }
                int global_match = PyObject_RichCompareBool(vt, pt, Py_EQ);
                int zero_dim = PyTuple_GET_SIZE(vt) == 0;
                PyObject *tmpl = NULL, *held_tmpl = NULL;
                if (mode == 0 && !zero_dim) {
                    tmpl = (param_dt && global_match == 1) ? param : Py_None;
                    if (tmpl == param && held != NULL && dst == copy) {
                        held_tmpl = held_state_template(
                            st, held, key, param, dtensor_cls);
                        ok = held_tmpl != NULL || !PyErr_Occurred();
                        tmpl = held_tmpl ? held_tmpl : tmpl;
                        n_held += held_tmpl != NULL;
                    }
                }
                else if (mode == 1 && param_dt && !zero_dim) {
                    if (global_match == 1) {
                        tmpl = param;
                    }
                    else {
                        PyObject *lt = PySequence_Tuple(lshape);
                        int local_match =
                            lt ? PyObject_RichCompareBool(vt, lt, Py_EQ) : -1;
                        Py_XDECREF(lt);
                        if (local_match == 1) {
                            PyObject *wrapped = wrap_local_shard(
                                st, val, param, pshape, from_local);
                            ok = wrapped != NULL &&
                                 PyDict_SetItem(dst, key, wrapped) == 0;
                            Py_XDECREF(wrapped);
                        }
                        else if (local_match == 0) {
                            PyErr_Format(st->err_value,
                                         "optimizer state '%S' of parameter "
                                         "'%S' has shape %R, which is neither "
                                         "the parameter's global shape %R "
                                         "nor its local shard's %R",
                                         key,
                                         fqn,
                                         vt,
                                         pt,
                                         lshape);
                            ok = 0;
                        }
                        else {
                            ok = 0;
                        }
                    }
                }
                if (ok && global_match < 0) {
                    ok = 0;
                }
                if (ok && tmpl != NULL) {
                    PyObject *job = PyTuple_Pack(3, val, tmpl, device);
                    PyObject *slot = job ? PyTuple_Pack(2, dst, key) : NULL;
                    ok = slot && PyList_Append(jobs, job) == 0 &&
                         PyList_Append(slots, slot) == 0;
                    Py_XDECREF(job);
                    Py_XDECREF(slot);
                }
                Py_XDECREF(held_tmpl);
                Py_DECREF(vt);
                Py_DECREF(pt);
            }
            Py_XDECREF(sub);
            Py_DECREF(pair);
        }
        Py_CLEAR(stack);
        Py_XDECREF(copy);
        Py_XDECREF(param);
        Py_XDECREF(held);
        Py_XDECREF(pshape);
        Py_XDECREF(lshape);
        Py_XDECREF(device);
        if (!ok) {
            dcp_note_format("while loading optimizer state of '%S'", fqn);
            goto done;
        }
    }
    result = Py_BuildValue("(OOOn)", new_state, jobs, slots, n_held);
done:
    Py_XDECREF(by_fqn);
    Py_XDECREF(new_state);
    Py_XDECREF(jobs);
    Py_XDECREF(slots);
    Py_XDECREF(items);
    Py_XDECREF(stack);
    return result;
}

PyDoc_STRVAR(dcp_write_slots__doc__,
             "write_slots(slots, values, /)\n--\n\n"
             "container[key] = value for each slot.");

/* write_slots(slots, values): container[key] = value for each pair. */
static PyObject *
dcp_write_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("write_slots", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *slots = dcp_sequence_fast(args[0], "slots");
    PyObject *values = slots ? dcp_sequence_fast(args[1], "values") : NULL;
    if (values == NULL) {
        Py_XDECREF(slots);
        return NULL;
    }
    int ok =
        PySequence_Fast_GET_SIZE(slots) == PySequence_Fast_GET_SIZE(values);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "one value per slot");
    }
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(slots); i++) {
        PyObject *slot = PySequence_Fast_GET_ITEM(slots, i);
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        ok = PyTuple_Check(slot) && PyTuple_GET_SIZE(slot) == 2 &&
             value != Py_None &&
             PyObject_SetItem(PyTuple_GET_ITEM(slot, 0),
                              PyTuple_GET_ITEM(slot, 1),
                              value) == 0;
        if (!ok && !PyErr_Occurred() && value != Py_None) {
            PyErr_SetString(PyExc_TypeError, "slots are (container, key)");
        }
        if (!ok && value == Py_None && !PyErr_Occurred()) {
            ok = 1; /* not needed on this rank */
        }
    }
    Py_DECREF(slots);
    Py_DECREF(values);
    if (!ok) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(
    dcp_broadcast_jobs__doc__,
    "broadcast_jobs(meta, full, local, device, dtensor_cls, tensor_cls, /)"
    "\n--\n\n"
    "The work list of a model broadcast.");

/* broadcast_jobs(meta, full, local, device, dtensor_cls, tensor_cls)
 *   -> (keys, jobs, non_tensor)
 *
 * A model broadcast's work list from the metadata every rank received:
 * for each key whose metadata describes a tensor with a shape, the job
 * (full tensor on the source / metadata elsewhere, template, device):
 * template is the local DTensor (keep my shard), None (keep the full
 * tensor) or False (this rank has no such key: receive, do not keep).
 * Other values (and 0-dim tensors, which travel in the metadata) are
 * returned in non_tensor as (key, value). */
static PyObject *
dcp_broadcast_jobs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("broadcast_jobs", nargs, 6) < 0) {
        return NULL;
    }
    PyObject *meta = args[0], *full = args[1], *local = args[2];
    PyObject *device = args[3], *dtensor_cls = args[4], *tensor_cls = args[5];
    if (!PyDict_Check(meta) || !PyDict_Check(local) ||
        (full != Py_None && !PyDict_Check(full))) {
        PyErr_SetString(PyExc_TypeError, "broadcast_jobs needs dicts");
        return NULL;
    }
    PyObject *items = dcp_items_list(st, meta);
    PyObject *keys = PyList_New(0), *jobs = PyList_New(0);
    PyObject *plain = PyList_New(0), *result = NULL;
    if (!items || !keys || !jobs || !plain) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *key = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
        PyObject *v = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 1);
        int is_tensor = PyObject_IsInstance(v, tensor_cls);
        if (is_tensor < 0) {
            goto done;
        }
        int is_meta = !is_tensor && PyTuple_Check(v) &&
                      PyObject_HasAttr(v, st->str_shape) &&
                      PyObject_HasAttr(v, st->str_dtype);
        if (!is_meta) {
            PyObject *pair = PyTuple_Pack(2, key, v);
            if (pair == NULL || PyList_Append(plain, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
            continue;
        }
        PyObject *value = v, *lv = NULL, *tmpl, *dev;
        if (full != Py_None) {
            int found = dcp_dict_get_ref(full, key, &value);
            if (found <= 0) {
                if (found == 0) {
                    PyErr_SetObject(st->err_key, key);
                }
                goto done;
            }
        }
        else {
            Py_INCREF(value);
        }
        int has = dcp_dict_get_ref(local, key, &lv);
        int is_dt = has > 0 ? PyObject_IsInstance(lv, dtensor_cls) : 0;
        if (has < 0 || is_dt < 0) {
            Py_DECREF(value);
            Py_XDECREF(lv);
            goto done;
        }
        if (has == 0 || lv == Py_None) {
            tmpl = Py_False;
            dev = Py_NewRef(device);
        }
        else {
            int lv_tensor = PyObject_IsInstance(lv, tensor_cls);
            /* a plain meta tensor (loaded with assign=True) receives its
             * data on the load's device, as upstream's broadcast */
            int lv_meta = 0;
            if (lv_tensor > 0 && !is_dt) {
                PyObject *flag = PyObject_GetAttr(lv, st->str_is_meta);
                lv_meta = flag ? PyObject_IsTrue(flag) : -1;
                Py_XDECREF(flag);
            }
            if (lv_tensor < 0 || lv_meta < 0) {
                Py_DECREF(value);
                Py_DECREF(lv);
                goto done;
            }
            tmpl = is_dt ? lv : (lv_tensor > 0 ? Py_None : Py_False);
            dev = lv_tensor > 0 && !lv_meta
                      ? PyObject_GetAttr(lv, st->str_device)
                      : Py_NewRef(device);
        }
        PyObject *job = dev ? PyTuple_Pack(3, value, tmpl, dev) : NULL;
        Py_XDECREF(dev);
        Py_DECREF(value);
        Py_XDECREF(lv);
        if (job == NULL || PyList_Append(jobs, job) < 0 ||
            PyList_Append(keys, key) < 0) {
            Py_XDECREF(job);
            goto done;
        }
        Py_DECREF(job);
    }
    result = PyTuple_Pack(3, keys, jobs, plain);
done:
    Py_XDECREF(items);
    Py_XDECREF(keys);
    Py_XDECREF(jobs);
    Py_XDECREF(plain);
    return result;
}

PyDoc_STRVAR(dcp_shape_mismatches__doc__,
             "shape_mismatches(jobs, tensor_cls, /)\n--\n\n"
             "Jobs whose template tensor has another shape than the value.");

/* shape_mismatches(jobs, tensor_cls) -> [(i, job shape, template shape)]
 * for jobs whose template (a tensor) has another shape than the value. */
static PyObject *
dcp_shape_mismatches(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("shape_mismatches", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *jobs = dcp_sequence_fast(args[0], "jobs");
    if (jobs == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < PySequence_Fast_GET_SIZE(jobs); i++) {
        PyObject *job = PySequence_Fast_GET_ITEM(jobs, i);
        if (!PyTuple_Check(job) || PyTuple_GET_SIZE(job) != 3) {
            PyErr_SetString(PyExc_TypeError,
                            "jobs are (value, template, device)");
            Py_CLEAR(out);
            break;
        }
        PyObject *tmpl = PyTuple_GET_ITEM(job, 1);
        int is_t = PyObject_IsInstance(tmpl, args[1]);
        if (is_t <= 0) {
            if (is_t < 0) {
                Py_CLEAR(out);
            }
            continue;
        }
        PyObject *a =
            PyObject_GetAttr(PyTuple_GET_ITEM(job, 0), st->str_shape);
        PyObject *b = a ? PyObject_GetAttr(tmpl, st->str_shape) : NULL;
        PyObject *at = b ? PySequence_Tuple(a) : NULL;
        PyObject *bt = at ? PySequence_Tuple(b) : NULL;
        int eq = bt ? PyObject_RichCompareBool(at, bt, Py_EQ) : -1;
        PyObject *entry = eq == 0 ? Py_BuildValue("(nOO)", i, at, bt) : NULL;
        if (eq < 0 ||
            (eq == 0 && (entry == NULL || PyList_Append(out, entry) < 0))) {
            Py_CLEAR(out);
        }
        Py_XDECREF(entry);
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_XDECREF(at);
        Py_XDECREF(bt);
    }
    Py_DECREF(jobs);
    return out;
}

PyMethodDef dcp_load_jobs_methods[] = {
    {"optim_state_jobs",
     DCP_FASTCALL(dcp_optim_state_jobs),
     METH_FASTCALL,
     dcp_optim_state_jobs__doc__},
    {"write_slots",
     DCP_FASTCALL(dcp_write_slots),
     METH_FASTCALL,
     dcp_write_slots__doc__},
    {"broadcast_jobs",
     DCP_FASTCALL(dcp_broadcast_jobs),
     METH_FASTCALL,
     dcp_broadcast_jobs__doc__},
    {"shape_mismatches",
     DCP_FASTCALL(dcp_shape_mismatches),
     METH_FASTCALL,
     dcp_shape_mismatches__doc__},
    {NULL, NULL, 0, NULL},
};
