/* FQN rules for arbitrary names, and the model-side key operations.
 *
 * resolve(): upstream's _get_fqns(model, name, ...) -- a getattr walk
 * along the dotted name that drops wrapper levels -- with one deliberate
 * change (D16 in docs/differences.md): a name that passes through an
 * activation-checkpoint wrapper continues into the wrapped module, so a
 * compiled module inside a CheckpointWrapper loses its "_orig_mod." like any
 * other compiled module.  Names that do not involve that nesting resolve
 * exactly as upstream.
 *
 * A batch of names (every key of model.state_dict()) shares most of its
 * prefixes, so the walk state after each dotted prefix is cached for the
 * duration of one call: each distinct module path is resolved once.
 */
#include "dcp.h"

typedef struct {
    dcp_state *st;
    dcp_Context *ctx;
    PyObject *model;
    PyObject *modifiers;
    int skip_ddp;
    int skip_compiler;
    PyObject *cache; /* dict: prefix str -> (curr, emitted prefix str) */
} dcp_resolver;

/* Upstream removes the activation-checkpoint token with str.replace. */
static PyObject *
strip_ckpt_token(dcp_state *st, PyObject *name)
{
    PyObject *token = PyUnicode_Concat(st->str_ckpt_wrapped, st->str_dot);
    if (token == NULL) {
        return NULL;
    }
    Py_ssize_t found =
        PyUnicode_Find(name, token, 0, PyUnicode_GET_LENGTH(name), 1);
    PyObject *result = NULL;
    if (found == -2) {
        goto done;
    }
    if (found == -1) {
        result = Py_NewRef(name);
        goto done;
    }
    result = PyUnicode_Replace(name, token, st->str_empty, -1);
done:
    Py_DECREF(token);
    return result;
}

/* hasattr(obj, name): 1 / 0 / -1.  Used for attributes the walk really
 * needs (hidden children); the modifier hook is found with
 * dcp_lookup_hook, which raises no AttributeError per token. */
static int
has_attr(PyObject *obj, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value != NULL) {
        Py_DECREF(value);
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* 1 if `module` is an activation-checkpoint wrapper and `tok` names
 * nothing registered on the wrapper itself, so the walk should continue
 * in the wrapped module (D16).  0 otherwise, -1 on error. */
static int
passes_through_ckpt(dcp_resolver *r,
                    PyObject *module,
                    PyObject *tok,
                    PyObject **inner)
{
    dcp_state *st = r->st;
    PyObject *modules = NULL;
    int result = 0;
    *inner = NULL;
    if (PyUnicode_Compare(tok, st->str_ckpt_wrapped) == 0) {
        return 0;
    }
    modules = PyObject_GetAttr(module, st->str_modules);
    if (modules == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (!PyDict_Check(modules)) {
        goto done;
    }
    int rc = dcp_dict_get_ref(modules, st->str_ckpt_wrapped, inner);
    if (rc <= 0) {
        result = rc;
        goto done;
    }
    /* Registered on the wrapper itself: no pass-through. */
    PyObject *containers[3] = {modules, NULL, NULL};
    PyObject *params = PyObject_GetAttr(module, st->str_parameters);
    PyObject *buffers =
        params ? PyObject_GetAttr(module, st->str_buffers) : NULL;
    if (params == NULL || buffers == NULL) {
        Py_XDECREF(params);
        Py_CLEAR(*inner);
        result = -1;
        goto done;
    }
    containers[1] = params;
    containers[2] = buffers;
    result = 1;
    for (int i = 0; i < 3 && result == 1; i++) {
        int has = PySequence_Contains(containers[i], tok);
        if (has < 0) {
            result = -1;
        }
        else if (has) {
            result = 0;
        }
    }
    Py_DECREF(params);
    Py_DECREF(buffers);
    if (result != 1) {
        Py_CLEAR(*inner);
    }
done:
    Py_XDECREF(modules);
    return result;
}

/* 1 if `name` is in the _parameters, _buffers or _modules dict of
 * `module`, 0 if not (or `module` has no such dicts), -1 on error. */
static int
registered_member(dcp_state *st, PyObject *module, PyObject *name)
{
    PyObject *attrs[3] = {
        st->str_parameters, st->str_buffers, st->str_modules};
    for (int i = 0; i < 3; i++) {
        PyObject *container = PyObject_GetAttr(module, attrs[i]);
        if (container == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                return -1;
            }
            PyErr_Clear();
            return 0;
        }
        int has =
            PyDict_Check(container) ? PyDict_Contains(container, name) : 0;
        Py_DECREF(container);
        if (has != 0) {
            return has;
        }
    }
    return 0;
}

/* Processes one token.  On entry *curr and *emitted (an owned list of
 * emitted tokens) describe the walk so far; both are updated in place.
 * `next` is the following token or NULL.  Sets *flat to a new set when
 * FSDP1's flat-parameter expansion ends the walk.  Returns 0 or -1. */
static int
resolve_token(dcp_resolver *r,
              PyObject **curr,
              PyObject *emitted,
              PyObject *tok,
              PyObject *next,
              PyObject **flat)
{
    dcp_state *st = r->st;
    dcp_Context *ctx = r->ctx;
    PyObject *obj = *curr, *child = NULL;
    int rc;

    for (;;) {
        /* DDP: the token must be "module". */
        if ((rc = dcp_isinstance_any(obj, ctx->ddp_types)) != 0) {
            if (rc < 0) {
                return -1;
            }
            if (PyUnicode_Compare(tok, st->str_module) != 0) {
                PyErr_Format(
                    PyExc_AssertionError, "Expected 'module', got '%S'", tok);
                return -1;
            }
            child = PyObject_GetAttr(obj, st->str_module);
            if (child == NULL) {
                return -1;
            }
            if (!r->skip_ddp && PyList_Append(emitted, tok) < 0) {
                Py_DECREF(child);
                return -1;
            }
            break;
        }
        /* FSDP1: expand the flat parameter, else step into the wrapped
         * module. */
        if ((rc = dcp_isinstance_any(obj, ctx->fsdp1_types)) != 0) {
            if (rc < 0) {
                return -1;
            }
            if (next != NULL &&
                PyUnicode_Compare(next, st->str_flat_param) == 0) {
                PyObject *fp = PyObject_GetAttr(obj, st->str_flat_param);
                PyObject *names =
                    fp ? PyObject_GetAttr(fp, st->str_fqns) : NULL;
                PyObject *prefix = NULL, *list = NULL;
                Py_XDECREF(fp);
                if (names == NULL) {
                    return -1;
                }
                list = dcp_as_list(st, names, "FlatParameter._fqns");
                Py_DECREF(names);
                if (list == NULL) {
                    return -1;
                }
                *flat = PySet_New(NULL);
                prefix = PyUnicode_Join(st->str_dot, emitted);
                if (*flat == NULL || prefix == NULL) {
                    Py_XDECREF(prefix);
                    Py_DECREF(list);
                    Py_CLEAR(*flat);
                    return -1;
                }
                for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
                    if (!PyUnicode_Check(PyList_GET_ITEM(list, i))) {
                        /* callers treat the FQNs as str (%S, lengths) */
                        PyErr_Format(
                            st->err_type,
                            "FlatParameter._fqns must hold str, "
                            "got %.200s",
                            Py_TYPE(PyList_GET_ITEM(list, i))->tp_name);
                        Py_DECREF(prefix);
                        Py_DECREF(list);
                        Py_CLEAR(*flat);
                        return -1;
                    }
                    PyObject *full =
                        PyUnicode_GET_LENGTH(prefix)
                            ? dcp_join_name(
                                  st, prefix, PyList_GET_ITEM(list, i))
                            : Py_NewRef(PyList_GET_ITEM(list, i));
                    if (full == NULL || PySet_Add(*flat, full) < 0) {
                        Py_XDECREF(full);
                        Py_DECREF(prefix);
                        Py_DECREF(list);
                        Py_CLEAR(*flat);
                        return -1;
                    }
                    Py_DECREF(full);
                }
                Py_DECREF(prefix);
                Py_DECREF(list);
                return 0;
            }
            child = PyObject_GetAttr(obj, st->str_fsdp_wrapped);
            if (child == NULL) {
                return -1;
            }
            if (PyUnicode_Compare(tok, st->str_fsdp_wrapped) != 0) {
                PyObject *inner = PyObject_GetAttr(child, tok);
                Py_DECREF(child);
                if (inner == NULL || PyList_Append(emitted, tok) < 0) {
                    Py_XDECREF(inner);
                    return -1;
                }
                child = inner;
            }
            break;
        }
        /* torch.compile: the token must be "_orig_mod". */
        if ((rc = dcp_isinstance_any(obj, ctx->compiled_types)) != 0) {
            if (rc < 0) {
                return -1;
            }
            if (PyUnicode_Compare(tok, st->str_orig_mod) != 0) {
                PyErr_Format(PyExc_AssertionError,
                             "Expected '_orig_mod', got '%S'",
                             tok);
                return -1;
            }
            child = PyObject_GetAttr(obj, st->str_orig_mod);
            if (child == NULL) {
                return -1;
            }
            if (!r->skip_compiler && PyList_Append(emitted, tok) < 0) {
                Py_DECREF(child);
                return -1;
            }
            break;
        }
        /* D16: continue inside an activation-checkpoint wrapper. */
        PyObject *inner = NULL;
        rc = passes_through_ckpt(r, obj, tok, &inner);
        if (rc < 0) {
            return -1;
        }
        if (rc == 1) {
            Py_SETREF(*curr, inner);
            obj = *curr;
            continue;
        }
        /* Any other module: the modifier hook may hide a level. */
        PyObject *hook = dcp_lookup_hook(obj, r->modifiers);
        if (hook == NULL && PyErr_Occurred()) {
            return -1;
        }
        if (hook != NULL) {
            PyObject *mapping = PyObject_CallNoArgs(hook);
            PyObject *hidden = NULL;
            Py_XDECREF(hook);
            if (mapping == NULL) {
                return -1;
            }
            hidden = PyObject_CallMethodOneArg(mapping, st->str_get, tok);
            Py_DECREF(mapping);
            if (hidden == NULL) {
                return -1;
            }
            int truthy = PyObject_IsTrue(hidden);
            if (truthy < 0) {
                Py_DECREF(hidden);
                return -1;
            }
            if (truthy) {
                int present =
                    PyUnicode_Check(hidden) ? has_attr(obj, hidden) : 0;
                if (present < 0) {
                    Py_DECREF(hidden);
                    return -1;
                }
                if (present) {
                    PyObject *sub = PyObject_GetAttr(obj, hidden);
                    if (sub == NULL) {
                        Py_DECREF(hidden);
                        return -1;
                    }
                    Py_SETREF(*curr, sub);
                    obj = *curr;
                }
            }
            Py_DECREF(hidden);
        }
        if (PyList_Append(emitted, tok) < 0) {
            return -1;
        }
        if (PyUnicode_Compare(tok, st->str_extra_state) == 0) {
            if (next != NULL) {
                PyErr_SetString(PyExc_RuntimeError,
                                "Expect `_extra_state` to be the last obj "
                                "name");
                return -1;
            }
            return 0;
        }
        if (next == NULL) {
            /* Upstream getattr()s the last token too (an unresolvable
             * name raises AttributeError).  A name registered in the
             * module's own containers resolves for sure, so only other
             * names pay for a real getattr (nn.Module.__getattr__ is
             * Python code). */
            int found = registered_member(st, obj, tok);
            if (found != 0) {
                return found < 0 ? -1 : 0;
            }
        }
        child = PyObject_GetAttr(obj, tok);
        if (child == NULL) {
            return -1;
        }
        break;
    }
    Py_SETREF(*curr, child);
    return 0;
}

/* Canonical FQNs of `name` as a new set, or NULL. */
static PyObject *
resolve(dcp_resolver *r, PyObject *name)
{
    dcp_state *st = r->st;
    PyObject *stripped = NULL, *tokens = NULL, *curr = NULL;
    PyObject *emitted = NULL, *flat = NULL, *result = NULL;
    PyObject *joined = NULL, *final = NULL;
    Py_ssize_t start = 0;

    stripped = strip_ckpt_token(st, name);
    if (stripped == NULL) {
        goto done;
    }
    Py_ssize_t dot = PyUnicode_FindChar(
        stripped, '.', 0, PyUnicode_GET_LENGTH(stripped), 1);
    if (dot == -2) {
        goto done;
    }
    if (dot == -1) {
        result = PySet_New(NULL);
        if (result != NULL && PySet_Add(result, stripped) < 0) {
            Py_CLEAR(result);
        }
        goto done;
    }
    tokens = PyUnicode_Split(stripped, st->str_dot, -1);
    if (tokens == NULL) {
        goto done;
    }
    Py_ssize_t ntok = PyList_GET_SIZE(tokens);

    /* Resume from the longest cached prefix: the walk state after a
     * prefix depends on the prefix only, except that FSDP1's flat
     * parameter expansion looks one token ahead -- so never resume right
     * before a "_flat_param" token.  Every prefix walked is cached (keys
     * share their module paths: each is walked once per call). */
    Py_ssize_t *ends = PyMem_New(Py_ssize_t, ntok);
    if (ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, at = 0; i < ntok; i++) {
        at += PyUnicode_GET_LENGTH(PyList_GET_ITEM(tokens, i));
        ends[i] = at; /* stripped[:ends[i]] is the prefix up to token i */
        at += 1;
    }
    for (Py_ssize_t k = ntok - 2; r->cache != NULL && k >= 0; k--) {
        int cmp = PyUnicode_Compare(PyList_GET_ITEM(tokens, k + 1),
                                    st->str_flat_param);
        if (cmp == -1 && PyErr_Occurred()) {
            PyMem_Free(ends);
            goto done;
        }
        if (cmp == 0) {
            continue;
        }
        PyObject *prefix = PyUnicode_Substring(stripped, 0, ends[k]);
        PyObject *cached = NULL;
        int hit = prefix ? dcp_dict_get_ref(r->cache, prefix, &cached) : -1;
        Py_XDECREF(prefix);
        if (hit < 0) {
            PyMem_Free(ends);
            goto done;
        }
        if (hit) {
            curr = Py_NewRef(PyTuple_GET_ITEM(cached, 0));
            emitted = PySequence_List(PyTuple_GET_ITEM(cached, 1));
            Py_DECREF(cached);
            start = k + 1;
            break;
        }
    }
    if (curr == NULL) {
        curr = Py_NewRef(r->model);
        emitted = PyList_New(0);
    }
    if (emitted == NULL) {
        PyMem_Free(ends);
        goto done;
    }
    for (Py_ssize_t i = start; i < ntok; i++) {
        PyObject *tok = PyList_GET_ITEM(tokens, i);
        PyObject *next = i + 1 < ntok ? PyList_GET_ITEM(tokens, i + 1) : NULL;
        if (resolve_token(r, &curr, emitted, tok, next, &flat) < 0) {
            PyMem_Free(ends);
            goto done;
        }
        if (flat != NULL) {
            result = flat;
            flat = NULL;
            PyMem_Free(ends);
            goto done;
        }
        if (i <= ntok - 2 && r->cache != NULL) {
            PyObject *prefix = PyUnicode_Substring(stripped, 0, ends[i]);
            PyObject *frozen = prefix ? PyList_AsTuple(emitted) : NULL;
            PyObject *entry = frozen ? PyTuple_Pack(2, curr, frozen) : NULL;
            Py_XDECREF(frozen);
            if (entry == NULL ||
                PyDict_SetDefault(r->cache, prefix, entry) == NULL) {
                Py_XDECREF(entry);
                Py_XDECREF(prefix);
                PyMem_Free(ends);
                goto done;
            }
            Py_DECREF(entry);
            Py_DECREF(prefix);
        }
    }
    PyMem_Free(ends);
    joined = PyUnicode_Join(st->str_dot, emitted);
    if (joined == NULL) {
        goto done;
    }
    final = strip_ckpt_token(st, joined);
    if (final == NULL) {
        goto done;
    }
    result = PySet_New(NULL);
    if (result != NULL && PySet_Add(result, final) < 0) {
        Py_CLEAR(result);
    }
done:
    Py_XDECREF(stripped);
    Py_XDECREF(tokens);
    Py_XDECREF(curr);
    Py_XDECREF(emitted);
    Py_XDECREF(flat);
    Py_XDECREF(joined);
    Py_XDECREF(final);
    return result;
}

PyDoc_STRVAR(
    dcp_get_fqns__doc__,
    "get_fqns(ctx, model, name, modifiers_name, skip_ddp_prefix, "
    "skip_compiler_prefix, /)\n--\n\n"
    "Canonical FQNs of a (possibly wrapper-prefixed) name, as a set.");

static PyObject *
dcp_get_fqns(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("get_fqns", nargs, 6) < 0 ||
        !dcp_context_check(st, args[0]) ||
        dcp_check_str("get_fqns", "name", args[2]) < 0 ||
        dcp_check_str("get_fqns", "modifiers_name", args[3]) < 0) {
        return NULL;
    }
    /* one at a time: IsTrue runs Python code, never with an error set */
    int skip_ddp = PyObject_IsTrue(args[4]);
    int skip_compiler = skip_ddp < 0 ? -1 : PyObject_IsTrue(args[5]);
    if (skip_ddp < 0 || skip_compiler < 0) {
        return NULL;
    }
    dcp_resolver r = {st,
                      (dcp_Context *)args[0],
                      args[1],
                      args[3],
                      skip_ddp,
                      skip_compiler,
                      NULL};
    return resolve(&r, args[2]);
}

/* ----------------------------------------------------------------------
 * Model state dict keys
 */

/* Upstream's verify(key, fqn): an FQN may only differ from its key by
 * dropped "module" / "_orig_mod" segments.  1 / 0 / -1. */
static int
key_only_drops_wrappers(dcp_state *st, PyObject *key, PyObject *fqn)
{
    if (PyUnicode_GET_LENGTH(fqn) >= PyUnicode_GET_LENGTH(key)) {
        return 0;
    }
    PyObject *fqn_split = PyUnicode_Split(fqn, st->str_dot, -1);
    PyObject *key_split =
        fqn_split ? PyUnicode_Split(key, st->str_dot, -1) : NULL;
    int result = -1;
    if (key_split == NULL) {
        goto done;
    }
    Py_ssize_t fqn_idx = 0, nfqn = PyList_GET_SIZE(fqn_split);
    Py_ssize_t nkey = PyList_GET_SIZE(key_split);
    result = 1;
    for (Py_ssize_t k = 0; k < nkey; k++) {
        PyObject *part = PyList_GET_ITEM(key_split, k);
        if (PyUnicode_Compare(part, PyList_GET_ITEM(fqn_split, fqn_idx)) ==
            0) {
            fqn_idx++;
            if (fqn_idx == nfqn) {
                result = k == nkey - 1;
                break;
            }
        }
        else if (PyUnicode_Compare(part, st->str_module) != 0 &&
                 PyUnicode_Compare(part, st->str_orig_mod) != 0) {
            result = 0;
            break;
        }
    }
done:
    Py_XDECREF(fqn_split);
    Py_XDECREF(key_split);
    return result;
}

static PyObject *
mapping_pop(dcp_state *st, PyObject *mapping, PyObject *key)
{
    if (PyDict_CheckExact(mapping)) {
        PyObject *value = NULL;
        if (dcp_dict_get_ref(mapping, key, &value) <= 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetObject(PyExc_KeyError, key);
            }
            return NULL;
        }
        if (PyDict_DelItem(mapping, key) < 0) {
            Py_DECREF(value);
            return NULL;
        }
        return value;
    }
    /* OrderedDict keeps its own order bookkeeping: go through its API. */
    return PyObject_CallMethodOneArg(mapping, st->str_pop, key);
}

/* ----------------------------------------------------------------------
 * The common case of canonicalize_model_keys, per parent module
 *
 * model.state_dict() has a key per parameter and buffer, a few under each
 * module prefix.  resolve() caches the walk up to each prefix but still
 * applies the last token's rules (three isinstance checks, the checkpoint
 * pass-through, the modifier hook, the registration check), splits and
 * joins token lists and builds a set, for every key.  Under a parent that
 * is no wrapper (not DDP, FSDP1 or compiled, no checkpoint-wrapped child)
 * and has no modifier hook, those rules reduce to: emit the token, and
 * getattr() it unless it is `_extra_state` or registered in the parent's
 * containers.  The parent's facts are learnt once, after resolve() has
 * handled its first key; the keys after it take this path.
 */

/* The parent's entry in r->fast:
 * (curr, joined emitted prefix, identity, params, buffers, modules) with
 * identity True when the joined prefix is the parent name itself, and
 * each container the object getattr returned or None where the lookup
 * failed with AttributeError (registered_member stops there); or None
 * when the parent is not plain. */
enum { FAST_CURR, FAST_JOINED, FAST_IDENTITY, FAST_CONTAINERS, FAST_SIZE = 6 };

/* Learns the parent of `stripped` (cut at `last_dot`) after resolve() ran
 * on a key under it.  0 or -1. */
static int
fast_learn(dcp_resolver *r, PyObject *fast, PyObject *parent)
{
    dcp_state *st = r->st;
    dcp_Context *ctx = r->ctx;
    PyObject *cached = NULL, *entry = NULL, *joined = NULL;
    PyObject *containers[3] = {NULL, NULL, NULL};
    int rc = dcp_dict_get_ref(r->cache, parent, &cached);
    if (rc <= 0) {
        return rc; /* resolve() did not pass through it */
    }
    PyObject *curr = PyTuple_GET_ITEM(cached, 0);
    PyObject *emitted = PyTuple_GET_ITEM(cached, 1);
    int plain = 1, r1;
    PyObject *wrappers[3] = {
        ctx->ddp_types, ctx->fsdp1_types, ctx->compiled_types};
    for (int i = 0; i < 3 && plain; i++) {
        if ((r1 = dcp_isinstance_any(curr, wrappers[i])) < 0) {
            goto error;
        }
        plain = !r1;
    }
    PyObject *hook = plain ? dcp_lookup_hook(curr, r->modifiers) : NULL;
    if (hook != NULL) {
        Py_DECREF(hook);
        plain = 0;
    }
    else if (PyErr_Occurred()) {
        goto error;
    }
    PyObject *names[3] = {
        st->str_parameters, st->str_buffers, st->str_modules};
    for (int i = 0; i < 3 && plain; i++) {
        containers[i] = PyObject_GetAttr(curr, names[i]);
        if (containers[i] == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                goto error;
            }
            PyErr_Clear();
            if (i == 2) {
                break; /* no _modules: no checkpoint pass-through either */
            }
            plain = 0; /* registered_member stops early: keep it simple */
        }
    }
    if (plain && containers[2] != NULL && PyDict_Check(containers[2])) {
        /* passes_through_ckpt() would look for a wrapped child */
        if ((r1 = PyDict_Contains(containers[2], st->str_ckpt_wrapped)) < 0) {
            goto error;
        }
        plain = !r1;
    }
    if (!plain) {
        rc = PyDict_SetItem(fast, parent, Py_None);
        goto done;
    }
    joined = PyUnicode_Join(st->str_dot, emitted);
    if (joined == NULL) {
        goto error;
    }
    int identity = PyTuple_GET_SIZE(emitted) > 0 &&
                   PyUnicode_Compare(joined, parent) == 0;
    if (identity == 0 && PyErr_Occurred()) {
        goto error;
    }
    entry = PyTuple_New(FAST_SIZE);
    if (entry == NULL) {
        goto error;
    }
    PyTuple_SET_ITEM(entry, FAST_CURR, Py_NewRef(curr));
    PyTuple_SET_ITEM(
        entry,
        FAST_JOINED,
        PyTuple_GET_SIZE(emitted) ? Py_NewRef(joined) : Py_NewRef(Py_None));
    PyTuple_SET_ITEM(
        entry, FAST_IDENTITY, Py_NewRef(identity ? Py_True : Py_False));
    for (int i = 0; i < 3; i++) {
        PyTuple_SET_ITEM(entry,
                         FAST_CONTAINERS + i,
                         containers[i] ? containers[i] : Py_NewRef(Py_None));
        containers[i] = NULL;
    }
    rc = PyDict_SetItem(fast, parent, entry);
    goto done;
error:
    rc = -1;
done:
    Py_XDECREF(cached);
    Py_XDECREF(entry);
    Py_XDECREF(joined);
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(containers[i]);
    }
    return rc;
}

/* The canonical FQN of `key` through its parent's entry in `fast`: 1 with
 * a new reference in *fqn, 0 when the general path must run (and *parent
 * set to a new reference to the parent name, or NULL), -1 on error. */
static int
fast_canonical(dcp_resolver *r,
               PyObject *fast,
               PyObject *key,
               PyObject **fqn,
               PyObject **parent_out)
{
    dcp_state *st = r->st;
    PyObject *stripped = NULL, *parent = NULL, *tok = NULL, *entry = NULL;
    int rc = -1;
    *fqn = *parent_out = NULL;
    stripped = strip_ckpt_token(st, key);
    if (stripped == NULL) {
        return -1;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(stripped);
    Py_ssize_t last_dot = PyUnicode_FindChar(stripped, '.', 0, len, -1);
    if (last_dot < 0) {
        rc = last_dot == -2 ? -1 : 0;
        goto done;
    }
    parent = PyUnicode_Substring(stripped, 0, last_dot);
    tok = parent ? PyUnicode_Substring(stripped, last_dot + 1, len) : NULL;
    if (tok == NULL) {
        goto done;
    }
    int found = dcp_dict_get_ref(fast, parent, &entry);
    if (found <= 0 || entry == Py_None ||
        PyUnicode_Compare(tok, st->str_flat_param) == 0) {
        rc = found < 0 ? -1 : 0;
        if (found == 0) {
            *parent_out = Py_NewRef(parent);
        }
        goto done;
    }
    /* the last token: registered, `_extra_state`, or a real getattr */
    if (PyUnicode_Compare(tok, st->str_extra_state) != 0) {
        int registered = 0;
        for (int i = 0; i < 3 && !registered; i++) {
            PyObject *c = PyTuple_GET_ITEM(entry, FAST_CONTAINERS + i);
            if (c == Py_None) {
                break;
            }
            registered = PyDict_Check(c) ? PyDict_Contains(c, tok) : 0;
            if (registered < 0) {
                goto done;
            }
        }
        if (!registered) {
            PyObject *child =
                PyObject_GetAttr(PyTuple_GET_ITEM(entry, FAST_CURR), tok);
            if (child == NULL) {
                goto done;
            }
            Py_DECREF(child);
        }
    }
    PyObject *joined = PyTuple_GET_ITEM(entry, FAST_JOINED);
    if (PyTuple_GET_ITEM(entry, FAST_IDENTITY) == Py_True) {
        *fqn = Py_NewRef(stripped); /* joined + "." + tok == stripped */
    }
    else {
        PyObject *full = joined == Py_None ? Py_NewRef(tok)
                                           : dcp_join_name(st, joined, tok);
        *fqn = full ? strip_ckpt_token(st, full) : NULL;
        Py_XDECREF(full);
        if (*fqn == NULL) {
            goto done;
        }
    }
    rc = 1;
done:
    Py_XDECREF(stripped);
    Py_XDECREF(parent);
    Py_XDECREF(tok);
    Py_XDECREF(entry);
    return rc;
}

PyDoc_STRVAR(
    dcp_canonicalize_model_keys__doc__,
    "canonicalize_model_keys(ctx, model, state_dict, modifiers_name, /)"
    "\n--\n\n"
    "Rename the keys of a fresh model.state_dict() to canonical FQNs, in "
    "place, as upstream does.");

static PyObject *
dcp_canonicalize_model_keys(PyObject *module,
                            PyObject *const *args,
                            Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *keys = NULL, *result = NULL;
    if (dcp_check_nargs("canonicalize_model_keys", nargs, 4) < 0 ||
        !dcp_context_check(st, args[0]) ||
        dcp_check_str("canonicalize_model_keys", "modifiers_name", args[3]) <
            0) {
        return NULL;
    }
    PyObject *sd = args[2];
    dcp_resolver r = {
        st, (dcp_Context *)args[0], args[1], args[3], 1, 1, NULL};
    PyObject *fast = PyDict_New();
    r.cache = fast ? PyDict_New() : NULL;
    if (r.cache == NULL) {
        Py_XDECREF(fast);
        return NULL;
    }
    keys = PySequence_List(sd);
    if (keys == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_Check(key)) {
            PyErr_Format(st->err_type,
                         "model state_dict keys must be str, got %R",
                         key);
            goto done;
        }
        PyObject *fqn = NULL, *parent = NULL;
        int quick = fast_canonical(&r, fast, key, &fqn, &parent);
        if (quick < 0) {
            goto done;
        }
        if (quick == 0) {
            PyObject *fqns = resolve(&r, key);
            if (fqns == NULL) {
                Py_XDECREF(parent);
                goto done;
            }
            if (PySet_GET_SIZE(fqns) != 1) {
                PyErr_Format(PyExc_AssertionError,
                             "Expected 1 FQN for key '%S', got %zd: %R",
                             key,
                             PySet_GET_SIZE(fqns),
                             fqns);
                Py_DECREF(fqns);
                Py_XDECREF(parent);
                goto done;
            }
            fqn = PySet_Pop(fqns);
            Py_DECREF(fqns);
            if (fqn == NULL ||
                (parent != NULL && fast_learn(&r, fast, parent) < 0)) {
                Py_XDECREF(fqn);
                Py_XDECREF(parent);
                goto done;
            }
            Py_XDECREF(parent);
        }
        int same = PyUnicode_Compare(fqn, key) == 0;
        if (!same) {
            int ok = key_only_drops_wrappers(st, key, fqn);
            if (ok <= 0) {
                if (ok == 0) {
                    PyErr_Format(PyExc_RuntimeError,
                                 "An unexpected key, %S, exists. FQN is %S",
                                 key,
                                 fqn);
                }
                Py_DECREF(fqn);
                goto done;
            }
            PyObject *value = mapping_pop(st, sd, key);
            if (value == NULL || PyObject_SetItem(sd, fqn, value) < 0) {
                Py_XDECREF(value);
                Py_DECREF(fqn);
                goto done;
            }
            Py_DECREF(value);
        }
        Py_DECREF(fqn);
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    Py_XDECREF(r.cache);
    Py_XDECREF(fast);
    return result;
}

PyDoc_STRVAR(dcp_drop_frozen__doc__,
             "drop_frozen(index, state_dict, /)\n--\n\n"
             "Pop the FQNs of parameters with requires_grad=False.");

/* drop_frozen(index, state_dict): upstream's ignore_frozen_params --
 * pop every FQN of every parameter with requires_grad=False, in
 * named_parameters() order; KeyError if a key is absent. */
static PyObject *
dcp_drop_frozen(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("drop_frozen", nargs, 2) < 0 ||
        !dcp_index_check(st, args[0])) {
        return NULL;
    }
    dcp_ModelIndex *ix = (dcp_ModelIndex *)args[0];
    PyObject *sd = args[1];
    PyObject *params = Py_NewRef(ix->np_params);
    PyObject *fqns = Py_NewRef(ix->np_fqns);
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject *p = PyList_GET_ITEM(params, i);
        PyObject *rg = PyObject_GetAttr(p, st->str_requires_grad);
        if (rg == NULL) {
            goto done;
        }
        int trainable = PyObject_IsTrue(rg);
        Py_DECREF(rg);
        if (trainable < 0) {
            goto done;
        }
        if (trainable) {
            continue;
        }
        PyObject *fqn = PyList_GET_ITEM(fqns, i);
        PyObject *names = NULL;
        if (fqn == Py_None) {
            Py_ssize_t slot = dcp_index_tensor_slot(ix, p);
            if (slot < 0) {
                continue;
            }
            names = Py_NewRef(PyList_GET_ITEM(ix->tensor_fqns, slot));
        }
        else {
            names = PyList_New(1);
            if (names == NULL) {
                goto done;
            }
            PyList_SET_ITEM(names, 0, Py_NewRef(fqn));
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(names); j++) {
            PyObject *value = mapping_pop(st, sd, PyList_GET_ITEM(names, j));
            if (value == NULL) {
                Py_DECREF(names);
                goto done;
            }
            Py_DECREF(value);
        }
        Py_DECREF(names);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(params);
    Py_DECREF(fqns);
    return result;
}

PyDoc_STRVAR(dcp_first_key_containing__doc__,
             "first_key_containing(mapping, needle, /)\n--\n\n"
             "The first str key containing `needle`, or None.");

/* first_key_containing(mapping, needle) -> the first str key containing
 * `needle`, or None (upstream's "_flat_param in key" check, E10). */
static PyObject *
dcp_first_key_containing(PyObject *module,
                         PyObject *const *args,
                         Py_ssize_t nargs)
{
    if (dcp_check_nargs("first_key_containing", nargs, 2) < 0 ||
        dcp_check_str("first_key_containing", "needle", args[1]) < 0) {
        return NULL;
    }
    PyObject *keys = PySequence_List(args[0]);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_Check(key)) {
            continue;
        }
        int has = PyUnicode_Contains(key, args[1]);
        if (has < 0) {
            goto done;
        }
        if (has) {
            result = Py_NewRef(key);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(keys);
    return result;
}

PyDoc_STRVAR(dcp_filter_prefixes__doc__,
             "filter_prefixes(state_dict, prefixes, keep, /)\n--\n\n"
             "Keep keys under the given prefixes, optionally stripping them.");

/* filter_prefixes(state_dict, prefixes, keep) -> new dict
 *
 * Upstream's deprecated `submodules` filter: for each key, for each prefix
 * (in the given order) the key starts with, keep it (keep=True) or strip
 * the prefix. */
static PyObject *
dcp_filter_prefixes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    if (dcp_check_nargs("filter_prefixes", nargs, 3) < 0) {
        return NULL;
    }
    int keep = PyObject_IsTrue(args[2]);
    if (keep < 0) {
        return NULL;
    }
    PyObject *prefixes = dcp_as_list(st, args[1], "prefixes");
    PyObject *items = prefixes ? dcp_items_list(st, args[0]) : NULL;
    PyObject *out = items ? PyDict_New() : NULL;
    if (out == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        if (!PyUnicode_Check(key)) {
            continue;
        }
        Py_ssize_t len = PyUnicode_GET_LENGTH(key);
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(prefixes); j++) {
            PyObject *prefix = PyList_GET_ITEM(prefixes, j);
            Py_ssize_t starts = PyUnicode_Tailmatch(key, prefix, 0, len, -1);
            if (starts < 0) {
                goto error;
            }
            if (!starts) {
                continue;
            }
            PyObject *new_key =
                keep ? Py_NewRef(key)
                     : PyUnicode_Substring(
                           key, PyUnicode_GET_LENGTH(prefix), len);
            if (new_key == NULL ||
                PyDict_SetItem(out, new_key, PyTuple_GET_ITEM(pair, 1)) < 0) {
                Py_XDECREF(new_key);
                goto error;
            }
            Py_DECREF(new_key);
        }
    }
    Py_DECREF(prefixes);
    Py_DECREF(items);
    return out;
error:
    Py_XDECREF(prefixes);
    Py_XDECREF(items);
    Py_XDECREF(out);
    return NULL;
}

PyMethodDef dcp_fqn_methods[] = {
    {"get_fqns",
     DCP_FASTCALL(dcp_get_fqns),
     METH_FASTCALL,
     dcp_get_fqns__doc__},
    {"canonicalize_model_keys",
     DCP_FASTCALL(dcp_canonicalize_model_keys),
     METH_FASTCALL,
     dcp_canonicalize_model_keys__doc__},
    {"drop_frozen",
     DCP_FASTCALL(dcp_drop_frozen),
     METH_FASTCALL,
     dcp_drop_frozen__doc__},
    {"first_key_containing",
     DCP_FASTCALL(dcp_first_key_containing),
     METH_FASTCALL,
     dcp_first_key_containing__doc__},
    {"filter_prefixes",
     DCP_FASTCALL(dcp_filter_prefixes),
     METH_FASTCALL,
     dcp_filter_prefixes__doc__},
    {NULL, NULL, 0, NULL},
};
