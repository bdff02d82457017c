/* Row chunks of a full-load stream: the source packs dim-0 row ranges of
 * full tensors into a bucket (pack_rows), every receiver keeps its part of
 * them (extract_rows), row windows clipping the blocks of a shard layout.
 * The plan (which rows of which job sit where) comes from full_load.c.
 */
#include "dcp.h"

PyDoc_STRVAR(dcp_extract_rows__doc__,
             "extract_rows(buffer, items, dests, /)\n--\n\n"
             "Keep this rank's part of broadcast row chunks.");

/* extract_rows(buffer, items, dests)
 *
 * Stream receive side.  items: [(offset, nbytes, dtype, chunk_shape,
 * row_start, job, blocks), ...]: the chunk of rows [row_start,
 * row_start + chunk_shape[0]) of a full tensor sits at buffer[offset:];
 * dests[job] is where it goes (None: not needed on this rank); blocks
 * None means dest is the full tensor (the rows are copied to the same
 * rows), else dest is a local shard and the blocks (local <- global) are
 * clipped to the rows. */
static PyObject *
dcp_extract_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("extract_rows", nargs, 3) < 0) {
        return NULL;
    }
    if (!PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "dests must be a list");
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(args[1], "items must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t offset, nbytes, row_start, job;
        PyObject *dtype, *cshape, *blocks;
        if (!dcp_parse_tuple(PySequence_Fast_GET_ITEM(seq, i),
                             "nnOOnnO",
                             &offset,
                             &nbytes,
                             &dtype,
                             &cshape,
                             &row_start,
                             &job,
                             &blocks)) {
            goto error;
        }
        if (!PyTuple_Check(cshape)) {
            PyErr_Format(
                PyExc_TypeError,
                "extract_rows: chunk_shape must be a tuple, not %.200s",
                Py_TYPE(cshape)->tp_name);
            goto error;
        }
        if (job < 0 || job >= PyList_GET_SIZE(args[2])) {
            PyErr_SetString(PyExc_IndexError, "job out of range");
            goto error;
        }
        /* Strong reference: the torch calls below may run code that
         * changes the caller's dests list. */
        PyObject *dest = Py_NewRef(PyList_GET_ITEM(args[2], job));
        if (nbytes == 0 || dest == Py_None) {
            Py_DECREF(dest);
            continue;
        }
        PyObject *win = dcp_byte_window(args[0], offset, nbytes);
        PyObject *chunk = win ? dcp_typed_view(st, win, dtype, cshape) : NULL;
        Py_XDECREF(win);
        if (chunk == NULL) {
            Py_DECREF(dest);
            goto error;
        }
        int rc;
        if (blocks == Py_None) {
            Py_ssize_t rows =
                PyTuple_Check(cshape) && PyTuple_GET_SIZE(cshape)
                    ? PyLong_AsSsize_t(PyTuple_GET_ITEM(cshape, 0))
                    : -1;
            if (rows < 0) {
                /* 0-dim tensors travel whole */
                rc = PyErr_Occurred() ? -1 : dcp_copy_into(st, dest, chunk);
            }
            else {
                PyObject *a = PyLong_FromSsize_t(row_start);
                PyObject *b = a ? PyLong_FromSsize_t(row_start + rows) : NULL;
                PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
                Py_XDECREF(a);
                Py_XDECREF(b);
                rc = sl ? PyObject_SetItem(dest, sl, chunk) : -1;
                Py_XDECREF(sl);
            }
        }
        else {
            PyObject *rows =
                PyTuple_GET_SIZE(cshape) ? PyTuple_GET_ITEM(cshape, 0) : NULL;
            PyObject *window = rows ? Py_BuildValue("(nO)", row_start, rows)
                                    : Py_NewRef(Py_None);
            PyObject *dir = PyLong_FromLong(1);
            PyObject *none = NULL;
            if (window != NULL && dir != NULL) {
                PyObject *cb[5] = {dest, chunk, blocks, dir, window};
                none = dcp_copy_blocks(module, cb, 5);
            }
            Py_XDECREF(window);
            Py_XDECREF(dir);
            rc = none ? 0 : -1;
            Py_XDECREF(none);
        }
        Py_DECREF(chunk);
        Py_DECREF(dest);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(dcp_pack_rows__doc__,
             "pack_rows(buffer, src_items, values, uint8, /)\n--\n\n"
             "Pack row chunks of full tensors into a stream bucket.");

/* pack_rows(buffer, src_items, values, uint8): the source side of a
 * stream bucket; src_items as plan_full_load returns them. */
static PyObject *
dcp_pack_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("pack_rows", nargs, 4) < 0) {
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(args[1], "items");
    PyObject *values = seq ? dcp_sequence_fast(args[2], "values") : NULL;
    if (values == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t job, r0, nr, offset;
        if (!dcp_parse_tuple(PySequence_Fast_GET_ITEM(seq, i),
                             "nnnn",
                             &job,
                             &r0,
                             &nr,
                             &offset)) {
            goto error;
        }
        if (job < 0 || job >= PySequence_Fast_GET_SIZE(values)) {
            PyErr_SetString(PyExc_IndexError, "job out of range");
            goto error;
        }
        PyObject *value = PySequence_Fast_GET_ITEM(values, job);
        if (PyTuple_Check(value) && PyTuple_GET_SIZE(value) == 3) {
            value = PyTuple_GET_ITEM(value, 0); /* a job: (value, ...) */
        }
        PyObject *rows;
        if (r0 < 0) {
            rows = Py_NewRef(value);
        }
        else {
            PyObject *a = PyLong_FromSsize_t(r0);
            PyObject *b = a ? PyLong_FromSsize_t(r0 + nr) : NULL;
            PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
            Py_XDECREF(a);
            Py_XDECREF(b);
            rows = sl ? PyObject_GetItem(value, sl) : NULL;
            Py_XDECREF(sl);
        }
        PyObject *bytes = rows ? dcp_tensor_bytes(st, rows, args[3]) : NULL;
        Py_XDECREF(rows);
        if (bytes == NULL) {
            goto error;
        }
        Py_ssize_t nbytes = PyObject_Length(bytes);
        int rc = nbytes < 0 ? -1 : 0;
        if (nbytes > 0) {
            PyObject *win = dcp_byte_window(args[0], offset, nbytes);
            rc = win ? dcp_copy_into(st, win, bytes) : -1;
            Py_XDECREF(win);
        }
        Py_DECREF(bytes);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(seq);
    Py_DECREF(values);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    Py_DECREF(values);
    return NULL;
}

PyMethodDef dcp_rows_methods[] = {
    {"extract_rows",
     DCP_FASTCALL(dcp_extract_rows),
     METH_FASTCALL,
     dcp_extract_rows__doc__},
    {"pack_rows",
     DCP_FASTCALL(dcp_pack_rows),
     METH_FASTCALL,
     dcp_pack_rows__doc__},
    {NULL, NULL, 0, NULL},
};
