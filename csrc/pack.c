/* Block and byte copies: moving the sub-boxes of a shard layout between a
 * shard and its full tensor (copy_blocks and dcp_copy_block_list), and the
 * helpers the gather and full-load code share to move tensor bytes in and
 * out of bucket buffers (slices, typed views, tensor bytes, copy_).
 *
 * Data only ever moves through torch ops (view, slicing, copy_) called
 * from here and through torch.distributed collectives called by Python.
 */
#include "dcp.h"

/* ----------------------------------------------------------------------
 * Byte copies
 */

/* The slice object tuple for a block's local or global side. */
static PyObject *
block_slices(PyObject *starts, PyObject *lengths, Py_ssize_t shift0)
{
    Py_ssize_t n = PyTuple_GET_SIZE(starts);
    if (PyTuple_GET_SIZE(lengths) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "block: starts and lengths differ in length");
        return NULL;
    }
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t d = 0; t != NULL && d < n; d++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(starts, d));
        Py_ssize_t l = PyLong_AsSsize_t(PyTuple_GET_ITEM(lengths, d));
        if ((s == -1 || l == -1) && PyErr_Occurred()) {
            Py_CLEAR(t);
            break;
        }
        if (d == 0) {
            s = (s < 0 || shift0 < 0) ? -1 : s - shift0;
        }
        if (s < 0 || l < 0 || s > PY_SSIZE_T_MAX - l) {
            PyErr_SetString(PyExc_ValueError,
                            "block: negative or overflowing start/length");
            Py_CLEAR(t);
            break;
        }
        PyObject *a = PyLong_FromSsize_t(s), *b = PyLong_FromSsize_t(s + l);
        PyObject *sl = (a && b) ? PySlice_New(a, b, NULL) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (sl == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, d, sl);
    }
    return t;
}

/* dst[dst_slices] = src[src_slices], as torch does for `a[...] = b[...]`. */
static int
copy_box(PyObject *dst,
         PyObject *dst_slices,
         PyObject *src,
         PyObject *src_slices)
{
    PyObject *piece = PyObject_GetItem(src, src_slices);
    if (piece == NULL) {
        return -1;
    }
    int rc = PyObject_SetItem(dst, dst_slices, piece);
    Py_DECREF(piece);
    return rc;
}

/* A block (local_starts, global_starts, lengths): three tuples, borrowed.
 * 0 or -1. */
int
dcp_parse_block(PyObject *block, PyObject **ls, PyObject **gs, PyObject **ln)
{
    return dcp_parse_tuple(block,
                           "O!O!O!",
                           &PyTuple_Type,
                           ls,
                           &PyTuple_Type,
                           gs,
                           &PyTuple_Type,
                           ln)
               ? 0
               : -1;
}

PyDoc_STRVAR(
    dcp_copy_blocks__doc__,
    "copy_blocks(dst, src, blocks, direction, row_window, /)\n--\n\n"
    "Copy the sub-boxes of a shard layout between shard and full tensor.");

/* copy_blocks(dst, src, blocks, direction, row_window)
 *
 * direction 0: assemble -- dst is the full tensor, src a local shard:
 *   dst[global box] = src[local box];
 * direction 1: extract -- dst is the local shard, src a full tensor or a
 *   window of its rows: dst[local box] = src[global box].
 * row_window: None, or (row_start, row_count) when src/dst holding the
 *   full tensor only holds those dim-0 rows; blocks are clipped to them.
 * Returns None. */
static PyObject *
dcp_copy_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("copy_blocks", nargs, 5) < 0) {
        return NULL;
    }
    long direction = PyLong_AsLong(args[3]);
    if (direction == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t w0 = 0, wn = -1;
    if (args[4] != Py_None && !dcp_parse_tuple(args[4], "nn", &w0, &wn)) {
        return NULL;
    }
    if (dcp_copy_block_list(
            args[0], args[1], args[2], direction == 0 ? 0 : 1, w0, wn) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

int
dcp_copy_block_list(PyObject *dst,
                    PyObject *src,
                    PyObject *blocks,
                    int direction,
                    Py_ssize_t w0,
                    Py_ssize_t wn)
{
    PyObject *seq = dcp_sequence_fast(blocks, "blocks must be a sequence");
    if (seq == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *ls, *gs, *ln;
        if (dcp_parse_block(block, &ls, &gs, &ln) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        PyObject *l_starts = Py_NewRef(ls), *g_starts = Py_NewRef(gs);
        PyObject *lens = Py_NewRef(ln);
        Py_ssize_t shift = 0;
        if (wn >= 0 && PyTuple_GET_SIZE(gs) > 0) {
            /* clip dim 0 of the block to the row window */
            Py_ssize_t g0 = -1, l0 = -1, n0 = -1;
            if (PyTuple_GET_SIZE(ls) > 0 && PyTuple_GET_SIZE(ln) > 0) {
                g0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(gs, 0));
                l0 = g0 < 0 ? -1 : PyLong_AsSsize_t(PyTuple_GET_ITEM(ls, 0));
                n0 = l0 < 0 ? -1 : PyLong_AsSsize_t(PyTuple_GET_ITEM(ln, 0));
            }
            if (g0 < 0 || l0 < 0 || n0 < 0 || w0 < 0 ||
                g0 > PY_SSIZE_T_MAX - n0 || w0 > PY_SSIZE_T_MAX - wn) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_ValueError,
                                    "copy_blocks: bad block or row window");
                }
                Py_DECREF(l_starts);
                Py_DECREF(g_starts);
                Py_DECREF(lens);
                Py_DECREF(seq);
                return -1;
            }
            Py_ssize_t lo = g0 > w0 ? g0 : w0;
            Py_ssize_t hi = (g0 + n0) < (w0 + wn) ? (g0 + n0) : (w0 + wn);
            if (lo >= hi) {
                Py_DECREF(l_starts);
                Py_DECREF(g_starts);
                Py_DECREF(lens);
                continue;
            }
            Py_SETREF(l_starts, PySequence_List(ls));
            Py_SETREF(g_starts, PySequence_List(gs));
            Py_SETREF(lens, PySequence_List(ln));
            /* PyList_SetItem stores a NULL item without complaint: make
             * the ints first, and hand each over only once it exists. */
            PyObject *nl = PyLong_FromSsize_t(l0 + (lo - g0));
            PyObject *ng = nl ? PyLong_FromSsize_t(lo) : NULL;
            PyObject *nn = ng ? PyLong_FromSsize_t(hi - lo) : NULL;
            int ok = l_starts && g_starts && lens && nn;
            if (ok) {
                ok = PyList_SetItem(l_starts, 0, nl) == 0;
                nl = NULL;
                ok = ok && PyList_SetItem(g_starts, 0, ng) == 0;
                ng = NULL;
                ok = ok && PyList_SetItem(lens, 0, nn) == 0;
                nn = NULL;
            }
            Py_XDECREF(nl);
            Py_XDECREF(ng);
            Py_XDECREF(nn);
            if (ok) {
                Py_SETREF(l_starts, PyList_AsTuple(l_starts));
                Py_SETREF(g_starts, PyList_AsTuple(g_starts));
                Py_SETREF(lens, PyList_AsTuple(lens));
                ok = l_starts && g_starts && lens;
            }
            if (!ok) {
                Py_XDECREF(l_starts);
                Py_XDECREF(g_starts);
                Py_XDECREF(lens);
                Py_DECREF(seq);
                return -1;
            }
            shift = w0;
        }
        PyObject *lsl = block_slices(l_starts, lens, 0);
        PyObject *gsl = lsl ? block_slices(g_starts, lens, shift) : NULL;
        int rc = -1;
        if (gsl != NULL) {
            rc = direction == 0 ? copy_box(dst, gsl, src, lsl)
                                : copy_box(dst, lsl, src, gsl);
        }
        Py_XDECREF(lsl);
        Py_XDECREF(gsl);
        Py_DECREF(l_starts);
        Py_DECREF(g_starts);
        Py_DECREF(lens);
        if (rc < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

/* ----------------------------------------------------------------------
 * Byte windows and typed views of bucket buffers
 */

/* obj[start:stop]. */
PyObject *
dcp_slice(PyObject *obj, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *a = PyLong_FromSsize_t(start);
    PyObject *b = a ? PyLong_FromSsize_t(stop) : NULL;
    PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (sl == NULL) {
        return NULL;
    }
    PyObject *view = PyObject_GetItem(obj, sl);
    Py_DECREF(sl);
    return view;
}

/* `window` (uint8) reinterpreted as `dtype` with `shape`. */
PyObject *
dcp_typed_view(dcp_state *st,
               PyObject *window,
               PyObject *dtype,
               PyObject *shape)
{
    PyObject *typed = dcp_call_method1(st->str_view, window, dtype);
    if (typed == NULL) {
        return NULL;
    }
    PyObject *shaped = dcp_call_method1(st->str_view, typed, shape);
    Py_DECREF(typed);
    return shaped;
}

/* The bytes of `tensor` as a flat uint8 tensor (a copy only when the
 * tensor is not contiguous). */
PyObject *
dcp_tensor_bytes(dcp_state *st, PyObject *tensor, PyObject *uint8)
{
    PyObject *minus_one = PyLong_FromLong(-1);
    if (minus_one == NULL) {
        return NULL;
    }
    PyObject *flat = dcp_call_method1(st->str_reshape, tensor, minus_one);
    Py_DECREF(minus_one);
    if (flat == NULL) {
        return NULL;
    }
    PyObject *bytes = dcp_call_method1(st->str_view, flat, uint8);
    Py_DECREF(flat);
    return bytes;
}

int
dcp_copy_into(dcp_state *st, PyObject *dst, PyObject *src)
{
    PyObject *r = dcp_call_method1(st->str_copy_, dst, src);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

PyMethodDef dcp_pack_methods[] = {
    {"copy_blocks",
     DCP_FASTCALL(dcp_copy_blocks),
     METH_FASTCALL,
     dcp_copy_blocks__doc__},
    {NULL, NULL, 0, NULL},
};
