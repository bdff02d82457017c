/* Full -> local loads: every rank holds the full tensors, or rank 0
 * streams them in buckets of dim-0 row chunks.  Plans the destinations
 * (this rank's shard of each DTensor template, a full tensor, the
 * caller's own destination, or in place into the template's local tensor)
 * and the stream buckets (plan_full_load), and wraps the loaded shards as
 * DTensors like their templates (finish_full_load).
 */
#include "dcp.h"

/* ----------------------------------------------------------------------
 * Full -> local loads (every rank holds the full tensors, or rank 0
 * streams them in buckets)
 */

/* My coordinate in `mesh` (cached per mesh in `cache`, a dict keyed by
 * the mesh object), as a tuple; also the mesh shape.  0 / -1. */
static int
mesh_info(PyObject *cache, PyObject *mesh, PyObject **coord, PyObject **shape)
{
    PyObject *entry = NULL;
    int found = dcp_dict_get_ref(cache, mesh, &entry);
    if (found < 0) {
        return -1;
    }
    if (!found) {
        PyObject *c = PyObject_CallMethod(
            mesh, "get_coordinate", NULL); /* cpylint-ignore: once per mesh */
        PyObject *s = c ? PyObject_GetAttrString(mesh, "shape")
                        : NULL; /* cpylint-ignore: once per mesh */
        if (c != NULL && c == Py_None) {
            PyErr_SetString(PyExc_ValueError,
                            "this rank is not part of the tensor's device "
                            "mesh");
        }
        entry = (c && s && c != Py_None) ? PyTuple_Pack(2, c, s) : NULL;
        Py_XDECREF(c);
        Py_XDECREF(s);
        if (entry == NULL || PyDict_SetItem(cache, mesh, entry) < 0) {
            Py_XDECREF(entry);
            return -1;
        }
    }
    *coord = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
    *shape = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    Py_DECREF(entry);
    return 0;
}

/* Layout (local_shape, blocks) of DTensor `tmpl` on this rank, for a
 * full tensor of shape `gshape_obj`. */
static PyObject *
my_layout(dcp_state *st,
          PyObject *cache,
          PyObject *tmpl,
          PyObject *gshape_obj,
          PyObject *classes)
{
    PyObject *mesh = PyObject_GetAttr(tmpl, st->str_device_mesh);
    PyObject *pls = mesh ? PyObject_GetAttr(tmpl, st->str_placements) : NULL;
    PyObject *coord = NULL, *mshape_obj = NULL, *result = NULL;
    if (pls == NULL || mesh_info(cache, mesh, &coord, &mshape_obj) < 0) {
        goto done;
    }
    Py_ssize_t gshape[DCP_MAX_DIMS], mshape[DCP_MAX_DIMS], c[DCP_MAX_DIMS];
    Py_ssize_t ndim, mdim, cdim;
    placement_t pl[DCP_MAX_DIMS];
    if (dcp_parse_shape(gshape_obj, gshape, &ndim, "shape") < 0 ||
        dcp_parse_shape(mshape_obj, mshape, &mdim, "mesh shape") < 0 ||
        dcp_parse_shape(coord, c, &cdim, "coordinate") < 0) {
        goto done;
    }
    PyObject *seq = dcp_sequence_fast(pls, "placements");
    if (seq == NULL) {
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(seq) != mdim || cdim != mdim) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError,
                        "DTensor placements do not match its mesh");
        goto done;
    }
    int ok = 1;
    for (Py_ssize_t m = 0; ok && m < mdim; m++) {
        ok = dcp_encode_placement(
                 PySequence_Fast_GET_ITEM(seq, m), classes, &pl[m]) == 0;
    }
    Py_DECREF(seq);
    if (ok) {
        for (Py_ssize_t m = 0; m < mdim; m++) {
            if (pl[m].kind == PL_PARTIAL) {
                pl[m].kind = PL_REPLICATE; /* loads hold full values */
            }
        }
        result = dcp_shard_layout(gshape, ndim, mshape, mdim, c, pl);
    }
done:
    Py_XDECREF(mesh);
    Py_XDECREF(pls);
    Py_XDECREF(coord);
    Py_XDECREF(mshape_obj);
    return result;
}

/* The live local tensor of DTensor `tmpl` when a load may write this
 * rank's shard straight into it: of shape `dest_shape`, dtype `dtype`
 * (the bytes are copied as they are) and device `device`, and contiguous.
 * New reference, NULL with no error set when it may not, NULL with an
 * error on failure. */
static PyObject *
in_place_dest(dcp_state *st,
              PyObject *tmpl,
              PyObject *dest_shape,
              PyObject *dtype,
              PyObject *device)
{
    PyObject *attr = NULL;
    int ok = -1; /* -1 error, 0 no, 1 yes */
    PyObject *local = PyObject_GetAttr(tmpl, st->str_local_tensor);
    if (local == NULL) {
        goto done;
    }
    attr = PyObject_GetAttr(local, st->str_shape);
    if (attr == NULL ||
        (ok = PyObject_RichCompareBool(attr, dest_shape, Py_EQ)) != 1) {
        goto done;
    }
    ok = -1;
    Py_SETREF(attr, PyObject_GetAttr(local, st->str_dtype));
    if (attr == NULL ||
        (ok = PyObject_RichCompareBool(attr, dtype, Py_EQ)) != 1) {
        goto done;
    }
    ok = -1;
    Py_SETREF(attr, PyObject_GetAttr(local, st->str_device));
    if (attr == NULL ||
        (ok = PyObject_RichCompareBool(attr, device, Py_EQ)) != 1) {
        goto done;
    }
    Py_SETREF(attr, PyObject_CallMethodNoArgs(local, st->str_is_contiguous));
    ok = attr == NULL ? -1 : PyObject_IsTrue(attr);
done:
    Py_XDECREF(attr);
    if (ok == 1) {
        return local;
    }
    Py_XDECREF(local);
    return NULL; /* with an error set when ok < 0 */
}

PyDoc_STRVAR(
    dcp_plan_full_load__doc__,
    "plan_full_load(jobs, dtensor_cls, classes, budget, empty, stream,"
    " in_place=False, /)"
    "\n--\n\n"
    "Destinations, layouts and stream buckets for a full -> local load.");

/* plan_full_load(jobs, dtensor_cls, classes, budget, empty, stream
 *                [, in_place]) -> (dests, layouts, buckets)
 *
 * in_place (default False): a DTensor template's shard is written straight
 * into the template's own local tensor where in_place_dest allows (the
 * caller has validated the whole load first: the model changes only once
 * the data arrives, as upstream's loads do, without a second copy of the
 * shards).
 *
 * jobs: [(value, template, device)] -- value is the full tensor (or, on
 * receiving ranks of a stream, any object with .shape and .dtype);
 * template is a DTensor (keep this rank's shard of it), None (keep the
 * full value), False (not needed here) or (dest, blocks): copy the blocks
 * (local <- global) of the value into the given dest tensor (several jobs
 * may share one dest: FSDP1 flat shards); device is where results live.
 * dests[i]: the tensor job i's data lands in (a fresh local shard or full
 * tensor), or None for jobs a receiver does not need (template None and
 * stream=False never happens: those are the value itself).
 * stream=False: every rank holds the full values; dests are filled here
 * by local slicing and buckets is empty.
 * stream=True: buckets = [(nbytes, src_items, dst_items)] with
 *   src_items [(job, row_start, rows, offset)] to pack on the source and
 *   dst_items (offset, nbytes, dtype, chunk_shape, row_start, job,
 *   blocks|None) for extract_rows once `job` is replaced by dests[job]. */
static PyObject *
dcp_plan_full_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (nargs != 7 && dcp_check_nargs("plan_full_load", nargs, 6) < 0) {
        return NULL;
    }
    int in_place = nargs == 7 ? PyObject_IsTrue(args[6]) : 0;
    if (in_place < 0) {
        return NULL;
    }
    PyObject *dtensor_cls = args[1], *classes = args[2], *empty = args[4];
    Py_ssize_t budget = PyLong_AsSsize_t(args[3]);
    if (budget == -1 && PyErr_Occurred()) {
        return NULL; /* before IsTrue: it may run Python code */
    }
    int stream = PyObject_IsTrue(args[5]);
    if (stream < 0) {
        return NULL;
    }
    if (!PyTuple_Check(classes) || PyTuple_GET_SIZE(classes) != 3) {
        PyErr_SetString(PyExc_TypeError, "bad placement classes");
        return NULL;
    }
    PyObject *jobs = dcp_sequence_fast(args[0], "jobs must be a sequence");
    if (jobs == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(jobs);
    PyObject *dests = PyList_New(n), *layouts = PyList_New(n);
    PyObject *buckets = PyList_New(0), *cache = PyDict_New();
    PyObject *src_items = NULL, *dst_items = NULL, *result = NULL;
    Py_ssize_t used = 0;
    if (!dests || !layouts || !buckets || !cache) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(dests, i, Py_NewRef(Py_None));
        PyList_SET_ITEM(layouts, i, Py_NewRef(Py_None));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value, *tmpl, *device;
        if (!dcp_parse_tuple(PySequence_Fast_GET_ITEM(jobs, i),
                             "OOO",
                             &value,
                             &tmpl,
                             &device)) {
            goto done;
        }
        PyObject *shape = PyObject_GetAttr(value, st->str_shape);
        PyObject *dtype =
            shape ? PyObject_GetAttr(value, st->str_dtype) : NULL;
        PyObject *isz =
            dtype ? PyObject_GetAttrString(
                        dtype, "itemsize") /* cpylint-ignore: per job */
                  : NULL;
        Py_ssize_t itemsize = isz ? PyLong_AsSsize_t(isz) : -1;
        Py_XDECREF(isz);
        PyObject *shape_t = shape ? PySequence_Tuple(shape) : NULL;
        Py_XDECREF(shape);
        int ok = shape_t != NULL && itemsize > 0;
        if (!ok && !PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError,
                            "plan_full_load: dtype.itemsize must be positive");
        }
        int is_dt = 0;
        int needed = tmpl != Py_False;
        /* (dest, blocks): the caller's own destination and layout */
        int explicit = PyTuple_Check(tmpl) && PyTuple_GET_SIZE(tmpl) == 2;
        if (ok && needed && tmpl != Py_None && !explicit) {
            is_dt = PyObject_IsInstance(tmpl, dtensor_cls);
            ok = is_dt >= 0;
        }
        PyObject *layout = NULL, *dest_shape = NULL, *blocks = Py_None;
        if (ok && explicit) {
            blocks = PyTuple_GET_ITEM(tmpl, 1);
        }
        else if (ok && is_dt) {
            layout = my_layout(st, cache, tmpl, shape_t, classes);
            ok = layout != NULL;
            if (ok) {
                dest_shape = PyTuple_GET_ITEM(layout, 0);
                blocks = PyTuple_GET_ITEM(layout, 1);
                ok = PyList_SetItem(layouts, i, Py_NewRef(layout)) == 0;
            }
        }
        else if (ok) {
            dest_shape = shape_t;
        }
        /* allocate the destination */
        PyObject *dest = NULL;
        if (ok && explicit) {
            dest = Py_NewRef(PyTuple_GET_ITEM(tmpl, 0));
        }
        else if (ok && is_dt && in_place) {
            dest = in_place_dest(st, tmpl, dest_shape, dtype, device);
            ok = dest != NULL || !PyErr_Occurred();
        }
        if (ok && needed && dest == NULL) {
            PyObject *kw =
                Py_BuildValue("{sOsO}", "dtype", dtype, "device", device);
            PyObject *a = kw ? PyTuple_Pack(1, dest_shape) : NULL;
            dest = a ? PyObject_Call(empty, a, kw) : NULL;
            Py_XDECREF(kw);
            Py_XDECREF(a);
            ok = dest != NULL;
        }
        if (ok && needed && !stream) {
            /* local slicing from the full value this rank holds */
            PyObject *none = NULL;
            if (is_dt || explicit) {
                PyObject *dir = PyLong_FromLong(1);
                PyObject *cb[5] = {dest, value, blocks, dir, Py_None};
                none = dir ? dcp_copy_blocks(module, cb, 5) : NULL;
                Py_XDECREF(dir);
            }
            else {
                none = dcp_copy_into(st, dest, value) == 0 ? Py_NewRef(Py_None)
                                                           : NULL;
            }
            ok = none != NULL;
            Py_XDECREF(none);
        }
        if (ok && needed) {
            ok = PyList_SetItem(dests, i, dest) == 0; /* steals dest */
            dest = NULL;
        }
        Py_XDECREF(dest);
        /* stream plan: row chunks in buckets */
        Py_ssize_t nd = ok ? PyTuple_GET_SIZE(shape_t) : 0;
        Py_ssize_t rows =
            nd ? PyLong_AsSsize_t(PyTuple_GET_ITEM(shape_t, 0)) : 1;
        Py_ssize_t row_bytes = itemsize;
        for (Py_ssize_t d = 1; ok && d < nd; d++) {
            Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape_t, d));
            if (dim < 0 || (dim > 0 && row_bytes > PY_SSIZE_T_MAX / dim)) {
                ok = 0; /* no exception is carried past this point */
                break;
            }
            row_bytes *= dim;
        }
        if (ok && rows < 0) {
            ok = 0;
        }
        if (!ok && !PyErr_Occurred() && shape_t != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "plan_full_load: bad tensor shape %R",
                         shape_t);
        }
        Py_ssize_t per_chunk = row_bytes > 0 ? budget / row_bytes : rows;
        if (per_chunk < 1) {
            per_chunk = 1; /* a row larger than a bucket travels alone */
        }
        for (Py_ssize_t r0 = 0; ok && stream && r0 < rows; r0 += per_chunk) {
            Py_ssize_t nr = rows - r0 < per_chunk ? rows - r0 : per_chunk;
            Py_ssize_t nbytes = nr * row_bytes;
            Py_ssize_t need = dcp_align_up(nbytes);
            if (src_items != NULL && used + need > budget &&
                PyList_GET_SIZE(src_items) > 0) {
                PyObject *b =
                    Py_BuildValue("(nOO)", used, src_items, dst_items);
                ok = b != NULL && PyList_Append(buckets, b) == 0;
                Py_XDECREF(b);
                Py_CLEAR(src_items);
                Py_CLEAR(dst_items);
                used = 0;
            }
            if (ok && src_items == NULL) {
                src_items = PyList_New(0);
                dst_items = PyList_New(0);
                ok = src_items && dst_items;
            }
            PyObject *cshape = NULL;
            if (ok) {
                if (nd) {
                    PyObject *l = PySequence_List(shape_t);
                    PyObject *nro = l ? PyLong_FromSsize_t(nr) : NULL;
                    ok = nro && PyList_SetItem(l, 0, nro) == 0;
                    cshape = ok ? PyList_AsTuple(l) : NULL;
                    Py_XDECREF(l);
                }
                else {
                    cshape = PyTuple_New(0);
                }
                ok = cshape != NULL;
            }
            if (ok) {
                PyObject *si = Py_BuildValue(
                    "(nnnn)", i, nd ? r0 : (Py_ssize_t)-1, nr, used);
                PyObject *di = Py_BuildValue(
                    "(nnOOnnO)", used, nbytes, dtype, cshape, r0, i, blocks);
                ok = si && di && PyList_Append(src_items, si) == 0 &&
                     PyList_Append(dst_items, di) == 0;
                Py_XDECREF(si);
                Py_XDECREF(di);
            }
            Py_XDECREF(cshape);
            used += need;
        }
        Py_XDECREF(layout);
        Py_XDECREF(shape_t);
        Py_XDECREF(dtype);
        if (!ok) {
            dcp_note_format("while planning the load of tensor %zd", i);
            goto done;
        }
    }
    if (src_items != NULL && PyList_GET_SIZE(src_items) > 0) {
        PyObject *b = Py_BuildValue("(nOO)", used, src_items, dst_items);
        if (b == NULL || PyList_Append(buckets, b) < 0) {
            Py_XDECREF(b);
            goto done;
        }
        Py_DECREF(b);
    }
    result = PyTuple_Pack(3, dests, layouts, buckets);
done:
    Py_DECREF(jobs);
    Py_XDECREF(dests);
    Py_XDECREF(layouts);
    Py_XDECREF(buckets);
    Py_XDECREF(cache);
    Py_XDECREF(src_items);
    Py_XDECREF(dst_items);
    return result;
}

PyDoc_STRVAR(dcp_finish_full_load__doc__,
             "finish_full_load(jobs, dests, layouts, from_local, offload, /)"
             "\n--\n\n"
             "Wrap loaded shards as DTensors like their templates.");

/* finish_full_load(jobs, dests, layouts, from_local, offload) -> values
 *
 * The loaded value of each job: DTensor.from_local(dest, mesh,
 * placements, shape=, stride=) for DTensor templates, else dest; moved to
 * `offload` when it is not None (plain results only). */
static PyObject *
dcp_finish_full_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("finish_full_load", nargs, 5) < 0) {
        return NULL;
    }
    PyObject *jobs = dcp_sequence_fast(args[0], "jobs");
    PyObject *dests = jobs ? dcp_sequence_fast(args[1], "dests") : NULL;
    PyObject *layouts = dests ? dcp_sequence_fast(args[2], "layouts") : NULL;
    PyObject *from_local = args[3], *offload = args[4];
    PyObject *out = NULL;
    if (layouts == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(jobs);
    if (PySequence_Fast_GET_SIZE(dests) != n ||
        PySequence_Fast_GET_SIZE(layouts) != n) {
        PyErr_Format(PyExc_ValueError,
                     "finish_full_load: %zd jobs but %zd dests and %zd "
                     "layouts",
                     n,
                     PySequence_Fast_GET_SIZE(dests),
                     PySequence_Fast_GET_SIZE(layouts));
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *job = PySequence_Fast_GET_ITEM(jobs, i);
        PyObject *tmpl = PyTuple_Check(job) && PyTuple_GET_SIZE(job) == 3
                             ? PyTuple_GET_ITEM(job, 1)
                             : NULL;
        PyObject *dest = PySequence_Fast_GET_ITEM(dests, i);
        PyObject *value = NULL;
        if (tmpl == NULL) {
            PyErr_SetString(PyExc_TypeError,
                            "jobs are (value, template, device)");
        }
        else if (dest == Py_None) {
            value = Py_NewRef(Py_None);
        }
        else if (PySequence_Fast_GET_ITEM(layouts, i) != Py_None) {
            PyObject *mesh = PyObject_GetAttr(tmpl, st->str_device_mesh);
            PyObject *pls =
                mesh ? PyObject_GetAttr(tmpl, st->str_placements) : NULL;
            PyObject *shape =
                pls ? PyObject_GetAttr(tmpl, st->str_shape) : NULL;
            PyObject *stride = shape
                                   ? PyObject_CallMethod(
                                         tmpl,
                                         "stride",
                                         NULL) /* cpylint-ignore: per tensor */
                                   : NULL;
            PyObject *kw = stride ? Py_BuildValue("{sOsOsO}",
                                                  "shape",
                                                  shape,
                                                  "stride",
                                                  stride,
                                                  "run_check",
                                                  Py_False)
                                  : NULL;
            PyObject *a = kw ? PyTuple_Pack(3, dest, mesh, pls) : NULL;
            value = a ? PyObject_Call(from_local, a, kw) : NULL;
            if (value != NULL && offload != Py_None) {
                PyObject *call[2] = {value, offload};
                Py_SETREF(value,
                          PyObject_VectorcallMethod(
                              st->str_to,
                              call,
                              2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                              NULL));
            }
            Py_XDECREF(mesh);
            Py_XDECREF(pls);
            Py_XDECREF(shape);
            Py_XDECREF(stride);
            Py_XDECREF(kw);
            Py_XDECREF(a);
        }
        else if (offload != Py_None) {
            PyObject *call[2] = {dest, offload};
            value = PyObject_VectorcallMethod(
                st->str_to, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        else {
            value = Py_NewRef(dest);
        }
        if (value == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, value);
    }
done:
    Py_XDECREF(jobs);
    Py_XDECREF(dests);
    Py_XDECREF(layouts);
    return out;
}

PyMethodDef dcp_full_load_methods[] = {
    {"plan_full_load",
     DCP_FASTCALL(dcp_plan_full_load),
     METH_FASTCALL,
     dcp_plan_full_load__doc__},
    {"finish_full_load",
     DCP_FASTCALL(dcp_finish_full_load),
     METH_FASTCALL,
     dcp_finish_full_load__doc__},
    {NULL, NULL, 0, NULL},
};
