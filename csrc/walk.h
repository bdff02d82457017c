/* Declarations shared by the files of the module walk: walk.c (the walk
 * itself), model_index.c (the ModelIndex type it fills), walk_cache.c
 * (the walk trace that replays an unchanged tree), walk_types.c (the
 * type facts both read) and model_save.c (the model state dict built
 * natively, from the same type facts).  Internal to those five files;
 * the rest of the core sees ModelIndex through dcp.h.
 */
#ifndef DCP_WALK_H
#define DCP_WALK_H

#include "dcp.h"

/* Per-type facts, cached for the duration of one walk. */
enum {
    TF_KNOWN = 1 << 0,
    TF_CUSTOM_CHILDREN = 1 << 1, /* overrides named_children */
    TF_CUSTOM_BUFFERS = 1 << 2,  /* overrides named_buffers */
    TF_CUSTOM_PARAMS = 1 << 3,   /* overrides named_parameters */
    TF_EXTRA_STATE = 1 << 4,     /* overrides get_extra_state */
    TF_DDP = 1 << 6,
    TF_COMPILED = 1 << 7,
    TF_FSDP1 = 1 << 8,
    /* Attribute access on instances runs no user code: tp_getattro is
     * nn.Module's, __getattribute__ and __class__ are object's, __getattr__
     * is nn.Module's, and no class in the MRO defines one of the container
     * names the walk reads (so they come from the instance __dict__). */
    TF_PLAIN = 1 << 9,
    /* Loads by rules of its own: _load_from_state_dict differs from
     * nn.Module's, or get_extra_state and set_extra_state are not both
     * overridden or both inherited.  Recorded in index->load_modules. */
    TF_LOAD_RULES = 1 << 10,
    /* Saves by rules of its own: state_dict or _save_to_state_dict is not
     * nn.Module's, or the class defines one of the state-dict hook
     * registries (model_save.c then leaves the tree to torch). */
    TF_SAVE_RULES = 1 << 11,
};

/* Types whose walk calls user code or depends on more than the module
 * containers; a tree holding one is never replayed (see "Replaying a walk",
 * walk_cache.c). */
#define TF_UNCACHEABLE                                           \
    (TF_CUSTOM_CHILDREN | TF_CUSTOM_BUFFERS | TF_CUSTOM_PARAMS | \
     TF_EXTRA_STATE | TF_FSDP1)

/* Trace decisions for one member (see "Replaying a walk", walk_cache.c). */
enum {
    TR_SKIP_NONE = 0,          /* value None (or a non-str name) */
    TR_SKIP_DUP = 1,           /* seen before (dedup by identity) */
    TR_SKIP_NONPERSISTENT = 2, /* a non-persistent buffer */
    TR_TAKE = 3,               /* recorded / visited */
};

/* The trace of a walk, recorded while walking (walk_cache.c, "Replaying a
 * walk"). `on` drops to 0 as soon as the tree turns out not to be replayable;
 * recording then stops. */
typedef struct {
    int32_t *ev; /* decisions and counts, in walk order */
    Py_ssize_t len;
    Py_ssize_t cap;
    PyObject *names; /* list: every member name the walk read, in order */
    int on;
} dcp_trace_rec;

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    dcp_ModelIndex *index;
    PyObject *modifiers_name;
    dcp_ptrmap visited;     /* module -> 1 */
    PyObject *visited_keep; /* list pinning every visited module */
    PyObject *type_flags;   /* dict: type -> int */
    int noted;              /* an error note was attached already */
    dcp_trace_rec rec;
} dcp_walker;

/* walk_types.c */
long dcp_type_flags_compute(dcp_state *st,
                            dcp_Context *ctx,
                            PyObject *module,
                            int plain_only);
long dcp_type_flags_cached(dcp_state *st,
                           dcp_Context *ctx,
                           dcp_ptrmap *types,
                           PyObject *module);
int dcp_plain_len(PyObject *obj);
int dcp_dict_attr_exact(PyObject *inst, PyObject *name, PyObject **out);

/* model_index.c */
dcp_ModelIndex *dcp_index_create(dcp_state *st,
                                 PyObject *ctx,
                                 PyObject *model,
                                 PyObject *modifiers);

/* walk_cache.c */
PyObject *dcp_walktrace_new(dcp_state *st, dcp_walker *w, dcp_ModelIndex *ix);

#endif /* DCP_WALK_H */
