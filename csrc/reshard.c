/* Resharding plans: where every rank's shard of a DTensor lives in the
 * full tensor, how tensors are packed into buckets, and the byte copies
 * in and out of bucket buffers.
 *
 * Geometry.  DTensor shards a tensor dimension by dimension, mesh
 * dimension by mesh dimension, left to right (torch's
 * _compute_local_shape_and_global_offset): Shard(d) splits the current
 * extent of dim d into mesh-size chunks the way torch.chunk does (ceil
 * sized, the last ones short or empty); _StridedShard(d, split_factor)
 * first splits into split_factor pieces and takes this rank's chunk of
 * each.  We track, per tensor dimension, the global indices the local
 * shard covers as a short list of runs (start, length) in local order;
 * a plain Shard keeps one run, a strided one up to split_factor.  The
 * cartesian product of the runs of all dimensions gives the blocks:
 * (local start, global start, length) per dimension, each a sub-box that
 * a single slice assignment moves.
 *
 * Buckets.  Tensors are packed, in order, into byte buckets: for a gather
 * each rank contributes a segment per tensor sized for the largest shard
 * (all ranks' segments must have equal size), aligned to 16 bytes so the
 * bytes can be viewed as any dtype; a bucket closes when the gathered
 * size (segments x ranks) would exceed the budget.  A tensor larger than
 * the budget gets a bucket of its own.
 *
 * Data only ever moves through torch ops (view, slicing, copy_) called
 * from here and through torch.distributed collectives called by Python.
 */
#include "dcp.h"

#define DCP_MAX_DIMS 64
#define DCP_MAX_RUNS 4096 /* runs per dim: split_factor products */
/* Byte alignment of every segment: the widest scalar (complex128) is
 * 16 bytes, and Tensor.view(dtype) needs offsets divisible by it. */
#define DCP_ALIGN 16

enum { PL_REPLICATE = 0, PL_SHARD = 1, PL_STRIDED = 2, PL_PARTIAL = 3 };

typedef struct {
    Py_ssize_t start; /* global index */
    Py_ssize_t len;
} run_t;

typedef struct {
    run_t *runs;
    Py_ssize_t n;
    Py_ssize_t cap;
} runlist_t;

static int
runs_push(runlist_t *rl, Py_ssize_t start, Py_ssize_t len)
{
    if (len <= 0) {
        return 0;
    }
    if (rl->n > 0 && rl->runs[rl->n - 1].start + rl->runs[rl->n - 1].len ==
                         start) {
        rl->runs[rl->n - 1].len += len; /* merge adjacent runs */
        return 0;
    }
    if (rl->n == rl->cap) {
        Py_ssize_t cap = rl->cap ? rl->cap * 2 : 4;
        if (cap > DCP_MAX_RUNS) {
            PyErr_SetString(PyExc_ValueError,
                            "sharding produces too many strided runs");
            return -1;
        }
        run_t *runs = PyMem_Realloc(rl->runs, (size_t)cap * sizeof(run_t));
        if (runs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        rl->runs = runs;
        rl->cap = cap;
    }
    rl->runs[rl->n].start = start;
    rl->runs[rl->n].len = len;
    rl->n++;
    return 0;
}

static Py_ssize_t
runs_total(const runlist_t *rl)
{
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < rl->n; i++) {
        total += rl->runs[i].len;
    }
    return total;
}

/* Appends to `out` the global runs covering local positions [a, a+len)
 * of `in`. */
static int
runs_select(const runlist_t *in, Py_ssize_t a, Py_ssize_t len,
            runlist_t *out)
{
    Py_ssize_t pos = 0;
    Py_ssize_t end = a + len;
    for (Py_ssize_t i = 0; i < in->n && pos < end; i++) {
        Py_ssize_t r0 = pos, r1 = pos + in->runs[i].len;
        Py_ssize_t lo = a > r0 ? a : r0, hi = end < r1 ? end : r1;
        if (lo < hi &&
            runs_push(out, in->runs[i].start + (lo - r0), hi - lo) < 0) {
            return -1;
        }
        pos = r1;
    }
    return 0;
}

/* torch.chunk-style split of `size` into `n` chunks: chunk `k`. */
static void
chunk_range(Py_ssize_t size, Py_ssize_t n, Py_ssize_t k, Py_ssize_t *start,
            Py_ssize_t *len)
{
    Py_ssize_t full = n > 0 ? (size + n - 1) / n : 0;
    Py_ssize_t s = full * k;
    if (s > size) {
        s = size;
    }
    Py_ssize_t e = s + full;
    if (e > size) {
        e = size;
    }
    *start = s;
    *len = e > s ? e - s : 0;
}

typedef struct {
    int kind;
    Py_ssize_t dim;
    Py_ssize_t split_factor;
} placement_t;

/* Parses placements: a sequence of (kind, dim, split_factor). */
static int
parse_placements(PyObject *obj, placement_t *out, Py_ssize_t max,
                 Py_ssize_t *n)
{
    PyObject *seq = PySequence_Fast(obj, "placements must be a sequence");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > max) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many placements");
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long kind, dim, sf;
        if (!PyArg_ParseTuple(item, "lll", &kind, &dim, &sf)) {
            Py_DECREF(seq);
            return -1;
        }
        if (kind < PL_REPLICATE || kind > PL_PARTIAL || dim < 0 || sf < 1) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "bad placement tuple");
            return -1;
        }
        out[i].kind = (int)kind;
        out[i].dim = dim;
        out[i].split_factor = sf;
    }
    *n = len;
    Py_DECREF(seq);
    return 0;
}

static int
parse_shape(PyObject *obj, Py_ssize_t *out, Py_ssize_t *n, const char *what)
{
    PyObject *seq = PySequence_Fast(obj, what);
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > DCP_MAX_DIMS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s has too many dimensions", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "%s has a negative entry", what);
            return -1;
        }
        out[i] = v;
    }
    *n = len;
    Py_DECREF(seq);
    return 0;
}

static PyObject *
ssize_tuple(const Py_ssize_t *v, Py_ssize_t n)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *x = PyLong_FromSsize_t(v[i]);
        if (x == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* The layout of the shard at mesh coordinate `coord`:
 * (local_shape, [(lstart, gstart, length), ...]).  New tuple or NULL. */
static PyObject *
shard_layout(const Py_ssize_t *gshape, Py_ssize_t ndim,
             const Py_ssize_t *mesh, Py_ssize_t mdim, const Py_ssize_t *coord,
             const placement_t *pl)
{
    runlist_t runs[DCP_MAX_DIMS];
    PyObject *result = NULL, *blocks = NULL;
    Py_ssize_t local[DCP_MAX_DIMS];
    memset(runs, 0, sizeof(runs));
    for (Py_ssize_t d = 0; d < ndim; d++) {
        if (runs_push(&runs[d], 0, gshape[d]) < 0) {
            goto done;
        }
        if (gshape[d] == 0) {
            runs[d].n = 0;
        }
    }
    for (Py_ssize_t m = 0; m < mdim; m++) {
        const placement_t *p = &pl[m];
        if (p->kind != PL_SHARD && p->kind != PL_STRIDED) {
            continue;
        }
        if (p->dim >= ndim) {
            PyErr_Format(PyExc_ValueError,
                         "Sharding dim %zd greater than tensor ndim %zd",
                         p->dim, ndim);
            goto done;
        }
        runlist_t *cur = &runs[p->dim];
        runlist_t next = {NULL, 0, 0};
        Py_ssize_t size = runs_total(cur);
        if (p->kind == PL_SHARD) {
            Py_ssize_t s, len;
            chunk_range(size, mesh[m], coord[m], &s, &len);
            if (runs_select(cur, s, len, &next) < 0) {
                PyMem_Free(next.runs);
                goto done;
            }
        }
        else {
            /* _StridedShard: split into split_factor pieces, then take
             * chunk `coord` of each piece (torch's symbolic formula). */
            Py_ssize_t sf = p->split_factor;
            Py_ssize_t first = (size + sf - 1) / sf;
            for (Py_ssize_t k = 0; k < sf; k++) {
                Py_ssize_t fs = first * k < size ? first * k : size;
                Py_ssize_t fe = first * (k + 1) < size ? first * (k + 1) : size;
                Py_ssize_t flen = fe > fs ? fe - fs : 0;
                Py_ssize_t s, len;
                chunk_range(flen, mesh[m], coord[m], &s, &len);
                if (runs_select(cur, fs + s, len, &next) < 0) {
                    PyMem_Free(next.runs);
                    goto done;
                }
            }
        }
        PyMem_Free(cur->runs);
        *cur = next;
    }
    for (Py_ssize_t d = 0; d < ndim; d++) {
        local[d] = runs_total(&runs[d]);
    }
    blocks = PyList_New(0);
    if (blocks == NULL) {
        goto done;
    }
    int empty = 0;
    for (Py_ssize_t d = 0; d < ndim; d++) {
        empty |= runs[d].n == 0;
    }
    if (!empty) {
        /* cartesian product of runs, odometer style */
        Py_ssize_t idx[DCP_MAX_DIMS] = {0};
        for (;;) {
            Py_ssize_t ls[DCP_MAX_DIMS], gs[DCP_MAX_DIMS], ln[DCP_MAX_DIMS];
            for (Py_ssize_t d = 0; d < ndim; d++) {
                Py_ssize_t pos = 0;
                for (Py_ssize_t j = 0; j < idx[d]; j++) {
                    pos += runs[d].runs[j].len;
                }
                ls[d] = pos;
                gs[d] = runs[d].runs[idx[d]].start;
                ln[d] = runs[d].runs[idx[d]].len;
            }
            PyObject *lt = ssize_tuple(ls, ndim);
            PyObject *gt = lt ? ssize_tuple(gs, ndim) : NULL;
            PyObject *nt = gt ? ssize_tuple(ln, ndim) : NULL;
            PyObject *block = nt ? PyTuple_Pack(3, lt, gt, nt) : NULL;
            Py_XDECREF(lt);
            Py_XDECREF(gt);
            Py_XDECREF(nt);
            if (block == NULL || PyList_Append(blocks, block) < 0) {
                Py_XDECREF(block);
                goto done;
            }
            Py_DECREF(block);
            Py_ssize_t d = ndim - 1;
            while (d >= 0 && ++idx[d] == runs[d].n) {
                idx[d] = 0;
                d--;
            }
            if (d < 0) {
                break;
            }
        }
    }
    PyObject *lshape = ssize_tuple(local, ndim);
    if (lshape != NULL) {
        result = PyTuple_Pack(2, lshape, blocks);
        Py_DECREF(lshape);
    }
done:
    for (Py_ssize_t d = 0; d < ndim; d++) {
        PyMem_Free(runs[d].runs);
    }
    Py_XDECREF(blocks);
    return result;
}

/* shard_layouts(global_shape, mesh_shape, placements, coords)
 *   -> [(local_shape, blocks) per coordinate] */
PyObject *
dcp_shard_layouts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t gshape[DCP_MAX_DIMS], mesh[DCP_MAX_DIMS];
    Py_ssize_t ndim, mdim, npl;
    placement_t pl[DCP_MAX_DIMS];
    if (dcp_check_nargs("shard_layouts", nargs, 4) < 0 ||
        parse_shape(args[0], gshape, &ndim, "global_shape") < 0 ||
        parse_shape(args[1], mesh, &mdim, "mesh_shape") < 0 ||
        parse_placements(args[2], pl, DCP_MAX_DIMS, &npl) < 0) {
        return NULL;
    }
    if (npl != mdim) {
        PyErr_SetString(PyExc_ValueError,
                        "one placement per mesh dimension is required");
        return NULL;
    }
    PyObject *coords = PySequence_Fast(args[3], "coords must be a sequence");
    if (coords == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(coords);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t coord[DCP_MAX_DIMS], cdim;
        if (parse_shape(PySequence_Fast_GET_ITEM(coords, i), coord, &cdim,
                        "coordinate") < 0) {
            Py_CLEAR(out);
            break;
        }
        if (cdim != mdim) {
            PyErr_SetString(PyExc_ValueError,
                            "coordinate rank differs from the mesh's");
            Py_CLEAR(out);
            break;
        }
        for (Py_ssize_t m = 0; m < mdim; m++) {
            if (coord[m] >= mesh[m]) {
                PyErr_SetString(PyExc_ValueError,
                                "coordinate outside the mesh");
                Py_CLEAR(out);
                break;
            }
        }
        if (out == NULL) {
            break;
        }
        PyObject *layout = shard_layout(gshape, ndim, mesh, mdim, coord, pl);
        if (layout == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, layout);
    }
    Py_DECREF(coords);
    return out;
}

/* ----------------------------------------------------------------------
 * Bucket planning
 */

static Py_ssize_t
align_up(Py_ssize_t n)
{
    return (n + DCP_ALIGN - 1) / DCP_ALIGN * DCP_ALIGN;
}

/* plan_buckets(segment_bytes, copies, budget)
 *   -> [(bucket_segment_size, [(item, offset), ...]), ...]
 *
 * segment_bytes[i]: the bytes item i needs in each copy of a bucket;
 * copies: how many copies of the segment a bucket holds once filled (the
 * number of ranks for a gather, 1 for a broadcast); budget: the largest
 * filled bucket in bytes.  Items are placed in order; zero-sized items
 * are placed at offset 0 of the current bucket. */
PyObject *
dcp_plan_buckets(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("plan_buckets", nargs, 3) < 0) {
        return NULL;
    }
    Py_ssize_t copies = PyLong_AsSsize_t(args[1]);
    Py_ssize_t budget = PyLong_AsSsize_t(args[2]);
    if ((copies == -1 || budget == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (copies < 1 || budget < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "plan_buckets: copies and budget must be positive");
        return NULL;
    }
    PyObject *sizes = PySequence_Fast(args[0], "segment_bytes");
    if (sizes == NULL) {
        return NULL;
    }
    PyObject *buckets = PyList_New(0), *items = NULL;
    Py_ssize_t used = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sizes);
    if (buckets == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t sz = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, i));
        if (sz == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (sz < 0) {
            PyErr_SetString(PyExc_ValueError, "negative segment size");
            goto error;
        }
        sz = align_up(sz);
        int fits = items != NULL && (used + sz) <= budget / copies;
        if (!fits && items != NULL && PyList_GET_SIZE(items) > 0) {
            PyObject *b = Py_BuildValue("(nO)", used, items);
            if (b == NULL || PyList_Append(buckets, b) < 0) {
                Py_XDECREF(b);
                goto error;
            }
            Py_DECREF(b);
            Py_CLEAR(items);
            used = 0;
        }
        if (items == NULL && (items = PyList_New(0)) == NULL) {
            goto error;
        }
        PyObject *entry = Py_BuildValue("(nn)", i, used);
        if (entry == NULL || PyList_Append(items, entry) < 0) {
            Py_XDECREF(entry);
            goto error;
        }
        Py_DECREF(entry);
        used += sz;
    }
    if (items != NULL && PyList_GET_SIZE(items) > 0) {
        PyObject *b = Py_BuildValue("(nO)", used, items);
        if (b == NULL || PyList_Append(buckets, b) < 0) {
            Py_XDECREF(b);
            goto error;
        }
        Py_DECREF(b);
    }
    Py_XDECREF(items);
    Py_DECREF(sizes);
    return buckets;
error:
    Py_XDECREF(items);
    Py_XDECREF(buckets);
    Py_DECREF(sizes);
    return NULL;
}

/* ----------------------------------------------------------------------
 * Byte copies
 */

/* The slice object tuple for a block's local or global side. */
static PyObject *
block_slices(PyObject *starts, PyObject *lengths, Py_ssize_t shift0)
{
    Py_ssize_t n = PyTuple_GET_SIZE(starts);
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t d = 0; t != NULL && d < n; d++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(starts, d));
        Py_ssize_t l = PyLong_AsSsize_t(PyTuple_GET_ITEM(lengths, d));
        if ((s == -1 || l == -1) && PyErr_Occurred()) {
            Py_CLEAR(t);
            break;
        }
        if (d == 0) {
            s -= shift0;
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
copy_box(PyObject *dst, PyObject *dst_slices, PyObject *src,
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

/* copy_blocks(dst, src, blocks, direction, row_window)
 *
 * direction 0: assemble -- dst is the full tensor, src a local shard:
 *   dst[global box] = src[local box];
 * direction 1: extract -- dst is the local shard, src a full tensor or a
 *   window of its rows: dst[local box] = src[global box].
 * row_window: None, or (row_start, row_count) when src/dst holding the
 *   full tensor only holds those dim-0 rows; blocks are clipped to them.
 * Returns None. */
PyObject *
dcp_copy_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("copy_blocks", nargs, 5) < 0) {
        return NULL;
    }
    PyObject *dst = args[0], *src = args[1], *blocks = args[2];
    long direction = PyLong_AsLong(args[3]);
    if (direction == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t w0 = 0, wn = -1;
    if (args[4] != Py_None &&
        !PyArg_ParseTuple(args[4], "nn", &w0, &wn)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *ls, *gs, *ln;
        if (!PyArg_ParseTuple(block, "O!O!O!", &PyTuple_Type, &ls,
                              &PyTuple_Type, &gs, &PyTuple_Type, &ln)) {
            Py_DECREF(seq);
            return NULL;
        }
        PyObject *l_starts = Py_NewRef(ls), *g_starts = Py_NewRef(gs);
        PyObject *lens = Py_NewRef(ln);
        Py_ssize_t shift = 0;
        if (wn >= 0 && PyTuple_GET_SIZE(gs) > 0) {
            /* clip dim 0 of the block to the row window */
            Py_ssize_t g0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(gs, 0));
            Py_ssize_t l0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(ls, 0));
            Py_ssize_t n0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(ln, 0));
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
            int ok = l_starts && g_starts && lens &&
                     PyList_SetItem(l_starts, 0,
                                    PyLong_FromSsize_t(l0 + (lo - g0))) == 0 &&
                     PyList_SetItem(g_starts, 0, PyLong_FromSsize_t(lo)) == 0 &&
                     PyList_SetItem(lens, 0, PyLong_FromSsize_t(hi - lo)) == 0;
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
                return NULL;
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
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------------
 * Batched bucket copies (no Python loop per tensor)
 */

/* A 1-D uint8 view of `buffer` bytes [offset, offset + nbytes). */
static PyObject *
byte_window(PyObject *buffer, Py_ssize_t offset, Py_ssize_t nbytes)
{
    PyObject *a = PyLong_FromSsize_t(offset);
    PyObject *b = a ? PyLong_FromSsize_t(offset + nbytes) : NULL;
    PyObject *sl = b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    if (sl == NULL) {
        return NULL;
    }
    PyObject *view = PyObject_GetItem(buffer, sl);
    Py_DECREF(sl);
    return view;
}

/* `window` (uint8) reinterpreted as `dtype` with `shape`. */
static PyObject *
typed_view(dcp_state *st, PyObject *window, PyObject *dtype, PyObject *shape)
{
    PyObject *args1[2] = {window, dtype};
    PyObject *typed = PyObject_VectorcallMethod(
        st->str_view, args1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (typed == NULL) {
        return NULL;
    }
    PyObject *args2[2] = {typed, shape};
    PyObject *shaped = PyObject_VectorcallMethod(
        st->str_view, args2, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(typed);
    return shaped;
}

/* The bytes of `tensor` as a flat uint8 tensor (a copy only when the
 * tensor is not contiguous). */
static PyObject *
tensor_bytes(dcp_state *st, PyObject *tensor, PyObject *uint8)
{
    PyObject *minus_one = PyLong_FromLong(-1);
    if (minus_one == NULL) {
        return NULL;
    }
    PyObject *rargs[2] = {tensor, minus_one};
    PyObject *flat = PyObject_VectorcallMethod(
        st->str_reshape, rargs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(minus_one);
    if (flat == NULL) {
        return NULL;
    }
    PyObject *args[2] = {flat, uint8};
    PyObject *bytes = PyObject_VectorcallMethod(
        st->str_view, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(flat);
    return bytes;
}

static int
copy_into(dcp_state *st, PyObject *dst, PyObject *src)
{
    PyObject *args[2] = {dst, src};
    PyObject *r = PyObject_VectorcallMethod(
        st->str_copy_, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* pack_bytes(buffer, items, uint8)
 *
 * items: [(tensor, byte_offset), ...] -- each tensor's bytes are copied
 * into buffer[offset : offset + nbytes].  Empty tensors are skipped. */
PyObject *
dcp_pack_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("pack_bytes", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "items must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *tensor;
        Py_ssize_t offset;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "On", &tensor,
                              &offset)) {
            goto error;
        }
        PyObject *bytes = tensor_bytes(st, tensor, args[2]);
        if (bytes == NULL) {
            goto error;
        }
        Py_ssize_t n = PyObject_Length(bytes);
        int rc = -1;
        if (n == 0) {
            rc = 0;
        }
        else if (n > 0) {
            PyObject *win = byte_window(args[0], offset, n);
            rc = win ? copy_into(st, win, bytes) : -1;
            Py_XDECREF(win);
        }
        Py_DECREF(bytes);
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

/* unpack_gathered(buffer, segment, items, empty, device, results,
 *                 indices, offload)
 *
 * `buffer` holds R equal segments of `segment` bytes, one per rank in
 * row-major mesh order.  items: [(offset, dtype, global_shape, layouts)]
 * where layouts[r] is None (skip) or (nbytes, local_shape, blocks) for
 * rank r.  Each full tensor is created with empty(global_shape,
 * dtype=dtype, device=device), assembled, moved to `offload` unless that
 * is None, and stored in results[indices[k]]. */
PyObject *
dcp_unpack_gathered(PyObject *module, PyObject *const *args,
                    Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("unpack_gathered", nargs, 8) < 0) {
        return NULL;
    }
    PyObject *buffer = args[0], *empty = args[3], *device = args[4];
    PyObject *results = args[5], *offload = args[7];
    Py_ssize_t segment = PyLong_AsSsize_t(args[1]);
    if (segment == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_Check(results)) {
        PyErr_SetString(PyExc_TypeError, "results must be a list");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[2], "items must be a sequence");
    PyObject *idx = seq ? PySequence_Fast(args[6], "indices") : NULL;
    if (idx == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (PySequence_Fast_GET_SIZE(idx) != n) {
        PyErr_SetString(PyExc_ValueError, "one index per item");
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t offset;
        PyObject *dtype, *gshape, *layouts;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nOOO",
                              &offset, &dtype, &gshape, &layouts)) {
            goto error;
        }
        PyObject *kwargs = Py_BuildValue("{sOsO}", "dtype", dtype, "device",
                                         device);
        PyObject *cargs = kwargs ? PyTuple_Pack(1, gshape) : NULL;
        PyObject *full = cargs ? PyObject_Call(empty, cargs, kwargs) : NULL;
        Py_XDECREF(kwargs);
        Py_XDECREF(cargs);
        if (full == NULL) {
            goto error;
        }
        PyObject *lseq = PySequence_Fast(layouts, "layouts");
        int ok = lseq != NULL;
        for (Py_ssize_t r = 0; ok && r < PySequence_Fast_GET_SIZE(lseq); r++) {
            PyObject *layout = PySequence_Fast_GET_ITEM(lseq, r);
            Py_ssize_t nbytes;
            PyObject *lshape, *blocks;
            if (layout == Py_None) {
                continue;
            }
            if (!PyArg_ParseTuple(layout, "nOO", &nbytes, &lshape, &blocks)) {
                ok = 0;
                break;
            }
            if (nbytes == 0) {
                continue;
            }
            PyObject *win = byte_window(buffer, r * segment + offset, nbytes);
            PyObject *piece = win ? typed_view(st, win, dtype, lshape) : NULL;
            Py_XDECREF(win);
            PyObject *none = NULL;
            if (piece != NULL) {
                PyObject *dir = PyLong_FromLong(0);
                PyObject *cb[5] = {full, piece, blocks, dir, Py_None};
                none = dir ? dcp_copy_blocks(module, cb, 5) : NULL;
                Py_XDECREF(dir);
            }
            Py_XDECREF(piece);
            ok = none != NULL;
            Py_XDECREF(none);
        }
        Py_XDECREF(lseq);
        if (ok && offload != Py_None) {
            PyObject *call[2] = {full, offload};
            PyObject *moved = PyObject_VectorcallMethod(
                st->str_to, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_SETREF(full, moved);
            ok = full != NULL;
        }
        if (!ok) {
            Py_XDECREF(full);
            goto error;
        }
        Py_ssize_t dest = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(idx, i));
        if (dest < 0 || dest >= PyList_GET_SIZE(results)) {
            Py_DECREF(full);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_IndexError, "result index out of range");
            }
            goto error;
        }
        /* PyList_SetItem steals `full` and releases the old item. */
        if (PyList_SetItem(results, dest, full) < 0) {
            goto error;
        }
    }
    Py_DECREF(seq);
    Py_DECREF(idx);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    Py_DECREF(idx);
    return NULL;
}

/* extract_rows(buffer, items)
 *
 * Broadcast receive side.  items: [(offset, nbytes, dtype, chunk_shape,
 * row_start, dest, blocks), ...]: the chunk of rows [row_start,
 * row_start + chunk_shape[0]) of a full tensor sits at buffer[offset:];
 * blocks None means `dest` is the full tensor (the rows are copied to the
 * same rows of dest), else `dest` is a local shard and the blocks (local
 * <- global) are clipped to the rows. */
PyObject *
dcp_extract_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("extract_rows", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "items must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t offset, nbytes, row_start;
        PyObject *dtype, *cshape, *dest, *blocks;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nnOOnOO",
                              &offset, &nbytes, &dtype, &cshape, &row_start,
                              &dest, &blocks)) {
            goto error;
        }
        if (nbytes == 0) {
            continue;
        }
        PyObject *win = byte_window(args[0], offset, nbytes);
        PyObject *chunk = win ? typed_view(st, win, dtype, cshape) : NULL;
        Py_XDECREF(win);
        if (chunk == NULL) {
            goto error;
        }
        int rc;
        if (blocks == Py_None) {
            Py_ssize_t rows = PyTuple_Check(cshape) && PyTuple_GET_SIZE(cshape)
                                  ? PyLong_AsSsize_t(PyTuple_GET_ITEM(cshape, 0))
                                  : -1;
            if (rows < 0) {
                /* 0-dim tensors travel whole */
                rc = PyErr_Occurred() ? -1 : copy_into(st, dest, chunk);
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
            PyObject *rows = PyTuple_GET_SIZE(cshape)
                                 ? PyTuple_GET_ITEM(cshape, 0)
                                 : NULL;
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

/* ----------------------------------------------------------------------
 * Gather plans for DTensor leaves
 */

/* Encodes one Placement object as (kind, dim, split_factor). */
static int
encode_placement(PyObject *p, PyObject *classes, placement_t *out)
{
    /* classes: (Shard, _StridedShard, Replicate) */
    PyObject *shard = PyTuple_GET_ITEM(classes, 0);
    PyObject *strided = PyTuple_GET_ITEM(classes, 1);
    PyObject *replicate = PyTuple_GET_ITEM(classes, 2);
    int rc = PyObject_IsInstance(p, strided);
    if (rc < 0) {
        return -1;
    }
    int kind = rc ? PL_STRIDED : -1;
    if (kind < 0) {
        rc = PyObject_IsInstance(p, shard);
        if (rc < 0) {
            return -1;
        }
        kind = rc ? PL_SHARD : -1;
    }
    if (kind < 0) {
        rc = PyObject_IsInstance(p, replicate);
        if (rc < 0) {
            return -1;
        }
        kind = rc ? PL_REPLICATE : PL_PARTIAL;
    }
    out->kind = kind;
    out->dim = 0;
    out->split_factor = 1;
    if (kind == PL_SHARD || kind == PL_STRIDED) {
        PyObject *dim = PyObject_GetAttrString(p, "dim"); /* cpylint-ignore: placement objects, cold */
        out->dim = dim ? PyLong_AsSsize_t(dim) : -1;
        Py_XDECREF(dim);
        if (out->dim < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "negative shard dim");
            }
            return -1;
        }
    }
    if (kind == PL_STRIDED) {
        PyObject *sf = PyObject_GetAttrString(p, "split_factor"); /* cpylint-ignore: cold */
        out->split_factor = sf ? PyLong_AsSsize_t(sf) : -1;
        Py_XDECREF(sf);
        if (out->split_factor < 1) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "bad split_factor");
            }
            return -1;
        }
    }
    return 0;
}

/* Row-major coordinates of a mesh shape, as a list of tuples. */
static PyObject *
mesh_coords(const Py_ssize_t *mesh, Py_ssize_t mdim, Py_ssize_t *count)
{
    Py_ssize_t total = 1;
    for (Py_ssize_t m = 0; m < mdim; m++) {
        total *= mesh[m];
    }
    *count = total;
    PyObject *out = PyList_New(total);
    Py_ssize_t idx[DCP_MAX_DIMS] = {0};
    for (Py_ssize_t i = 0; out != NULL && i < total; i++) {
        PyObject *c = ssize_tuple(idx, mdim);
        if (c == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, c);
        for (Py_ssize_t m = mdim - 1; m >= 0; m--) {
            if (++idx[m] < mesh[m]) {
                break;
            }
            idx[m] = 0;
        }
    }
    return out;
}

/* plan_gather(leaves, dtensor_cls, placement_classes, budget)
 *   -> [(mesh, [(segment, pack_items, unpack_items, leaf_indices)])]
 *
 * Groups the DTensor leaves by device mesh (identity), computes every
 * rank's shard layout, and packs the tensors of each mesh into buckets
 * whose all-gathered size stays within `budget` bytes.  pack_items are
 * (local tensor, offset); unpack_items are (offset, dtype, global shape,
 * layouts) with layouts[r] = (nbytes, local_shape, blocks) for the rank at
 * row-major coordinate r, or None where that rank only holds a replica of
 * data another rank provides.  Raises ValueError for Partial placements.
 */
PyObject *
dcp_plan_gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dcp_check_nargs("plan_gather", nargs, 4) < 0) {
        return NULL;
    }
    PyObject *dtensor_cls = args[1], *classes = args[2];
    if (!PyTuple_Check(classes) || PyTuple_GET_SIZE(classes) != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "placement_classes is (Shard, _StridedShard, "
                        "Replicate)");
        return NULL;
    }
    Py_ssize_t budget = PyLong_AsSsize_t(args[3]);
    if (budget == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *leaves = PySequence_Fast(args[0], "leaves must be a sequence");
    if (leaves == NULL) {
        return NULL;
    }
    PyObject *meshes = PyList_New(0), *members = PyList_New(0);
    PyObject *result = NULL;
    if (meshes == NULL || members == NULL) {
        goto done;
    }
    /* group leaf indices by mesh identity */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(leaves); i++) {
        PyObject *leaf = PySequence_Fast_GET_ITEM(leaves, i);
        int is_dt = PyObject_IsInstance(leaf, dtensor_cls);
        if (is_dt < 0) {
            goto done;
        }
        if (!is_dt) {
            continue;
        }
        PyObject *mesh = PyObject_GetAttrString(leaf, "device_mesh"); /* cpylint-ignore: per leaf, DTensor property */
        if (mesh == NULL) {
            goto done;
        }
        Py_ssize_t g = 0, n = PyList_GET_SIZE(meshes);
        while (g < n && PyList_GET_ITEM(meshes, g) != mesh) {
            g++;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        int rc = index == NULL ? -1 : 0;
        if (rc == 0 && g == n) {
            PyObject *list = PyList_New(0);
            rc = (list == NULL || PyList_Append(meshes, mesh) < 0 ||
                  PyList_Append(members, list) < 0)
                     ? -1
                     : 0;
            Py_XDECREF(list);
        }
        if (rc == 0) {
            rc = PyList_Append(PyList_GET_ITEM(members, g), index);
        }
        Py_XDECREF(index);
        Py_DECREF(mesh);
        if (rc < 0) {
            goto done;
        }
    }
    result = PyList_New(0);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(meshes); g++) {
        PyObject *mesh = PyList_GET_ITEM(meshes, g);
        PyObject *idxs = PyList_GET_ITEM(members, g);
        Py_ssize_t nt = PyList_GET_SIZE(idxs);
        Py_ssize_t mshape[DCP_MAX_DIMS], mdim, ncoord;
        PyObject *shape_obj = PyObject_GetAttrString(mesh, "shape"); /* cpylint-ignore: once per mesh */
        int ok = shape_obj != NULL &&
                 parse_shape(shape_obj, mshape, &mdim, "mesh shape") == 0;
        Py_XDECREF(shape_obj);
        if (!ok) {
            Py_CLEAR(result);
            goto done;
        }
        PyObject *coords = mesh_coords(mshape, mdim, &ncoord);
        PyObject *segs = PyList_New(nt), *packs = PyList_New(nt);
        PyObject *unpacks = PyList_New(nt), *buckets = NULL, *plan = NULL;
        ok = coords && segs && packs && unpacks;
        for (Py_ssize_t t = 0; ok && t < nt; t++) {
            Py_ssize_t li = PyLong_AsSsize_t(PyList_GET_ITEM(idxs, t));
            PyObject *leaf = PySequence_Fast_GET_ITEM(leaves, li);
            Py_ssize_t gshape[DCP_MAX_DIMS], ndim, npl;
            placement_t pl[DCP_MAX_DIMS];
            PyObject *shp = PyObject_GetAttrString(leaf, "shape"); /* cpylint-ignore: per leaf */
            PyObject *pls = shp ? PyObject_GetAttrString(leaf, "placements") /* cpylint-ignore: per leaf */
                                : NULL;
            PyObject *dtype = pls ? PyObject_GetAttrString(leaf, "dtype") /* cpylint-ignore: per leaf */
                                  : NULL;
            PyObject *isz = dtype ? PyObject_GetAttrString(dtype, "itemsize") /* cpylint-ignore: per leaf */
                                  : NULL;
            PyObject *local = isz ? PyObject_GetAttrString(leaf, "_local_tensor") /* cpylint-ignore: per leaf */
                                  : NULL;
            Py_ssize_t itemsize = isz ? PyLong_AsSsize_t(isz) : -1;
            ok = local != NULL && itemsize > 0 &&
                 parse_shape(shp, gshape, &ndim, "DTensor shape") == 0;
            PyObject *plseq = ok ? PySequence_Fast(pls, "placements") : NULL;
            ok = plseq != NULL;
            npl = ok ? PySequence_Fast_GET_SIZE(plseq) : 0;
            if (ok && npl != mdim) {
                PyErr_SetString(PyExc_ValueError,
                                "DTensor placements do not match its mesh");
                ok = 0;
            }
            for (Py_ssize_t m = 0; ok && m < npl; m++) {
                ok = encode_placement(PySequence_Fast_GET_ITEM(plseq, m),
                                      classes, &pl[m]) == 0;
                if (ok && pl[m].kind == PL_PARTIAL) {
                    PyErr_SetString(PyExc_ValueError,
                                    "Partial placements cannot be gathered "
                                    "as state");
                    ok = 0;
                }
            }
            Py_XDECREF(plseq);
            PyObject *layouts = ok ? PyList_New(ncoord) : NULL;
            Py_ssize_t seg = 0;
            for (Py_ssize_t r = 0; layouts && r < ncoord; r++) {
                Py_ssize_t coord[DCP_MAX_DIMS], cd;
                int replica = 0;
                parse_shape(PyList_GET_ITEM(coords, r), coord, &cd, "coord");
                for (Py_ssize_t m = 0; m < mdim; m++) {
                    replica |= pl[m].kind == PL_REPLICATE && coord[m] != 0;
                }
                PyObject *lay = shard_layout(gshape, ndim, mshape, mdim,
                                             coord, pl);
                if (lay == NULL) {
                    Py_CLEAR(layouts);
                    break;
                }
                PyObject *lshape = PyTuple_GET_ITEM(lay, 0);
                Py_ssize_t numel = 1;
                for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(lshape); d++) {
                    numel *= PyLong_AsSsize_t(PyTuple_GET_ITEM(lshape, d));
                }
                Py_ssize_t nbytes = numel * itemsize;
                if (nbytes > seg) {
                    seg = nbytes;
                }
                PyObject *entry =
                    replica ? Py_NewRef(Py_None)
                            : Py_BuildValue("(nOO)", nbytes, lshape,
                                            PyTuple_GET_ITEM(lay, 1));
                Py_DECREF(lay);
                if (entry == NULL) {
                    Py_CLEAR(layouts);
                    break;
                }
                PyList_SET_ITEM(layouts, r, entry);
            }
            ok = layouts != NULL;
            if (ok) {
                PyObject *sz = PyLong_FromSsize_t(seg);
                PyObject *up = sz ? Py_BuildValue("(OOOO)", PyList_GET_ITEM(idxs, t),
                                                  dtype, shp, layouts)
                                  : NULL;
                ok = up != NULL;
                if (ok) {
                    PyList_SET_ITEM(segs, t, sz);
                    PyList_SET_ITEM(packs, t, Py_NewRef(local));
                    PyList_SET_ITEM(unpacks, t, up);
                }
                else {
                    Py_XDECREF(sz);
                }
            }
            Py_XDECREF(layouts);
            Py_XDECREF(shp);
            Py_XDECREF(pls);
            Py_XDECREF(dtype);
            Py_XDECREF(isz);
            Py_XDECREF(local);
        }
        if (ok) {
            PyObject *copies = PyLong_FromSsize_t(ncoord);
            PyObject *bud = copies ? PyLong_FromSsize_t(budget) : NULL;
            PyObject *pb[3] = {segs, copies, bud};
            buckets = bud ? dcp_plan_buckets(module, pb, 3) : NULL;
            Py_XDECREF(copies);
            Py_XDECREF(bud);
            ok = buckets != NULL;
        }
        PyObject *bucket_list = ok ? PyList_New(0) : NULL;
        for (Py_ssize_t b = 0; bucket_list && b < PyList_GET_SIZE(buckets);
             b++) {
            PyObject *bk = PyList_GET_ITEM(buckets, b);
            PyObject *seg = PyTuple_GET_ITEM(bk, 0);
            PyObject *items = PyTuple_GET_ITEM(bk, 1);
            Py_ssize_t ni = PyList_GET_SIZE(items);
            PyObject *p_items = PyList_New(ni), *u_items = PyList_New(ni);
            PyObject *l_idx = PyList_New(ni);
            int bok = p_items && u_items && l_idx;
            for (Py_ssize_t k = 0; bok && k < ni; k++) {
                PyObject *it = PyList_GET_ITEM(items, k);
                Py_ssize_t t = PyLong_AsSsize_t(PyTuple_GET_ITEM(it, 0));
                PyObject *off = PyTuple_GET_ITEM(it, 1);
                PyObject *up = PyList_GET_ITEM(unpacks, t);
                PyObject *pi = PyTuple_Pack(2, PyList_GET_ITEM(packs, t), off);
                PyObject *ui = PyTuple_Pack(4, off, PyTuple_GET_ITEM(up, 1),
                                            PyTuple_GET_ITEM(up, 2),
                                            PyTuple_GET_ITEM(up, 3));
                if (pi == NULL || ui == NULL) {
                    Py_XDECREF(pi);
                    Py_XDECREF(ui);
                    bok = 0;
                    break;
                }
                PyList_SET_ITEM(p_items, k, pi);
                PyList_SET_ITEM(u_items, k, ui);
                PyList_SET_ITEM(l_idx, k, Py_NewRef(PyTuple_GET_ITEM(up, 0)));
            }
            PyObject *entry = bok ? PyTuple_Pack(4, seg, p_items, u_items,
                                                 l_idx)
                                  : NULL;
            Py_XDECREF(p_items);
            Py_XDECREF(u_items);
            Py_XDECREF(l_idx);
            if (entry == NULL || PyList_Append(bucket_list, entry) < 0) {
                Py_XDECREF(entry);
                Py_CLEAR(bucket_list);
            }
            Py_XDECREF(entry);
        }
        if (bucket_list != NULL) {
            plan = PyTuple_Pack(2, mesh, bucket_list);
        }
        Py_XDECREF(bucket_list);
        Py_XDECREF(coords);
        Py_XDECREF(segs);
        Py_XDECREF(packs);
        Py_XDECREF(unpacks);
        Py_XDECREF(buckets);
        if (plan == NULL || PyList_Append(result, plan) < 0) {
            Py_XDECREF(plan);
            Py_CLEAR(result);
            goto done;
        }
        Py_DECREF(plan);
    }
done:
    Py_DECREF(leaves);
    Py_XDECREF(meshes);
    Py_XDECREF(members);
    return result;
}
