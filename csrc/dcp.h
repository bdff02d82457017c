/* Shared declarations of the _dcp_optim extension.
 *
 * Layout of the C core (one concern per file):
 *   module.c   module definition, per-module state, method table (the
 *              top: it calls every file's init, nothing calls into it)
 *   helpers.c  shared helpers (names, items snapshots, pinned dict
 *              iteration, type lookups, exception notes): the bottom
 *   context.c  Context: the torch classes and base methods the core needs,
 *              handed in from Python so the core never imports torch
 *   walk.c     the module walk: one native walk of the nn.Module tree
 *   model_index.c  ModelIndex: the type the walk fills
 *   walk_cache.c   WalkTrace: a walk's record, replayed on an unchanged tree
 *   walk_types.c   facts about module types, read by the walk and replay
 *   fqn.c      FQN rules for arbitrary names (upstream's _get_fqns) and
 *              canonicalisation of model state_dict keys
 *   optim.c    optimizer param-ID <-> FQN mapping (get side)
 *   split.c    splitting a combined optimizer state dict per optimizer
 *              and installing it (set side)
 *   flat.c     the flattened optimizer format
 *   tree.c     copying state-dict trees and collecting tensor leaves
 *   shard_geometry.c  every rank's shard of a DTensor from mesh + placements
 *   pack.c     block copies between shards and full tensors; byte packing
 *   full_load.c  full -> local load plans and their results
 *   load_jobs.c  the job lists of model and optimizer full loads
 *   gather.c   full gathers: GatherPlan, packing and unpacking buckets
 *   fsdp1.c    FSDP1 flat-parameter <-> original-parameter mapping
 *   model_save.c  nn.Module.state_dict() built natively, where torch's
 *              call would run none of the model's own code
 *
 * Conventions (see docs/contributing.md): functions document their return
 * contract; "new reference or NULL with an exception set" unless said
 * otherwise; int-returning helpers return 0 / -1; predicates 1 / 0 / -1.
 */
#ifndef DCP_H
#define DCP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "compat.h"
#include "ptrmap.h"

/* Interned attribute and key names, one field each in dcp_state. */
#define DCP_INTERNED_STRINGS(X)                      \
    X(modules, "_modules")                           \
    X(parameters, "_parameters")                     \
    X(buffers, "_buffers")                           \
    X(non_persistent, "_non_persistent_buffers_set") \
    X(requires_grad, "requires_grad")                \
    X(params, "params")                              \
    X(state, "state")                                \
    X(param_groups, "param_groups")                  \
    X(module, "module")                              \
    X(orig_mod, "_orig_mod")                         \
    X(ckpt_wrapped, "_checkpoint_wrapped_module")    \
    X(fsdp_wrapped, "_fsdp_wrapped_module")          \
    X(flat_param, "_flat_param")                     \
    X(fqns, "_fqns")                                 \
    X(extra_state, "_extra_state")                   \
    X(named_children, "named_children")              \
    X(named_parameters, "named_parameters")          \
    X(named_buffers, "named_buffers")                \
    X(get_extra_state, "get_extra_state")            \
    X(dot, ".")                                      \
    X(empty, "")                                     \
    X(step, "step")                                  \
    X(state_prefix, "state.")                        \
    X(pg_prefix, "param_groups.")                    \
    X(to, "to")                                      \
    X(shape, "shape")                                \
    X(dtype, "dtype")                                \
    X(device, "device")                              \
    X(is_floating_point, "is_floating_point")        \
    X(is_complex, "is_complex")                      \
    X(is_meta, "is_meta")                            \
    X(dim, "dim")                                    \
    X(detach, "detach")                              \
    X(cpu, "cpu")                                    \
    X(view, "view")                                  \
    X(reshape, "reshape")                            \
    X(copy_, "copy_")                                \
    X(fused, "fused")                                \
    X(capturable, "capturable")                      \
    X(device_mesh, "device_mesh")                    \
    X(load_pre_hooks, "_load_state_dict_pre_hooks")  \
    X(post_hooks, "_load_state_dict_post_hooks")     \
    X(load_from_sd, "_load_from_state_dict")         \
    X(set_extra_state, "set_extra_state")            \
    X(placements, "placements")                      \
    X(local_tensor, "_local_tensor")                 \
    X(is_contiguous, "is_contiguous")                \
    X(data_ptr, "data_ptr")                          \
    X(stride, "stride")                              \
    X(layout, "layout")                              \
    X(is_neg, "is_neg")                              \
    X(is_conj, "is_conj")                            \
    X(getattribute, "__getattribute__")              \
    X(getattr_hook, "__getattr__")                   \
    X(dunder_class, "__class__")                     \
    X(get_coordinate, "get_coordinate")              \
    X(itemsize, "itemsize")                          \
    X(split_factor, "split_factor")                  \
    X(narrow, "narrow")                              \
    X(as_strided, "as_strided")                      \
    X(numel, "numel")                                \
    X(copy, "copy")                                  \
    X(metadata, "_metadata")                         \
    X(get, "get")                                    \
    X(pop, "pop")                                    \
    X(state_dict, "state_dict")                      \
    X(save_to_sd, "_save_to_state_dict")             \
    X(sd_pre_hooks, "_state_dict_pre_hooks")         \
    X(sd_hooks, "_state_dict_hooks")                 \
    X(version_attr, "_version")                      \
    X(version, "version")

/* The exception contract.  An error a caller can cause through the public
 * API (a wrong key, shape, dtype or type in a state dict, an unknown FQN,
 * a bad param group) is raised with one of the package's classes from
 * dcp_optim/errors.py, held here; each subclasses the built-in exception
 * upstream raises in that case, so `except KeyError` keeps working
 * (OptimizerDictTypeError is a TypeError and an AttributeError: where a
 * malformed optimizer dict makes upstream fail on a missing method).
 * Where upstream raises its own type and text (AssertionError,
 * NotImplementedError, the E* texts of errors.py), the core raises the
 * same built-in so the two compare equal.  Errors only internal misuse of
 * the private _dcp_optim functions can cause (a wrong argument type or
 * count, a plan or job tuple the Python layer did not build, a broken
 * invariant) stay plain built-ins: they are bugs, not user errors.
 *
 * The exec slot imports dcp_optim.errors (which imports nothing from the
 * package) and fills these slots, so they are never looked up lazily;
 * the package imports the core while its own __init__ runs, by which
 * time importing a torch-free submodule is no cycle.  Classes defined in
 * Python keep errors.py the one readable place that documents them. */
#define DCP_ERROR_CLASSES(X)                \
    X(key, "StateDictKeyError")             \
    X(value, "StateDictValueError")         \
    X(type, "StateDictTypeError")           \
    X(runtime, "StateDictRuntimeError")     \
    X(optim_dict, "OptimizerDictTypeError") \
    X(module_name, "ModuleNameTypeError")

typedef struct {
    PyTypeObject *Context_Type;
    PyTypeObject *ModelIndex_Type;
    PyTypeObject *WalkTrace_Type; /* internal: not added to the module */
    PyTypeObject *LoadPlan_Type;  /* full_load.c */
    /* gather.c */
    PyTypeObject *GatherPlan_Type;
#define DCP_STATE_STR_FIELD(name, text) PyObject *str_##name;
    DCP_INTERNED_STRINGS(DCP_STATE_STR_FIELD)
#undef DCP_STATE_STR_FIELD
#define DCP_STATE_ERR_FIELD(name, text) PyObject *err_##name;
    DCP_ERROR_CLASSES(DCP_STATE_ERR_FIELD)
#undef DCP_STATE_ERR_FIELD
} dcp_state;

extern PyModuleDef dcp_moduledef;

static inline dcp_state *
dcp_get_state(PyObject *module)
{
    void *state = PyModule_GetState(module);
    assert(state != NULL);
    return (dcp_state *)state;
}

/* State of the module that defined `tp`; used by methods of heap types. */
static inline dcp_state *
dcp_get_state_by_type(PyTypeObject *tp)
{
    PyObject *module = dcp_type_module_by_def(tp, &dcp_moduledef);
    assert(module != NULL);
    return dcp_get_state(module);
}

/* ----------------------------------------------------------------------
 * Context (context.c)
 *
 * Every torch object the core needs is a field of a Context instance that
 * the Python layer builds once at import.  Tests build Contexts over fake
 * classes so the sanitizer and refcount suites can drive the core without
 * torch.  One field list generates the struct, traverse, clear and the
 * constructor's keywords.
 */
#define DCP_CONTEXT_FIELDS(X)                                              \
    X(module_type)             /* torch.nn.Module */                       \
    X(tensor_type)             /* torch.Tensor */                          \
    X(dtensor_type)            /* DTensor class, or None */                \
    X(ddp_types)               /* tuple: classes stripping "module." */    \
    X(compiled_types)          /* tuple: classes stripping "_orig_mod." */ \
    X(fsdp1_types)             /* tuple: FSDP1 FullyShardedDataParallel */ \
    X(base_named_children)     /* nn.Module.named_children */              \
    X(base_named_parameters)   /* nn.Module.named_parameters */            \
    X(base_named_buffers)      /* nn.Module.named_buffers */               \
    X(base_get_extra_state)    /* nn.Module.get_extra_state */             \
    X(extra_state_marker)      /* class of the _extra_state marker */      \
    X(defaultdict_type)        /* collections.defaultdict */               \
    X(dict_type)               /* dict (defaultdict's factory) */          \
    X(float32)                 /* torch.float32 */                         \
    X(cpu_device)              /* torch.device("cpu") */                   \
    X(bytesio_type)            /* io.BytesIO */                            \
    X(deepcopy)                /* copy.deepcopy */                         \
    X(base_state_dict)         /* nn.Module.state_dict, or None */         \
    X(base_save_to_state_dict) /* nn.Module._save_to_state_dict */         \
    X(ordereddict_type)        /* collections.OrderedDict */

typedef struct {
    PyObject_HEAD
#define DCP_CONTEXT_STRUCT_FIELD(name) PyObject *name;
    DCP_CONTEXT_FIELDS(DCP_CONTEXT_STRUCT_FIELD)
#undef DCP_CONTEXT_STRUCT_FIELD
} dcp_Context;

int dcp_context_init_type(PyObject *module, dcp_state *st);
/* 1 if `obj` is a dcp_Context, 0 with TypeError set otherwise. */
int dcp_context_check(dcp_state *st, PyObject *obj);

/* isinstance against a tuple field of the context: 1 / 0 / -1. */
static inline int
dcp_isinstance_any(PyObject *obj, PyObject *types)
{
    if (types == Py_None || PyTuple_GET_SIZE(types) == 0) {
        return 0;
    }
    return PyObject_IsInstance(obj, types);
}

/* ----------------------------------------------------------------------
 * ModelIndex (model_index.c; filled by walk.c)
 *
 * The result of one walk over the module tree; everything per-tensor the
 * other files need.  Lists are parallel arrays (one element per entry),
 * which keeps the object simple to traverse and cheap to expose.
 *
 * Every list (and the kinds bytearray) is read-only once the walk is
 * done: indexes replayed from the same WalkTrace share the string lists
 * (walk_cache.c, "Replaying a walk").  Never append to, sort or assign into
 * them.
 */
typedef struct {
    PyObject_HEAD
    PyObject *ctx; /* the dcp_Context the walk used */
    PyObject *model;
    PyObject *modifiers_name; /* str: the _fqn_modifiers method name */
    /* _iterate_valid_model_state order (children first, then buffers,
     * then parameters, then the _extra_state marker). */
    PyObject *raw_names; /* list[str]: names with wrapper prefixes */
    PyObject *fqns;      /* list[str]: canonical FQNs */
    PyObject *load_keys; /* list[str]: keys model.load_state_dict wants */
    PyObject *values;    /* list[Tensor | marker] */
    PyObject *kinds;     /* bytearray: DCP_KIND_* per entry */
    /* Unique tensors in first-seen order, with every FQN naming each. */
    PyObject *tensors;      /* list[Tensor] */
    PyObject *tensor_fqns;  /* list[list[str]] */
    PyObject *tensor_loads; /* list[list[str]] */
    /* model.named_parameters() order (pre-order, deduplicated) with the
     * canonical FQN of each parameter's first name. */
    PyObject *np_params;     /* list[Parameter] */
    PyObject *np_names;      /* list[str]: raw names */
    PyObject *np_fqns;       /* list[str] */
    PyObject *fsdp1_modules; /* list of FSDP1 instances, pre-order */
    PyObject *load_modules;  /* modules, in walk order, with load rules of
                                their own: load_state_dict pre/post hooks,
                                or a type overriding _load_from_state_dict
                                or only one of get_/set_extra_state */
    PyObject *trace;         /* WalkTrace that replays this walk, or None (see
                                walk_cache.c: only plain trees are replayed) */
    PyObject *views;    /* dict: name -> the read-only copy Python sees of a
                           container above (NULL until first asked for) */
    int shared_modules; /* a module is reachable under several paths
                         * (self.b = self.a): the walk keeps the first,
                         * load_state_dict expects keys under every path */
    int custom_load;    /* some module has load_state_dict pre-hooks that may
                           rename keys (activation-checkpoint wrappers aside) */
    dcp_ptrmap tensor_map; /* tensor -> index in `tensors` */
    dcp_ptrmap param_map;  /* param -> index in np_params */
} dcp_ModelIndex;

enum {
    DCP_KIND_PARAM = 0,
    DCP_KIND_BUFFER = 1,
    DCP_KIND_EXTRA = 2,
};

int dcp_index_init_type(PyObject *module, dcp_state *st);
/* The WalkTrace type (walk_cache.c; internal, not added to the module). */
int dcp_walktrace_init_type(PyObject *module, dcp_state *st);
/* Index of `tensor` in index->tensors, or -1 when the model lacks it. */
Py_ssize_t dcp_index_tensor_slot(dcp_ModelIndex *index, PyObject *tensor);
/* Index of `param` in index->np_params, or -1. */
Py_ssize_t dcp_index_param_slot(dcp_ModelIndex *index, PyObject *param);
/* 1 if `obj` is a ModelIndex, 0 with TypeError set otherwise. */
int dcp_index_check(dcp_state *st, PyObject *obj);

/* ----------------------------------------------------------------------
 * Shared helpers (helpers.c)
 */

/* Returns "prefix.name" (or "name" when prefix is empty) as a new str. */
PyObject *dcp_join_name(dcp_state *st, PyObject *prefix, PyObject *name);
/* Returns prefix + name + "." : the prefix for a child; new reference. */
PyObject *dcp_child_prefix(dcp_state *st, PyObject *prefix, PyObject *name);
/* Iteration over an exact dict that survives code run in the loop body
 * (an allocation may start a collection, and a finalizer may change the
 * dict): the dict and the current key and value are strong references
 * held by the iterator, and a change of size since the start raises
 * RuntimeError("dictionary changed size during iteration"), as CPython's
 * dict iterators do.
 *
 *     dcp_dict_iter it;
 *     dcp_dict_iter_init(&it, dict);
 *     while ((rc = dcp_dict_iter_next(&it, &key, &value)) == 1) { ... }
 *     dcp_dict_iter_clear(&it);   // also on every early exit
 *
 * `key` and `value` are borrowed from the iterator, valid until the next
 * call to next or clear. */
typedef struct {
    PyObject *dict;
    Py_ssize_t pos;
    Py_ssize_t size;
    PyObject *key;
    PyObject *value;
} dcp_dict_iter;

static inline void
dcp_dict_iter_init(dcp_dict_iter *it, PyObject *dict)
{
    it->dict = Py_NewRef(dict);
    it->pos = 0;
    it->size = PyDict_GET_SIZE(dict);
    it->key = NULL;
    it->value = NULL;
}

/* 1 with the next entry, 0 at the end, -1 with RuntimeError when the
 * dict changed size; the iterator is cleared at the end and on error. */
int dcp_dict_iter_next(dcp_dict_iter *it, PyObject **key, PyObject **value);
/* Releases what the iterator holds; safe to call more than once. */
void dcp_dict_iter_clear(dcp_dict_iter *it);
/* Snapshot of a mapping's items as a new list of 2-tuples; exact dicts
 * are copied entry by entry (pinned, size checked: dcp_dict_iter),
 * anything else through .items(). */
PyObject *dcp_items_list(dcp_state *st, PyObject *mapping);
/* Makes every item of `list` a 2-tuple, unpacking other iterables as
 * `for a, b in ...` would.  On an item that is no pair, raises
 * StateDictTypeError (not iterable) or StateDictValueError (not two
 * values), the classes of the built-ins upstream's unpacking raises,
 * with the message "<format> must yield pairs: ...".  0 or -1. */
int dcp_unpack_pairs(dcp_state *st, PyObject *list, const char *format, ...);
/* Looks `name` up along type(obj).__mro__ without running descriptors or
 * __getattr__.  Returns a new reference, or NULL without an exception
 * when absent, or NULL with an exception on error (check PyErr_Occurred).
 */
PyObject *dcp_type_lookup(PyTypeObject *tp, PyObject *name);
/* The modifier hook of a module: looked up on the class (bound like
 * attribute access would) or in the instance __dict__.  Returns a new
 * reference, NULL without an exception when absent, NULL with an
 * exception on error.  Unlike getattr() it never raises AttributeError,
 * which matters because nn.Module.__getattr__ builds an exception per
 * miss and the lookup happens once per module or key. */
PyObject *dcp_lookup_hook(PyObject *obj, PyObject *name);
/* Adds a PEP 678 note (PyUnicode_FromFormat syntax) to the exception
 * being raised; a no-op when none is. */
void dcp_note_format(const char *format, ...);
/* Adds the note "at key '<key>'" to the exception being raised. */
void dcp_note_key(PyObject *key);
/* Convert an optimizer's `params` entry or the like into a new list. */
PyObject *dcp_as_list(dcp_state *st, PyObject *seq, const char *what);

/* ----------------------------------------------------------------------
 * Shard geometry (shard_geometry.c)
 */
#define DCP_MAX_DIMS 64
/* Byte alignment of every bucket segment: the widest scalar (complex128)
 * is 16 bytes, and Tensor.view(dtype) needs offsets divisible by it. */
#define DCP_ALIGN 16

enum { PL_REPLICATE = 0, PL_SHARD = 1, PL_STRIDED = 2, PL_PARTIAL = 3 };

typedef struct {
    int kind;
    Py_ssize_t dim;
    Py_ssize_t split_factor;
} placement_t;

/* n rounded up to DCP_ALIGN (n <= PY_SSIZE_T_MAX - DCP_ALIGN). */
static inline Py_ssize_t
dcp_align_up(Py_ssize_t n)
{
    return (n + DCP_ALIGN - 1) / DCP_ALIGN * DCP_ALIGN;
}

/* a * b for sizes >= 0; -1 with ValueError ("<what>: negative size") or
 * OverflowError ("<what>: size overflows"). */
Py_ssize_t dcp_size_product(Py_ssize_t a, Py_ssize_t b, const char *what);
/* Bytes of a tensor of `shape` (a tuple of ints) with `itemsize`-byte
 * elements; -1 with an exception (errors named by `what`) on a shape that
 * is not a tuple, is negative or overflows. */
Py_ssize_t dcp_shape_nbytes(PyObject *shape,
                            Py_ssize_t itemsize,
                            const char *what);
/* Parses a sequence of at most DCP_MAX_DIMS non-negative ints.  0 / -1. */
int dcp_parse_shape(PyObject *obj,
                    Py_ssize_t *out,
                    Py_ssize_t *n,
                    const char *what);
/* Parses placements, a sequence of at most `max` (kind, dim,
 * split_factor) tuples; a Partial kind only with `allow_partial`.  0 / -1. */
int dcp_parse_placements(PyObject *obj,
                         placement_t *out,
                         Py_ssize_t max,
                         Py_ssize_t *n,
                         int allow_partial);
/* A new tuple of the n ints of v. */
PyObject *dcp_ssize_tuple(const Py_ssize_t *v, Py_ssize_t n);
/* (local_shape, [(lstart, gstart, length), ...]) of the shard at mesh
 * coordinate `coord`; new tuple or NULL. */
PyObject *dcp_shard_layout(const Py_ssize_t *gshape,
                           Py_ssize_t ndim,
                           const Py_ssize_t *mesh,
                           Py_ssize_t mdim,
                           const Py_ssize_t *coord,
                           const placement_t *pl);
/* Encodes one Placement object; classes = (Shard, _StridedShard,
 * Replicate), anything else is Partial.  0 / -1. */
int dcp_encode_placement(dcp_state *st,
                         PyObject *p,
                         PyObject *classes,
                         placement_t *out);

/* ----------------------------------------------------------------------
 * Block and byte copies (pack.c)
 */

/* A block (local_starts, global_starts, lengths): three tuples, borrowed.
 * 0 / -1. */
int dcp_parse_block(PyObject *block,
                    PyObject **ls,
                    PyObject **gs,
                    PyObject **ln);
/* obj[start:stop] (a slice along dim 0: byte windows of a bucket,
 * rows of a tensor). */
PyObject *dcp_slice(PyObject *obj, Py_ssize_t start, Py_ssize_t stop);
/* `window` (uint8) reinterpreted as `dtype` with `shape`. */
PyObject *dcp_typed_view(dcp_state *st,
                         PyObject *window,
                         PyObject *dtype,
                         PyObject *shape);
/* The bytes of `tensor` as a flat uint8 tensor (a copy only when the
 * tensor is not contiguous). */
PyObject *dcp_tensor_bytes(dcp_state *st, PyObject *tensor, PyObject *uint8);
/* dst.copy_(src).  0 / -1. */
int dcp_copy_into(dcp_state *st, PyObject *dst, PyObject *src);
/* Copies the blocks (a sequence of parse_block triples) of a shard layout:
 * direction 0 dst[global box] = src[local box] (assemble), 1
 * dst[local box] = src[global box] (extract); wn >= 0 clips the blocks to
 * the dim-0 rows [w0, w0 + wn) that the full side holds.  0 / -1. */
int dcp_copy_block_list(PyObject *dst,
                        PyObject *src,
                        PyObject *blocks,
                        int direction,
                        Py_ssize_t w0,
                        Py_ssize_t wn);

/* ----------------------------------------------------------------------
 * Full -> local load plans (full_load.c)
 */
int dcp_full_load_init_type(PyObject *module, dcp_state *st);

/* Method tables: each file defines the table of the functions it owns,
 * next to them, and the module's exec slot adds every table. */
#define DCP_FASTCALL(fn) ((PyCFunction)(void (*)(void))(fn))
extern PyMethodDef dcp_walk_methods[];           /* walk.c */
extern PyMethodDef dcp_fqn_methods[];            /* fqn.c */
extern PyMethodDef dcp_optim_methods[];          /* optim.c */
extern PyMethodDef dcp_split_methods[];          /* split.c */
extern PyMethodDef dcp_flat_methods[];           /* flat.c */
extern PyMethodDef dcp_tree_methods[];           /* tree.c */
extern PyMethodDef dcp_model_load_methods[];     /* model_load.c */
extern PyMethodDef dcp_schema_methods[];         /* schema.c */
extern PyMethodDef dcp_fsdp1_methods[];          /* fsdp1.c */
extern PyMethodDef dcp_model_save_methods[];     /* model_save.c */
extern PyMethodDef dcp_shard_geometry_methods[]; /* shard_geometry.c */
extern PyMethodDef dcp_pack_methods[];           /* pack.c */
extern PyMethodDef dcp_full_load_methods[];      /* full_load.c */
extern PyMethodDef dcp_load_jobs_methods[];      /* load_jobs.c */
extern PyMethodDef dcp_gather_methods[];         /* gather.c */
extern PyMethodDef dcp_reshard_plan_methods[];   /* reshard_plan.c */

/* tree.c: 1 when `obj` is a set or frozenset of plain values (numbers,
 * strings, bytes, None, tuples of them): a state value that full gets and
 * the flattened format carry as it is; 0 otherwise; -1 on error. */
int dcp_is_plain_set(PyObject *obj);

/* ----------------------------------------------------------------------
 * Full gathers (gather.c): the GatherPlan type and its executors.
 */
int dcp_gather_init_type(PyObject *module, dcp_state *st);

/* obj.<name>(arg) through an interned method name; new reference or
 * NULL. */
static inline PyObject *
dcp_call_method1(PyObject *name, PyObject *obj, PyObject *arg)
{
    PyObject *args[2] = {obj, arg};
    return PyObject_VectorcallMethod(
        name, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Argument helpers for METH_FASTCALL functions. */
static inline int
dcp_check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes exactly %zd arguments (%zd given)",
                     fname,
                     expected,
                     nargs);
        return -1;
    }
    return 0;
}

static inline int
dcp_check_str(const char *fname, const char *what, PyObject *obj)
{
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s must be str, not %.200s",
                     fname,
                     what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

#endif /* DCP_H */
