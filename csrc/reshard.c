/* Gather plans: how the DTensor leaves of a state dict are packed, mesh
 * by mesh, into byte buckets that one all-gather each moves, and how the
 * full tensors are assembled from a gathered bucket.  Shard geometry lives
 * in shard_geometry.c, block and byte copies in pack.c.
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

/* The shared geometry and copy helpers under their dcp.h names. */
#define align_up dcp_align_up
#define shape_nbytes dcp_shape_nbytes
#define parse_shape dcp_parse_shape
#define ssize_tuple dcp_ssize_tuple
#define shard_layout dcp_shard_layout
#define encode_placement dcp_encode_placement
#define parse_block dcp_parse_block
#define byte_window dcp_byte_window
#define typed_view dcp_typed_view

/* ----------------------------------------------------------------------
 * Bucket planning
 */

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
