/* Shard geometry: where the shard of a DTensor at a mesh coordinate lives
 * in the full tensor, from the mesh shape and the placements.
 *
 * DTensor shards a tensor dimension by dimension, mesh dimension by mesh
 * dimension, left to right (torch's _compute_local_shape_and_global_offset):
 * Shard(d) splits the current extent of dim d into mesh-size chunks the way
 * torch.chunk does (ceil sized, the last ones short or empty);
 * _StridedShard(d, split_factor) first splits into split_factor pieces and
 * takes this rank's chunk of each.  We track, per tensor dimension, the
 * global indices the local shard covers as a short list of runs (start,
 * length) in local order; a plain Shard keeps one run, a strided one up to
 * split_factor.  The cartesian product of the runs of all dimensions gives
 * the blocks: (local start, global start, length) per dimension, each a
 * sub-box that a single slice assignment moves.
 *
 * Owns: runs, chunk ranges, shape and placement parsing, overflow-checked
 * byte sizes, shard_layout / shard_layouts, encode_placement.
 */
#include "dcp.h"

#define DCP_MAX_RUNS 4096 /* runs per dim: split_factor products */

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
Py_ssize_t
dcp_size_product(Py_ssize_t a, Py_ssize_t b, const char *what)
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
Py_ssize_t
dcp_shape_nbytes(PyObject *shape, Py_ssize_t itemsize, const char *what)
{
    if (!PyTuple_Check(shape)) {
        PyErr_Format(PyExc_TypeError, "%s: shape is a tuple", what);
        return -1;
    }
    Py_ssize_t n = itemsize;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
        Py_ssize_t dim = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (dim == -1 && PyErr_Occurred()) {
            return -1;
        }
        if ((n = dcp_size_product(n, dim, what)) < 0) {
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

int
dcp_parse_placements(PyObject *obj,
                     placement_t *out,
                     Py_ssize_t max,
                     Py_ssize_t *n,
                     int allow_partial)
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
        if (kind < PL_REPLICATE ||
            kind > (allow_partial ? PL_PARTIAL : PL_STRIDED) || dim < 0 ||
            sf < 1) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError,
                            allow_partial
                                ? "bad placement tuple"
                                : "bad placement tuple (a Partial placement "
                                  "cannot be resharded)");
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

int
dcp_parse_shape(PyObject *obj,
                Py_ssize_t *out,
                Py_ssize_t *n,
                const char *what)
{
    char message[128];
    PyOS_snprintf(message, sizeof(message), "%s must be a sequence", what);
    PyObject *seq = dcp_sequence_fast(obj, message);
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

PyObject *
dcp_ssize_tuple(const Py_ssize_t *v, Py_ssize_t n)
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
PyObject *
dcp_shard_layout(const Py_ssize_t *gshape,
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
            PyObject *lt = dcp_ssize_tuple(ls, ndim);
            PyObject *gt = lt ? dcp_ssize_tuple(gs, ndim) : NULL;
            PyObject *nt = gt ? dcp_ssize_tuple(ln, ndim) : NULL;
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
    PyObject *lshape = dcp_ssize_tuple(local, ndim);
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

PyDoc_STRVAR(
    dcp_shard_layouts__doc__,
    "shard_layouts(global_shape, mesh_shape, placements, coords, /)\n--\n\n"
    "(local_shape, blocks) of the shard at each mesh coordinate.");

/* shard_layouts(global_shape, mesh_shape, placements, coords)
 *   -> [(local_shape, blocks) per coordinate] */
static PyObject *
dcp_shard_layouts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t gshape[DCP_MAX_DIMS], mesh[DCP_MAX_DIMS];
    Py_ssize_t ndim, mdim, npl;
    placement_t pl[DCP_MAX_DIMS];
    if (dcp_check_nargs("shard_layouts", nargs, 4) < 0 ||
        dcp_parse_shape(args[0], gshape, &ndim, "global_shape") < 0 ||
        dcp_parse_shape(args[1], mesh, &mdim, "mesh_shape") < 0 ||
        dcp_parse_placements(args[2], pl, DCP_MAX_DIMS, &npl, 1) < 0) {
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
        if (dcp_parse_shape(PySequence_Fast_GET_ITEM(coords, i),
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
        PyObject *layout =
            dcp_shard_layout(gshape, ndim, mesh, mdim, coord, pl);
        if (layout == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, layout);
    }
    Py_DECREF(coords);
    return out;
}

/* Encodes one Placement object as (kind, dim, split_factor). */
int
dcp_encode_placement(dcp_state *st,
                     PyObject *p,
                     PyObject *classes,
                     placement_t *out)
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
        PyObject *dim = PyObject_GetAttr(p, st->str_dim);
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
        PyObject *sf = PyObject_GetAttr(p, st->str_split_factor);
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

PyMethodDef dcp_shard_geometry_methods[] = {
    {"shard_layouts",
     DCP_FASTCALL(dcp_shard_layouts),
     METH_FASTCALL,
     dcp_shard_layouts__doc__},
    {NULL, NULL, 0, NULL},
};
