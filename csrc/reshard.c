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
    if (rl->n > 0 &&
        rl->runs[rl->n - 1].start + rl->runs[rl->n - 1].len == start) {
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
runs_select(const runlist_t *in, Py_ssize_t a, Py_ssize_t len, runlist_t *out)
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

/* a * b for sizes (a, b >= 0); -1 with OverflowError naming `what`
 * when the product does not fit a Py_ssize_t (a (2**31, 2**31) float
 * tensor must not plan as 0 bytes). */
static Py_ssize_t
size_product(Py_ssize_t a, Py_ssize_t b, const char *what)
{
    if (a < 0 || b < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative size", what);
        return -1;
    }
    if (b > 0 && a > PY_SSIZE_T_MAX / b) {
        PyErr_Format(PyExc_OverflowError, "%s: size overflows", what);
        return -1;
    }
    return a * b;
}

/* The number of bytes of a tensor of `shape` (a tuple of ints) with
 * `itemsize`-byte elements; -1 with an exception on a bad or
 * overflowing shape. */
static Py_ssize_t
shape_nbytes(PyObject *shape, Py_ssize_t itemsize, const char *what)
{
    Py_ssize_t n = itemsize;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
        Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (dim == -1 && PyErr_Occurred()) {
            return -1;
        }
        if ((n = size_product(n, dim, what)) < 0) {
            return -1;
        }
    }
    return n;
}

/* torch.chunk-style split of `size` into `n` chunks: chunk `k`. */
static void
chunk_range(Py_ssize_t size,
            Py_ssize_t n,
            Py_ssize_t k,
            Py_ssize_t *start,
            Py_ssize_t *len)
{
    /* Written so that nothing overflows for any size / k (k >= n can
     * come from a caller's coordinate): chunks past the end are empty. */
    Py_ssize_t full = n > 0 ? size / n + (size % n != 0) : 0;
    Py_ssize_t s = (full == 0 || k > size / full) ? size : full * k;
    if (s > size) {
        s = size;
    }
    Py_ssize_t e = full > size - s ? size : s + full;
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
parse_placements(PyObject *obj,
                 placement_t *out,
                 Py_ssize_t max,
                 Py_ssize_t *n)
{
    PyObject *seq = dcp_sequence_fast(obj, "placements must be a sequence");
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
        if (!dcp_parse_tuple(item, "lll", &kind, &dim, &sf)) {
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
    PyObject *seq = dcp_sequence_fast(obj, what);
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
shard_layout(const Py_ssize_t *gshape,
             Py_ssize_t ndim,
             const Py_ssize_t *mesh,
             Py_ssize_t mdim,
             const Py_ssize_t *coord,
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
                         p->dim,
                         ndim);
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
            Py_ssize_t first = size / sf + (size % sf != 0);
            /* Pieces past the end are empty: only the first
             * ceil(size / first) can hold data (a huge split_factor
             * must not mean a huge loop), and first * k stays below
             * size for them. */
            Py_ssize_t pieces =
                first > 0 ? size / first + (size % first != 0) : 0;
            if (pieces > sf) {
                pieces = sf;
            }
            for (Py_ssize_t k = 0; k < pieces; k++) {
                Py_ssize_t fs = first * k;
                Py_ssize_t fe = first > size - fs ? size : fs + first;
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
    PyObject *coords = dcp_sequence_fast(args[3], "coords must be a sequence");
    if (coords == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(coords);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t coord[DCP_MAX_DIMS], cdim;
        if (parse_shape(PySequence_Fast_GET_ITEM(coords, i),
                        coord,
                        &cdim,
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
    PyObject *sizes = dcp_sequence_fast(args[0], "segment_bytes");
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
        if (sz > PY_SSIZE_T_MAX - DCP_ALIGN) {
            PyErr_SetString(PyExc_OverflowError, "segment size too large");
            goto error;
        }
        sz = align_up(sz);
        /* used <= max(budget / copies, largest sz): no overflow */
        int fits = items != NULL && sz <= budget / copies - used;
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
static int
parse_block(PyObject *block, PyObject **ls, PyObject **gs, PyObject **ln)
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
    if (args[4] != Py_None && !dcp_parse_tuple(args[4], "nn", &w0, &wn)) {
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(blocks, "blocks must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *ls, *gs, *ln;
        if (parse_block(block, &ls, &gs, &ln) < 0) {
            Py_DECREF(seq);
            return NULL;
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
                return NULL;
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
    PyObject *seq = dcp_sequence_fast(args[1], "items must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *tensor;
        Py_ssize_t offset;
        if (!dcp_parse_tuple(
                PySequence_Fast_GET_ITEM(seq, i), "On", &tensor, &offset)) {
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

/* One rank's piece of a row-contiguous tensor (see row_pieces). */
typedef struct {
    Py_ssize_t row;    /* first global row */
    Py_ssize_t rows;   /* row count */
    Py_ssize_t start;  /* byte offset in the gathered buffer */
    Py_ssize_t nbytes; /* > 0 */
    PyObject *lshape;  /* borrowed from the layout */
} row_piece_t;

/* Predicate: `block` (local starts, global starts, lengths) is the whole
 * local shard `lshape` and spans every dimension of `gshape` but the
 * first.  Sets *row and *rows to its global dim-0 range.  1 / 0 / -1. */
static int
block_is_rows(PyObject *block,
              PyObject *lshape,
              PyObject *gshape,
              Py_ssize_t *row,
              Py_ssize_t *rows)
{
    PyObject *ls, *gs, *ln;
    if (parse_block(block, &ls, &gs, &ln) < 0) {
        return -1;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(gshape);
    if (PyTuple_GET_SIZE(ls) != nd || PyTuple_GET_SIZE(gs) != nd ||
        PyTuple_GET_SIZE(ln) != nd) {
        return 0;
    }
    int same = PyObject_RichCompareBool(lshape, ln, Py_EQ);
    if (same <= 0) {
        return same;
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        Py_ssize_t l0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(ls, d));
        Py_ssize_t g0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(gs, d));
        Py_ssize_t n0 = PyLong_AsSsize_t(PyTuple_GET_ITEM(ln, d));
        Py_ssize_t full = PyLong_AsSsize_t(PyTuple_GET_ITEM(gshape, d));
        if (PyErr_Occurred()) {
            return -1;
        }
        if (l0 != 0 || (d > 0 && (g0 != 0 || n0 != full))) {
            return 0;
        }
        if (d == 0) {
            *row = g0;
            *rows = n0;
        }
    }
    return 1;
}

/* The pieces of a full tensor whose non-empty shards are each a range of
 * whole rows (dim 0) and together tile it -- FSDP2's Shard(0), even or
 * not -- as typed views of the gathered buffer, in row order, so that one
 * torch.cat assembles the tensor: two torch calls per shard instead of a
 * slice assignment per block.  `typed` caches buffer.view(dtype) per
 * dtype.  Returns a new list, None (not row-contiguous: use the general
 * path), or NULL with an exception set. */
static PyObject *
row_pieces(dcp_state *st,
           PyObject *buffer,
           Py_ssize_t segment,
           Py_ssize_t offset,
           PyObject *dtype,
           PyObject *gshape,
           PyObject *layouts,
           PyObject *typed)
{
    if (!PyTuple_Check(gshape) || PyTuple_GET_SIZE(gshape) == 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t total_rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(gshape, 0));
    if (total_rows == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *lseq = dcp_sequence_fast(layouts, "layouts");
    if (lseq == NULL) {
        return NULL;
    }
    Py_ssize_t nl = PySequence_Fast_GET_SIZE(lseq), count = 0;
    row_piece_t *pc = PyMem_New(row_piece_t, nl > 0 ? nl : 1);
    PyObject *result = NULL, *pieces = NULL, *view = NULL;
    int usable = 1;
    if (pc == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; usable && r < nl; r++) {
        PyObject *layout = PySequence_Fast_GET_ITEM(lseq, r);
        Py_ssize_t nbytes;
        PyObject *lshape, *blocks;
        if (layout == Py_None) {
            continue;
        }
        if (!dcp_parse_tuple(layout, "nOO", &nbytes, &lshape, &blocks)) {
            goto done;
        }
        if (nbytes == 0) {
            continue;
        }
        if (!PyList_Check(blocks) || PyList_GET_SIZE(blocks) != 1 ||
            !PyTuple_Check(lshape)) {
            usable = 0;
            break;
        }
        int rc = block_is_rows(PyList_GET_ITEM(blocks, 0),
                               lshape,
                               gshape,
                               &pc[count].row,
                               &pc[count].rows);
        if (rc < 0) {
            goto done;
        }
        usable = rc;
        pc[count].start = r * segment + offset;
        pc[count].nbytes = nbytes;
        pc[count].lshape = lshape;
        count += rc;
    }
    /* insertion sort by first row (a handful of ranks), then the pieces
     * must tile [0, total_rows) with rows of equal byte size */
    for (Py_ssize_t i = 1; usable && i < count; i++) {
        row_piece_t cur = pc[i];
        Py_ssize_t j = i;
        while (j > 0 && pc[j - 1].row > cur.row) {
            pc[j] = pc[j - 1];
            j--;
        }
        pc[j] = cur;
    }
    Py_ssize_t next = 0, itemsize = 0;
    for (Py_ssize_t i = 0; usable && i < count; i++) {
        Py_ssize_t numel = shape_nbytes(pc[i].lshape, 1, "row pieces");
        if (numel < 0) {
            goto done;
        }
        Py_ssize_t isz = numel > 0 ? pc[i].nbytes / numel : 0;
        usable = pc[i].row == next && isz > 0 && isz * numel == pc[i].nbytes &&
                 pc[i].start % isz == 0 && (itemsize == 0 || isz == itemsize);
        itemsize = isz;
        next += pc[i].rows;
    }
    if (!usable || count == 0 || next != total_rows) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (dcp_dict_get_ref(typed, dtype, &view) < 0) {
        goto done;
    }
    if (view == NULL) {
        PyObject *vargs[2] = {buffer, dtype};
        view = PyObject_VectorcallMethod(
            st->str_view, vargs, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (view == NULL || PyDict_SetItem(typed, dtype, view) < 0) {
            goto done;
        }
    }
    pieces = PyList_New(count);
    for (Py_ssize_t i = 0; pieces != NULL && i < count; i++) {
        PyObject *flat =
            byte_window(view, pc[i].start / itemsize, pc[i].nbytes / itemsize);
        PyObject *piece = flat;
        if (flat != NULL && PyTuple_GET_SIZE(pc[i].lshape) > 1) {
            PyObject *a[2] = {flat, pc[i].lshape};
            piece = PyObject_VectorcallMethod(
                st->str_view, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_DECREF(flat);
        }
        if (piece == NULL) {
            goto done;
        }
        PyList_SET_ITEM(pieces, i, piece);
    }
    if (pieces != NULL) {
        result = Py_NewRef(pieces);
    }
done:
    PyMem_Free(pc);
    Py_XDECREF(pieces);
    Py_XDECREF(view);
    Py_DECREF(lseq);
    return result;
}

/* unpack_gathered(buffer, segment, items, empty, device, results,
 *                 indices, offload[, cat])
 *
 * `buffer` holds R equal segments of `segment` bytes, one per rank in
 * row-major mesh order.  items: [(offset, dtype, global_shape, layouts)]
 * where layouts[r] is None (skip) or (nbytes, local_shape, blocks) for
 * rank r.  Each full tensor is assembled -- by cat(pieces) when its
 * shards are whole-row ranges (row_pieces) and `cat` is given, else
 * created with empty(global_shape, dtype=dtype, device=device) and filled
 * block by block --, moved to `offload` unless that is None, and stored
 * in results[indices[k]].  Returns None. */
PyObject *
dcp_unpack_gathered(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (nargs != 8 && nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "unpack_gathered() takes 8 or 9 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    PyObject *buffer = args[0], *empty = args[3], *device = args[4];
    PyObject *results = args[5], *offload = args[7];
    PyObject *cat = nargs == 9 ? args[8] : Py_None;
    Py_ssize_t segment = PyLong_AsSsize_t(args[1]);
    if (segment == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_Check(results)) {
        PyErr_SetString(PyExc_TypeError, "results must be a list");
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(args[2], "items must be a sequence");
    PyObject *idx = seq ? dcp_sequence_fast(args[6], "indices") : NULL;
    PyObject *typed = idx ? PyDict_New() : NULL; /* dtype -> typed buffer */
    if (typed == NULL) {
        Py_XDECREF(seq);
        Py_XDECREF(idx);
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
        if (!dcp_parse_tuple(PySequence_Fast_GET_ITEM(seq, i),
                             "nOOO",
                             &offset,
                             &dtype,
                             &gshape,
                             &layouts)) {
            goto error;
        }
        PyObject *full = NULL;
        if (cat != Py_None) {
            PyObject *pieces = row_pieces(
                st, buffer, segment, offset, dtype, gshape, layouts, typed);
            if (pieces == NULL) {
                goto error;
            }
            if (pieces != Py_None) {
                full = PyObject_CallOneArg(cat, pieces);
                Py_DECREF(pieces);
                if (full == NULL) {
                    goto error;
                }
            }
            else {
                Py_DECREF(pieces);
            }
        }
        int assembled = full != NULL;
        if (!assembled) {
            PyObject *kwargs =
                Py_BuildValue("{sOsO}", "dtype", dtype, "device", device);
            PyObject *cargs = kwargs ? PyTuple_Pack(1, gshape) : NULL;
            full = cargs ? PyObject_Call(empty, cargs, kwargs) : NULL;
            Py_XDECREF(kwargs);
            Py_XDECREF(cargs);
            if (full == NULL) {
                goto error;
            }
        }
        PyObject *lseq =
            assembled ? NULL : dcp_sequence_fast(layouts, "layouts");
        int ok = assembled || lseq != NULL;
        for (Py_ssize_t r = 0;
             ok && lseq && r < PySequence_Fast_GET_SIZE(lseq);
             r++) {
            PyObject *layout = PySequence_Fast_GET_ITEM(lseq, r);
            Py_ssize_t nbytes;
            PyObject *lshape, *blocks;
            if (layout == Py_None) {
                continue;
            }
            if (!dcp_parse_tuple(layout, "nOO", &nbytes, &lshape, &blocks)) {
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
    Py_DECREF(typed);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    Py_DECREF(idx);
    Py_DECREF(typed);
    return NULL;
}

/* extract_rows(buffer, items, dests)
 *
 * Stream receive side.  items: [(offset, nbytes, dtype, chunk_shape,
 * row_start, job, blocks), ...]: the chunk of rows [row_start,
 * row_start + chunk_shape[0]) of a full tensor sits at buffer[offset:];
 * dests[job] is where it goes (None: not needed on this rank); blocks
 * None means dest is the full tensor (the rows are copied to the same
 * rows), else dest is a local shard and the blocks (local <- global) are
 * clipped to the rows. */
PyObject *
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
        PyObject *win = byte_window(args[0], offset, nbytes);
        PyObject *chunk = win ? typed_view(st, win, dtype, cshape) : NULL;
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
        PyObject *dim = PyObject_GetAttrString(
            p, "dim"); /* cpylint-ignore: placement objects, cold */
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
        PyObject *sf = PyObject_GetAttrString(
            p, "split_factor"); /* cpylint-ignore: cold */
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

/* plan_gather(leaves, dtensor_cls, placement_classes, budget[, floor])
 *   -> [(mesh, [(segment, pack_items, unpack_items, leaf_indices)],
 *        signature, leaf_indices, budget)]
 *
 * Groups the DTensor leaves by device mesh (identity), computes every
 * rank's shard layout, and packs the tensors of each mesh into buckets
 * whose all-gathered size stays within the budget.  pack_items are
 * (local tensor, offset); unpack_items are (offset, dtype, global shape,
 * layouts) with layouts[r] = (nbytes, local_shape, blocks) for the rank at
 * row-major coordinate r, or None where that rank only holds a replica of
 * data another rank provides.  Raises ValueError for Partial placements.
 *
 * floor > 0 makes the budget adaptive, per mesh: max(floor, the largest
 * gathered tensor), at most `budget`; floor 0 (the default) uses `budget`
 * as given.  The budget used is the last item of each mesh's plan.
 */
PyObject *
dcp_plan_gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (nargs != 4 && nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "plan_gather() takes 4 or 5 arguments (%zd given)",
                     nargs);
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
    Py_ssize_t floor_bytes = nargs == 5 ? PyLong_AsSsize_t(args[4]) : 0;
    if (floor_bytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *leaves = dcp_sequence_fast(args[0], "leaves must be a sequence");
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
        PyObject *mesh = PyObject_GetAttr(leaf, st->str_device_mesh);
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
        PyObject *shape_obj = PyObject_GetAttr(mesh, st->str_shape);
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
        PyObject *signature = PyList_New(nt);
        ok = coords && segs && packs && unpacks && signature;
        for (Py_ssize_t t = 0; ok && t < nt; t++) {
            Py_ssize_t li = PyLong_AsSsize_t(PyList_GET_ITEM(idxs, t));
            PyObject *leaf = PySequence_Fast_GET_ITEM(leaves, li);
            Py_ssize_t gshape[DCP_MAX_DIMS], ndim, npl;
            placement_t pl[DCP_MAX_DIMS];
            PyObject *shp = PyObject_GetAttr(leaf, st->str_shape);
            PyObject *pls =
                shp ? PyObject_GetAttr(leaf, st->str_placements) : NULL;
            PyObject *dtype =
                pls ? PyObject_GetAttr(leaf, st->str_dtype) : NULL;
            PyObject *isz =
                dtype ? PyObject_GetAttrString(
                            dtype, "itemsize") /* cpylint-ignore: per leaf */
                      : NULL;
            PyObject *local =
                isz ? PyObject_GetAttr(leaf, st->str_local_tensor) : NULL;
            Py_ssize_t itemsize = isz ? PyLong_AsSsize_t(isz) : -1;
            ok = local != NULL && itemsize > 0 &&
                 parse_shape(shp, gshape, &ndim, "DTensor shape") == 0;
            PyObject *plseq = ok ? dcp_sequence_fast(pls, "placements") : NULL;
            ok = plseq != NULL;
            npl = ok ? PySequence_Fast_GET_SIZE(plseq) : 0;
            if (ok && npl != mdim) {
                PyErr_SetString(PyExc_ValueError,
                                "DTensor placements do not match its mesh");
                ok = 0;
            }
            for (Py_ssize_t m = 0; ok && m < npl; m++) {
                ok = encode_placement(PySequence_Fast_GET_ITEM(plseq, m),
                                      classes,
                                      &pl[m]) == 0;
                if (ok && pl[m].kind == PL_PARTIAL) {
                    PyErr_SetString(PyExc_ValueError,
                                    "Partial placements cannot be gathered "
                                    "as state");
                    ok = 0;
                }
            }
            Py_XDECREF(plseq);
            if (ok) {
                /* (shape, placements, itemsize): what every rank of the
                 * mesh must agree on before the collectives start */
                PyObject *enc = PyTuple_New(npl);
                for (Py_ssize_t m = 0; enc && m < npl; m++) {
                    PyObject *e = Py_BuildValue(
                        "(inn)", pl[m].kind, pl[m].dim, pl[m].split_factor);
                    if (e == NULL) {
                        Py_CLEAR(enc);
                        break;
                    }
                    PyTuple_SET_ITEM(enc, m, e);
                }
                PyObject *gt = enc ? ssize_tuple(gshape, ndim) : NULL;
                PyObject *sig =
                    gt ? Py_BuildValue("(OOn)", gt, enc, itemsize) : NULL;
                Py_XDECREF(enc);
                Py_XDECREF(gt);
                ok = sig != NULL;
                if (ok) {
                    PyList_SET_ITEM(signature, t, sig);
                }
            }
            PyObject *layouts = ok ? PyList_New(ncoord) : NULL;
            Py_ssize_t seg = 0;
            for (Py_ssize_t r = 0; layouts && r < ncoord; r++) {
                Py_ssize_t coord[DCP_MAX_DIMS], cd;
                int replica = 0;
                parse_shape(PyList_GET_ITEM(coords, r), coord, &cd, "coord");
                for (Py_ssize_t m = 0; m < mdim; m++) {
                    replica |= pl[m].kind == PL_REPLICATE && coord[m] != 0;
                }
                PyObject *lay =
                    shard_layout(gshape, ndim, mshape, mdim, coord, pl);
                if (lay == NULL) {
                    Py_CLEAR(layouts);
                    break;
                }
                PyObject *lshape = PyTuple_GET_ITEM(lay, 0);
                Py_ssize_t nbytes =
                    shape_nbytes(lshape, itemsize, "gather plan");
                if (nbytes < 0) {
                    Py_DECREF(lay);
                    Py_CLEAR(layouts);
                    break;
                }
                if (nbytes > seg) {
                    seg = nbytes;
                }
                PyObject *entry =
                    replica ? Py_NewRef(Py_None)
                            : Py_BuildValue("(nOO)",
                                            nbytes,
                                            lshape,
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
                PyObject *up = sz ? Py_BuildValue("(OOOO)",
                                                  PyList_GET_ITEM(idxs, t),
                                                  dtype,
                                                  shp,
                                                  layouts)
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
        Py_ssize_t mesh_budget = budget;
        if (ok && floor_bytes > 0) {
            /* adaptive: room for the largest gathered tensor, at least
             * the floor, at most the given budget */
            Py_ssize_t largest = 0;
            for (Py_ssize_t t = 0; t < nt; t++) {
                Py_ssize_t seg = PyLong_AsSsize_t(PyList_GET_ITEM(segs, t));
                if (align_up(seg) > largest) {
                    largest = align_up(seg);
                }
            }
            largest = ncoord < 1 || largest > budget / ncoord
                          ? budget
                          : largest * ncoord;
            mesh_budget = largest > floor_bytes ? largest : floor_bytes;
            if (mesh_budget > budget) {
                mesh_budget = budget;
            }
        }
        if (ok) {
            PyObject *copies = PyLong_FromSsize_t(ncoord);
            PyObject *bud = copies ? PyLong_FromSsize_t(mesh_budget) : NULL;
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
                PyObject *ui = PyTuple_Pack(4,
                                            off,
                                            PyTuple_GET_ITEM(up, 1),
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
            PyObject *entry =
                bok ? PyTuple_Pack(4, seg, p_items, u_items, l_idx) : NULL;
            Py_XDECREF(p_items);
            Py_XDECREF(u_items);
            Py_XDECREF(l_idx);
            if (entry == NULL || PyList_Append(bucket_list, entry) < 0) {
                Py_CLEAR(bucket_list);
            }
            Py_XDECREF(entry);
        }
        if (bucket_list != NULL) {
            plan = Py_BuildValue(
                "(OOOOn)", mesh, bucket_list, signature, idxs, mesh_budget);
        }
        Py_XDECREF(bucket_list);
        Py_XDECREF(coords);
        Py_XDECREF(segs);
        Py_XDECREF(packs);
        Py_XDECREF(unpacks);
        Py_XDECREF(signature);
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
    if (parse_shape(gshape_obj, gshape, &ndim, "shape") < 0 ||
        parse_shape(mshape_obj, mshape, &mdim, "mesh shape") < 0 ||
        parse_shape(coord, c, &cdim, "coordinate") < 0) {
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
        ok = encode_placement(
                 PySequence_Fast_GET_ITEM(seq, m), classes, &pl[m]) == 0;
    }
    Py_DECREF(seq);
    if (ok) {
        for (Py_ssize_t m = 0; m < mdim; m++) {
            if (pl[m].kind == PL_PARTIAL) {
                pl[m].kind = PL_REPLICATE; /* loads hold full values */
            }
        }
        result = shard_layout(gshape, ndim, mshape, mdim, c, pl);
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
PyObject *
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
                none = copy_into(st, dest, value) == 0 ? Py_NewRef(Py_None)
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
            Py_ssize_t need = align_up(nbytes);
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

/* pack_rows(buffer, src_items, values, uint8): the source side of a
 * stream bucket; src_items as plan_full_load returns them. */
PyObject *
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
        PyObject *bytes = rows ? tensor_bytes(st, rows, args[3]) : NULL;
        Py_XDECREF(rows);
        if (bytes == NULL) {
            goto error;
        }
        Py_ssize_t nbytes = PyObject_Length(bytes);
        int rc = nbytes < 0 ? -1 : 0;
        if (nbytes > 0) {
            PyObject *win = byte_window(args[0], offset, nbytes);
            rc = win ? copy_into(st, win, bytes) : -1;
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

/* finish_full_load(jobs, dests, layouts, from_local, offload) -> values
 *
 * The loaded value of each job: DTensor.from_local(dest, mesh,
 * placements, shape=, stride=) for DTensor templates, else dest; moved to
 * `offload` when it is not None (plain results only). */
PyObject *
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

/* to_metadata(leaves, meta_cls, tensor_cls) -> what a stream sends ahead
 * of the data: 0-dim tensors as CPU values, other tensors as
 * meta_cls(shape tuple, dtype). */
PyObject *
dcp_to_metadata(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("to_metadata", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *seq = dcp_sequence_fast(args[0], "leaves");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *v = NULL;
        int is_tensor = PyObject_IsInstance(t, args[2]);
        if (is_tensor == 0) {
            v = Py_NewRef(t);
        }
        else if (is_tensor > 0) {
            PyObject *shape = PyObject_GetAttr(t, st->str_shape);
            PyObject *tup = shape ? PySequence_Tuple(shape) : NULL;
            Py_XDECREF(shape);
            if (tup != NULL && PyTuple_GET_SIZE(tup) == 0) {
                v = PyObject_CallMethodNoArgs(t, st->str_cpu);
            }
            else if (tup != NULL) {
                PyObject *dtype = PyObject_GetAttr(t, st->str_dtype);
                v = dtype ? PyObject_CallFunctionObjArgs(
                                args[1], tup, dtype, NULL)
                          : NULL;
                Py_XDECREF(dtype);
            }
            Py_XDECREF(tup);
        }
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

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
PyObject *
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
    items = dcp_items_list(state);
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
            pshape =
                param_dt >= 0 ? PyObject_GetAttr(param, st->str_shape) : NULL;
            device = pshape ? PyObject_GetAttr(param, st->str_device) : NULL;
            ok = device != NULL;
            if (ok && param_dt) {
                PyObject *local =
                    PyObject_GetAttr(param, st->str_local_tensor);
                lshape = local ? PyObject_GetAttr(local, st->str_shape) : NULL;
                Py_XDECREF(local);
                ok = lshape != NULL;
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
            PyObject *sub = ok ? dcp_items_list(src) : NULL;
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
                if (val_dt) {
                    continue; /* already sharded */
                }
                PyObject *vshape = PyObject_GetAttr(val, st->str_shape);
                PyObject *vt = vshape ? PySequence_Tuple(vshape) : NULL;
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

/* write_slots(slots, values): container[key] = value for each pair. */
PyObject *
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
PyObject *
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
    PyObject *items = dcp_items_list(meta);
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

/* shape_mismatches(jobs, tensor_cls) -> [(i, job shape, template shape)]
 * for jobs whose template (a tensor) has another shape than the value. */
PyObject *
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
