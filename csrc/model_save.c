/* nn.Module.state_dict() built natively: the OrderedDict torch's call
 * returns, its `_metadata` included, for trees in which that call would
 * run none of the model's own code.  Torch's call costs Python per module
 * (the recursion, _save_to_state_dict, the hook loops, the metadata);
 * here only the per-tensor detach() calls into torch.
 *
 * What torch's call does, per module, in this order (torch/nn/modules/
 * module.py, Module.state_dict and _save_to_state_dict), with keep_vars
 * False and a fresh destination:
 *   1. destination._metadata[prefix[:-1]] = {"version": module._version};
 *   2. every hook of module._state_dict_pre_hooks;
 *   3. module._save_to_state_dict: each parameter that is not None as
 *      prefix + name -> param.detach(); each buffer that is not None and
 *      whose name is not in module._non_persistent_buffers_set, the same;
 *      the extra state where the class overrides get_extra_state;
 *   4. module.state_dict(prefix=prefix + name + ".") for each child of
 *      module._modules that is not None;
 *   5. every hook of module._state_dict_hooks.
 *
 * The tree qualifies when, for every module reached, torch's call would
 * take exactly those steps without calling anything of the model's: the
 * module is an nn.Module whose type is TF_PLAIN (attribute access runs no
 * user code) and has neither TF_EXTRA_STATE nor TF_SAVE_RULES (state_dict
 * and _save_to_state_dict are nn.Module's; walk_types.c); its instance
 * __dict__ holds no `state_dict` or `_save_to_state_dict` of its own; both
 * hook registries are there, dict-like and empty; its containers are exact
 * dicts (and an exact set) with exact str names; its children are
 * nn.Modules.  Anything else returns None and the caller runs torch's
 * call, which then does what it does (raises included).
 *
 * Two passes.  The first reads the tree only and calls nothing, so a tree
 * that does not qualify costs no detach() (a tensor subclass may run
 * Python in it).  The second checks each module again as it builds: a
 * detach() that changed the tree makes it return None, and torch's call
 * then starts over (detaching again).  `_version` is read with getattr,
 * as torch does; a class may make it a property, which then runs once per
 * module in both.
 */
#include "walk.h"

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    dcp_ptrmap types;   /* type -> TF_* flags (dcp_type_flags_cached) */
    PyObject *dest;     /* second pass: the OrderedDict being filled */
    PyObject *metadata; /* its _metadata */
} sd_walk;

/* 1 if type(module) saves by nn.Module's rules (see the top), 0 if not,
 * -1 on error.  The flags once per type and call. */
static int
sd_type_ok(sd_walk *s, PyObject *module)
{
    long flags = dcp_type_flags_cached(s->st, s->ctx, &s->types, module);
    if (flags < 0) {
        return -1;
    }
    return (flags & TF_PLAIN) &&
           !(flags & (TF_EXTRA_STATE | TF_SAVE_RULES | TF_FSDP1));
}

/* 1 if the instance __dict__ entry `name` is a dict-like hook registry
 * with nothing in it, 0 if not (missing: torch's getattr would ask
 * __getattr__), -1 on error. */
static int
sd_no_hooks(PyObject *inst, PyObject *name)
{
    PyObject *hooks = NULL;
    int rc = dcp_dict_get_ref(inst, name, &hooks);
    if (rc <= 0) {
        return rc;
    }
    int empty = dcp_plain_len(hooks) && PyDict_GET_SIZE(hooks) == 0;
    Py_DECREF(hooks);
    return empty;
}

/* The instance __dict__ entry `name` as an exact dict whose keys are all
 * exact str: 1 with a new reference in *out, 0 when it is anything else,
 * -1 on error.  Reading keys and types runs no code. */
static int
sd_members(PyObject *inst, PyObject *name, PyObject **out)
{
    int rc = dcp_dict_attr_exact(inst, name, out);
    if (rc <= 0) {
        return rc;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(*out, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) {
            Py_CLEAR(*out);
            return 0;
        }
    }
    return 1;
}

/* The containers of `module` when it qualifies (see the top): 1 with new
 * references in c[0..3] (_parameters, _buffers, _non_persistent_buffers_set,
 * _modules), 0 when it does not (c[] all NULL), -1 on error. */
static int
sd_module(sd_walk *s, PyObject *module, PyObject *c[4])
{
    dcp_state *st = s->st;
    PyObject *inst = NULL;
    int rc;
    c[0] = c[1] = c[2] = c[3] = NULL;
    if (!PyObject_TypeCheck(module, (PyTypeObject *)s->ctx->module_type)) {
        return 0;
    }
    if ((rc = sd_type_ok(s, module)) <= 0) {
        return rc;
    }
    inst = PyObject_GenericGetDict(module, NULL);
    if (inst == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    rc = 0;
    if (!PyDict_Check(inst)) {
        goto done;
    }
    /* torch looks these up on the instance first: what it would call */
    int has;
    if ((has = PyDict_Contains(inst, st->str_state_dict)) != 0 ||
        (has = PyDict_Contains(inst, st->str_save_to_sd)) != 0) {
        rc = has < 0 ? -1 : 0;
        goto done;
    }
    if ((rc = sd_no_hooks(inst, st->str_sd_pre_hooks)) <= 0 ||
        (rc = sd_no_hooks(inst, st->str_sd_hooks)) <= 0 ||
        (rc = sd_members(inst, st->str_parameters, &c[0])) <= 0 ||
        (rc = sd_members(inst, st->str_buffers, &c[1])) <= 0 ||
        (rc = sd_members(inst, st->str_modules, &c[3])) <= 0) {
        goto done;
    }
    if ((rc = dcp_dict_get_ref(inst, st->str_non_persistent, &c[2])) <= 0) {
        goto done;
    }
    rc = PySet_CheckExact(c[2]) ? 1 : 0;
done:
    Py_DECREF(inst);
    if (rc <= 0) {
        for (int i = 0; i < 4; i++) {
            Py_CLEAR(c[i]);
        }
    }
    return rc;
}

/* First pass: 1 if the tree under `module` qualifies, 0 if not, -1 on
 * error.  Calls nothing of the model's.  A tree too deep for the
 * recursion limit does not qualify: torch's call then raises its own
 * RecursionError. */
static int
sd_check(sd_walk *s, PyObject *module)
{
    PyObject *c[4] = {NULL, NULL, NULL, NULL};
    dcp_dict_iter it = {NULL, 0, 0, NULL, NULL};
    int rc, more;
    if (Py_EnterRecursiveCall(" while checking the module tree")) {
        if (!PyErr_ExceptionMatches(PyExc_RecursionError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    if ((rc = sd_module(s, module, c)) <= 0) {
        goto done;
    }
    /* the iterator pins the dict and the child across the recursion (an
     * allocation there may run a finalizer that changes the tree) */
    dcp_dict_iter_init(&it, c[3]);
    PyObject *name, *child;
    while ((more = dcp_dict_iter_next(&it, &name, &child)) == 1) {
        if (child != Py_None && (rc = sd_check(s, child)) <= 0) {
            goto done;
        }
    }
    if (more < 0) {
        PyErr_Clear(); /* changed size while checking: leave it to torch */
        rc = 0;
        goto done;
    }
    rc = 1;
done:
    Py_LeaveRecursiveCall();
    dcp_dict_iter_clear(&it);
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(c[i]);
    }
    return rc;
}

/* destination[prefix + name] = value.detach() for each member that is not
 * None (and, with `non_persistent`, whose name is not in it): step 3.
 * 1, 0 when the dict changed size under a detach(), -1 on error. */
static int
sd_save_members(sd_walk *s,
                PyObject *members,
                PyObject *non_persistent,
                PyObject *prefix)
{
    dcp_dict_iter it;
    PyObject *name, *value;
    int more;
    dcp_dict_iter_init(&it, members);
    while ((more = dcp_dict_iter_next(&it, &name, &value)) == 1) {
        if (value == Py_None) {
            continue;
        }
        if (non_persistent != NULL) {
            int skip = PySet_Contains(non_persistent, name); /* exact str */
            if (skip < 0) {
                goto error;
            }
            if (skip) {
                continue;
            }
        }
        PyObject *detached =
            PyObject_CallMethodNoArgs(value, s->st->str_detach);
        if (detached == NULL) {
            goto error;
        }
        PyObject *key = PyUnicode_Concat(prefix, name);
        int set = key == NULL ? -1 : PyObject_SetItem(s->dest, key, detached);
        Py_XDECREF(key);
        Py_DECREF(detached);
        if (set < 0) {
            goto error;
        }
    }
    if (more < 0) {
        PyErr_Clear(); /* a detach() changed the module: torch starts over */
        return 0;
    }
    return 1;
error:
    dcp_dict_iter_clear(&it);
    return -1;
}

/* Second pass: fills s->dest and s->metadata for `module` under `prefix`
 * (steps 1, 3 and 4; 2 and 5 have no hooks to run).  1, 0 when the tree
 * no longer qualifies, -1 on error. */
static int
sd_build(sd_walk *s, PyObject *module, PyObject *prefix)
{
    dcp_state *st = s->st;
    PyObject *c[4] = {NULL, NULL, NULL, NULL};
    PyObject *version = NULL, *local = NULL, *key = NULL;
    dcp_dict_iter it = {NULL, 0, 0, NULL, NULL};
    int rc, more;
    if (Py_EnterRecursiveCall(" while building the model state dict")) {
        return -1;
    }
    if ((rc = sd_module(s, module, c)) <= 0) {
        goto done;
    }
    rc = -1;
    /* step 1 */
    version = PyObject_GetAttr(module, st->str_version_attr);
    local = version == NULL ? NULL : PyDict_New();
    if (local == NULL || PyDict_SetItem(local, st->str_version, version) < 0) {
        goto done;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(prefix);
    key = n > 0 ? PyUnicode_Substring(prefix, 0, n - 1) : Py_NewRef(prefix);
    if (key == NULL || PyObject_SetItem(s->metadata, key, local) < 0) {
        goto done;
    }
    /* step 3 */
    if ((rc = sd_save_members(s, c[0], NULL, prefix)) <= 0 ||
        (rc = sd_save_members(s, c[1], c[2], prefix)) <= 0) {
        goto done;
    }
    /* step 4 */
    dcp_dict_iter_init(&it, c[3]);
    PyObject *name, *child;
    while ((more = dcp_dict_iter_next(&it, &name, &child)) == 1) {
        if (child == Py_None) {
            continue;
        }
        PyObject *child_prefix = dcp_child_prefix(st, prefix, name);
        if (child_prefix == NULL) {
            rc = -1;
            goto done;
        }
        rc = sd_build(s, child, child_prefix);
        Py_DECREF(child_prefix);
        if (rc <= 0) {
            goto done;
        }
    }
    if (more < 0) {
        PyErr_Clear(); /* a detach() changed the tree: torch starts over */
        rc = 0;
        goto done;
    }
    rc = 1;
done:
    Py_LeaveRecursiveCall();
    dcp_dict_iter_clear(&it);
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(c[i]);
    }
    Py_XDECREF(version);
    Py_XDECREF(local);
    Py_XDECREF(key);
    return rc;
}

PyDoc_STRVAR(
    dcp_plain_state_dict__doc__,
    "plain_state_dict(ctx, model, /)\n--\n\n"
    "What model.state_dict() returns (an OrderedDict with its _metadata), "
    "built natively, when torch's call would run none of the model's own "
    "code; None when it would (run torch's call then).");

/* plain_state_dict(ctx, model) -> OrderedDict or None */
static PyObject *
dcp_plain_state_dict(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("plain_state_dict", nargs, 2) < 0 ||
        !dcp_context_check(st, args[0])) {
        return NULL;
    }
    dcp_Context *ctx = (dcp_Context *)args[0];
    PyObject *model = args[1];
    sd_walk s = {st, ctx, {NULL, 0, 0}, NULL, NULL};
    PyObject *result = NULL;
    if (ctx->ordereddict_type == Py_None || !PyType_Check(ctx->module_type)) {
        Py_RETURN_NONE;
    }
    int rc = sd_check(&s, model);
    if (rc < 0) {
        goto done;
    }
    if (rc > 0) {
        s.dest = PyObject_CallNoArgs(ctx->ordereddict_type);
        s.metadata =
            s.dest == NULL ? NULL : PyObject_CallNoArgs(ctx->ordereddict_type);
        if (s.metadata == NULL ||
            PyObject_SetAttr(s.dest, st->str_metadata, s.metadata) < 0) {
            goto done;
        }
        rc = sd_build(&s, model, st->str_empty);
        if (rc < 0) {
            goto done;
        }
    }
    result = rc > 0 ? Py_NewRef(s.dest) : Py_NewRef(Py_None);
done:
    dcp_ptrmap_free(&s.types);
    Py_XDECREF(s.dest);
    Py_XDECREF(s.metadata);
    return result;
}

PyMethodDef dcp_model_save_methods[] = {
    {"plain_state_dict",
     DCP_FASTCALL(dcp_plain_state_dict),
     METH_FASTCALL,
     dcp_plain_state_dict__doc__},
    {NULL, NULL, 0, NULL},
};
