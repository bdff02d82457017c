/* In-memory resharding plans: which boxes of a tensor move between which
 * ranks when its shards go from one layout (mesh A, placements A) to
 * another (mesh B, placements B) over the same ranks or a subset.
 *
 * Both layouts come from the shard geometry of shard_geometry.c
 * (dcp_shard_layout: the blocks (local start, global start, length) of
 * the shard at a mesh coordinate).  Source coordinates that differ only
 * on Replicate mesh dimensions hold the same data: they form one group,
 * and every byte a destination rank needs comes from exactly one holder
 * of the group that owns it -- the destination rank itself when it is a
 * holder (a local copy), else holders[dst_rank % n_holders].  Sender and
 * receiver compute that choice alike, and both enumerate the boxes of a
 * (source, destination) pair in the same order (destination block, then
 * source block), so the i-th box sent is the i-th box received.
 *
 * A rank computes only its own part: the boxes it receives (one pass over
 * the source groups) and the boxes it sends (one pass over the
 * destination coordinates).
 *
 * Owns: reshard_plan.
 */
#include "dcp.h"

typedef struct {
    Py_ssize_t ls[DCP_MAX_DIMS];
    Py_ssize_t gs[DCP_MAX_DIMS];
    Py_ssize_t ln[DCP_MAX_DIMS];
} rblock_t;

typedef struct {
    rblock_t *blocks;
    Py_ssize_t n;
} rlayout_t;

typedef struct {
    Py_ssize_t shape[DCP_MAX_DIMS];
    Py_ssize_t mdim;
    placement_t pl[DCP_MAX_DIMS];
    Py_ssize_t *ranks; /* one global rank per coordinate, row-major */
    Py_ssize_t size;   /* number of coordinates */
} rmesh_t;

static void
rmesh_free(rmesh_t *m)
{
    PyMem_Free(m->ranks);
    m->ranks = NULL;
}

/* Parses (mesh_shape, placements, ranks) into `m`.  0 / -1. */
static int
parse_rmesh(PyObject *shape,
            PyObject *placements,
            PyObject *ranks,
            const char *side,
            rmesh_t *m)
{
    Py_ssize_t npl;
    m->ranks = NULL;
    if (dcp_parse_shape(shape, m->shape, &m->mdim, "mesh_shape") < 0 ||
        dcp_parse_placements(placements, m->pl, DCP_MAX_DIMS, &npl, 0) < 0) {
        return -1;
    }
    if (npl != m->mdim) {
        PyErr_Format(PyExc_ValueError,
                     "%s: one placement per mesh dimension is required",
                     side);
        return -1;
    }
    m->size = 1;
    for (Py_ssize_t d = 0; d < m->mdim; d++) {
        m->size = dcp_size_product(m->size, m->shape[d], "mesh size");
        if (m->size < 0) {
            return -1;
        }
    }
    PyObject *seq = dcp_sequence_fast(ranks, "ranks must be a sequence");
    if (seq == NULL) {
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != m->size) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError,
                     "%s: %zd ranks for a mesh of %zd coordinates",
                     side,
                     PySequence_Fast_GET_SIZE(seq),
                     m->size);
        return -1;
    }
    m->ranks =
        PyMem_Calloc((size_t)(m->size ? m->size : 1), sizeof(Py_ssize_t));
    if (m->ranks == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < m->size; i++) {
        Py_ssize_t r = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (r == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            rmesh_free(m);
            return -1;
        }
        if (r < 0) {
            Py_DECREF(seq);
            rmesh_free(m);
            PyErr_Format(PyExc_ValueError, "%s: negative rank", side);
            return -1;
        }
        m->ranks[i] = r;
    }
    Py_DECREF(seq);
    return 0;
}

static void
coord_of(const rmesh_t *m, Py_ssize_t index, Py_ssize_t *coord)
{
    for (Py_ssize_t d = m->mdim - 1; d >= 0; d--) {
        coord[d] = index % m->shape[d];
        index /= m->shape[d];
    }
}

static Py_ssize_t
index_of(const rmesh_t *m, const Py_ssize_t *coord)
{
    Py_ssize_t index = 0;
    for (Py_ssize_t d = 0; d < m->mdim; d++) {
        index = index * m->shape[d] + coord[d];
    }
    return index;
}

/* The layout of the shard at linear coordinate `index` as C blocks. */
static int
layout_at(const Py_ssize_t *gshape,
          Py_ssize_t ndim,
          const rmesh_t *m,
          Py_ssize_t index,
          rlayout_t *out)
{
    Py_ssize_t coord[DCP_MAX_DIMS];
    out->blocks = NULL;
    out->n = 0;
    coord_of(m, index, coord);
    PyObject *layout =
        dcp_shard_layout(gshape, ndim, m->shape, m->mdim, coord, m->pl);
    if (layout == NULL) {
        return -1;
    }
    PyObject *blocks = PyTuple_GET_ITEM(layout, 1); /* a list */
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    out->blocks = PyMem_Calloc((size_t)(n ? n : 1), sizeof(rblock_t));
    if (out->blocks == NULL) {
        Py_DECREF(layout);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *ls, *gs, *ln;
        if (dcp_parse_block(PyList_GET_ITEM(blocks, b), &ls, &gs, &ln) < 0) {
            goto error;
        }
        for (Py_ssize_t d = 0; d < ndim; d++) {
            rblock_t *rb = &out->blocks[b];
            rb->ls[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(ls, d));
            rb->gs[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(gs, d));
            rb->ln[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(ln, d));
            if (PyErr_Occurred()) {
                goto error;
            }
        }
    }
    out->n = n;
    Py_DECREF(layout);
    return 0;
error:
    Py_DECREF(layout);
    PyMem_Free(out->blocks);
    out->blocks = NULL;
    return -1;
}

/* The group representative of source coordinate `index`: the coordinate
 * with every Replicate mesh dimension at 0. */
static Py_ssize_t
group_of(const rmesh_t *m, Py_ssize_t index)
{
    Py_ssize_t coord[DCP_MAX_DIMS];
    coord_of(m, index, coord);
    for (Py_ssize_t d = 0; d < m->mdim; d++) {
        if (m->pl[d].kind == PL_REPLICATE) {
            coord[d] = 0;
        }
    }
    return index_of(m, coord);
}

/* The rank of group `rep` that serves destination rank `dst`: `dst`
 * itself when it holds the group's data (pos maps a rank to its source
 * coordinate, or -1), else holders[dst % n]. */
static Py_ssize_t
choose_holder(const rmesh_t *m,
              const Py_ssize_t *offsets,
              const Py_ssize_t *holders,
              const Py_ssize_t *pos,
              Py_ssize_t maxr,
              Py_ssize_t rep,
              Py_ssize_t dst)
{
    if (dst <= maxr && pos[dst] >= 0 && group_of(m, pos[dst]) == rep) {
        return dst;
    }
    Py_ssize_t lo = offsets[rep], hi = offsets[rep + 1];
    return m->ranks[holders[lo + dst % (hi - lo)]];
}

/* Whether the layout is "simple": no _StridedShard and every tensor
 * dimension split by at most one mesh dimension.  Then the shard at a
 * coordinate is one box, chunk coord[m] of dim tdim[m] along each
 * sharded mesh dimension m, and the coordinates whose box meets a given
 * box form a product of ranges (chunk_span): planning visits only
 * those. */
static int
simple_layout(const rmesh_t *m, Py_ssize_t ndim, Py_ssize_t *tdim)
{
    int used[DCP_MAX_DIMS] = {0};
    for (Py_ssize_t d = 0; d < m->mdim; d++) {
        tdim[d] = -1;
        if (m->shape[d] <= 0 || m->pl[d].kind == PL_STRIDED) {
            return 0;
        }
        if (m->pl[d].kind == PL_SHARD) {
            Py_ssize_t t = m->pl[d].dim;
            if (t >= ndim || used[t]) {
                return 0; /* the general path reports or handles it */
            }
            used[t] = 1;
            tdim[d] = t;
        }
    }
    return 1;
}

/* [k0, k1): the torch.chunk chunks of a dimension of `size` split `n`
 * ways that meet [lo, lo + len). */
static void
chunk_span(Py_ssize_t size,
           Py_ssize_t n,
           Py_ssize_t lo,
           Py_ssize_t len,
           Py_ssize_t *k0,
           Py_ssize_t *k1)
{
    Py_ssize_t full = size / n + (size % n != 0);
    *k0 = *k1 = 0;
    if (full == 0 || len <= 0) {
        return;
    }
    *k0 = lo / full;
    *k1 = (lo + len - 1) / full + 1;
    if (*k1 > n) {
        *k1 = n;
    }
    if (*k0 > *k1) {
        *k0 = *k1;
    }
}

/* The coordinate ranges of mesh `m` (simple, tdim) whose shard meets the
 * box `b`; `all_replicas`: Replicate dimensions span the whole mesh
 * dimension (destinations) or only coordinate 0 (source groups).
 * Returns 0 when some range is empty. */
static int
meeting_ranges(const rmesh_t *m,
               const Py_ssize_t *tdim,
               const Py_ssize_t *gshape,
               const rblock_t *b,
               int all_replicas,
               Py_ssize_t *k0,
               Py_ssize_t *k1)
{
    for (Py_ssize_t d = 0; d < m->mdim; d++) {
        if (tdim[d] < 0) {
            k0[d] = 0;
            k1[d] = all_replicas ? m->shape[d] : 1;
        }
        else {
            Py_ssize_t t = tdim[d];
            chunk_span(
                gshape[t], m->shape[d], b->gs[t], b->ln[t], &k0[d], &k1[d]);
        }
        if (k0[d] >= k1[d]) {
            return 0;
        }
    }
    return 1;
}

/* Advances the odometer `c` over the ranges [k0, k1); 0 when done. */
static int
odometer_next(Py_ssize_t *c,
              const Py_ssize_t *k0,
              const Py_ssize_t *k1,
              Py_ssize_t mdim)
{
    for (Py_ssize_t d = mdim - 1; d >= 0; d--) {
        if (++c[d] < k1[d]) {
            return 1;
        }
        c[d] = k0[d];
    }
    return 0;
}

/* Appends the intersections of destination layout `dl` with source
 * layout `sl` to `out`, as (peer, src_lstart, dst_lstart, lengths) or,
 * with peer < 0, as (src_lstart, dst_lstart, lengths). */
static int
intersect_into(PyObject *out,
               Py_ssize_t peer,
               const rlayout_t *sl,
               const rlayout_t *dl,
               Py_ssize_t ndim)
{
    for (Py_ssize_t i = 0; i < dl->n; i++) {
        const rblock_t *db = &dl->blocks[i];
        for (Py_ssize_t j = 0; j < sl->n; j++) {
            const rblock_t *sb = &sl->blocks[j];
            Py_ssize_t so[DCP_MAX_DIMS], doff[DCP_MAX_DIMS], ln[DCP_MAX_DIMS];
            int empty = 0;
            for (Py_ssize_t d = 0; d < ndim && !empty; d++) {
                Py_ssize_t lo = db->gs[d] > sb->gs[d] ? db->gs[d] : sb->gs[d];
                Py_ssize_t de = db->gs[d] + db->ln[d];
                Py_ssize_t se = sb->gs[d] + sb->ln[d];
                Py_ssize_t hi = de < se ? de : se;
                empty = lo >= hi;
                so[d] = sb->ls[d] + (lo - sb->gs[d]);
                doff[d] = db->ls[d] + (lo - db->gs[d]);
                ln[d] = hi - lo;
            }
            if (empty) {
                continue;
            }
            PyObject *st = dcp_ssize_tuple(so, ndim);
            PyObject *dt = st ? dcp_ssize_tuple(doff, ndim) : NULL;
            PyObject *lt = dt ? dcp_ssize_tuple(ln, ndim) : NULL;
            PyObject *item = NULL;
            if (lt != NULL) {
                item = peer < 0 ? PyTuple_Pack(3, st, dt, lt)
                                : Py_BuildValue("(nOOO)", peer, st, dt, lt);
            }
            Py_XDECREF(st);
            Py_XDECREF(dt);
            Py_XDECREF(lt);
            if (item == NULL || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                return -1;
            }
            Py_DECREF(item);
        }
    }
    return 0;
}

PyDoc_STRVAR(
    dcp_reshard_plan__doc__,
    "reshard_plan(global_shape, src_mesh_shape, src_placements, src_ranks,\n"
    "             dst_mesh_shape, dst_placements, dst_ranks, rank, /)\n--\n\n"
    "This rank's part of moving a tensor from the source layout to the\n"
    "destination layout: (local, recv, send).  local: [(src_lstart,\n"
    "dst_lstart, lengths)] boxes copied within the rank; recv / send:\n"
    "[(peer, src_lstart, dst_lstart, lengths)] in the order both sides\n"
    "enumerate them.  Placements are (kind, dim, split_factor) triples\n"
    "(0 Replicate, 1 Shard, 2 _StridedShard); ranks list the global rank\n"
    "of each mesh coordinate, row-major.");

static PyObject *
dcp_reshard_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t gshape[DCP_MAX_DIMS], ndim;
    rmesh_t src = {.ranks = NULL}, dst = {.ranks = NULL};
    rlayout_t mine = {NULL, 0}, other = {NULL, 0};
    Py_ssize_t *offsets = NULL, *holders = NULL, *fill = NULL, *pos = NULL;
    PyObject *local = NULL, *recv = NULL, *send = NULL, *result = NULL;
    if (dcp_check_nargs("reshard_plan", nargs, 8) < 0 ||
        dcp_parse_shape(args[0], gshape, &ndim, "global_shape") < 0 ||
        parse_rmesh(args[1], args[2], args[3], "source", &src) < 0 ||
        parse_rmesh(args[4], args[5], args[6], "destination", &dst) < 0) {
        goto error;
    }
    Py_ssize_t rank = PyLong_AsSsize_t(args[7]);
    if (rank == -1 && PyErr_Occurred()) {
        goto error;
    }
    local = PyList_New(0);
    recv = PyList_New(0);
    send = PyList_New(0);
    if (local == NULL || recv == NULL || send == NULL) {
        goto error;
    }
    /* holders of each source group, grouped by representative (a
     * counting sort: offsets[rep] .. offsets[rep + 1]) */
    size_t cells = (size_t)src.size + 1;
    offsets = PyMem_Calloc(cells, sizeof(Py_ssize_t));
    holders = PyMem_Calloc(cells, sizeof(Py_ssize_t));
    fill = PyMem_Calloc(cells, sizeof(Py_ssize_t));
    if (offsets == NULL || holders == NULL || fill == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < src.size; i++) {
        offsets[group_of(&src, i) + 1]++;
    }
    for (Py_ssize_t i = 0; i < src.size; i++) {
        offsets[i + 1] += offsets[i];
    }
    for (Py_ssize_t i = 0; i < src.size; i++) {
        Py_ssize_t rep = group_of(&src, i);
        holders[offsets[rep] + fill[rep]++] = i;
    }
    /* pos: rank -> source coordinate (or -1) */
    Py_ssize_t maxr = rank;
    for (Py_ssize_t i = 0; i < src.size; i++) {
        maxr = src.ranks[i] > maxr ? src.ranks[i] : maxr;
    }
    if (maxr >= ((Py_ssize_t)1 << 26)) {
        PyErr_SetString(PyExc_ValueError, "rank too large");
        goto error;
    }
    pos = PyMem_Malloc((size_t)(maxr + 1) * sizeof(Py_ssize_t));
    if (pos == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t r = 0; r <= maxr; r++) {
        pos[r] = -1;
    }
    for (Py_ssize_t i = 0; i < src.size; i++) {
        pos[src.ranks[i]] = i;
    }
    Py_ssize_t my_dst = -1, my_src = rank <= maxr ? pos[rank] : -1;
    for (Py_ssize_t j = 0; j < dst.size; j++) {
        if (dst.ranks[j] == rank) {
            my_dst = j;
            break;
        }
    }
    Py_ssize_t stdim[DCP_MAX_DIMS], dtdim[DCP_MAX_DIMS];
    int simple =
        simple_layout(&src, ndim, stdim) && simple_layout(&dst, ndim, dtdim);
    Py_ssize_t k0[DCP_MAX_DIMS], k1[DCP_MAX_DIMS], c[DCP_MAX_DIMS];
    /* receiving side: this rank's destination shard, from every group
     * that holds part of it */
    if (my_dst >= 0) {
        if (layout_at(gshape, ndim, &dst, my_dst, &mine) < 0) {
            goto error;
        }
        int more = src.size > 0;
        Py_ssize_t rep = -1;
        if (simple) {
            more = mine.n == 1 &&
                   meeting_ranges(
                       &src, stdim, gshape, &mine.blocks[0], 0, k0, k1);
            memcpy(c, k0, sizeof(Py_ssize_t) * (size_t)src.mdim);
        }
        while (more) {
            if (simple) {
                rep = index_of(&src, c);
                more = odometer_next(c, k0, k1, src.mdim);
            }
            else {
                rep++;
                more = rep + 1 < src.size;
                if (offsets[rep + 1] == offsets[rep]) {
                    continue; /* not a representative */
                }
            }
            Py_ssize_t h =
                choose_holder(&src, offsets, holders, pos, maxr, rep, rank);
            if (layout_at(gshape, ndim, &src, rep, &other) < 0) {
                goto error;
            }
            int rc = intersect_into(h == rank ? local : recv,
                                    h == rank ? -1 : h,
                                    &other,
                                    &mine,
                                    ndim);
            PyMem_Free(other.blocks);
            other.blocks = NULL;
            if (rc < 0) {
                goto error;
            }
        }
        PyMem_Free(mine.blocks);
        mine.blocks = NULL;
    }
    /* sending side: every other destination rank this rank serves */
    if (my_src >= 0) {
        Py_ssize_t rep = group_of(&src, my_src);
        if (layout_at(gshape, ndim, &src, rep, &mine) < 0) {
            goto error;
        }
        int more = dst.size > 0;
        Py_ssize_t j = -1;
        if (simple) {
            more = mine.n == 1 &&
                   meeting_ranges(
                       &dst, dtdim, gshape, &mine.blocks[0], 1, k0, k1);
            memcpy(c, k0, sizeof(Py_ssize_t) * (size_t)dst.mdim);
        }
        while (more) {
            if (simple) {
                j = index_of(&dst, c);
                more = odometer_next(c, k0, k1, dst.mdim);
            }
            else {
                j++;
                more = j + 1 < dst.size;
            }
            Py_ssize_t peer = dst.ranks[j];
            if (peer == rank ||
                choose_holder(&src, offsets, holders, pos, maxr, rep, peer) !=
                    rank) {
                continue;
            }
            if (layout_at(gshape, ndim, &dst, j, &other) < 0) {
                goto error;
            }
            int rc = intersect_into(send, peer, &mine, &other, ndim);
            PyMem_Free(other.blocks);
            other.blocks = NULL;
            if (rc < 0) {
                goto error;
            }
        }
    }
    result = PyTuple_Pack(3, local, recv, send);
error:
    PyMem_Free(mine.blocks);
    PyMem_Free(other.blocks);
    PyMem_Free(offsets);
    PyMem_Free(holders);
    PyMem_Free(fill);
    PyMem_Free(pos);
    rmesh_free(&src);
    rmesh_free(&dst);
    Py_XDECREF(local);
    Py_XDECREF(recv);
    Py_XDECREF(send);
    return result;
}

PyMethodDef dcp_reshard_plan_methods[] = {
    {"reshard_plan",
     DCP_FASTCALL(dcp_reshard_plan),
     METH_FASTCALL,
     dcp_reshard_plan__doc__},
    {NULL, NULL, 0, NULL},
};
