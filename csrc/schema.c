/* Pristine optimizer state from a declarative schema (D2 in
 * docs/differences.md).
 *
 * A never-stepped parameter's state is what its optimizer would create on
 * the first step before updating anything (step 0, zero moments, Rprop's
 * step sizes filled with lr, ...).  The Python layer turns an optimizer
 * class and a param group into a list of state specs, once per group;
 * this file applies the specs to every parameter lacking state, calling
 * torch factories (zeros_like, full_like, tensor, ...) directly, so no
 * Python code runs per parameter.
 *
 * A spec is (name, factory, args, kwargs, complex_args, dims):
 *   factory(*args, **kwargs) with two placeholders substituted in args
 *   and kwargs values: PARAM (the parameter) and PARAM_DEVICE (its
 *   device).  When complex_args is not None and the parameter is complex,
 *   it replaces args (Rprop and Adagrad fill complex parameters with
 *   complex(v, v)).  dims, when not None, is (lo, hi): the entry exists
 *   only for parameters with lo <= dim() <= hi (Adafactor factors the
 *   state of matrices only).
 */
#include "dcp.h"

/* Substitutes the placeholders in a tuple.  New tuple or NULL. */
static PyObject *
substitute_args(PyObject *args,
                PyObject *param_mark,
                PyObject *param,
                PyObject *device_mark,
                PyObject **device,
                dcp_state *st)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        if (item == param_mark) {
            item = param;
        }
        else if (item == device_mark) {
            if (*device == NULL) {
                *device = PyObject_GetAttr(param, st->str_device);
                if (*device == NULL) {
                    Py_DECREF(out);
                    return NULL;
                }
            }
            item = *device;
        }
        PyTuple_SET_ITEM(out, i, Py_NewRef(item));
    }
    return out;
}

static PyObject *
substitute_kwargs(PyObject *kwargs,
                  PyObject *param_mark,
                  PyObject *param,
                  PyObject *device_mark,
                  PyObject **device,
                  dcp_state *st)
{
    if (kwargs == Py_None) {
        return Py_NewRef(Py_None);
    }
    PyObject *out = PyDict_New();
    PyObject *key, *value;
    if (out == NULL) {
        return NULL;
    }
    /* kwargs is a dict the Python layer built, but reading param.device
     * runs Python code and every store allocates: the entries are pinned
     * and the size checked (dcp_dict_iter). */
    dcp_dict_iter it;
    dcp_dict_iter_init(&it, kwargs);
    int more;
    while ((more = dcp_dict_iter_next(&it, &key, &value)) == 1) {
        if (value == param_mark) {
            value = param;
        }
        else if (value == device_mark) {
            if (*device == NULL) {
                *device = PyObject_GetAttr(param, st->str_device);
                if (*device == NULL) {
                    more = -1;
                    break;
                }
            }
            value = *device;
        }
        if (PyDict_SetItem(out, key, value) < 0) {
            more = -1;
            break;
        }
    }
    dcp_dict_iter_clear(&it);
    if (more < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static int
check_specs(PyObject *specs)
{
    if (specs == Py_None) {
        return 0;
    }
    if (!PyList_Check(specs)) {
        PyErr_SetString(PyExc_TypeError, "state specs must be a list");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(specs); i++) {
        PyObject *spec = PyList_GET_ITEM(specs, i);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 6 ||
            !PyCallable_Check(PyTuple_GET_ITEM(spec, 1)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(spec, 2)) ||
            (PyTuple_GET_ITEM(spec, 3) != Py_None &&
             !PyDict_Check(PyTuple_GET_ITEM(spec, 3))) ||
            (PyTuple_GET_ITEM(spec, 4) != Py_None &&
             !PyTuple_Check(PyTuple_GET_ITEM(spec, 4))) ||
            (PyTuple_GET_ITEM(spec, 5) != Py_None &&
             (!PyTuple_Check(PyTuple_GET_ITEM(spec, 5)) ||
              PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 5)) != 2))) {
            PyErr_SetString(PyExc_TypeError,
                            "a state spec is (name, factory, args tuple, "
                            "kwargs dict or None, complex args or None, "
                            "(lo, hi) dims or None)");
            return -1;
        }
    }
    return 0;
}

/* One parameter's pristine state dict.  New dict or NULL. */
static PyObject *
materialize_one(dcp_state *st,
                PyObject *param,
                PyObject *specs,
                PyObject *param_mark,
                PyObject *device_mark)
{
    PyObject *state = PyDict_New(), *device = NULL;
    int is_complex = -1; /* not asked yet */
    long ndim = -1;      /* not asked yet */
    if (state == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(specs); i++) {
        PyObject *spec = PyList_GET_ITEM(specs, i);
        PyObject *args = PyTuple_GET_ITEM(spec, 2);
        PyObject *complex_args = PyTuple_GET_ITEM(spec, 4);
        PyObject *dims = PyTuple_GET_ITEM(spec, 5);
        if (dims != Py_None) {
            if (ndim < 0) {
                PyObject *d = PyObject_CallMethodNoArgs(param, st->str_dim);
                ndim = d ? PyLong_AsLong(d) : -1;
                Py_XDECREF(d);
                if (ndim < 0) {
                    if (!PyErr_Occurred()) {
                        PyErr_SetString(PyExc_ValueError, "negative dim()");
                    }
                    goto error;
                }
            }
            long lo = PyLong_AsLong(PyTuple_GET_ITEM(dims, 0));
            long hi = PyLong_AsLong(PyTuple_GET_ITEM(dims, 1));
            if ((lo == -1 || hi == -1) && PyErr_Occurred()) {
                goto error;
            }
            if (ndim < lo || ndim > hi) {
                continue;
            }
        }
        if (complex_args != Py_None) {
            if (is_complex < 0) {
                PyObject *r =
                    PyObject_CallMethodNoArgs(param, st->str_is_complex);
                is_complex = r ? PyObject_IsTrue(r) : -1;
                Py_XDECREF(r);
                if (is_complex < 0) {
                    goto error;
                }
            }
            if (is_complex) {
                args = complex_args;
            }
        }
        PyObject *call_args =
            substitute_args(args, param_mark, param, device_mark, &device, st);
        PyObject *call_kwargs =
            call_args ? substitute_kwargs(PyTuple_GET_ITEM(spec, 3),
                                          param_mark,
                                          param,
                                          device_mark,
                                          &device,
                                          st)
                      : NULL;
        PyObject *value = NULL;
        if (call_kwargs != NULL) {
            value = PyObject_Call(PyTuple_GET_ITEM(spec, 1),
                                  call_args,
                                  call_kwargs == Py_None ? NULL : call_kwargs);
        }
        Py_XDECREF(call_args);
        Py_XDECREF(call_kwargs);
        if (value == NULL) {
            dcp_note_key(PyTuple_GET_ITEM(spec, 0));
            goto error;
        }
        int rc = PyDict_SetItem(state, PyTuple_GET_ITEM(spec, 0), value);
        Py_DECREF(value);
        if (rc < 0) {
            goto error;
        }
    }
    Py_XDECREF(device);
    return state;
error:
    Py_XDECREF(device);
    Py_DECREF(state);
    return NULL;
}

PyDoc_STRVAR(
    dcp_materialize_state__doc__,
    "materialize_state(missing, specs_by_group, PARAM, PARAM_DEVICE, /)"
    "\n--\n\n"
    "Pristine optimizer state for parameters without state.");

/* materialize_state(missing, specs_by_group, PARAM, PARAM_DEVICE)
 *   -> dict fqn -> pristine state
 *
 * missing: list of (param, group index, fqn) as optim_missing returns;
 * specs_by_group[g]: list of specs, or None for "no synthetic state". */
static PyObject *
dcp_materialize_state(PyObject *module,
                      PyObject *const *args,
                      Py_ssize_t nargs)
{
    dcp_state *st = dcp_get_state(module);
    PyObject *missing = NULL, *specs = NULL, *out = NULL;
    if (dcp_check_nargs("materialize_state", nargs, 4) < 0) {
        return NULL;
    }
    missing = dcp_as_list(st, args[0], "missing");
    specs = missing ? dcp_as_list(st, args[1], "specs_by_group") : NULL;
    if (specs == NULL) {
        goto error;
    }
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(specs); g++) {
        if (check_specs(PyList_GET_ITEM(specs, g)) < 0) {
            goto error;
        }
    }
    out = PyDict_New();
    if (out == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(missing); i++) {
        PyObject *item = PyList_GET_ITEM(missing, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(item, 2))) {
            PyErr_SetString(PyExc_TypeError,
                            "missing entries are (param, group, fqn)");
            goto error;
        }
        Py_ssize_t g = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        if (g == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (g < 0 || g >= PyList_GET_SIZE(specs)) {
            PyErr_SetString(PyExc_IndexError, "group index out of range");
            goto error;
        }
        PyObject *group_specs = PyList_GET_ITEM(specs, g);
        if (group_specs == Py_None) {
            continue;
        }
        PyObject *state = materialize_one(
            st, PyTuple_GET_ITEM(item, 0), group_specs, args[2], args[3]);
        if (state == NULL) {
            dcp_note_format(
                "while building pristine optimizer state for "
                "'%S'",
                PyTuple_GET_ITEM(item, 2));
            goto error;
        }
        int rc = PyDict_SetItem(out, PyTuple_GET_ITEM(item, 2), state);
        Py_DECREF(state);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(missing);
    Py_DECREF(specs);
    return out;
error:
    Py_XDECREF(missing);
    Py_XDECREF(specs);
    Py_XDECREF(out);
    return NULL;
}

PyMethodDef dcp_schema_methods[] = {
    {"materialize_state",
     DCP_FASTCALL(dcp_materialize_state),
     METH_FASTCALL,
     dcp_materialize_state__doc__},
    {NULL, NULL, 0, NULL},
};
