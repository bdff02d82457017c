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
mesh_info(dcp_state *st,
          PyObject *cache,
          PyObject *mesh,
          PyObject **coord,
          PyObject **shape)
{
    PyObject *entry = NULL;
    int found = dcp_dict_get_ref(cache, mesh, &entry);
    if (found < 0) {
        return -1;
    }
    if (!found) {
        PyObject *c = PyObject_CallMethodNoArgs(mesh, st->str_get_coordinate);
        PyObject *s = c ? PyObject_GetAttr(mesh, st->str_shape) : NULL;
        if (c != NULL && c == Py_None) {
            PyErr_SetString(st->err_value,
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
    if (pls == NULL || mesh_info(st, cache, mesh, &coord, &mshape_obj) < 0) {
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
        PyErr_SetString(st->err_value,
                        "DTensor placements do not match its mesh");
        goto done;
    }
    int ok = 1;
    for (Py_ssize_t m = 0; ok && m < mdim; m++) {
        ok = dcp_encode_placement(
                 st, PySequence_Fast_GET_ITEM(seq, m), classes, &pl[m]) == 0;
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

/* ----------------------------------------------------------------------
 * LoadPlan: what plan_full_load decided, as C arrays that finish_full_load
 * and the stream's executors (chunks(bucket)) read, never re-parsed.
 */

/* One job: its full value (or metadata on a stream's receivers), template,
 * dtype, where its data lands (NULL: not needed here) and the blocks
 * (local <- global) of that dest, or None when dest is the full tensor. */
typedef struct {
    PyObject *value;
    PyObject *tmpl;
    PyObject *dtype;
    PyObject *dest;
    PyObject *blocks;
    int sharded; /* wrap dest as a DTensor like tmpl when finishing */
} dcp_load_job;

/* One dim-0 row chunk of a job's value in a stream bucket. */
typedef struct {
    Py_ssize_t job;
    Py_ssize_t row_start; /* -1: a 0-dim value, travelling whole */
    Py_ssize_t rows;
    Py_ssize_t offset; /* in the bucket */
    Py_ssize_t nbytes;
    PyObject *cshape; /* tuple: the chunk's shape */
} dcp_load_chunk;

typedef struct {
    Py_ssize_t nbytes;
    Py_ssize_t first; /* chunks[first : first + count] */
    Py_ssize_t count;
} dcp_load_bucket;

typedef struct {
    PyObject_HEAD
    Py_ssize_t njobs;
    dcp_load_job *jobs;
    Py_ssize_t nchunks, chunk_cap;
    dcp_load_chunk *chunks;
    Py_ssize_t nbuckets, bucket_cap;
    dcp_load_bucket *buckets;
    Py_ssize_t max_bucket;
} dcp_LoadPlan;

static void
load_plan_free_arrays(dcp_LoadPlan *plan)
{
    for (Py_ssize_t i = 0; i < plan->njobs; i++) {
        dcp_load_job *J = &plan->jobs[i];
        Py_CLEAR(J->value);
        Py_CLEAR(J->tmpl);
        Py_CLEAR(J->dtype);
        Py_CLEAR(J->dest);
        Py_CLEAR(J->blocks);
    }
    for (Py_ssize_t c = 0; c < plan->nchunks; c++) {
        Py_CLEAR(plan->chunks[c].cshape);
    }
    PyMem_Free(plan->jobs);
    PyMem_Free(plan->chunks);
    PyMem_Free(plan->buckets);
    plan->jobs = NULL;
    plan->chunks = NULL;
    plan->buckets = NULL;
    plan->njobs = plan->nchunks = plan->nbuckets = 0;
    plan->chunk_cap = plan->bucket_cap = 0;
}

static int
LoadPlan_traverse(PyObject *self, visitproc visit, void *arg)
{
    dcp_LoadPlan *plan = (dcp_LoadPlan *)self;
    Py_VISIT(Py_TYPE(self));
    for (Py_ssize_t i = 0; i < plan->njobs; i++) {
        dcp_load_job *J = &plan->jobs[i];
        Py_VISIT(J->value);
        Py_VISIT(J->tmpl);
        Py_VISIT(J->dtype);
        Py_VISIT(J->dest);
        Py_VISIT(J->blocks);
    }
    for (Py_ssize_t c = 0; c < plan->nchunks; c++) {
        Py_VISIT(plan->chunks[c].cshape);
    }
    return 0;
}

/* A cleared plan (a reference cycle through a job's value) has no jobs
 * and no buckets left: the executors see an empty plan. */
static int
LoadPlan_clear(PyObject *self)
{
    load_plan_free_arrays((dcp_LoadPlan *)self);
    return 0;
}

static void
LoadPlan_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    (void)LoadPlan_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
LoadPlan_repr(PyObject *self)
{
    dcp_LoadPlan *plan = (dcp_LoadPlan *)self;
    return PyUnicode_FromFormat(
        "<LoadPlan jobs=%zd chunks=%zd buckets=%zd "
        "max_bucket_bytes=%zd>",
        plan->njobs,
        plan->nchunks,
        plan->nbuckets,
        plan->max_bucket);
}

static PyObject *
LoadPlan_get_njobs(PyObject *self, void *closure)
{
    return PyLong_FromSsize_t(((dcp_LoadPlan *)self)->njobs);
}

static PyObject *
LoadPlan_get_nbuckets(PyObject *self, void *closure)
{
    return PyLong_FromSsize_t(((dcp_LoadPlan *)self)->nbuckets);
}

static PyObject *
LoadPlan_get_max_bucket(PyObject *self, void *closure)
{
    return PyLong_FromSsize_t(((dcp_LoadPlan *)self)->max_bucket);
}

static PyObject *
LoadPlan_get_bucket_bytes(PyObject *self, void *closure)
{
    dcp_LoadPlan *plan = (dcp_LoadPlan *)self;
    PyObject *t = PyTuple_New(plan->nbuckets);
    for (Py_ssize_t b = 0; t != NULL && b < plan->nbuckets; b++) {
        PyObject *v = PyLong_FromSsize_t(plan->buckets[b].nbytes);
        if (v == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, b, v);
    }
    return t;
}

static PyObject *
LoadPlan_get_dests(PyObject *self, void *closure)
{
    dcp_LoadPlan *plan = (dcp_LoadPlan *)self;
    PyObject *t = PyTuple_New(plan->njobs);
    for (Py_ssize_t i = 0; t != NULL && i < plan->njobs; i++) {
        PyObject *d = plan->jobs[i].dest;
        PyTuple_SET_ITEM(t, i, Py_NewRef(d != NULL ? d : Py_None));
    }
    return t;
}

/* plan.chunks(bucket) -> [(value, row_start, rows, offset, nbytes, dtype,
 * chunk_shape, dest, blocks)] for the row chunks of a stream bucket, in
 * bucket order: what the stream's executors (dcp_optim/_engine/distribute.py)
 * pack on the source and copy into the dests on every rank.  row_start is -1
 * for a 0-dim value (it travels whole); dest None where the job is not needed
 * here; blocks None where dest is the full tensor. */
static PyObject *
LoadPlan_chunks(PyObject *self, PyObject *arg)
{
    dcp_LoadPlan *plan = (dcp_LoadPlan *)self;
    Py_ssize_t b = PyLong_AsSsize_t(arg);
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
    const dcp_load_bucket *bk = &plan->buckets[b];
    PyObject *out = PyList_New(bk->count);
    for (Py_ssize_t k = 0; out != NULL && k < bk->count; k++) {
        const dcp_load_chunk *c = &plan->chunks[bk->first + k];
        const dcp_load_job *J = &plan->jobs[c->job];
        PyObject *item = Py_BuildValue("(OnnnnOOOO)",
                                       J->value,
                                       c->row_start,
                                       c->rows,
                                       c->offset,
                                       c->nbytes,
                                       J->dtype,
                                       c->cshape,
                                       J->dest != NULL ? J->dest : Py_None,
                                       J->blocks);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, item);
    }
    return out;
}

static PyMethodDef LoadPlan_methods[] = {
    {"chunks",
     LoadPlan_chunks,
     METH_O,
     "chunks(bucket, /)\n--\n\n"
     "The row chunks of a stream bucket: (value, row_start, rows, offset, "
     "nbytes, dtype, chunk_shape, dest, blocks)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef LoadPlan_getset[] = {
    {"njobs", LoadPlan_get_njobs, NULL, "Number of jobs.", NULL},
    {"nbuckets",
     LoadPlan_get_nbuckets,
     NULL,
     "Number of stream buckets.",
     NULL},
    {"max_bucket_bytes",
     LoadPlan_get_max_bucket,
     NULL,
     "Bytes of the largest stream bucket (0 without buckets).",
     NULL},
    {"bucket_bytes",
     LoadPlan_get_bucket_bytes,
     NULL,
     "Bytes of each stream bucket, as a tuple.",
     NULL},
    {"dests",
     LoadPlan_get_dests,
     NULL,
     "Where each job's data lands (None: not needed here), as a tuple.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot LoadPlan_slots[] = {
    {Py_tp_dealloc, LoadPlan_dealloc},
    {Py_tp_traverse, LoadPlan_traverse},
    {Py_tp_clear, LoadPlan_clear},
    {Py_tp_repr, LoadPlan_repr},
    {Py_tp_getset, LoadPlan_getset},
    {Py_tp_methods, LoadPlan_methods},
    {Py_tp_doc,
     "The plan of a full -> local load (made by plan_full_load; read-only)."},
    {0, NULL},
};

static PyType_Spec LoadPlan_spec = {
    .name = "dcp_optim._dcp_optim.LoadPlan",
    .basicsize = sizeof(dcp_LoadPlan),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = LoadPlan_slots,
};

int
dcp_full_load_init_type(PyObject *module, dcp_state *st)
{
    st->LoadPlan_Type =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &LoadPlan_spec, NULL);
    if (st->LoadPlan_Type == NULL) {
        return -1;
    }
    return PyModule_AddType(module, st->LoadPlan_Type);
}

/* 1 if `obj` is a LoadPlan, 0 with TypeError set otherwise. */
static int
load_plan_check(dcp_state *st, PyObject *obj)
{
    if (Py_IS_TYPE(obj, st->LoadPlan_Type)) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError,
                 "expected a LoadPlan, got %.200s",
                 Py_TYPE(obj)->tp_name);
    return 0;
}

/* A plan of n jobs, every field NULL (dests None until set). */
static dcp_LoadPlan *
load_plan_new(dcp_state *st, Py_ssize_t n)
{
    dcp_LoadPlan *plan = PyObject_GC_New(dcp_LoadPlan, st->LoadPlan_Type);
    if (plan == NULL) {
        return NULL;
    }
    plan->njobs = plan->nchunks = plan->nbuckets = 0;
    plan->chunk_cap = plan->bucket_cap = plan->max_bucket = 0;
    plan->chunks = NULL;
    plan->buckets = NULL;
    plan->jobs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(dcp_load_job));
    if (plan->jobs == NULL) {
        PyObject_GC_Track(plan);
        Py_DECREF(plan);
        PyErr_NoMemory();
        return NULL;
    }
    plan->njobs = n;
    PyObject_GC_Track(plan);
    return plan;
}

/* Appends a chunk, stealing c->cshape (released on failure too).  0 / -1. */
static int
load_plan_add_chunk(dcp_LoadPlan *plan, const dcp_load_chunk *c)
{
    if (plan->nchunks == plan->chunk_cap) {
        Py_ssize_t cap = plan->chunk_cap ? plan->chunk_cap * 2 : 16;
        dcp_load_chunk *chunks =
            PyMem_Realloc(plan->chunks, (size_t)cap * sizeof(dcp_load_chunk));
        if (chunks == NULL) {
            Py_DECREF(c->cshape);
            PyErr_NoMemory();
            return -1;
        }
        plan->chunks = chunks;
        plan->chunk_cap = cap;
    }
    plan->chunks[plan->nchunks++] = *c;
    return 0;
}

/* Closes the bucket of chunks [first, nchunks) holding `nbytes`.  0 / -1. */
static int
load_plan_close_bucket(dcp_LoadPlan *plan, Py_ssize_t first, Py_ssize_t nbytes)
{
    if (plan->nbuckets == plan->bucket_cap) {
        Py_ssize_t cap = plan->bucket_cap ? plan->bucket_cap * 2 : 4;
        dcp_load_bucket *buckets = PyMem_Realloc(
            plan->buckets, (size_t)cap * sizeof(dcp_load_bucket));
        if (buckets == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        plan->buckets = buckets;
        plan->bucket_cap = cap;
    }
    dcp_load_bucket *b = &plan->buckets[plan->nbuckets++];
    b->nbytes = nbytes;
    b->first = first;
    b->count = plan->nchunks - first;
    if (nbytes > plan->max_bucket) {
        plan->max_bucket = nbytes;
    }
    return 0;
}

PyDoc_STRVAR(
    dcp_plan_full_load__doc__,
    "plan_full_load(jobs, dtensor_cls, classes, budget, empty, stream,"
    " in_place=False, /)"
    "\n--\n\n"
    "The LoadPlan of a full -> local load: destinations and stream "
    "buckets.");

/* plan_full_load(jobs, dtensor_cls, classes, budget, empty, stream
 *                [, in_place]) -> LoadPlan
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
 * The plan's dest of job i is the tensor its data lands in (a fresh local
 * shard or full tensor), or None for jobs a receiver does not need
 * (template None and stream=False never happens: those are the value
 * itself).
 * stream=False: every rank holds the full values; the dests are filled
 * here by local slicing and the plan has no buckets.
 * stream=True: the plan's buckets hold dim-0 row chunks of the values,
 *   which the source packs and every rank copies into its dests
 *   (plan.chunks(b), dcp_optim/_engine/distribute.py). */
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
    PyObject *cache = PyDict_New(), *result = NULL;
    dcp_LoadPlan *plan = cache ? load_plan_new(st, n) : NULL;
    Py_ssize_t used = 0, bucket_first = 0;
    if (plan == NULL) {
        goto done;
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
        dcp_load_job *J = &plan->jobs[i];
        J->value = Py_NewRef(value);
        J->tmpl = Py_NewRef(tmpl);
        PyObject *shape = PyObject_GetAttr(value, st->str_shape);
        PyObject *dtype =
            shape ? PyObject_GetAttr(value, st->str_dtype) : NULL;
        PyObject *isz =
            dtype ? PyObject_GetAttr(dtype, st->str_itemsize) : NULL;
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
                J->sharded = 1;
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
            ok = (is_dt || explicit)
                     ? dcp_copy_block_list(dest, value, blocks, 1, 0, -1) == 0
                     : dcp_copy_into(st, dest, value) == 0;
        }
        if (ok && needed) {
            J->dest = dest; /* steals dest */
            dest = NULL;
        }
        Py_XDECREF(dest);
        if (ok) {
            J->dtype = Py_NewRef(dtype);
            J->blocks = Py_NewRef(blocks);
        }
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
            if (used + need > budget && plan->nchunks > bucket_first) {
                ok = load_plan_close_bucket(plan, bucket_first, used) == 0;
                bucket_first = plan->nchunks;
                used = 0;
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
                dcp_load_chunk c = {
                    i, nd ? r0 : (Py_ssize_t)-1, nr, used, nbytes, cshape};
                ok = load_plan_add_chunk(plan, &c) == 0; /* steals cshape */
            }
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
    if (plan->nchunks > bucket_first &&
        load_plan_close_bucket(plan, bucket_first, used) < 0) {
        goto done;
    }
    result = Py_NewRef((PyObject *)plan);
done:
    Py_DECREF(jobs);
    Py_XDECREF(cache);
    Py_XDECREF(plan);
    return result;
}

PyDoc_STRVAR(dcp_finish_full_load__doc__,
             "finish_full_load(plan, from_local, offload, /)\n--\n\n"
             "The loaded value of each job of a LoadPlan: shards wrapped as "
             "DTensors like their templates.");

/* finish_full_load(plan, from_local, offload) -> values
 *
 * The loaded value of each job: DTensor.from_local(dest, mesh,
 * placements, shape=, stride=) for DTensor templates -- the template
 * itself where dest is its own local tensor (an in-place load) and
 * nothing is offloaded -- else dest (None where the job is not needed
 * here); moved to `offload` when it is not None (plain results only). */
static PyObject *
dcp_finish_full_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("finish_full_load", nargs, 3) < 0 ||
        !load_plan_check(st, args[0])) {
        return NULL;
    }
    dcp_LoadPlan *plan = (dcp_LoadPlan *)args[0];
    PyObject *from_local = args[1], *offload = args[2];
    /* The calls below run Python code: hold the plan. */
    Py_INCREF(plan);
    PyObject *out = PyList_New(plan->njobs);
    for (Py_ssize_t i = 0; out != NULL && i < PyList_GET_SIZE(out); i++) {
        PyObject *value = NULL;
        if (i >= plan->njobs) {
            PyErr_SetString(PyExc_RuntimeError, "the plan was cleared");
        }
        else if (plan->jobs[i].dest == NULL) {
            value = Py_NewRef(Py_None);
        }
        else if (plan->jobs[i].sharded) {
            PyObject *tmpl = Py_NewRef(plan->jobs[i].tmpl);
            PyObject *dest = Py_NewRef(plan->jobs[i].dest);
            /* In place: the shard landed in the template's own local
             * tensor, so the template is the loaded value (a new DTensor
             * around the same local would be one more object per tensor
             * for the commit to find aliased). */
            int own = 0;
            if (offload == Py_None) {
                PyObject *local = PyObject_GetAttr(tmpl, st->str_local_tensor);
                if (local == NULL) {
                    own = -1;
                }
                else {
                    own = local == dest;
                    Py_DECREF(local);
                }
            }
            if (own != 0) {
                value = own > 0 ? Py_NewRef(tmpl) : NULL;
                Py_DECREF(tmpl);
                Py_DECREF(dest);
                if (value == NULL) {
                    Py_CLEAR(out);
                    break;
                }
                PyList_SET_ITEM(out, i, value);
                continue;
            }
            PyObject *mesh = PyObject_GetAttr(tmpl, st->str_device_mesh);
            PyObject *pls =
                mesh ? PyObject_GetAttr(tmpl, st->str_placements) : NULL;
            PyObject *shape =
                pls ? PyObject_GetAttr(tmpl, st->str_shape) : NULL;
            PyObject *stride =
                shape ? PyObject_CallMethodNoArgs(tmpl, st->str_stride) : NULL;
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
                Py_SETREF(value, dcp_call_method1(st->str_to, value, offload));
            }
            Py_DECREF(tmpl);
            Py_DECREF(dest);
            Py_XDECREF(mesh);
            Py_XDECREF(pls);
            Py_XDECREF(shape);
            Py_XDECREF(stride);
            Py_XDECREF(kw);
            Py_XDECREF(a);
        }
        else if (offload != Py_None) {
            value = dcp_call_method1(st->str_to, plan->jobs[i].dest, offload);
        }
        else {
            value = Py_NewRef(plan->jobs[i].dest);
        }
        if (value == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, value);
    }
    Py_DECREF(plan);
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
