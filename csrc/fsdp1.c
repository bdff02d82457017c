/* FSDP1 flat parameters <-> original parameters.
 *
 * FSDP1 (FullyShardedDataParallel) flattens the parameters of a wrapped
 * module into one FlatParameter: the original parameters, flattened, one
 * after the other (with alignment padding entries where FSDP inserts them),
 * padded at the end to a multiple of the world size, and split into equal
 * shards, one per rank.  The optimizer sees either the FlatParameter (state:
 * one 1-D tensor of the shard's size per state name) or, with
 * use_orig_params=True, each original parameter's piece of this rank's
 * shard (state: 1-D tensors of the piece's size).
 *
 * Everything here is pure index arithmetic on the FlatParameter's metadata
 * (_numels_with_padding, _is_padding_mask, _shapes) and the shard size;
 * the data moves through torch ops (narrow, view, copy_) called from here
 * and through the bucketed collectives of the Python layer.
 */
#include "dcp.h"

/* Parses (numels_with_padding, is_padding_mask, shapes) into the offset
 * and numel of each real (non-padding) parameter in the unsharded flat
 * tensor.  Returns the number of real parameters, or -1. */
static Py_ssize_t
flat_layout(PyObject *numels_obj,
            PyObject *mask_obj,
            Py_ssize_t **offsets,
            Py_ssize_t **numels)
{
    PyObject *numels_seq = dcp_sequence_fast(numels_obj, "numels");
    PyObject *mask_seq =
        numels_seq ? dcp_sequence_fast(mask_obj, "mask") : NULL;
    Py_ssize_t n = -1;
    *offsets = *numels = NULL;
    if (mask_seq == NULL) {
        goto done;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(numels_seq);
    if (PySequence_Fast_GET_SIZE(mask_seq) != total) {
        PyErr_SetString(PyExc_ValueError,
                        "FlatParameter metadata: numels and padding mask "
                        "differ in length");
        goto done;
    }
    *offsets = PyMem_Calloc((size_t)total + 1, sizeof(Py_ssize_t));
    *numels = PyMem_Calloc((size_t)total + 1, sizeof(Py_ssize_t));
    if (*offsets == NULL || *numels == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t pos = 0, real = 0;
    for (Py_ssize_t i = 0; i < total; i++) {
        Py_ssize_t k =
            PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(numels_seq, i));
        /* no call into Python (__bool__) with the error of k pending */
        int pad = (k == -1 && PyErr_Occurred())
                      ? -1
                      : PyObject_IsTrue(PySequence_Fast_GET_ITEM(mask_seq, i));
        if (pad < 0) {
            goto done;
        }
        if (k < 0) {
            PyErr_SetString(PyExc_ValueError, "negative numel");
            goto done;
        }
        if (k > PY_SSIZE_T_MAX - pos) {
            PyErr_SetString(PyExc_OverflowError,
                            "FlatParameter metadata: numels overflow");
            goto done;
        }
        if (!pad) {
            (*offsets)[real] = pos;
            (*numels)[real] = k;
            real++;
        }
        pos += k;
    }
    n = real;
done:
    if (n < 0) {
        PyMem_Free(*offsets);
        PyMem_Free(*numels);
        *offsets = *numels = NULL;
    }
    Py_XDECREF(numels_seq);
    Py_XDECREF(mask_seq);
    return n;
}

static PyObject *
narrow1d(dcp_state *st, PyObject *tensor, Py_ssize_t start, Py_ssize_t length)
{
    PyObject *dim = PyLong_FromLong(0);
    PyObject *a = dim ? PyLong_FromSsize_t(start) : NULL;
    PyObject *n = a ? PyLong_FromSsize_t(length) : NULL;
    PyObject *result = NULL;
    if (n != NULL) {
        PyObject *args[4] = {tensor, dim, a, n};
        result = PyObject_VectorcallMethod(
            st->str_narrow, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    Py_XDECREF(dim);
    Py_XDECREF(a);
    Py_XDECREF(n);
    return result;
}

PyDoc_STRVAR(
    dcp_flat_unflatten__doc__,
    "flat_unflatten(full, numels_with_padding, is_padding_mask, shapes, /)"
    "\n--\n\n"
    "Views of the original parameters in an unsharded FSDP1 flat tensor.");

/* flat_unflatten(full, numels_with_padding, is_padding_mask, shapes)
 *   -> [view of each original parameter]
 *
 * `full` is the unsharded flat tensor (possibly longer: the end padding
 * is ignored); views follow FlatParameter._get_unflat_views_aligned. */
static PyObject *
dcp_flat_unflatten(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    Py_ssize_t *offsets = NULL, *numels = NULL;
    PyObject *shapes = NULL, *out = NULL;
    if (dcp_check_nargs("flat_unflatten", nargs, 4) < 0) {
        return NULL;
    }
    Py_ssize_t n = flat_layout(args[1], args[2], &offsets, &numels);
    if (n < 0) {
        return NULL;
    }
    shapes = dcp_sequence_fast(args[3], "shapes");
    if (shapes == NULL) {
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(shapes) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "FlatParameter metadata: one shape per parameter");
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *piece = narrow1d(st, args[0], offsets[i], numels[i]);
        PyObject *view =
            piece
                ? dcp_call_method1(
                      st->str_view, piece, PySequence_Fast_GET_ITEM(shapes, i))
                : NULL;
        Py_XDECREF(piece);
        if (view == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, view);
    }
done:
    PyMem_Free(offsets);
    PyMem_Free(numels);
    Py_XDECREF(shapes);
    return out;
}

PyDoc_STRVAR(
    dcp_flat_pieces__doc__,
    "flat_pieces(numels_with_padding, is_padding_mask, shard_numel, rank, /)"
    "\n--\n\n"
    "(param, param start, shard start, length) of a rank's FSDP1 shard.");

/* flat_pieces(numels_with_padding, is_padding_mask, shard_numel, rank)
 *   -> [(param index, start in param, start in shard, length)]
 *
 * The pieces of the original parameters that the shard of `rank` holds
 * (the shard covers [rank * shard_numel, (rank + 1) * shard_numel) of the
 * padded unsharded flat tensor). */
static PyObject *
dcp_flat_pieces(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t *offsets = NULL, *numels = NULL;
    if (dcp_check_nargs("flat_pieces", nargs, 4) < 0) {
        return NULL;
    }
    Py_ssize_t shard = PyLong_AsSsize_t(args[2]);
    Py_ssize_t rank = PyLong_AsSsize_t(args[3]);
    if ((shard == -1 || rank == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (shard < 0 || rank < 0 ||
        (rank > 0 && shard > (PY_SSIZE_T_MAX - shard) / rank)) {
        PyErr_SetString(PyExc_ValueError,
                        "flat_pieces: shard_numel and rank must be "
                        "non-negative and the shard must fit");
        return NULL;
    }
    Py_ssize_t n = flat_layout(args[0], args[1], &offsets, &numels);
    if (n < 0) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    Py_ssize_t lo = rank * shard, hi = lo + shard;
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t a = offsets[i] > lo ? offsets[i] : lo;
        Py_ssize_t b =
            offsets[i] + numels[i] < hi ? offsets[i] + numels[i] : hi;
        if (a >= b) {
            continue;
        }
        PyObject *t =
            Py_BuildValue("(nnnn)", i, a - offsets[i], a - lo, b - a);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(out);
        }
        Py_XDECREF(t);
    }
    PyMem_Free(offsets);
    PyMem_Free(numels);
    return out;
}

PyDoc_STRVAR(dcp_flat_assemble__doc__,
             "flat_assemble(dest, pieces, values, /)\n--\n\n"
             "Copy per-parameter pieces into a flat shard.");

/* flat_assemble(dest, pieces, values)
 *
 * dest[shard_start : shard_start + length] = values[param][...] for each
 * piece (param, param_start, shard_start, length): values[param] is the
 * piece itself (use_orig_params: the optimizer's 1-D state of that
 * parameter on this rank) or None (left as is). */
static PyObject *
dcp_flat_assemble(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("flat_assemble", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *pieces = dcp_sequence_fast(args[1], "pieces");
    PyObject *values = pieces ? dcp_sequence_fast(args[2], "values") : NULL;
    PyObject *flat_shape = values ? Py_BuildValue("(i)", -1) : NULL;
    if (flat_shape == NULL) {
        Py_XDECREF(pieces);
        Py_XDECREF(values);
        return NULL;
    }
    int ok = 1;
    for (Py_ssize_t k = 0; ok && k < PySequence_Fast_GET_SIZE(pieces); k++) {
        Py_ssize_t i, pstart, sstart, len;
        ok = dcp_parse_tuple(PySequence_Fast_GET_ITEM(pieces, k),
                             "nnnn",
                             &i,
                             &pstart,
                             &sstart,
                             &len);
        if (!ok) {
            break;
        }
        if (i < 0 || i >= PySequence_Fast_GET_SIZE(values)) {
            PyErr_SetString(PyExc_IndexError, "piece outside the values");
            ok = 0;
            break;
        }
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        if (value == Py_None) {
            continue;
        }
        PyObject *flat = dcp_call_method1(st->str_reshape, value, flat_shape);
        PyObject *src = flat ? narrow1d(st, flat, 0, len) : NULL;
        PyObject *dst = src ? narrow1d(st, args[0], sstart, len) : NULL;
        ok = dst != NULL && dcp_copy_into(st, dst, src) == 0;
        Py_XDECREF(flat);
        Py_XDECREF(src);
        Py_XDECREF(dst);
    }
    Py_DECREF(pieces);
    Py_DECREF(values);
    Py_DECREF(flat_shape);
    if (!ok) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dcp_map_call__doc__,
             "map_call(fn, values, extra, /)\n--\n\n"
             "[fn(v, *extra) for v in values], None passed through.");

/* map_call(fn, values, extra) -> [fn(v, *extra) for v in values], with
 * None values passed through. */
static PyObject *
dcp_map_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("map_call", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *values = dcp_sequence_fast(args[1], "values");
    PyObject *extra = values ? PySequence_Tuple(args[2]) : NULL;
    if (extra == NULL) {
        Py_XDECREF(values);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    Py_ssize_t ne = PyTuple_GET_SIZE(extra);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PySequence_Fast_GET_ITEM(values, i);
        PyObject *r;
        if (v == Py_None) {
            r = Py_NewRef(Py_None);
        }
        else {
            PyObject *a = PyTuple_New(ne + 1);
            if (a == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyTuple_SET_ITEM(a, 0, Py_NewRef(v));
            for (Py_ssize_t j = 0; j < ne; j++) {
                PyTuple_SET_ITEM(
                    a, j + 1, Py_NewRef(PyTuple_GET_ITEM(extra, j)));
            }
            r = PyObject_Call(args[0], a, NULL);
            Py_DECREF(a);
        }
        if (r == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, r);
    }
    Py_DECREF(values);
    Py_DECREF(extra);
    return out;
}

PyMethodDef dcp_fsdp1_methods[] = {
    {"flat_unflatten",
     DCP_FASTCALL(dcp_flat_unflatten),
     METH_FASTCALL,
     dcp_flat_unflatten__doc__},
    {"flat_pieces",
     DCP_FASTCALL(dcp_flat_pieces),
     METH_FASTCALL,
     dcp_flat_pieces__doc__},
    {"flat_assemble",
     DCP_FASTCALL(dcp_flat_assemble),
     METH_FASTCALL,
     dcp_flat_assemble__doc__},
    {"map_call",
     DCP_FASTCALL(dcp_map_call),
     METH_FASTCALL,
     dcp_map_call__doc__},
    {NULL, NULL, 0, NULL},
};
