/* Module definition of dcp_optim._dcp_optim: per-module state, the method
 * table (every file's own table, added by the exec slot) and multi-phase
 * initialisation.  The top of the core: it calls every file's init and
 * nothing calls into it (the shared helpers are helpers.c). */
#include "dcp.h"

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
    Py_VISIT(st->LoadPlan_Type);
    Py_VISIT(st->GatherPlan_Type);
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
    Py_CLEAR(st->LoadPlan_Type);
    Py_CLEAR(st->GatherPlan_Type);
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
    if (dcp_index_init_type(module, st) < 0 ||
        dcp_walktrace_init_type(module, st) < 0) {
        return -1;
    }
    if (dcp_full_load_init_type(module, st) < 0 ||
        dcp_gather_init_type(module, st) < 0) {
        return -1;
    }
    PyMethodDef *tables[] = {
        dcp_walk_methods,
        dcp_fqn_methods,
        dcp_optim_methods,
        dcp_split_methods,
        dcp_flat_methods,
        dcp_tree_methods,
        dcp_model_load_methods,
        dcp_schema_methods,
        dcp_fsdp1_methods,
        dcp_model_save_methods,
        dcp_shard_geometry_methods,
        dcp_pack_methods,
        dcp_full_load_methods,
        dcp_load_jobs_methods,
        dcp_gather_methods,
        dcp_reshard_plan_methods,
    };
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
        if (PyModule_AddFunctions(module, tables[i]) < 0) {
            return -1;
        }
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
#ifdef Py_mod_gil
    /* The core relies on the GIL: no critical sections guard the dicts and
     * lists it reads while calling back into Python, so a free-threaded
     * build (3.13t) re-enables the GIL when it imports the module. */
    {Py_mod_gil, Py_MOD_GIL_USED},
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
