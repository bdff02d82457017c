/* Full gathers of DTensors: the gather plan (the GatherPlan type), and
 * the executors that pack a rank's shards into a bucket segment and
 * assemble full tensors from a gathered bucket.
 *
 * plan_gather groups the DTensor leaves by device mesh and packs each
 * mesh's tensors, in order, into byte buckets: every rank contributes one
 * segment per bucket, in which each tensor has a slot sized for its
 * largest shard, aligned to its dtype's size (segments to 16 bytes, so
 * a typed view of the buffer reads every slot); a bucket
 * closes when its gathered size (segment x ranks) would exceed the
 * budget.  Tensors are planned one of two ways:
 *
 * - even: a 1-D mesh of W ranks and Shard(0) -- FSDP2's layout, padded
 *   or not.  DTensor splits dim 0 the way torch.chunk does, so rank r
 *   holds rows [r*c, min(n, (r+1)*c)) with c = ceil(n / W): the tensor
 *   sits at the same offset of every rank's segment, padded to c rows.
 *   The plan is closed form (offset, n, c, elements per row), nothing per
 *   rank, and the gathered bucket, viewed as [W, segment], gives the full
 *   tensor with at most two strided copies (the ranks holding c rows,
 *   then the one holding fewer).  A bucket that holds one such tensor
 *   whose shards are unpadded and fill the segment is "direct": its
 *   gathered bytes are the full tensor's, so the caller gathers straight
 *   into the result.
 * - even on a multi-dimensional mesh ("nested"): placements that shard
 *   dim 0 on at most two mesh dimensions, every other one Replicate.
 *   One sharded dimension of size S: as above with W = S.  Two, an
 *   outer one of size So that splits the rows evenly (co = n / So) and
 *   an inner one of size Si that chunks each outer block (ci =
 *   ceil(co / Si)): the rank at outer index o, inner index i holds rows
 *   o*co + [i*ci, min(co, (i+1)*ci)).  (Shard(0), Shard(0)) has the
 *   outer dimension first; (_StridedShard(0, split_factor=S1),
 *   Shard(0)) on dims (0, 1) -- FSDP2 over TP -- has it second (dim 1
 *   is sharded first, then each of its blocks across dim 0).  The
 *   gathered bucket, as [So, Si, ci rows] through the mesh strides at
 *   index 0 of the Replicate dims (one replica), is copied into the
 *   full tensor viewed as [So, co rows] by the same one or two copies.
 * - general: any other layout (uneven outer blocks, other split
 *   factors, Shard(d > 0)): every rank's (local shape, blocks) from
 *   shard_layouts, assembled by one torch.cat of whole-row pieces where
 *   the shards are row ranges, else block by block.
 *
 * Data only moves through torch ops called from here and through the
 * torch.distributed collectives that Python runs between pack_bucket and
 * unpack_bucket.
 */
#include "dcp.h"

#include <structmember.h>

/* One tensor of a plan. */
typedef struct {
    Py_ssize_t leaf;      /* index in the leaves / results list */
    Py_ssize_t offset;    /* byte offset of its slot in the segment */
    Py_ssize_t seg;       /* bytes of its largest shard (unaligned) */
    Py_ssize_t rows;      /* even: global dim-0 size */
    Py_ssize_t chunk;     /* even: rows per rank (slot rows) */
    Py_ssize_t row_elems; /* even: elements per row */
    Py_ssize_t outer;     /* even: outer mesh dim, -1 if none */
    Py_ssize_t inner;     /* even: inner mesh dim */
    Py_ssize_t nouter;    /* even: outer mesh size (1 if none) */
    Py_ssize_t ninner;    /* even: inner mesh size */
    Py_ssize_t ostride;   /* even: segments between outer neighbours */
    Py_ssize_t istride;   /* even: segments between inner neighbours */
    Py_ssize_t itemsize;
    PyObject *local;   /* this rank's local tensor */
    PyObject *dtype;   /* torch dtype */
    PyObject *shape;   /* global shape */
    PyObject *layouts; /* general: [(nbytes, local_shape, blocks) or None
                        * per rank, row-major mesh order]; NULL if even */
} gitem_t;

typedef struct {
    PyObject_HEAD
    Py_ssize_t world;    /* ranks of the mesh: segments per bucket */
    Py_ssize_t nitems;   /* tensors, in bucket order */
    Py_ssize_t nbuckets; /* buckets */
    gitem_t *items;
    Py_ssize_t *first;   /* bucket b holds items [first[b], first[b+1]) */
    Py_ssize_t *segment; /* bytes of bucket b's segment */
} dcp_GatherPlan;

/* ----------------------------------------------------------------------
 * Small helpers (the shared ones are in dcp.h)
 */

/* obj[:, a:b] (columns of a 2-D tensor). */
static PyObject *
gather_columns(PyObject *obj, Py_ssize_t a, Py_ssize_t b)
{
    PyObject *lo = PyLong_FromSsize_t(a);
    PyObject *hi = lo ? PyLong_FromSsize_t(b) : NULL;
    PyObject *sl = hi ? PySlice_New(lo, hi, NULL) : NULL;
    PyObject *all = sl ? PySlice_New(NULL, NULL, NULL) : NULL;
    PyObject *key = all ? PyTuple_Pack(2, all, sl) : NULL;
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    Py_XDECREF(sl);
    Py_XDECREF(all);
    if (key == NULL) {
        return NULL;
    }
    PyObject *view = PyObject_GetItem(obj, key);
    Py_DECREF(key);
    return view;
}

/* tensor.view(n0, n1) (or tensor.view(n0) when n1 < 0). */
static PyObject *
gather_view2(dcp_state *st, PyObject *tensor, Py_ssize_t n0, Py_ssize_t n1)
{
    PyObject *shape =
        n1 < 0 ? Py_BuildValue("(n)", n0) : Py_BuildValue("(nn)", n0, n1);
    if (shape == NULL) {
        return NULL;
    }
    PyObject *view = dcp_call_method1(st->str_view, tensor, shape);
    Py_DECREF(shape);
    return view;
}

/* ----------------------------------------------------------------------
 * The GatherPlan type
 */

static int
GatherPlan_traverse(PyObject *self, visitproc visit, void *arg)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    Py_VISIT(Py_TYPE(self));
    for (Py_ssize_t i = 0; i < p->nitems; i++) {
        Py_VISIT(p->items[i].local);
        Py_VISIT(p->items[i].dtype);
        Py_VISIT(p->items[i].shape);
        Py_VISIT(p->items[i].layouts);
    }
    return 0;
}

static int
GatherPlan_clear(PyObject *self)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    for (Py_ssize_t i = 0; i < p->nitems; i++) {
        Py_CLEAR(p->items[i].local);
        Py_CLEAR(p->items[i].dtype);
        Py_CLEAR(p->items[i].shape);
        Py_CLEAR(p->items[i].layouts);
    }
    return 0;
}

static void
GatherPlan_dealloc(PyObject *self)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)GatherPlan_clear(self);
    PyMem_Free(p->items);
    PyMem_Free(p->first);
    PyMem_Free(p->segment);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The plan's bucket `arg` as an index; -1 with an exception. */
static Py_ssize_t
plan_bucket(dcp_GatherPlan *p, PyObject *arg)
{
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (b < 0 || b >= p->nbuckets) {
        PyErr_SetString(PyExc_IndexError, "bucket index out of range");
        return -1;
    }
    return b;
}

/* The item's objects are there (a cleared plan has none).  0 / -1. */
static int
item_ready(const gitem_t *it)
{
    if (it->local == NULL || it->dtype == NULL || it->shape == NULL) {
        PyErr_SetString(PyExc_ValueError, "the gather plan was cleared");
        return -1;
    }
    return 0;
}

/* Whether bucket b's gathered bytes are exactly one tensor's: one even
 * tensor, unpadded, filling the segment, its shards in row-major mesh
 * order (no replicas, the outer dimension first). */
static int
bucket_is_direct(const dcp_GatherPlan *p, Py_ssize_t b)
{
    if (p->first[b + 1] - p->first[b] != 1) {
        return 0;
    }
    const gitem_t *it = &p->items[p->first[b]];
    return it->layouts == NULL && it->offset == 0 && it->seg > 0 &&
           it->seg == p->segment[b] && it->chunk * p->world == it->rows &&
           it->nouter * it->ninner == p->world && it->outer < it->inner;
}

PyDoc_STRVAR(GatherPlan_segment_doc,
             "segment($self, bucket, /)\n--\n\n"
             "Bytes of one rank's segment of the bucket.");

static PyObject *
GatherPlan_segment(PyObject *self, PyObject *arg)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    Py_ssize_t b = plan_bucket(p, arg);
    return b < 0 ? NULL : PyLong_FromSsize_t(p->segment[b]);
}

PyDoc_STRVAR(GatherPlan_direct_doc,
             "direct($self, bucket, /)\n--\n\n"
             "(leaf index, dtype, shape) when the bucket's gathered bytes "
             "are exactly that tensor's, so the gather can write into the "
             "result; else None.");

static PyObject *
GatherPlan_direct(PyObject *self, PyObject *arg)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    Py_ssize_t b = plan_bucket(p, arg);
    if (b < 0) {
        return NULL;
    }
    if (!bucket_is_direct(p, b)) {
        Py_RETURN_NONE;
    }
    const gitem_t *it = &p->items[p->first[b]];
    if (item_ready(it) < 0) {
        return NULL;
    }
    return Py_BuildValue("(nOO)", it->leaf, it->dtype, it->shape);
}

PyDoc_STRVAR(GatherPlan_describe_doc,
             "describe($self, bucket, /)\n--\n\n"
             "The bucket's tensors: (leaf, offset, 'even', rows, chunk, "
             "row_elems) on one mesh dimension of all the ranks, (leaf, "
             "offset, 'nested', rows, chunk, row_elems, outer, inner) on "
             "a multi-dimensional mesh (outer -1: none), or (leaf, offset, "
             "'general', layouts).");

static PyObject *
GatherPlan_describe(PyObject *self, PyObject *arg)
{
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    Py_ssize_t b = plan_bucket(p, arg);
    if (b < 0) {
        return NULL;
    }
    Py_ssize_t lo = p->first[b], hi = p->first[b + 1];
    PyObject *out = PyList_New(hi - lo);
    for (Py_ssize_t i = lo; out != NULL && i < hi; i++) {
        const gitem_t *it = &p->items[i];
        PyObject *entry;
        if (it->layouts != NULL) {
            entry = Py_BuildValue(
                "(nnsO)", it->leaf, it->offset, "general", it->layouts);
        }
        else if (it->outer < 0 && it->ninner == p->world) {
            entry = Py_BuildValue("(nnsnnn)",
                                  it->leaf,
                                  it->offset,
                                  "even",
                                  it->rows,
                                  it->chunk,
                                  it->row_elems);
        }
        else {
            entry = Py_BuildValue("(nnsnnnnn)",
                                  it->leaf,
                                  it->offset,
                                  "nested",
                                  it->rows,
                                  it->chunk,
                                  it->row_elems,
                                  it->outer,
                                  it->inner);
        }
        if (entry == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i - lo, entry);
    }
    return out;
}

static PyMethodDef GatherPlan_methods[] = {
    {"segment", GatherPlan_segment, METH_O, GatherPlan_segment_doc},
    {"direct", GatherPlan_direct, METH_O, GatherPlan_direct_doc},
    {"describe", GatherPlan_describe, METH_O, GatherPlan_describe_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *
GatherPlan_get_max_segment(PyObject *self, void *closure)
{
    (void)closure;
    dcp_GatherPlan *p = (dcp_GatherPlan *)self;
    Py_ssize_t m = 0;
    for (Py_ssize_t b = 0; b < p->nbuckets; b++) {
        m = p->segment[b] > m ? p->segment[b] : m;
    }
    return PyLong_FromSsize_t(m);
}

static PyGetSetDef GatherPlan_getset[] = {
    {"max_segment",
     GatherPlan_get_max_segment,
     NULL,
     "The largest segment of any bucket (bytes).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef GatherPlan_members[] = {
    {"world",
     T_PYSSIZET,
     offsetof(dcp_GatherPlan, world),
     READONLY,
     "Ranks of the mesh (segments per gathered bucket)."},
    {"buckets",
     T_PYSSIZET,
     offsetof(dcp_GatherPlan, nbuckets),
     READONLY,
     "Number of buckets."},
    {"tensors",
     T_PYSSIZET,
     offsetof(dcp_GatherPlan, nitems),
     READONLY,
     "Number of tensors."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot GatherPlan_slots[] = {
    {Py_tp_dealloc, GatherPlan_dealloc},
    {Py_tp_traverse, GatherPlan_traverse},
    {Py_tp_clear, GatherPlan_clear},
    {Py_tp_methods, GatherPlan_methods},
    {Py_tp_members, GatherPlan_members},
    {Py_tp_getset, GatherPlan_getset},
    {Py_tp_doc,
     "How one mesh's DTensors are gathered: buckets of per-tensor slots, "
     "closed form for evenly sharded tensors."},
    {0, NULL},
};

static PyType_Spec GatherPlan_spec = {
    .name = "dcp_optim._dcp_optim.GatherPlan",
    .basicsize = sizeof(dcp_GatherPlan),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = GatherPlan_slots,
};

int
dcp_gather_init_type(PyObject *module, dcp_state *st)
{
    st->GatherPlan_Type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &GatherPlan_spec, NULL);
    if (st->GatherPlan_Type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->GatherPlan_Type);
}

/* A new, empty plan with room for `nitems` tensors and as many buckets. */
static dcp_GatherPlan *
plan_new(dcp_state *st, Py_ssize_t world, Py_ssize_t nitems)
{
    dcp_GatherPlan *p = PyObject_GC_New(dcp_GatherPlan, st->GatherPlan_Type);
    if (p == NULL) {
        return NULL;
    }
    p->world = world;
    p->nitems = 0;
    p->nbuckets = 0;
    p->items = PyMem_New(gitem_t, nitems > 0 ? nitems : 1);
    p->first = PyMem_New(Py_ssize_t, nitems + 1);
    p->segment = PyMem_New(Py_ssize_t, nitems > 0 ? nitems : 1);
    if (p->items == NULL || p->first == NULL || p->segment == NULL) {
        PyObject_GC_Track((PyObject *)p);
        Py_DECREF(p);
        PyErr_NoMemory();
        return NULL;
    }
    p->first[0] = 0;
    PyObject_GC_Track((PyObject *)p);
    return p;
}

/* ----------------------------------------------------------------------
 * plan_gather
 */

/* Segments between neighbours along mesh dimension m (row-major). */
static Py_ssize_t
mesh_stride(const Py_ssize_t *mshape, Py_ssize_t mdim, Py_ssize_t m)
{
    Py_ssize_t s = 1;
    for (Py_ssize_t k = m + 1; k < mdim; k++) {
        s *= mshape[k]; /* <= world, which fits */
    }
    return s;
}

/* Whether placements `pl` of a tensor with `rows` rows (-1: 0-D) have
 * the closed form (see the opening comment): sets *outer (-1 if none)
 * and *inner to the sharded mesh dimensions.  1 / 0. */
static int
closed_form(const placement_t *pl,
            const Py_ssize_t *mshape,
            Py_ssize_t mdim,
            Py_ssize_t rows,
            Py_ssize_t *outer,
            Py_ssize_t *inner)
{
    Py_ssize_t sd[2];
    int ns = 0;
    if (rows < 0) {
        return 0;
    }
    for (Py_ssize_t m = 0; m < mdim; m++) {
        if (pl[m].kind == PL_REPLICATE) {
            continue;
        }
        if ((pl[m].kind != PL_SHARD && pl[m].kind != PL_STRIDED) ||
            pl[m].dim != 0 || ns == 2) {
            return 0;
        }
        sd[ns++] = m;
    }
    if (ns == 0 || pl[sd[ns - 1]].kind != PL_SHARD) {
        return 0;
    }
    if (ns == 1) {
        *outer = -1;
        *inner = sd[0];
        return 1;
    }
    if (pl[sd[0]].kind == PL_SHARD) {
        *outer = sd[0];
        *inner = sd[1];
    }
    else if (pl[sd[0]].split_factor == mshape[sd[1]]) {
        *outer = sd[1];
        *inner = sd[0];
    }
    else {
        return 0;
    }
    return mshape[*outer] > 0 && rows % mshape[*outer] == 0;
}

/* Reads one DTensor leaf into `it` (new references) and its agreement
 * signature (shape, placements, itemsize) into *sig; when the layout is
 * not even, every rank's layout into it->layouts.  0 / -1. */
static int
plan_item(dcp_state *st,
          PyObject *leaf,
          PyObject *classes,
          const Py_ssize_t *mshape,
          Py_ssize_t mdim,
          Py_ssize_t world,
          gitem_t *it,
          PyObject **sig)
{
    Py_ssize_t gshape[DCP_MAX_DIMS], ndim;
    placement_t pl[DCP_MAX_DIMS] = {{0}};
    PyObject *pls = NULL, *plseq = NULL, *isz = NULL, *enc = NULL;
    PyObject *gt = NULL;
    int rc = -1;
    it->shape = PyObject_GetAttr(leaf, st->str_shape);
    if (it->shape == NULL) {
        goto done;
    }
    pls = PyObject_GetAttr(leaf, st->str_placements);
    if (pls == NULL) {
        goto done;
    }
    it->dtype = PyObject_GetAttr(leaf, st->str_dtype);
    if (it->dtype == NULL) {
        goto done;
    }
    isz = PyObject_GetAttr(it->dtype, st->str_itemsize);
    if (isz == NULL) {
        goto done;
    }
    it->itemsize = PyLong_AsSsize_t(isz);
    if (it->itemsize <= 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "dtype itemsize must be > 0");
        }
        goto done;
    }
    it->local = PyObject_GetAttr(leaf, st->str_local_tensor);
    if (it->local == NULL ||
        dcp_parse_shape(it->shape, gshape, &ndim, "shape") < 0) {
        goto done;
    }
    plseq = dcp_sequence_fast(pls, "placements");
    if (plseq == NULL) {
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(plseq) != mdim) {
        PyErr_SetString(st->err_value,
                        "DTensor placements do not match its mesh");
        goto done;
    }
    enc = PyTuple_New(mdim);
    if (enc == NULL) {
        goto done;
    }
    for (Py_ssize_t m = 0; m < mdim; m++) {
        if (dcp_encode_placement(
                st, PySequence_Fast_GET_ITEM(plseq, m), classes, &pl[m]) < 0) {
            goto done;
        }
        if (pl[m].kind == PL_PARTIAL) {
            PyErr_SetString(st->err_value,
                            "Partial placements cannot be gathered as state");
            goto done;
        }
        PyObject *e =
            Py_BuildValue("(inn)", pl[m].kind, pl[m].dim, pl[m].split_factor);
        if (e == NULL) {
            goto done;
        }
        PyTuple_SET_ITEM(enc, m, e);
    }
    gt = dcp_ssize_tuple(gshape, ndim);
    if (gt == NULL) {
        goto done;
    }
    /* (shape, placements, itemsize): what every rank of the mesh must
     * agree on before the collectives start */
    *sig = Py_BuildValue("(OOn)", gt, enc, it->itemsize);
    if (*sig == NULL) {
        goto done;
    }
    Py_ssize_t so = 1, si = 0, outer = -1, inner = -1;
    if (closed_form(
            pl, mshape, mdim, ndim >= 1 ? gshape[0] : -1, &outer, &inner)) {
        /* even: nested torch.chunk rows, closed form */
        so = outer >= 0 ? mshape[outer] : 1;
        si = mshape[inner];
        Py_ssize_t row = 1;
        for (Py_ssize_t d = 1; d < ndim; d++) {
            if ((row = dcp_size_product(row, gshape[d], "gather plan")) < 0) {
                goto done;
            }
        }
        Py_ssize_t rows = gshape[0];
        Py_ssize_t co = rows / so;
        Py_ssize_t chunk = co / si + (co % si != 0);
        Py_ssize_t row_bytes =
            dcp_size_product(row, it->itemsize, "gather plan");
        Py_ssize_t seg =
            row_bytes < 0 ? -1
                          : dcp_size_product(row_bytes, chunk, "gather plan");
        if (seg < 0 || dcp_size_product(row_bytes, rows, "gather plan") < 0) {
            goto done;
        }
        it->rows = rows;
        it->chunk = chunk;
        it->row_elems = row;
        it->seg = seg;
        it->outer = outer;
        it->inner = inner;
        it->nouter = so;
        it->ninner = si;
        it->ostride = outer >= 0 ? mesh_stride(mshape, mdim, outer) : 0;
        it->istride = mesh_stride(mshape, mdim, inner);
        rc = 0;
        goto done;
    }
    /* general: every rank's layout, in row-major mesh order */
    it->layouts = PyList_New(world);
    if (it->layouts == NULL) {
        goto done;
    }
    Py_ssize_t seg = 0;
    Py_ssize_t coord[DCP_MAX_DIMS] = {0};
    for (Py_ssize_t r = 0; r < world; r++) {
        PyObject *lay =
            dcp_shard_layout(gshape, ndim, mshape, mdim, coord, pl);
        if (lay == NULL) {
            goto done;
        }
        PyObject *lshape = PyTuple_GET_ITEM(lay, 0);
        Py_ssize_t nbytes =
            dcp_shape_nbytes(lshape, it->itemsize, "gather plan");
        /* a rank holding a replica of data another rank provides (a
         * non-zero coordinate along a Replicate dimension) sends nothing
         * that is read */
        int replica = 0;
        for (Py_ssize_t m = 0; m < mdim; m++) {
            replica |= pl[m].kind == PL_REPLICATE && coord[m] != 0;
        }
        PyObject *entry = NULL;
        if (nbytes >= 0) {
            entry =
                replica
                    ? Py_NewRef(Py_None)
                    : Py_BuildValue(
                          "(nOO)", nbytes, lshape, PyTuple_GET_ITEM(lay, 1));
        }
        Py_DECREF(lay);
        if (entry == NULL) {
            goto done;
        }
        PyList_SET_ITEM(it->layouts, r, entry);
        seg = nbytes > seg ? nbytes : seg;
        for (Py_ssize_t m = mdim - 1; m >= 0; m--) {
            if (++coord[m] < mshape[m]) {
                break;
            }
            coord[m] = 0;
        }
    }
    it->seg = seg;
    rc = 0;
done:
    Py_XDECREF(pls);
    Py_XDECREF(plseq);
    Py_XDECREF(isz);
    Py_XDECREF(enc);
    Py_XDECREF(gt);
    return rc;
}

/* The plan of one mesh's tensors: (mesh, plan, signature, leaf_indices,
 * budget).  New tuple or NULL. */
static PyObject *
plan_mesh(dcp_state *st,
          PyObject *mesh,
          PyObject *idxs,
          PyObject *leaves,
          PyObject *classes,
          Py_ssize_t budget,
          Py_ssize_t floor_bytes)
{
    Py_ssize_t nt = PyList_GET_SIZE(idxs);
    Py_ssize_t mshape[DCP_MAX_DIMS], mdim, world = 1;
    PyObject *signature = NULL, *result = NULL;
    dcp_GatherPlan *p = NULL;
    PyObject *shape_obj = PyObject_GetAttr(mesh, st->str_shape);
    if (shape_obj == NULL) {
        return NULL;
    }
    int bad = dcp_parse_shape(shape_obj, mshape, &mdim, "shape");
    Py_DECREF(shape_obj);
    if (bad < 0) {
        return NULL;
    }
    for (Py_ssize_t m = 0; m < mdim; m++) {
        if ((world = dcp_size_product(world, mshape[m], "gather plan")) < 0) {
            return NULL;
        }
    }
    if (world < 1) {
        PyErr_SetString(PyExc_ValueError, "gather plan: empty mesh");
        return NULL;
    }
    signature = PyList_New(nt);
    p = signature ? plan_new(st, world, nt) : NULL;
    if (p == NULL) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < nt; t++) {
        gitem_t *it = &p->items[t];
        memset(it, 0, sizeof(*it));
        p->nitems = t + 1; /* traverse / clear see the filled items */
        it->leaf = PyLong_AsSsize_t(PyList_GET_ITEM(idxs, t));
        PyObject *sig = NULL;
        if (plan_item(st,
                      PySequence_Fast_GET_ITEM(leaves, it->leaf),
                      classes,
                      mshape,
                      mdim,
                      world,
                      it,
                      &sig) < 0) {
            Py_XDECREF(sig);
            goto done;
        }
        PyList_SET_ITEM(signature, t, sig);
    }
    Py_ssize_t mesh_budget = budget;
    if (floor_bytes > 0) {
        /* adaptive: room for the largest gathered tensor, at least the
         * floor, at most the given budget */
        Py_ssize_t largest = 0;
        for (Py_ssize_t t = 0; t < nt; t++) {
            Py_ssize_t a = p->items[t].seg > PY_SSIZE_T_MAX - DCP_ALIGN
                               ? PY_SSIZE_T_MAX
                               : dcp_align_up(p->items[t].seg);
            largest = a > largest ? a : largest;
        }
        largest = largest > budget / world ? budget : largest * world;
        mesh_budget = largest > floor_bytes ? largest : floor_bytes;
        mesh_budget = mesh_budget > budget ? budget : mesh_budget;
    }
    /* buckets: tensors in order; a bucket closes when the next slot would
     * take its gathered size past the budget.  A slot is aligned to its
     * dtype's size (a typed view of the buffer reads it), a segment to
     * DCP_ALIGN, which every itemsize divides (each rank's segment starts
     * aligned): at large worlds a shard is a row or a few elements, and
     * rounding each slot to DCP_ALIGN would gather up to 4x the bytes of
     * a 4-byte shard. */
    Py_ssize_t used = 0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        gitem_t *it = &p->items[t];
        /* every torch dtype's size divides DCP_ALIGN; any other slot
         * takes the segment alignment */
        Py_ssize_t isz = it->itemsize >= 1 && DCP_ALIGN % it->itemsize == 0
                             ? it->itemsize
                             : DCP_ALIGN;
        if (it->seg > PY_SSIZE_T_MAX / 2 - DCP_ALIGN ||
            used > PY_SSIZE_T_MAX / 2 - DCP_ALIGN) {
            PyErr_SetString(PyExc_OverflowError, "segment size too large");
            goto done;
        }
        Py_ssize_t at = (used + isz - 1) / isz * isz;
        Py_ssize_t open = t - p->first[p->nbuckets];
        if (open > 0 && dcp_align_up(at + it->seg) > mesh_budget / world) {
            p->segment[p->nbuckets] = dcp_align_up(used);
            p->nbuckets++;
            p->first[p->nbuckets] = t;
            at = 0;
        }
        it->offset = at;
        used = at + it->seg;
    }
    if (nt > 0) {
        p->segment[p->nbuckets] = dcp_align_up(used);
        p->nbuckets++;
        p->first[p->nbuckets] = nt;
    }
    result = Py_BuildValue("(OOOOn)", mesh, p, signature, idxs, mesh_budget);
done:
    Py_XDECREF(signature);
    Py_XDECREF(p);
    return result;
}

PyDoc_STRVAR(
    plan_gather_doc,
    "plan_gather(leaves, dtensor_cls, placement_classes, budget, floor=0, /)"
    "\n--\n\n"
    "Bucketed gather plans for the DTensor leaves, per mesh: a list of "
    "(mesh, GatherPlan, signature, leaf_indices, budget).\n\n"
    "floor > 0 makes the budget adaptive per mesh: max(floor, the largest "
    "gathered tensor), at most `budget`.  Raises ValueError for Partial "
    "placements.");

/* The group of `mesh` among `meshes` (one object per group), appending
 * a group when no known mesh equals it.  Equal meshes reach DTensors as
 * different objects (torch's sharding propagation caches output specs,
 * whose mesh is the first equal one it met), so a mesh object not met
 * before is compared with each group's by ==, once: `seen` holds every
 * object met, `seen_group` its group.  The same leaves give the same
 * groups on every rank.  Returns the group index, or -1 with an error. */
static Py_ssize_t
mesh_group(PyObject *meshes,
           PyObject *members,
           PyObject *seen,
           PyObject *seen_group,
           PyObject *mesh)
{
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(seen); s++) {
        if (PyList_GET_ITEM(seen, s) == mesh) {
            return PyLong_AsSsize_t(PyList_GET_ITEM(seen_group, s));
        }
    }
    Py_ssize_t g = 0, n = PyList_GET_SIZE(meshes);
    for (; g < n; g++) {
        /* pinned: DeviceMesh.__eq__ runs Python code */
        PyObject *known = Py_NewRef(PyList_GET_ITEM(meshes, g));
        int eq = PyObject_RichCompareBool(known, mesh, Py_EQ);
        Py_DECREF(known);
        if (eq < 0) {
            return -1;
        }
        if (eq) {
            break;
        }
    }
    if (g == n) {
        PyObject *list = PyList_New(0);
        int rc = (list == NULL || PyList_Append(meshes, mesh) < 0 ||
                  PyList_Append(members, list) < 0)
                     ? -1
                     : 0;
        Py_XDECREF(list);
        /* a failed append to `members` leaves `meshes` one longer: the
         * caller's error path drops both */
        if (rc < 0) {
            return -1;
        }
    }
    PyObject *index = PyLong_FromSsize_t(g);
    int rc = (index == NULL || PyList_Append(seen, mesh) < 0 ||
              PyList_Append(seen_group, index) < 0)
                 ? -1
                 : 0;
    Py_XDECREF(index);
    return rc < 0 ? -1 : g;
}

/* plan_gather(leaves, dtensor_cls, placement_classes, budget[, floor]):
 * groups the DTensor leaves by mesh (equal meshes together), then plans
 * each mesh. */
static PyObject *
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
    if (budget < 1) {
        PyErr_SetString(PyExc_ValueError, "plan_gather: budget must be > 0");
        return NULL;
    }
    PyObject *leaves = dcp_sequence_fast(args[0], "leaves must be a sequence");
    if (leaves == NULL) {
        return NULL;
    }
    PyObject *meshes = PyList_New(0), *members = PyList_New(0);
    PyObject *seen = PyList_New(0), *seen_group = PyList_New(0);
    PyObject *result = NULL;
    if (meshes == NULL || members == NULL || seen == NULL ||
        seen_group == NULL) {
        goto done;
    }
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
        Py_ssize_t g = mesh_group(meshes, members, seen, seen_group, mesh);
        Py_DECREF(mesh);
        if (g < 0) {
            goto done;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        int rc = index == NULL ? -1 : 0;
        if (rc == 0) {
            rc = PyList_Append(PyList_GET_ITEM(members, g), index);
        }
        Py_XDECREF(index);
        if (rc < 0) {
            goto done;
        }
    }
    result = PyList_New(PyList_GET_SIZE(members));
    for (Py_ssize_t g = 0; result != NULL && g < PyList_GET_SIZE(members);
         g++) {
        PyObject *plan = plan_mesh(st,
                                   PyList_GET_ITEM(meshes, g),
                                   PyList_GET_ITEM(members, g),
                                   leaves,
                                   classes,
                                   budget,
                                   floor_bytes);
        if (plan == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, g, plan);
    }
done:
    Py_DECREF(leaves);
    Py_XDECREF(meshes);
    Py_XDECREF(members);
    Py_XDECREF(seen);
    Py_XDECREF(seen_group);
    return result;
}

/* ----------------------------------------------------------------------
 * Executors
 */

/* Checks (buffer, plan, bucket) arguments; the bucket index or -1. */
static Py_ssize_t
executor_args(dcp_state *st,
              PyObject *plan,
              PyObject *bucket,
              dcp_GatherPlan **out)
{
    if (!PyObject_TypeCheck(plan, st->GatherPlan_Type)) {
        PyErr_Format(PyExc_TypeError,
                     "plan must be a GatherPlan, not %.200s",
                     Py_TYPE(plan)->tp_name);
        return -1;
    }
    *out = (dcp_GatherPlan *)plan;
    return plan_bucket(*out, bucket);
}

PyDoc_STRVAR(pack_bucket_doc,
             "pack_bucket(buffer, plan, bucket, uint8, /)\n--\n\n"
             "Copy this rank's shards of the bucket's tensors into its "
             "segment `buffer` (uint8), each at its slot.");

static PyObject *
dcp_pack_bucket(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    dcp_GatherPlan *p;
    if (dcp_check_nargs("pack_bucket", nargs, 4) < 0) {
        return NULL;
    }
    Py_ssize_t b = executor_args(st, args[1], args[2], &p);
    if (b < 0) {
        return NULL;
    }
    /* the plan stays alive (args[1]) while its items are used */
    for (Py_ssize_t i = p->first[b]; i < p->first[b + 1]; i++) {
        const gitem_t *it = &p->items[i];
        if (item_ready(it) < 0) {
            return NULL;
        }
        PyObject *bytes = dcp_tensor_bytes(st, it->local, args[3]);
        if (bytes == NULL) {
            return NULL;
        }
        Py_ssize_t n = PyObject_Length(bytes);
        int rc = n < 0 ? -1 : 0;
        if (rc == 0 && n > it->seg) {
            PyErr_SetString(PyExc_ValueError,
                            "a local shard is larger than its planned slot");
            rc = -1;
        }
        if (rc == 0 && n > 0) {
            PyObject *win = dcp_slice(args[0], it->offset, it->offset + n);
            rc = win ? dcp_copy_into(st, win, bytes) : -1;
            Py_XDECREF(win);
        }
        Py_DECREF(bytes);
        if (rc < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* The gathered buffer as a flat tensor of the item's dtype, cached per
 * dtype in `flats`.  New reference or NULL. */
static PyObject *
typed_flat(dcp_state *st, PyObject *buffer, PyObject *flats, const gitem_t *it)
{
    PyObject *flat;
    if (dcp_dict_get_ref(flats, it->dtype, &flat) < 0) {
        return NULL;
    }
    if (flat != NULL) {
        return flat;
    }
    flat = dcp_call_method1(st->str_view, buffer, it->dtype);
    if (flat != NULL && PyDict_SetItem(flats, it->dtype, flat) < 0) {
        Py_CLEAR(flat);
    }
    return flat;
}

/* Copies an even tensor out of the gathered buffer into `full` (its
 * global shape): the rank at outer index o, inner index i (index 0 of
 * every Replicate dimension) holds rows o*co + [i*ci, min(co, (i+1)*ci))
 * in its slot.  The source is the buffer through the mesh strides,
 * [So, Si, ci*row]; the full tensor is [So, co*row].  The inner ranks
 * holding ci rows make one strided copy, the one holding fewer (if any)
 * one more.  0 / -1. */
static int
unpack_even(dcp_state *st,
            PyObject *flat,
            const gitem_t *it,
            Py_ssize_t world,
            Py_ssize_t segment,
            PyObject *full)
{
    Py_ssize_t n = it->rows, c = it->chunk, re = it->row_elems;
    if (n == 0 || re == 0) {
        return 0;
    }
    Py_ssize_t so = it->nouter, co = n / so, isz = it->itemsize;
    if (segment % isz != 0 || it->offset % isz != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "segment not a multiple of itemsize");
        return -1;
    }
    Py_ssize_t seg = segment / isz;
    Py_ssize_t start = it->offset / isz;
    Py_ssize_t q = co / c, rem = co - q * c;
    int rc = -1;
    PyObject *size = NULL, *stride = NULL, *src = NULL, *dflat = NULL;
    PyObject *tail = dcp_slice(flat, start, world * seg);
    if (tail == NULL) {
        goto done;
    }
    size = Py_BuildValue("(nnn)", so, it->ninner, c * re);
    stride =
        size
            ? Py_BuildValue(
                  "(nnn)", it->ostride * seg, it->istride * seg, (Py_ssize_t)1)
            : NULL;
    src = stride ? PyObject_CallMethodObjArgs(
                       tail, st->str_as_strided, size, stride, NULL)
                 : NULL;
    dflat = src ? gather_view2(st, full, n * re, -1) : NULL;
    if (dflat == NULL) {
        goto done;
    }
    if (q > 0) {
        PyObject *shape = Py_BuildValue("(nn)", so, co * re);
        PyObject *part =
            shape ? dcp_call_method1(st->str_view, dflat, shape) : NULL;
        PyObject *head = part ? gather_columns(part, 0, q * c * re) : NULL;
        PyObject *dims = head ? Py_BuildValue("(nnn)", so, q, c * re) : NULL;
        PyObject *dst =
            dims ? dcp_call_method1(st->str_view, head, dims) : NULL;
        PyObject *s1 = dst ? gather_columns(src, 0, q) : NULL;
        int ok = s1 != NULL && dcp_copy_into(st, dst, s1) == 0;
        Py_XDECREF(shape);
        Py_XDECREF(part);
        Py_XDECREF(head);
        Py_XDECREF(dims);
        Py_XDECREF(dst);
        Py_XDECREF(s1);
        if (!ok) {
            goto done;
        }
    }
    if (rem > 0) {
        PyObject *all = PySlice_New(NULL, NULL, NULL);
        PyObject *idx = all ? PyLong_FromSsize_t(q) : NULL;
        PyObject *key = idx ? PyTuple_Pack(2, all, idx) : NULL;
        PyObject *row = key ? PyObject_GetItem(src, key) : NULL;
        PyObject *s2 = row ? gather_columns(row, 0, rem * re) : NULL;
        PyObject *shape = s2 ? Py_BuildValue("(nn)", so, co * re) : NULL;
        PyObject *part =
            shape ? dcp_call_method1(st->str_view, dflat, shape) : NULL;
        PyObject *dst =
            part ? gather_columns(part, q * c * re, co * re) : NULL;
        int ok = dst != NULL && dcp_copy_into(st, dst, s2) == 0;
        Py_XDECREF(all);
        Py_XDECREF(idx);
        Py_XDECREF(key);
        Py_XDECREF(row);
        Py_XDECREF(s2);
        Py_XDECREF(shape);
        Py_XDECREF(part);
        Py_XDECREF(dst);
        if (!ok) {
            goto done;
        }
    }
    rc = 0;
done:
    Py_XDECREF(tail);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(src);
    Py_XDECREF(dflat);
    return rc;
}

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
    if (dcp_parse_block(block, &ls, &gs, &ln) < 0) {
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

/* One rank's piece of a row-contiguous tensor (see row_pieces). */
typedef struct {
    Py_ssize_t row;    /* first global row */
    Py_ssize_t rows;   /* row count */
    Py_ssize_t start;  /* byte offset in the gathered buffer */
    Py_ssize_t nbytes; /* > 0 */
    PyObject *lshape;  /* borrowed from the layout */
} row_piece_t;

/* The pieces of a general-layout tensor whose non-empty shards are each a
 * range of whole rows and together tile it (a multi-dimensional mesh
 * sharding dim 0, for example), as typed views of the gathered buffer in
 * row order, so that one torch.cat assembles it.  Returns a new list,
 * None (not row-contiguous: copy block by block), or NULL. */
static PyObject *
row_pieces(dcp_state *st,
           PyObject *buffer,
           Py_ssize_t segment,
           const gitem_t *it,
           PyObject *typed)
{
    PyObject *gshape = it->shape;
    if (!PyTuple_Check(gshape) || PyTuple_GET_SIZE(gshape) == 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t total_rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(gshape, 0));
    if (total_rows == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *lseq = it->layouts; /* a list the plan owns */
    Py_ssize_t nl = PyList_GET_SIZE(lseq), count = 0;
    row_piece_t *pc = PyMem_New(row_piece_t, nl > 0 ? nl : 1);
    PyObject *result = NULL, *pieces = NULL, *view = NULL;
    int usable = 1;
    if (pc == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_INCREF(lseq); /* pinned: torch calls below run Python code */
    for (Py_ssize_t r = 0; usable && r < nl; r++) {
        PyObject *layout = PyList_GET_ITEM(lseq, r);
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
        pc[count].start = r * segment + it->offset;
        pc[count].nbytes = nbytes;
        pc[count].lshape = lshape;
        count += rc;
    }
    /* insertion sort by first row, then the pieces must tile
     * [0, total_rows) */
    for (Py_ssize_t i = 1; usable && i < count; i++) {
        row_piece_t cur = pc[i];
        Py_ssize_t j = i;
        while (j > 0 && pc[j - 1].row > cur.row) {
            pc[j] = pc[j - 1];
            j--;
        }
        pc[j] = cur;
    }
    Py_ssize_t next = 0, isz = it->itemsize;
    for (Py_ssize_t i = 0; usable && i < count; i++) {
        usable = pc[i].row == next && pc[i].start % isz == 0;
        next += pc[i].rows;
    }
    if (!usable || count == 0 || next != total_rows) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (dcp_dict_get_ref(typed, it->dtype, &view) < 0) {
        goto done;
    }
    if (view == NULL) {
        view = dcp_call_method1(st->str_view, buffer, it->dtype);
        if (view == NULL || PyDict_SetItem(typed, it->dtype, view) < 0) {
            goto done;
        }
    }
    pieces = PyList_New(count);
    for (Py_ssize_t i = 0; pieces != NULL && i < count; i++) {
        PyObject *flat = dcp_slice(
            view, pc[i].start / isz, (pc[i].start + pc[i].nbytes) / isz);
        PyObject *piece = flat;
        if (flat != NULL && PyTuple_GET_SIZE(pc[i].lshape) > 1) {
            piece = dcp_call_method1(st->str_view, flat, pc[i].lshape);
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

/* A general-layout tensor assembled from the gathered buffer: by cat of
 * row pieces when it can, else into `full` block by block.  Returns the
 * full tensor (new reference) or NULL. */
static PyObject *
unpack_general(dcp_state *st,
               PyObject *buffer,
               Py_ssize_t segment,
               const gitem_t *it,
               PyObject *typed,
               PyObject *cat,
               PyObject *empty,
               PyObject *kwargs)
{
    if (cat != Py_None) {
        PyObject *pieces = row_pieces(st, buffer, segment, it, typed);
        if (pieces == NULL) {
            return NULL;
        }
        if (pieces != Py_None) {
            PyObject *full = PyObject_CallOneArg(cat, pieces);
            Py_DECREF(pieces);
            return full;
        }
        Py_DECREF(pieces);
    }
    PyObject *cargs = PyTuple_Pack(1, it->shape);
    PyObject *full = cargs ? PyObject_Call(empty, cargs, kwargs) : NULL;
    Py_XDECREF(cargs);
    if (full == NULL) {
        return NULL;
    }
    PyObject *lseq = Py_NewRef(it->layouts);
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(lseq); r++) {
        PyObject *layout = PyList_GET_ITEM(lseq, r);
        Py_ssize_t nbytes;
        PyObject *lshape, *blocks;
        if (layout == Py_None) {
            continue;
        }
        if (!dcp_parse_tuple(layout, "nOO", &nbytes, &lshape, &blocks)) {
            goto error;
        }
        if (nbytes == 0) {
            continue;
        }
        Py_ssize_t at = r * segment + it->offset;
        PyObject *win = dcp_slice(buffer, at, at + nbytes);
        PyObject *piece =
            win ? dcp_typed_view(st, win, it->dtype, lshape) : NULL;
        Py_XDECREF(win);
        int rc = piece == NULL
                     ? -1
                     : dcp_copy_block_list(full, piece, blocks, 0, 0, -1);
        Py_XDECREF(piece);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(lseq);
    return full;
error:
    Py_DECREF(lseq);
    Py_DECREF(full);
    return NULL;
}

PyDoc_STRVAR(
    unpack_bucket_doc,
    "unpack_bucket(buffer, plan, bucket, empty, device, results, offload, "
    "cat=None, /)\n--\n\n"
    "Assemble the full tensors of a gathered bucket (`buffer`: every "
    "rank's segment, in row-major mesh order) into results[leaf]: each "
    "created by empty(shape, dtype=..., device=device) (or by cat of row "
    "pieces), then moved to `offload` unless it is None.");

static PyObject *
dcp_unpack_bucket(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    dcp_GatherPlan *p;
    if (nargs != 7 && nargs != 8) {
        PyErr_Format(PyExc_TypeError,
                     "unpack_bucket() takes 7 or 8 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    PyObject *buffer = args[0], *empty = args[3], *device = args[4];
    PyObject *results = args[5], *offload = args[6];
    PyObject *cat = nargs == 8 ? args[7] : Py_None;
    Py_ssize_t b = executor_args(st, args[1], args[2], &p);
    if (b < 0) {
        return NULL;
    }
    if (!PyList_Check(results)) {
        PyErr_SetString(PyExc_TypeError, "results must be a list");
        return NULL;
    }
    Py_ssize_t segment = p->segment[b];
    /* dtype -> the buffer as a flat typed view */
    PyObject *flats = PyDict_New();
    PyObject *kwargs = NULL;
    if (flats == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = p->first[b]; i < p->first[b + 1]; i++) {
        const gitem_t *it = &p->items[i];
        PyObject *full = NULL;
        if (item_ready(it) < 0) {
            goto error;
        }
        Py_XSETREF(
            kwargs,
            Py_BuildValue("{sOsO}", "dtype", it->dtype, "device", device));
        if (kwargs == NULL) {
            goto error;
        }
        if (it->layouts == NULL) {
            PyObject *cargs = PyTuple_Pack(1, it->shape);
            full = cargs ? PyObject_Call(empty, cargs, kwargs) : NULL;
            Py_XDECREF(cargs);
            PyObject *flat = full ? typed_flat(st, buffer, flats, it) : NULL;
            int ok = flat != NULL &&
                     unpack_even(st, flat, it, p->world, segment, full) == 0;
            Py_XDECREF(flat);
            if (!ok) {
                Py_XDECREF(full);
                goto error;
            }
        }
        else {
            full = unpack_general(
                st, buffer, segment, it, flats, cat, empty, kwargs);
            if (full == NULL) {
                goto error;
            }
        }
        if (offload != Py_None) {
            Py_SETREF(full, dcp_call_method1(st->str_to, full, offload));
            if (full == NULL) {
                goto error;
            }
        }
        if (it->leaf < 0 || it->leaf >= PyList_GET_SIZE(results)) {
            Py_DECREF(full);
            PyErr_SetString(PyExc_IndexError, "result index out of range");
            goto error;
        }
        /* PyList_SetItem steals `full` and releases the old item. */
        if (PyList_SetItem(results, it->leaf, full) < 0) {
            goto error;
        }
    }
    Py_XDECREF(kwargs);
    Py_DECREF(flats);
    Py_RETURN_NONE;
error:
    Py_XDECREF(kwargs);
    Py_DECREF(flats);
    return NULL;
}

PyMethodDef dcp_gather_methods[] = {
    {"plan_gather",
     (PyCFunction)(void (*)(void))dcp_plan_gather,
     METH_FASTCALL,
     plan_gather_doc},
    {"pack_bucket",
     (PyCFunction)(void (*)(void))dcp_pack_bucket,
     METH_FASTCALL,
     pack_bucket_doc},
    {"unpack_bucket",
     (PyCFunction)(void (*)(void))dcp_unpack_bucket,
     METH_FASTCALL,
     unpack_bucket_doc},
    {NULL, NULL, 0, NULL},
};
