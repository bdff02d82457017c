"""Torch-free stand-ins that drive the C core ``dcp_optim._dcp_optim``.

The core never imports torch: every torch class and base method it needs
arrives in a ``Context``.  Building a Context over the fake classes below
lets the leak, sanitizer and valgrind runs exercise every C entry point on
interpreters where torch cannot load (Debian's ``python3.11d``: its
extension suffix is ``.cpython-311d-...so`` and torch ships none) and keeps
those runs fast and deterministic.

``load_core()`` imports the compiled module: from ``$DCP_OPTIM_CORE`` (a
path to a ``.so`` built for this interpreter, set by the Makefile) without
importing the ``dcp_optim`` package (whose ``__init__`` imports torch), or
else as ``dcp_optim._dcp_optim``.
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import io
import os
import sys

__all__ = [
    "FakeTensor",
    "FakeParameter",
    "FakeDTensor",
    "FakeModule",
    "FakeDDP",
    "FakeCompiled",
    "FakeFSDP",
    "FakeOptimizer",
    "Shard",
    "StridedShard",
    "Replicate",
    "Partial",
    "Mesh",
    "load_core",
    "make_context",
    "linear",
    "small_model",
]

_core = None


def load_core():
    """The compiled core (cached)."""
    global _core
    if _core is not None:
        return _core
    path = os.environ.get("DCP_OPTIM_CORE")
    if path:
        # The core's exec slot imports dcp_optim.errors (its exception
        # classes); that module imports nothing else, so it is loaded from
        # the source tree under its own name without the package.
        if "dcp_optim.errors" not in sys.modules:
            # beside the core when it is an installed package (make
            # test-wheel), else the source tree's: this file is
            # <repo>/tests/core/refleak/fakes.py
            source = os.path.join(os.path.dirname(os.path.abspath(path)), "errors.py")
            if not os.path.exists(source):
                root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
                source = os.path.join(root, "dcp_optim", "errors.py")
            espec = importlib.util.spec_from_file_location("dcp_optim.errors", source)
            errors = importlib.util.module_from_spec(espec)
            sys.modules["dcp_optim.errors"] = errors
            try:
                espec.loader.exec_module(errors)
            except BaseException:
                del sys.modules["dcp_optim.errors"]
                raise
        spec = importlib.util.spec_from_file_location("dcp_optim._dcp_optim", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the core from {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _core = module
    else:
        from dcp_optim import _dcp_optim

        _core = _dcp_optim
    return _core


# --- tensors -----------------------------------------------------------------


class FakeDType:
    def __init__(self, name: str, itemsize: int, floating: bool):
        self.name = name
        self.itemsize = itemsize
        self.is_floating_point = floating

    def __repr__(self) -> str:
        return f"fake.{self.name}"


FLOAT32 = FakeDType("float32", 4, True)
INT64 = FakeDType("int64", 8, False)
UINT8 = FakeDType("uint8", 1, False)


class FakeTensor:
    """Just enough of torch.Tensor for the core: shape, dtype, device,
    requires_grad, dim(), to(), view(), slicing, copy_()."""

    def __init__(self, shape=(2,), dtype=FLOAT32, device="cpu", requires_grad=True):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad
        self.copies = 0

    def __repr__(self) -> str:
        return f"FakeTensor({self.shape})"

    @property
    def is_meta(self) -> bool:
        return self.device == "meta"

    def dim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __len__(self) -> int:
        return self.numel() * self.dtype.itemsize if self.shape else 1

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        return False

    def stride(self):
        return tuple(1 for _ in self.shape)

    def to(self, *args, **kwargs):
        dtype = next((a for a in args if isinstance(a, FakeDType)), self.dtype)
        return FakeTensor(self.shape, dtype, self.device, self.requires_grad)

    def detach(self):
        return self

    def cpu(self):
        return self

    def view(self, *args):
        if len(args) == 1 and isinstance(args[0], FakeDType):
            return FakeTensor(self.shape, args[0], self.device)
        return self

    def reshape(self, *args):
        return FakeTensor((self.numel(),), self.dtype, self.device)

    def narrow(self, dim, start, length):
        return FakeTensor((length,), self.dtype, self.device)

    def as_strided(self, size, stride, storage_offset=None):
        return FakeTensor(tuple(size), self.dtype, self.device)

    def copy_(self, src):
        self.copies += 1
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        # Finite, like a tensor (without it __getitem__ makes an endless
        # old-style sequence).
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        inner = FakeTensor(self.shape[1:], self.dtype, self.device)
        return iter([inner] * min(self.shape[0], 8))

    def __setitem__(self, key, value):
        self.copies += 1


class FakeParameter(FakeTensor):
    pass


class Shard:
    def __init__(self, dim: int):
        self.dim = dim


class StridedShard(Shard):
    def __init__(self, dim: int, split_factor: int):
        super().__init__(dim)
        self.split_factor = split_factor


class Replicate:
    pass


class Partial:
    pass


PLACEMENT_CLASSES = (Shard, StridedShard, Replicate)


class Mesh:
    def __init__(self, shape=(2,), coordinate=(0,)):
        self.shape = tuple(shape)
        self._coordinate = coordinate

    def get_coordinate(self):
        return self._coordinate


class FakeDTensor(FakeTensor):
    def __init__(self, shape=(4, 2), placements=None, mesh=None, **kwargs):
        super().__init__(shape, **kwargs)
        self.device_mesh = mesh if mesh is not None else Mesh()
        self.placements = placements if placements is not None else (Shard(0),)
        local = list(shape)
        if local and isinstance(self.placements[0], Shard):
            local[0] = (local[0] + 1) // 2
        self._local_tensor = FakeTensor(tuple(local), self.dtype, self.device)

    @staticmethod
    def from_local(local, mesh, placements, shape=None, stride=None, run_check=True):
        return FakeDTensor(shape or local.shape, placements, mesh)


# --- modules -------------------------------------------------------------------


class FakeModule:
    """The attributes and named_* methods of nn.Module that the walk reads."""

    _version = 1

    def __init__(self):
        self._parameters = {}
        self._buffers = {}
        self._modules = {}
        self._non_persistent_buffers_set = set()
        self._load_state_dict_pre_hooks = {}
        self._load_state_dict_post_hooks = {}
        self._state_dict_pre_hooks = {}
        self._state_dict_hooks = {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise NotImplementedError  # the base method plain_state_dict compares with

    def __getattr__(self, name):
        # nn.Module's: registered members are attributes.
        d = self.__dict__
        for container in ("_parameters", "_buffers", "_modules"):
            members = d.get(container)
            if members is not None and name in members:
                return members[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def add(self, name, child):
        self._modules[name] = child
        return child

    def named_children(self):
        yield from self._modules.items()

    def named_parameters(self, prefix="", recurse=True):
        yield from ((prefix + k, v) for k, v in self._parameters.items() if v is not None)

    def named_buffers(self, prefix="", recurse=True):
        yield from ((prefix + k, v) for k, v in self._buffers.items() if v is not None)

    def named_modules(self, memo=None, prefix=""):
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(prefix=f"{prefix}.{name}" if prefix else name)

    def get_extra_state(self):
        raise RuntimeError("no extra state")

    def state_dict(self, prefix=""):
        out = {}
        for name, child in self._modules.items():
            out.update(child.state_dict(f"{prefix}{name}."))
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                out[prefix + name] = b
        for name, p in self._parameters.items():
            if p is not None:
                out[prefix + name] = p
        return out


class FakeDDP(FakeModule):
    def __init__(self, module):
        super().__init__()
        self._modules["module"] = module
        self.module = module


class FakeCompiled(FakeModule):
    def __init__(self, module):
        super().__init__()
        self._modules["_orig_mod"] = module
        self._orig_mod = module


class FakeFSDP(FakeModule):
    pass


class ExtraState:
    """Stands for upstream's _EXTRA_STATE marker."""


# --- optimizers ----------------------------------------------------------------


class FakeOptimizer:
    def __init__(self, groups, lr=0.1):
        self.state = collections.defaultdict(dict)
        self.param_groups = []
        for g in groups:
            g = dict(g) if isinstance(g, dict) else {"params": list(g)}
            g.setdefault("lr", lr)
            g["params"] = list(g["params"])
            self.param_groups.append(g)

    def state_dict(self):
        ids = {}
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [ids.setdefault(id(p), len(ids)) for p in g["params"]]
            groups.append(packed)
        by_id = {id(p): ids[id(p)] for g in self.param_groups for p in g["params"]}
        state = {by_id[id(p)]: s for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        raise NotImplementedError

    def __setstate__(self, d):
        self.__dict__.update(d)


def make_context(core=None, **overrides):
    core = core or load_core()
    fields = dict(
        module_type=FakeModule,
        tensor_type=FakeTensor,
        dtensor_type=FakeDTensor,
        ddp_types=(FakeDDP,),
        compiled_types=(FakeCompiled,),
        fsdp1_types=(FakeFSDP,),
        base_named_children=FakeModule.named_children,
        base_named_parameters=FakeModule.named_parameters,
        base_named_buffers=FakeModule.named_buffers,
        base_get_extra_state=FakeModule.get_extra_state,
        extra_state_marker=ExtraState,
        defaultdict_type=collections.defaultdict,
        dict_type=dict,
        float32=FLOAT32,
        cpu_device="cpu",
        bytesio_type=io.BytesIO,
        deepcopy=copy.deepcopy,
    )
    fields.update(overrides)
    return core.Context(**fields)


def linear(n_in=3, n_out=2, bias=True):
    m = FakeModule()
    m._parameters["weight"] = FakeParameter((n_out, n_in))
    m._parameters["bias"] = FakeParameter((n_out,)) if bias else None
    return m


def small_model():
    """root{a: linear, b: linear, running (buffer)}, b.weight frozen."""
    root = FakeModule()
    root.add("a", linear())
    root.add("b", linear(2, 2))
    root._modules["b"]._parameters["weight"].requires_grad = False
    root._buffers["running"] = FakeTensor((2,), requires_grad=False)
    return root


def params_of(model):
    out = []
    for _, mod in model.named_modules():
        out.extend(p for p in mod._parameters.values() if p is not None)
    return out

