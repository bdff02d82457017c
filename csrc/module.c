/* Module definition of dcp_optim._dcp_optim: per-module state, shared
 * helpers, the method table and multi-phase initialisation. */
#include "dcp.h"

#include <stdarg.h>

/* ======================================================================
 * Shared helpers
 */

PyObject *
dcp_join_name(dcp_state *st, PyObject *prefix, PyObject *name)
{
    if (PyUnicode_GET_LENGTH(prefix) == 0) {
        return Py_NewRef(name);
    }
    PyObject *with_dot = PyUnicode_Concat(prefix, st->str_dot);
    if (with_dot == NULL) {
        return NULL;
    }
    PyObject *joined = PyUnicode_Concat(with_dot, name);
    Py_DECREF(with_dot);
    return joined;
}

PyObject *
dcp_child_prefix(dcp_state *st, PyObject *prefix, PyObject *name)
{
    PyObject *joined = PyUnicode_Concat(prefix, name);
    if (joined == NULL) {
        return NULL;
    }
    PyObject *result = PyUnicode_Concat(joined, st->str_dot);
    Py_DECREF(joined);
    return result;
}

PyObject *
dcp_items_list(PyObject *mapping)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *result = PyList_New(PyDict_GET_SIZE(mapping));
        if (result == NULL) {
            return NULL;
        }
        Py_ssize_t pos = 0, i = 0;
        PyObject *key, *value;
        /* PyDict_Next runs no Python code, so the dict cannot change
         * under us; the size check only guards against a miscount. */
        while (PyDict_Next(mapping, &pos, &key, &value)) {
            if (i >= PyList_GET_SIZE(result)) {
                break;
            }
            PyObject *pair = PyTuple_Pack(2, key, value);
            if (pair == NULL) {
                Py_DECREF(result);
                return NULL;
            }
            PyList_SET_ITEM(result, i, pair);
            i++;
        }
        return result;
    }
    PyObject *items = PyMapping_Items(mapping);
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "items() of %.200s must yield (key, value) pairs",
                         Py_TYPE(mapping)->tp_name);
            Py_DECREF(items);
            return NULL;
        }
    }
    return items;
}

PyObject *
dcp_type_lookup(PyTypeObject *tp, PyObject *name)
{
    PyObject *mro = tp->tp_mro;
    if (mro == NULL || !PyTuple_Check(mro)) {
        return NULL;
    }
    /* Hold the MRO: a metaclass could replace it while we look. */
    Py_INCREF(mro);
    PyObject *found = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
        PyObject *base = PyTuple_GET_ITEM(mro, i);
        PyObject *dict = dcp_type_dict((PyTypeObject *)base);
        if (dict == NULL) {
            continue;
        }
        int rc = dcp_dict_get_ref(dict, name, &found);
        Py_DECREF(dict);
        if (rc < 0) {
            found = NULL;
            break;
        }
        if (rc == 1) {
            break;
        }
    }
    Py_DECREF(mro);
    return found;
}

PyObject *
dcp_lookup_hook(PyObject *obj, PyObject *name)
{
    PyObject *found = dcp_type_lookup(Py_TYPE(obj), name);
    if (found != NULL || PyErr_Occurred()) {
        if (found == NULL) {
            return NULL;
        }
        /* Bind it the way attribute access would (functions become
         * methods; staticmethods and plain callables stay as they are). */
        descrgetfunc get = Py_TYPE(found)->tp_descr_get;
        if (get != NULL) {
            PyObject *bound = get(found, obj, (PyObject *)Py_TYPE(obj));
            Py_DECREF(found);
            return bound;
        }
        return found;
    }
    PyObject *inst_dict = PyObject_GenericGetDict(obj, NULL);
    if (inst_dict == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
        }
        return NULL;
    }
    int rc = dcp_dict_get_ref(inst_dict, name, &found);
    Py_DECREF(inst_dict);
    return rc == 1 ? found : NULL;
}

void
dcp_note_format(const char *format, ...)
{
    /* Formatting runs with no exception pending: stash the one being
     * raised, build the note, restore it, then attach the note. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return;
    }
    va_list vargs;
    va_start(vargs, format);
    PyObject *note = PyUnicode_FromFormatV(format, vargs);
    va_end(vargs);
    if (note == NULL) {
        /* The original exception matters more than its note. */
        PyErr_Clear();
    }
    PyErr_Restore(type, value, tb);
    if (note != NULL) {
        dcp_add_note(note);
        Py_DECREF(note);
    }
}

void
dcp_note_key(PyObject *key)
{
    /* %S on anything but a str reads it as one: keys of state dicts and
     * optimizer state are arbitrary objects (ints, tuples, ...). */
    if (PyUnicode_Check(key)) {
        dcp_note_format("at key '%S'", key);
    }
    else {
        dcp_note_format("at key %R", key);
    }
}

PyObject *
dcp_as_list(PyObject *seq, const char *what)
{
    if (PyList_CheckExact(seq)) {
        return PyList_GetSlice(seq, 0, PyList_GET_SIZE(seq));
    }
    PyObject *result = PySequence_List(seq);
    if (result == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s must be a sequence, not %.200s",
                     what,
                     Py_TYPE(seq)->tp_name);
    }
    return result;
}

/* ======================================================================
 * Method table
 */

#define DCP_FASTCALL(fn) ((PyCFunction)(void (*)(void))(fn))

static PyMethodDef dcp_methods[] = {
    {"walk_model",
     DCP_FASTCALL(dcp_walk_model),
     METH_FASTCALL,
     "walk_model(ctx, model, modifiers_name, /)\n--\n\n"
     "Walk `model` once and return a ModelIndex."},
    {"get_fqns",
     DCP_FASTCALL(dcp_get_fqns),
     METH_FASTCALL,
     "get_fqns(ctx, model, name, modifiers_name, skip_ddp_prefix, "
     "skip_compiler_prefix, /)\n--\n\n"
     "Canonical FQNs of a (possibly wrapper-prefixed) name, as a set."},
    {"canonicalize_model_keys",
     DCP_FASTCALL(dcp_canonicalize_model_keys),
     METH_FASTCALL,
     "canonicalize_model_keys(ctx, model, state_dict, modifiers_name, /)"
     "\n--\n\n"
     "Rename the keys of a fresh model.state_dict() to canonical FQNs, in "
     "place, as upstream does."},
    {"drop_frozen",
     DCP_FASTCALL(dcp_frozen_fqns),
     METH_FASTCALL,
     "drop_frozen(index, state_dict, /)\n--\n\n"
     "Pop the FQNs of parameters with requires_grad=False."},
    {"optim_pack",
     DCP_FASTCALL(dcp_optim_pack),
     METH_FASTCALL,
     "optim_pack(index, optimizers, extra_states, out_state, out_groups, /)"
     "\n--\n\n"
     "FQN-keyed equivalent of Optimizer.state_dict() for each optimizer, "
     "merged into out_state / out_groups."},
    {"optim_remap",
     DCP_FASTCALL(dcp_optim_remap),
     METH_FASTCALL,
     "optim_remap(index, optimizer, osd, /)\n--\n\n"
     "Re-key an integer-ID optimizer state dict by FQN, in place."},
    {"optim_missing",
     DCP_FASTCALL(dcp_optim_missing),
     METH_FASTCALL,
     "optim_missing(index, optimizer, /)\n--\n\n"
     "(param, group_index, fqn) of trainable parameters without state."},
    {"flatten_optim",
     DCP_FASTCALL(dcp_flatten_optim),
     METH_FASTCALL,
     "flatten_optim(ctx, osd, group_counts, /)\n--\n\n"
     "The flattened optimizer format of a nested FQN-keyed dict."},
    {"unflatten_optim",
     DCP_FASTCALL(dcp_unflatten_optim),
     METH_FASTCALL,
     "unflatten_optim(index, flat, /)\n--\n\n"
     "Parse a flattened optimizer dict into a loaded-state view."},
    {"view_from_nested",
     DCP_FASTCALL(dcp_view_from_nested),
     METH_FASTCALL,
     "view_from_nested(osd, /)\n--\n\n"
     "A nested optimizer dict as a loaded-state view."},
    {"split_optim",
     DCP_FASTCALL(dcp_split_optim),
     METH_FASTCALL,
     "split_optim(index, optimizers, view, expect_state, /)\n--\n\n"
     "Match a loaded-state view to each optimizer by FQN."},
    {"prepare_install",
     DCP_FASTCALL(dcp_install_optim),
     METH_FASTCALL,
     "prepare_install(ctx, optimizer, split_dict, expected, /)\n--\n\n"
     "The (state, param_groups) Optimizer.load_state_dict would install, "
     "without its quadratic scan."},
    {"tree_leaves",
     DCP_FASTCALL(dcp_tree_copy),
     METH_FASTCALL,
     "tree_leaves(ctx, obj, type_check, /)\n--\n\n"
     "The tensor leaves of a state-dict tree, in traversal order."},
    {"tree_rebuild",
     DCP_FASTCALL(dcp_tree_fill),
     METH_FASTCALL,
     "tree_rebuild(ctx, obj, new_leaves, type_check, /)\n--\n\n"
     "Copy the containers of a tree around replacement tensor leaves."},
    {"tensors_to",
     DCP_FASTCALL(dcp_tensors_to),
     METH_FASTCALL,
     "tensors_to(tensors, device, /)\n--\n\n"
     "[t.to(device) for t in tensors]."},
    {"rename_for_load",
     DCP_FASTCALL(dcp_rename_for_load),
     METH_FASTCALL,
     "rename_for_load(index, state_dict, strict, rename, want_local, /)"
     "\n--\n\n"
     "Key a canonical model state dict the way model.load_state_dict "
     "expects, without mutating it."},
    {"full_load_merge",
     DCP_FASTCALL(dcp_full_load_merge),
     METH_FASTCALL,
     "full_load_merge(ctx, full_sd, local, device, /)\n--\n\n"
     "Merge a full model state dict into the local one (private copy)."},
    {"materialize_state",
     DCP_FASTCALL(dcp_materialize_state),
     METH_FASTCALL,
     "materialize_state(missing, specs_by_group, PARAM, PARAM_DEVICE, /)"
     "\n--\n\n"
     "Pristine optimizer state for parameters without state."},
    {"first_key_containing",
     DCP_FASTCALL(dcp_first_key_containing),
     METH_FASTCALL,
     "first_key_containing(mapping, needle, /)\n--\n\n"
     "The first str key containing `needle`, or None."},
    {"filter_prefixes",
     DCP_FASTCALL(dcp_filter_prefixes),
     METH_FASTCALL,
     "filter_prefixes(state_dict, prefixes, keep, /)\n--\n\n"
     "Keep keys under the given prefixes, optionally stripping them."},
    {"tensor_devices",
     DCP_FASTCALL(dcp_tensor_devices),
     METH_FASTCALL,
     "tensor_devices(ctx, values, /)\n--\n\n"
     "Distinct devices of the tensors with dim() > 0 among values."},
    {"shard_layouts",
     DCP_FASTCALL(dcp_shard_layouts),
     METH_FASTCALL,
     "shard_layouts(global_shape, mesh_shape, placements, coords, /)\n--\n\n"
     "(local_shape, blocks) of the shard at each mesh coordinate."},
    {"plan_buckets",
     DCP_FASTCALL(dcp_plan_buckets),
     METH_FASTCALL,
     "plan_buckets(segment_bytes, copies, budget, /)\n--\n\n"
     "Pack segments into byte buckets within a budget."},
    {"copy_blocks",
     DCP_FASTCALL(dcp_copy_blocks),
     METH_FASTCALL,
     "copy_blocks(dst, src, blocks, direction, row_window, /)\n--\n\n"
     "Copy the sub-boxes of a shard layout between shard and full tensor."},
    {"pack_bytes",
     DCP_FASTCALL(dcp_pack_bytes),
     METH_FASTCALL,
     "pack_bytes(buffer, items, uint8, /)\n--\n\n"
     "Copy tensors' bytes into a bucket buffer at given offsets."},
    {"unpack_gathered",
     DCP_FASTCALL(dcp_unpack_gathered),
     METH_FASTCALL,
     "unpack_gathered(buffer, segment, items, empty, device, results, "
     "indices, offload, cat=None, /)\n--\n\n"
     "Assemble full tensors from an all-gathered bucket."},
    {"extract_rows",
     DCP_FASTCALL(dcp_extract_rows),
     METH_FASTCALL,
     "extract_rows(buffer, items, dests, /)\n--\n\n"
     "Keep this rank's part of broadcast row chunks."},
    {"plan_gather",
     DCP_FASTCALL(dcp_plan_gather),
     METH_FASTCALL,
     "plan_gather(leaves, dtensor_cls, placement_classes, budget, "
     "floor=0, /)\n--\n\n"
     "Bucketed gather plans for the DTensor leaves, per mesh."},
    {"indices_of",
     DCP_FASTCALL(dcp_indices_of),
     METH_FASTCALL,
     "indices_of(values, cls, /)\n--\n\n"
     "Positions of the values that are instances of cls."},
    {"plan_full_load",
     DCP_FASTCALL(dcp_plan_full_load),
     METH_FASTCALL,
     "plan_full_load(jobs, dtensor_cls, classes, budget, empty, stream,"
     " in_place=False, /)"
     "\n--\n\n"
     "Destinations, layouts and stream buckets for a full -> local load."},
    {"pack_rows",
     DCP_FASTCALL(dcp_pack_rows),
     METH_FASTCALL,
     "pack_rows(buffer, src_items, values, uint8, /)\n--\n\n"
     "Pack row chunks of full tensors into a stream bucket."},
    {"finish_full_load",
     DCP_FASTCALL(dcp_finish_full_load),
     METH_FASTCALL,
     "finish_full_load(jobs, dests, layouts, from_local, offload, /)"
     "\n--\n\n"
     "Wrap loaded shards as DTensors like their templates."},
    {"to_metadata",
     DCP_FASTCALL(dcp_to_metadata),
     METH_FASTCALL,
     "to_metadata(leaves, meta_cls, tensor_cls, /)\n--\n\n"
     "What a stream sends ahead of tensor data."},
    {"optim_state_jobs",
     DCP_FASTCALL(dcp_optim_state_jobs),
     METH_FASTCALL,
     "optim_state_jobs(index, state, dtensor_cls, mode, from_local,"
     " existing=None, /)"
     "\n--\n\n"
     "Copy loaded optimizer state and list the tensors to localise."},
    {"write_slots",
     DCP_FASTCALL(dcp_write_slots),
     METH_FASTCALL,
     "write_slots(slots, values, /)\n--\n\n"
     "container[key] = value for each slot."},
    {"broadcast_jobs",
     DCP_FASTCALL(dcp_broadcast_jobs),
     METH_FASTCALL,
     "broadcast_jobs(meta, full, local, device, dtensor_cls, tensor_cls, /)"
     "\n--\n\n"
     "The work list of a model broadcast."},
    {"tree_paths",
     DCP_FASTCALL(dcp_tree_paths),
     METH_FASTCALL,
     "tree_paths(ctx, obj, /)\n--\n\n"
     "Dotted paths of the tensor leaves, in tree_leaves order."},
    {"shape_mismatches",
     DCP_FASTCALL(dcp_shape_mismatches),
     METH_FASTCALL,
     "shape_mismatches(jobs, tensor_cls, /)\n--\n\n"
     "Jobs whose template tensor has another shape than the value."},
    {"check_model_load",
     DCP_FASTCALL(dcp_check_model_load),
     METH_FASTCALL,
     "check_model_load(index, state_dict, strict, check_keys, /)\n--\n\n"
     "What model.load_state_dict would reject, before anything is copied."},
    {"flat_unflatten",
     DCP_FASTCALL(dcp_flat_unflatten),
     METH_FASTCALL,
     "flat_unflatten(full, numels_with_padding, is_padding_mask, shapes, /)"
     "\n--\n\n"
     "Views of the original parameters in an unsharded FSDP1 flat tensor."},
    {"flat_pieces",
     DCP_FASTCALL(dcp_flat_pieces),
     METH_FASTCALL,
     "flat_pieces(numels_with_padding, is_padding_mask, shard_numel, rank, /)"
     "\n--\n\n"
     "(param, param start, shard start, length) of a rank's FSDP1 shard."},
    {"flat_assemble",
     DCP_FASTCALL(dcp_flat_assemble),
     METH_FASTCALL,
     "flat_assemble(dest, pieces, values, /)\n--\n\n"
     "Copy per-parameter pieces into a flat shard."},
    {"map_call",
     DCP_FASTCALL(dcp_map_call),
     METH_FASTCALL,
     "map_call(fn, values, extra, /)\n--\n\n"
     "[fn(v, *extra) for v in values], None passed through."},
    {NULL, NULL, 0, NULL},
};

/* ======================================================================
 * Module state and multi-phase initialisation
 */

static int
dcp_module_traverse(PyObject *module, visitproc visit, void *arg)
{
    dcp_state *st = dcp_get_state(module);
    Py_VISIT(st->Context_Type);
    Py_VISIT(st->ModelIndex_Type);
    Py_VISIT(st->WalkTrace_Type);
#define DCP_VISIT_STR(name, text) Py_VISIT(st->str_##name);
    DCP_INTERNED_STRINGS(DCP_VISIT_STR)
#undef DCP_VISIT_STR
#define DCP_VISIT_ERR(name, text) Py_VISIT(st->err_##name);
    DCP_ERROR_CLASSES(DCP_VISIT_ERR)
#undef DCP_VISIT_ERR
    return 0;
}

static int
dcp_module_clear(PyObject *module)
{
    dcp_state *st = dcp_get_state(module);
    Py_CLEAR(st->Context_Type);
    Py_CLEAR(st->ModelIndex_Type);
    Py_CLEAR(st->WalkTrace_Type);
#define DCP_CLEAR_STR(name, text) Py_CLEAR(st->str_##name);
    DCP_INTERNED_STRINGS(DCP_CLEAR_STR)
#undef DCP_CLEAR_STR
#define DCP_CLEAR_ERR(name, text) Py_CLEAR(st->err_##name);
    DCP_ERROR_CLASSES(DCP_CLEAR_ERR)
#undef DCP_CLEAR_ERR
    return 0;
}

static void
dcp_module_free(void *module)
{
    (void)dcp_module_clear((PyObject *)module);
}

/* Exec-slot step: the exception classes of the contract in dcp.h, from
 * dcp_optim.errors; each must be an exception class.  A dcp_optim.errors
 * already in sys.modules is taken as it is: PyImport_ImportModule would
 * also import the package dcp_optim (to return the top-level module),
 * whose __init__ imports torch, and the torch-free suites load errors.py
 * and the core without the package. */
static int
dcp_errors_exec(dcp_state *st)
{
    PyObject *name = PyUnicode_FromString("dcp_optim.errors");
    if (name == NULL) {
        return -1;
    }
    PyObject *errors = PyImport_GetModule(name);
    if (errors == NULL && !PyErr_Occurred()) {
        errors = PyImport_Import(name);
    }
    Py_DECREF(name);
    if (errors == NULL) {
        return -1;
    }
    int rc = 0;
#define DCP_LOAD_ERR(name, text)                                    \
    if (rc == 0) {                                                  \
        st->err_##name = PyObject_GetAttrString(errors, text);      \
        if (st->err_##name == NULL) {                               \
            rc = -1;                                                \
        }                                                           \
        else if (!PyExceptionClass_Check(st->err_##name)) {         \
            PyErr_Format(PyExc_TypeError,                           \
                         "dcp_optim.errors.%s is not an exception", \
                         text);                                     \
            rc = -1;                                                \
        }                                                           \
    }
    DCP_ERROR_CLASSES(DCP_LOAD_ERR)
#undef DCP_LOAD_ERR
    Py_DECREF(errors);
    return rc;
}

static int
dcp_module_exec(PyObject *module)
{
    dcp_state *st = dcp_get_state(module);
    /* Fill every state slot now; nothing is filled lazily later. */
#define DCP_INTERN_STR(name, text)                     \
    st->str_##name = PyUnicode_InternFromString(text); \
    if (st->str_##name == NULL) {                      \
        return -1;                                     \
    }
    DCP_INTERNED_STRINGS(DCP_INTERN_STR)
#undef DCP_INTERN_STR
    if (dcp_errors_exec(st) < 0) {
        return -1;
    }
    if (dcp_context_init_type(module, st) < 0) {
        return -1;
    }
    if (dcp_walk_init_type(module, st) < 0) {
        return -1;
    }
    /* A marker tests use to prove the compiled core is the one loaded. */
    if (PyModule_AddStringConstant(module, "BACKEND", "c") < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "ABI_VERSION", 1) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot dcp_slots[] = {
    {Py_mod_exec, dcp_module_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

PyModuleDef dcp_moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dcp_optim._dcp_optim",
    .m_doc =
        "Native core of dcp_optim: module walks, FQN mapping, "
        "optimizer state (un)flattening and splitting, resharding "
        "plans.",
    .m_size = sizeof(dcp_state),
    .m_methods = dcp_methods,
    .m_slots = dcp_slots,
    .m_traverse = dcp_module_traverse,
    .m_clear = dcp_module_clear,
    .m_free = dcp_module_free,
};

PyMODINIT_FUNC PyInit__dcp_optim(void);

PyMODINIT_FUNC
PyInit__dcp_optim(void)
{
    return PyModuleDef_Init(&dcp_moduledef);
}
