/* Row chunks of a full-load stream: the source packs dim-0 row ranges of
 * full tensors into a bucket (pack_rows), every receiver keeps its part of
 * them (extract_rows), row windows clipping the blocks of a shard layout.
 * Both take a LoadPlan (full_load.c) and the index of a bucket of it.
 */
#include "dcp.h"

/* The bucket `index` of `plan`, or NULL with IndexError set. */
static const dcp_load_bucket *
plan_bucket(dcp_LoadPlan *plan, PyObject *index)
{
    Py_ssize_t b = PyLong_AsSsize_t(index);
    if (b == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (b < 0 || b >= plan->nbuckets) {
        PyErr_Format(PyExc_IndexError,
                     "bucket %zd out of range (the plan has %zd)",
                     b,
                     plan->nbuckets);
        return NULL;
    }
    return &plan->buckets[b];
}

/* The rows [c->row_start, +c->rows) of `value` (all of it for a 0-dim
 * chunk); new reference. */
static PyObject *
chunk_rows(PyObject *value, const dcp_load_chunk *c)
{
    if (c->row_start < 0) {
        return Py_NewRef(value);
    }
    PyObject *a = PyLong_FromSsize_t(c->row_start);
    PyObject *b = a ? PyLong_FromSsize_t(c->row_start + c->rows) : NULL;
    PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    PyObject *rows = sl ? PyObject_GetItem(value, sl) : NULL;
    Py_XDECREF(sl);
    return rows;
}

/* One chunk of the receiving side: its rows, viewed in `buffer`, copied
 * into the job's dest (the same rows of a full tensor, or the blocks of a
 * shard clipped to them).  0 / -1. */
static int
extract_chunk(dcp_state *st,
              PyObject *buffer,
              const dcp_load_chunk *c,
              PyObject *dest,
              PyObject *dtype,
              PyObject *blocks)
{
    PyObject *win = dcp_byte_window(buffer, c->offset, c->nbytes);
    PyObject *chunk = win ? dcp_typed_view(st, win, dtype, c->cshape) : NULL;
    Py_XDECREF(win);
    if (chunk == NULL) {
        return -1;
    }
    int rc;
    if (blocks != Py_None) {
        rc = c->row_start < 0
                 ? dcp_copy_block_list(dest, chunk, blocks, 1, 0, -1)
                 : dcp_copy_block_list(
                       dest, chunk, blocks, 1, c->row_start, c->rows);
    }
    else if (c->row_start < 0) {
        rc = dcp_copy_into(st, dest, chunk); /* 0-dim tensors travel whole */
    }
    else {
        PyObject *a = PyLong_FromSsize_t(c->row_start);
        PyObject *b = a ? PyLong_FromSsize_t(c->row_start + c->rows) : NULL;
        PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(b);
        rc = sl ? PyObject_SetItem(dest, sl, chunk) : -1;
        Py_XDECREF(sl);
    }
    Py_DECREF(chunk);
    return rc;
}

PyDoc_STRVAR(dcp_extract_rows__doc__,
             "extract_rows(plan, bucket, buffer, /)\n--\n\n"
             "Keep this rank's part of the row chunks of a broadcast "
             "bucket.");

/* extract_rows(plan, bucket, buffer)
 *
 * Stream receive side: every row chunk of bucket `bucket` of the
 * LoadPlan sits at its offset in `buffer`; it goes to its job's dest
 * (skipped where the job is not needed on this rank): the same rows of a
 * full tensor, or, for a shard, the blocks (local <- global) clipped to
 * the rows. */
static PyObject *
dcp_extract_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("extract_rows", nargs, 3) < 0 ||
        !dcp_load_plan_check(st, args[0])) {
        return NULL;
    }
    dcp_LoadPlan *plan = (dcp_LoadPlan *)args[0];
    const dcp_load_bucket *bk = plan_bucket(plan, args[1]);
    if (bk == NULL) {
        return NULL;
    }
    /* The plan owns every object used below and exposes none mutably;
     * hold it while torch runs. */
    Py_INCREF(plan);
    int rc = 0;
    for (Py_ssize_t k = bk->first; rc == 0 && k < bk->first + bk->count; k++) {
        const dcp_load_chunk *c = &plan->chunks[k];
        const dcp_load_job *J = &plan->jobs[c->job];
        if (c->nbytes == 0 || J->dest == NULL) {
            continue;
        }
        rc = extract_chunk(st, args[2], c, J->dest, J->dtype, J->blocks);
    }
    Py_DECREF(plan);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dcp_pack_rows__doc__,
             "pack_rows(plan, bucket, buffer, uint8, /)\n--\n\n"
             "Pack the row chunks of a stream bucket from the full "
             "tensors.");

/* pack_rows(plan, bucket, buffer, uint8): the source side of a stream
 * bucket: the bytes of each row chunk of the jobs' full values, at its
 * offset in `buffer`. */
static PyObject *
dcp_pack_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("pack_rows", nargs, 4) < 0 ||
        !dcp_load_plan_check(st, args[0])) {
        return NULL;
    }
    dcp_LoadPlan *plan = (dcp_LoadPlan *)args[0];
    const dcp_load_bucket *bk = plan_bucket(plan, args[1]);
    if (bk == NULL) {
        return NULL;
    }
    Py_INCREF(plan);
    int rc = 0;
    for (Py_ssize_t k = bk->first; rc == 0 && k < bk->first + bk->count; k++) {
        const dcp_load_chunk *c = &plan->chunks[k];
        PyObject *rows = chunk_rows(plan->jobs[c->job].value, c);
        PyObject *bytes = rows ? dcp_tensor_bytes(st, rows, args[3]) : NULL;
        Py_XDECREF(rows);
        if (bytes == NULL) {
            rc = -1;
            break;
        }
        Py_ssize_t nbytes = PyObject_Length(bytes);
        rc = nbytes < 0 ? -1 : 0;
        if (nbytes > 0) {
            PyObject *win = dcp_byte_window(args[2], c->offset, nbytes);
            rc = win ? dcp_copy_into(st, win, bytes) : -1;
            Py_XDECREF(win);
        }
        Py_DECREF(bytes);
    }
    Py_DECREF(plan);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
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
