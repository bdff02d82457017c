"""Section 5: scale simulation on torch's fake process group.

One CPU process acts as ONE rank of a world of W ranks:
``init_process_group("fake", store=FakeStore(), rank=r, world_size=W)``.
FSDP2, DTensor and both implementations run unchanged on it; the fake
group's collectives move no data.  What is measured is each rank's own CPU
work and memory for one call, for W = 8 ... 16384 (65536 on request).

Driver (``run_scale``): one fresh subprocess per (model, layout, W, rank),
rank 0 first (it records what it broadcasts, see below), then the other
ranks.  Worker (``python -m benchmarks.scale --worker CFG.json``): builds the
model, runs every operation for both implementations and writes JSON.

What the harness adds to the fake group (``Shims``, installed in the
worker process only, never in the package; upstream and dcp_optim run
through the same shims):

* **control all-gathers are SPMD**: an all-gather issued through the
  ``torch.distributed`` Python API whose per-rank input is at most
  ``CONTROL_BYTES`` (dcp_optim's 64-byte agreement records, small size
  exchanges) fills every rank's slot with this rank's contribution, as in
  a job where all ranks agree (outside the wire counter without calling
  the fake group, whose own all-gather copies slot by slot).  Larger
  (data) all-gathers, and the functional collectives FSDP2/DTensor use
  (``full_tensor``), are left to the fake group, for both implementations
  alike (torch 2.13's fake all-gather copies the local input into every
  slot; its other collectives leave outputs as they are).
* **object collectives carry what rank 0 sent**: ``broadcast_object_list``
  on the source pickles the objects and records the payload (per operation
  and implementation); on any other rank it delivers the payload the
  source recorded in its own simulated process of the same world, layout
  and model (rank 0 runs first and writes the recording; or, in one
  process, a rank-0 pass first), unpickled as a real receiver would.  The
  two wire broadcasts (size, then payload of the recorded length) are
  still issued on the fake group so that they are counted.
  ``all_gather_object`` delivers this rank's object in every slot (each
  pickled and unpickled, as received).  dcp_optim's broadcast loads send
  the source's payload (its metadata, with a small load's tensors) as one
  broadcast of bytes (``_engine.payload.broadcast_payload``): recorded and
  delivered the same way, the broadcast itself issued on the fake group.
* tensor broadcasts are the fake group's: a receiving rank's buffers keep
  whatever they held (the data is meaningless, the shapes and the work of
  cutting shards out of buckets are real).

Bytes and collectives are counted per call by a ``TorchDispatchMode`` over
the c10d and functional-collective ops (one extra, untimed call per
operation and implementation): the count, the bytes this rank would send
and receive (ring all-gather: (n-1) x input each way; broadcast: the
payload, sent by the root and received by the others; all-reduce: 2(n-1)/n
x size; reduce-scatter: (n-1)/n x input), and an alpha-beta time
``alpha * ceil(log2 n) per collective + bytes_received / bandwidth``
(``ALPHA_S``, ``BANDWIDTH_BPS``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pickle
import subprocess
import sys
import time
from collections import Counter
from typing import Any

WORLDS_DEFAULT = (8, 64, 512, 4096)
WORLDS_BIG = (16384, 65536)
WORLDS_QUICK = (8, 64, 512)
MODELS = ("rows", "tiles")
LAYOUTS = ("fsdp", "dp_tp", "fsdp1")
TP = 4
OPS = (
    "full_get_model",
    "full_get_optim",
    "sharded_get_model",
    "sharded_get_optim",
    "sharded_set_model",
    "sharded_set_optim",
    "bcast_set_model",
    "bcast_set_optim",
    "resume_plan",
)
IMPLS = ("upstream", "dcp_optim")
CONTROL_BYTES = 4096
ALPHA_S = 10e-6  # latency per collective step
BANDWIDTH_BPS = 25e9  # bytes per second per rank (a 200 Gb/s link)
SAVED_WORLD = 32  # the world the resumed checkpoint was written by
REP_BUDGET_S = 12.0  # CPU seconds of timed calls per (operation, implementation) at most
# A worker estimates its largest call's memory before building; above this
# it refuses the world and says why (the machine is shared).
MEM_LIMIT_MB = float(os.environ.get("DCP_SCALE_MEM_LIMIT_MB", "9000"))


# --- shims ------------------------------------------------------------------------


class Shims:
    """The fake group's collectives, made to model an SPMD job (see the
    module docstring).  ``key`` names the call being run; ``script`` maps
    keys to the payloads the source broadcast during that call."""

    def __init__(self) -> None:
        self.script: dict[str, list[bytes]] = {}
        self.key = ""
        self.prefix = ""
        self.pos = 0
        self.filled: Counter[str] = Counter()  # what the shims did, for the smoke test
        self._patched: list[tuple[Any, str, Any]] = []

    def start(self, key: str) -> None:
        self.key = self.prefix + key
        self.pos = 0
        if self._is_source_rank():
            self.script[key] = []

    def replay(self, what: str) -> bytes:
        """On a receiving rank: the next bytes the source recorded for the
        call being run."""
        recorded = self.script.get(self.key, [])
        if self.pos >= len(recorded):
            raise RuntimeError(
                f"scale harness: no {what} recorded by the source for {self.key!r} "
                f"(#{self.pos}); run rank 0 first"
            )
        self.pos += 1
        return recorded[self.pos - 1]

    @staticmethod
    def _is_source_rank() -> bool:
        import torch.distributed as dist

        return dist.get_rank() == 0

    def install(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        orig = {
            "all_gather_into_tensor": c10d.all_gather_into_tensor,
            "all_gather_single": getattr(c10d, "all_gather_single", None),
            "all_gather": c10d.all_gather,
            "all_gather_object": c10d.all_gather_object,
            "broadcast_object_list": c10d.broadcast_object_list,
        }
        bcast = c10d.broadcast
        shims = self

        def _fill_flat(out, inp):
            n = inp.numel() * inp.element_size()
            if n <= CONTROL_BYTES and out.numel() % max(inp.numel(), 1) == 0 and inp.numel():
                out.view(-1).view(-1, inp.numel()).copy_(inp.reshape(1, -1).clone())
                shims.filled["all_gather_into_tensor"] += 1

        def _control(inp) -> bool:
            # a control record outside the wire counter: the fake group's
            # own all-gather (a copy per rank slot, ~12 ms for a 64-byte
            # record at 4096 ranks) is not charged; the tile below is one copy
            return not _COUNTING and inp.numel() * inp.element_size() <= CONTROL_BYTES

        def flat_gather(name):
            # the two flat all-gathers of the API share one shim
            def gather(out, inp, group=None, async_op=False):
                if _control(inp):
                    _fill_flat(out, inp)
                    return None
                work = orig[name](out, inp, group=group, async_op=async_op)
                if work is not None:
                    work.wait()
                _fill_flat(out, inp)
                return work

            return gather

        all_gather_into_tensor = flat_gather("all_gather_into_tensor")
        all_gather_single = flat_gather("all_gather_single")

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            work = orig["all_gather"](tensor_list, tensor, group=group, async_op=async_op)
            if work is not None:
                work.wait()
            if tensor.numel() * tensor.element_size() <= CONTROL_BYTES:
                for t in tensor_list:
                    t.copy_(tensor)
                shims.filled["all_gather"] += 1
            return work

        def all_gather_object(object_list, obj, group=None):
            data = pickle.dumps(obj)
            size = torch.tensor([len(data)], dtype=torch.long)
            n = len(object_list)
            orig["all_gather_into_tensor"](torch.empty(n, dtype=torch.long), size, group=group)
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            orig["all_gather_into_tensor"](torch.empty(n * len(data), dtype=torch.uint8), payload, group=group)
            for i in range(n):
                object_list[i] = pickle.loads(data)
            shims.filled["all_gather_object"] += 1

        def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
            if src is None:
                src = c10d.get_global_rank(group, group_src) if group is not None else (group_src or 0)
            if dist.get_rank() == src:
                data = pickle.dumps(list(object_list))
                shims.script.setdefault(shims.key, []).append(data)
            else:
                data = shims.replay("broadcast")
            size = torch.tensor([len(data)], dtype=torch.long)
            bcast(size, src=src, group=group)
            bcast(torch.empty(len(data), dtype=torch.uint8), src=src, group=group)
            if dist.get_rank() != src:
                object_list[:] = pickle.loads(data)
                shims.filled["broadcast_object_list_replayed"] += 1
            else:
                shims.filled["broadcast_object_list_recorded"] += 1

        # dcp_optim's broadcast loads send the source's payload (metadata,
        # and a small load's tensors) as one broadcast of a byte tensor:
        # recorded and replayed like broadcast_object_list's
        from dcp_optim._engine import payload as _payload

        orig["broadcast_payload"] = _payload.broadcast_payload

        def broadcast_payload(route, payload, size):
            # (a receiver's size comes from the first agreement's flags,
            # which the fake group's all-reduce leaves as this rank's own:
            # the recording's length stands in for it)
            if route.is_source:
                data = orig["broadcast_payload"](route, payload, size)  # on the fake group: counted
                shims.script.setdefault(shims.key, []).append(bytes(data.numpy()))
                shims.filled["payload_recorded"] += 1
                return data
            sent = shims.replay("payload")
            orig["broadcast_payload"](route, payload, len(sent))
            shims.filled["payload_replayed"] += 1
            return torch.frombuffer(bytearray(sent), dtype=torch.uint8)

        new = {
            "all_gather_into_tensor": all_gather_into_tensor,
            "all_gather_single": all_gather_single,
            "all_gather": all_gather,
            "all_gather_object": all_gather_object,
            "broadcast_object_list": broadcast_object_list,
            "broadcast_payload": broadcast_payload,
        }
        by_id = {id(fn): new[name] for name, fn in orig.items() if fn is not None}
        for mname, mod in list(sys.modules.items()):
            if mod is None or not (mname.startswith("torch") or mname.startswith("dcp_optim")):
                continue
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for attr, val in list(d.items()):
                if callable(val) and id(val) in by_id:
                    self._patched.append((mod, attr, val))
                    setattr(mod, attr, by_id[id(val)])

    def uninstall(self) -> None:
        for mod, attr, val in reversed(self._patched):
            setattr(mod, attr, val)
        self._patched.clear()


# --- collective counting and the byte model ------------------------------------------

_COUNTING = False  # inside count_wire: control records take the fake group's path (counted)
_NS = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier")


def _group(arg: Any):
    import torch
    import torch.distributed.distributed_c10d as c10d

    if isinstance(arg, str):
        return c10d._resolve_process_group(arg)  # type: ignore[arg-type]  # a group name, str at run time
    if isinstance(arg, torch.ScriptObject):
        return torch._C._distributed_c10d.ProcessGroup.unbox(arg)
    return arg


def _group_size(arg: Any) -> int:
    return _group(arg).size()


def _nbytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class WireCount:
    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.sent = 0
        self.recv = 0
        self.model_s = 0.0
        self.unknown = 0

    def add(self, name: str, n: int, sent: int, recv: int) -> None:
        self.ops[name] += 1
        self.sent += sent
        self.recv += recv
        self.model_s += ALPHA_S * max(1, math.ceil(math.log2(max(n, 2)))) + recv / BANDWIDTH_BPS

    def summary(self) -> dict[str, Any]:
        return {
            "collectives": sum(self.ops.values()),
            "sent_bytes": self.sent,
            "recv_bytes": self.recv,
            "model_ms": self.model_s * 1e3,
            "ops": dict(sorted(self.ops.items())),
            "unaccounted": self.unknown,
        }


@contextlib.contextmanager
def count_wire(rank: int):
    """Counts the collectives of the calls inside and the bytes this rank
    would send and receive (module docstring), and writes what a real
    backend would write into every receive buffer (all-gather outputs:
    this rank's input in every slot; a non-source's broadcast buffer:
    zeros), so that the resident memory of a call run under it is what it
    would be with real collectives (the fake group leaves outputs
    untouched: never-written pages are not resident)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    global _COUNTING
    wc = WireCount()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ns = getattr(func, "namespace", "")
            name = getattr(func, "_opname", str(func))
            out = func(*args, **kwargs)
            if ns in _NS and not any(x in name for x in _NOT_COLLECTIVES):
                try:
                    _account(wc, f"{ns}.{name}", name, args, rank)
                except Exception:  # noqa: BLE001 - an op this model does not know: counted, 0 bytes
                    wc.add(f"{ns}.{name}", 2, 0, 0)
                    wc.unknown += 1
                _touch(name, args, out)
            return out

    _COUNTING = True
    try:
        with Mode():
            yield wc
    finally:
        _COUNTING = False


def _tile(out: Any, inp: Any) -> None:
    if inp.numel() and out.numel() % inp.numel() == 0:
        # an in-place all-gather's input is a slot of its output
        out.view(-1).view(-1, inp.numel()).copy_(inp.reshape(1, -1).clone())


def _touch(name: str, args: tuple, out: Any) -> None:
    """Write receive buffers as a real backend would (see ``count_wire``)."""
    if name == "all_gather_into_tensor":
        _tile(out, args[0])
    elif name == "all_gather_into_tensor_coalesced":
        for o, i in zip(out, args[0]):
            _tile(o, i)
    elif name == "_allgather_base_":
        _tile(args[0], args[1])
    elif name == "allgather_into_tensor_coalesced_":
        for o, i in zip(args[0], args[1]):
            _tile(o, i)
    elif name == "allgather_":
        for outs, i in zip(args[0], args[1]):
            for o in outs:
                o.copy_(i)
    elif name == "broadcast_":
        pg = _group(args[1])
        if pg.rank() != int(args[2]):
            for t in args[0]:
                t.zero_()
    elif name == "broadcast":
        pg = _group(args[2])
        if pg.rank() != int(args[1]):
            out.zero_()
    elif name == "scatter_":
        pg = _group(args[2])
        if pg.rank() != int(args[3]):
            for t in args[0]:
                t.zero_()


def _account(wc: WireCount, label: str, name: str, args: tuple, rank: int) -> None:
    if name.startswith("all_gather_into_tensor"):  # functional: (input(s), group_size, group_name)
        n = int(args[1])
        b = _nbytes(args[0]) * (n - 1)
        wc.add(label, n, b, b)
    elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        n = _group_size(args[2])
        b = _nbytes(args[1]) * (n - 1)
        wc.add(label, n, b, b)
    elif name == "allgather_":
        n = _group_size(args[2])
        b = _nbytes(args[1]) * (n - 1)
        wc.add(label, n, b, b)
    elif name == "broadcast_":  # (tensors, pg, root_rank, root_tensor, ...)
        pg = _group(args[1])
        n = pg.size()
        b = _nbytes(args[0])
        root = int(args[2])
        me = pg.rank()
        wc.add(label, n, b if me == root else 0, 0 if me == root else b)
    elif name == "broadcast":  # functional: (input, src (group rank), group_name)
        pg = _group(args[2])
        n, me, b = pg.size(), pg.rank(), _nbytes(args[0])
        wc.add(label, n, b if me == int(args[1]) else 0, 0 if me == int(args[1]) else b)
    elif name == "scatter_":  # (outputs, inputs (source only), pg, root_rank, ...)
        pg = _group(args[2])
        n, me, root = pg.size(), pg.rank(), int(args[3])
        out = _nbytes(args[0])
        # the source sends every other rank its piece (all of one size)
        wc.add(label, n, out * (n - 1) if me == root else 0, 0 if me == root else out)
    elif name.startswith("all_reduce") or name.startswith("allreduce"):
        n = _group_size(args[2] if name.startswith("all_reduce") else args[1])
        b = int(_nbytes(args[0]) * 2 * (n - 1) / n)
        wc.add(label, n, b, b)
    elif name.startswith("reduce_scatter"):
        n = int(args[2]) if name.startswith("reduce_scatter_tensor") and len(args) > 2 else 2
        b = int(_nbytes(args[0]) * (n - 1) / n)
        wc.add(label, n, b, b)
    else:
        wc.add(label, 2, 0, 0)


# --- memory --------------------------------------------------------------------------


def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# --- models and layouts ----------------------------------------------------------------


MODEL_TITLES = {
    "rows": "100 x Linear(16, 16384)",
    "tiles": "400 x 64x64",
    "mini": "3 x (Linear(16, 96), Linear(96, 16))",
}


def build(model_name: str, layout: str, world: int):
    """The model (sharded for ``layout``) and Adam after one step."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    if model_name == "rows":
        # 100 x Linear(16, 16384): whole rows on every rank up to 16384
        seq = nn.Sequential(*[nn.Linear(16, 16384) for _ in range(100)])
        model: nn.Module = seq
        units = list(seq)
        tp_plan = "*"
    elif model_name == "tiles":
        # 400 tensors of 64x64 in 20 blocks: padded shards at large worlds
        model = nn.Sequential(
            *[nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(20)]) for _ in range(20)]
        )
        units = list(model)
        tp_plan = "*.*"
    elif model_name == "mini":
        # the smoke test's: 3 blocks of Linear(16, 96) + Linear(96, 16):
        # padded and empty shards from 8 ranks on
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 96), nn.Linear(96, 16, bias=False)) for _ in range(3)]
        )
        units = list(model)
        tp_plan = "*.*"
    else:
        raise ValueError(model_name)
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for u in units:
            fully_shard(u, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "dp_tp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {tp_plan: ColwiseParallel()})
        for u in units:
            fully_shard(u, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        cls = nn.Linear if model_name == "rows" else nn.Sequential
        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({cls}) if model_name == "rows" else None,
            use_orig_params=False,
        )
    else:
        raise ValueError(layout)
    from .common import adam_after_one_step

    return model, adam_after_one_step(model)


def full_bytes(model_name: str) -> int:
    """Parameter bytes of the full model."""
    if model_name == "rows":
        return 100 * (16384 * 16 + 16384) * 4
    if model_name == "mini":
        return 3 * (16 * 96 + 96 + 96 * 16) * 4
    return 400 * 64 * 64 * 4


# --- the operations -------------------------------------------------------------------


def _impl(name: str) -> Any:
    if name == "upstream":
        import torch.distributed.checkpoint.state_dict as upstream

        return upstream
    import dcp_optim

    return dcp_optim


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def synth_metadata(flat_sd: dict[str, Any], saved_world: int):
    """DCP metadata of a checkpoint of ``flat_sd``'s global tensors as a
    ``saved_world``-rank 1-D FSDP job (Shard(0), ceil-divided rows) would
    have written it."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.tensor import DTensor

    md: dict[str, Any] = {}
    for k, v in flat_sd.items():
        if isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.dim() > 0):
            shape = tuple(v.shape)
            rows = shape[0]
            c = -(-rows // saved_world)
            chunks = []
            for r in range(saved_world):
                lo = r * c
                if lo >= rows:
                    break
                hi = min(rows, lo + c)
                chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size((lo,) + (0,) * (len(shape) - 1)),
                        sizes=torch.Size((hi - lo,) + shape[1:]),
                    )
                )
            local = v.to_local() if isinstance(v, DTensor) else v
            md[k] = TensorStorageMetadata(
                properties=TensorProperties.create_from_tensor(local), size=torch.Size(shape), chunks=chunks
            )
        elif isinstance(v, torch.Tensor):
            md[k] = TensorStorageMetadata(
                properties=TensorProperties.create_from_tensor(v),
                size=v.size(),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(()))],
            )
        else:
            md[k] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md)


class Case:
    """Inputs of every operation for one implementation (built untimed)."""

    def __init__(self, impl_name: str, model, optim, rank: int, saved_world: int):
        self.name = impl_name
        self.m = _impl(impl_name)
        self.model = model
        self.optim = optim
        self.rank = rank
        self.saved_world = saved_world
        self.full: tuple[Any, Any] | None = None
        self.sharded: tuple[Any, Any] | None = None
        self.meta_bytes = None

    def prepare(self, op: str):
        """Returns (fn, args) for one call of ``op``; inputs fresh per call."""
        m = self.m
        full = m.StateDictOptions(full_state_dict=True)
        bcast = m.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        if op == "full_get_model":
            return m.get_model_state_dict, (self.model,), {"options": full}
        if op == "full_get_optim":
            return m.get_optimizer_state_dict, (self.model, self.optim), {"options": full}
        if op in ("offload_get_model", "offload_get_optim"):  # opt-in (--ops): rank 0 keeps the result
            offload = m.StateDictOptions(full_state_dict=True, cpu_offload=True)
            if op == "offload_get_model":
                return m.get_model_state_dict, (self.model,), {"options": offload}
            return m.get_optimizer_state_dict, (self.model, self.optim), {"options": offload}
        if op == "sharded_get_model":
            return m.get_model_state_dict, (self.model,), {}
        if op == "sharded_get_optim":
            return m.get_optimizer_state_dict, (self.model, self.optim), {}
        if op in ("sharded_set_model", "sharded_set_optim", "resume_plan"):
            if self.sharded is None:
                self.sharded = (
                    m.get_model_state_dict(self.model),
                    m.get_optimizer_state_dict(self.model, self.optim),
                )
            if op == "sharded_set_model":
                return m.set_model_state_dict, (self.model, _copy(self.sharded[0])), {}
            if op == "sharded_set_optim":
                return m.set_optimizer_state_dict, (self.model, self.optim, _copy(self.sharded[1])), {}
            return self._resume_plan, (), {}
        if op in ("bcast_set_model", "bcast_set_optim"):
            if self.full is None:
                self.full = (
                    m.get_model_state_dict(self.model, options=full) if self.rank == 0 else {},
                    m.get_optimizer_state_dict(self.model, self.optim, options=full) if self.rank == 0 else {},
                )
            if op == "bcast_set_model":
                return m.set_model_state_dict, (self.model, _copy(self.full[0])), {"options": bcast}
            return m.set_optimizer_state_dict, (self.model, self.optim, _copy(self.full[1])), {"options": bcast}
        raise ValueError(op)

    def _resume_plan(self):  # noqa: D401
        """What a DCP resume does on this rank before bytes move: read the
        checkpoint's metadata (unpickle), set the load planner up on this
        rank's sharded state dict, create its local plan."""
        from torch.distributed.checkpoint import DefaultLoadPlanner

        if self.meta_bytes is None:
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            flat, _ = flatten_state_dict({"model": self.sharded[0], "optim": self.sharded[1]})
            self.meta_bytes = pickle.dumps(synth_metadata(flat, self.saved_world))
        metadata = pickle.loads(self.meta_bytes)
        if self.name == "upstream":
            planner = DefaultLoadPlanner()
        else:
            from dcp_optim import LoadPlanner

            planner = LoadPlanner()
        state = {"model": self.sharded[0], "optim": self.sharded[1]}
        planner.set_up_planner(state, metadata, self.rank == 0)
        return planner.create_local_plan()


def _cpu() -> float:
    return time.process_time()


def run_op(case: Case, op: str, shims: Shims, timings: list, peaks: list, keep: bool = False,
           wire_rank: int | None = None):
    fn, a, k = case.prepare(op)
    gc.collect()
    before = _status_kb()["VmRSS"]
    can = _reset_peak()
    shims.start(f"{op}/{case.name}")
    mode = count_wire(wire_rank) if wire_rank is not None else contextlib.nullcontext()
    with mode:
        t0, c0 = time.perf_counter(), _cpu()
        out = fn(*a, **k)
        c1, t1 = _cpu(), time.perf_counter()
    st = _status_kb()
    timings.append((c1 - c0, t1 - t0))
    peaks.append((st["VmHWM"] - before) / 1024 if can else None)
    result = out if keep else None
    del out, a, k, fn
    gc.collect()
    return result


# --- result checks (smoke test) ---------------------------------------------------------


def describe(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Keys -> (type, shape, dtype, placements) of a state dict: what is
    meaningful on the fake group (the values are not)."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(describe(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(x, dict) for x in obj):
        for i, v in enumerate(obj):
            out.update(describe(v, f"{prefix}{i}."))
        return out
    key = prefix[:-1]
    if isinstance(obj, (list, tuple)):
        # upstream's broadcast load returns tuples as lists
        return {key: ("sequence", tuple(describe(x).get("", x) for x in obj))}
    if isinstance(obj, DTensor):
        out[key] = ("DTensor", tuple(obj.shape), str(obj.dtype), tuple(str(p) for p in obj.placements),
                    tuple(obj.to_local().shape))
    elif isinstance(obj, torch.Tensor):
        out[key] = ("Tensor", tuple(obj.shape), str(obj.dtype))
    else:
        out[key] = (type(obj).__name__, obj if isinstance(obj, (int, float, str, bool, type(None))) else None)
    return out


# --- the shims' own check ------------------------------------------------------------------


def selfcheck(world: int = 8, rank: int = 3) -> dict[str, bool]:
    """What the shims claim, checked on the fake group (the smoke test
    asserts every entry): without them a receiving rank's object
    broadcast fails; with them records are SPMD, data all-gathers are
    left to the fake group, the source's recorded objects are delivered,
    and the wire mode counts and writes receive buffers."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out: dict[str, bool] = {}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        rec = torch.arange(64, dtype=torch.uint8)
        got = torch.zeros(world * 64, dtype=torch.uint8)
        try:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            out["fake_object_broadcast_fails"] = box[0] is None
        except Exception:  # noqa: BLE001 - what the fake group does here
            out["fake_object_broadcast_fails"] = True
        shims = Shims()
        shims.install()
        try:
            got.zero_()
            dist.all_gather_into_tensor(got, rec)
            out["records_tiled"] = bool((got.view(world, 64) == rec).all())
            before = shims.filled["all_gather_into_tensor"]
            big = torch.ones(CONTROL_BYTES + 4, dtype=torch.uint8)
            gbig = torch.zeros(world * big.numel(), dtype=torch.uint8)
            dist.all_gather_into_tensor(gbig, big)
            out["data_gathers_not_shimmed"] = shims.filled["all_gather_into_tensor"] == before
            objs = [None]
            shims.script = {"k": [pickle.dumps([{"meta": (1, 2)}])]}
            shims.start("k")
            dist.broadcast_object_list(objs, src=0)
            out["object_broadcast_replayed"] = objs == [{"meta": (1, 2)}]
            gathered = [None] * world
            dist.all_gather_object(gathered, ("x", rank))
            out["object_all_gather_spmd"] = gathered == [("x", rank)] * world
            buf = torch.full((16,), 7.0)
            with count_wire(rank) as wc:
                dist.broadcast(buf, src=0)
                g2 = torch.zeros(world * 16)
                dist.all_gather_into_tensor(g2, torch.ones(16))
            out["wire_counts"] = wc.summary()["collectives"] == 2
            out["wire_bytes"] = wc.recv == 64 + 64 * (world - 1) and wc.sent == 64 * (world - 1)
            out["wire_writes_receive_buffers"] = bool((buf == 0).all()) and bool((g2 == 1).all())
        finally:
            shims.uninstall()
        out["uninstalled"] = dist.broadcast_object_list is not None and not shims._patched
    finally:
        dist.destroy_process_group()
    return out


# --- worker -----------------------------------------------------------------------------


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process running ``cfg["passes"]`` in order: each pass is one
    rank of one world, model and layout (the process group is re-created
    for each).  Sources' broadcasts are recorded in ``shims.script``
    (loaded from ``script_in``, saved to ``script_out``), so a rank-0 pass
    must come before the other ranks' passes of the same world, model and
    layout.  torch 2.13 cannot re-create a 2-D device mesh's groups after
    ``destroy_process_group`` in one process: a 2-D pass must be the
    process's last."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import dcp_optim  # noqa: F401  (imported before the shims patch module references)

    shims = Shims()
    if cfg.get("script_in") and os.path.exists(cfg["script_in"]):
        with open(cfg["script_in"], "rb") as f:
            shims.script = pickle.load(f)
    results: dict[str, Any] = {"passes": []}
    if cfg.get("selfcheck"):
        results["selfcheck"] = selfcheck()
    shims.install()
    try:
        for ps in cfg["passes"]:
            pcfg = {**cfg, **ps}
            world, rank = pcfg["world"], pcfg["rank"]
            key = f"{pcfg['model']}/{pcfg['layout']}/{world}/"
            shims.prefix = key
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                r = _one_rank(pcfg, rank, world, pcfg["model"], pcfg["layout"],
                              pcfg.get("ops") or list(OPS), pcfg.get("impls") or list(IMPLS),
                              int(pcfg.get("reps", 3)), shims)
            finally:
                dist.destroy_process_group()
                gc.unfreeze()
                gc.collect()
            r.update(world=world, rank=rank, model=pcfg["model"], layout=pcfg["layout"])
            results["passes"].append(r)
    finally:
        shims.uninstall()
    if cfg.get("script_out"):
        with open(cfg["script_out"], "wb") as f:
            pickle.dump(shims.script, f)
    results["shims"] = dict(shims.filled)
    return results


def _one_rank(cfg, rank, world, model_name, layout, ops, impls, reps, shims) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, optim = build(model_name, layout, world)
    build_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()  # collections inside the timed region and gc.collect() stay cheap
    cases = {i: Case(i, model, optim, rank, cfg.get("saved_world", SAVED_WORLD)) for i in impls}
    out: dict[str, Any] = {"build_s": build_s, "ops": {}}
    check = cfg.get("check", False)
    for op in ops:
        per: dict[str, Any] = {}
        timings: dict[str, list[tuple[float, float]]] = {i: [] for i in impls}  # (cpu, wall)
        peaks: dict[str, list[Any]] = {i: [] for i in impls}
        described = {}
        try:
            # warm-up: one untimed call per implementation under the wire
            # counter (and, in check mode, whose result is described)
            for i in impls:
                fn, a, k = cases[i].prepare(op)
                shims.start(f"{op}/{i}")
                with count_wire(rank) as wc:
                    res = fn(*a, **k)
                per[i] = wc.summary()
                if check:
                    described[i] = _describe_result(op, res, model, optim)
                del res, a, k, fn
                gc.collect()
            # peak memory: one call each under the same mode (its receive
            # buffers written, as with real collectives), after the warm-up
            for i in impls:
                pk: list = []
                tm: list = []
                run_op(cases[i], op, shims, tm, pk, wire_rank=rank)
                per[i]["peak_mb"] = pk[0]
                per[i]["peak_call_cpu_s"] = tm[0][0]
            # best of `reps` timed calls; fewer where one call is long
            # (REP_BUDGET_S of CPU per implementation and operation)
            longest = max(per[i]["peak_call_cpu_s"] for i in impls)
            n_reps = max(1, min(reps, int(REP_BUDGET_S / max(longest, 1e-6)))) if reps else 0
            for r in range(n_reps):
                order = impls if r % 2 == 0 else list(reversed(impls))
                for i in order:
                    run_op(cases[i], op, shims, timings[i], peaks[i])
            for i in impls:
                cpu = [t[0] for t in timings[i]]
                wall = [t[1] for t in timings[i]]
                pk = [p for p in peaks[i] if p is not None]
                per[i].update(
                    cpu_ms=min(cpu) * 1e3 if cpu else None,
                    wall_ms=min(wall) * 1e3 if wall else None,
                    cpu_ms_all=[c * 1e3 for c in cpu],
                    peak_mb_untouched=max(pk) if pk else None,
                )
            if check:
                per["described"] = described
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            import traceback

            per["error"] = f"{type(exc).__name__}: {exc}"
            per["traceback"] = traceback.format_exc()[-3000:]
        out["ops"][op] = per
        print(f"  [W={world} r={rank} {model_name}/{layout}] {op}: "
              + ", ".join(f"{i} {per[i]['cpu_ms']:.1f} ms" for i in impls
                          if per.get(i, {}).get("cpu_ms") is not None)
              + (f" ERROR {per['error']}" if "error" in per else ""), file=sys.stderr, flush=True)
    if cfg.get("census"):
        out["census"] = object_census(cases, ops, shims)
    return out


def _describe_result(op: str, res: Any, model, optim) -> Any:
    """What is comparable between the implementations on the fake group:
    a getter's result (keys, types, shapes, dtypes, placements); for a
    load, the sharded state the model and optimizer hold afterwards (read
    by upstream's getters: the return values differ by design); for the
    resume, the read items of the plan."""
    if op == "resume_plan":
        return _describe_plan(res)
    if op.startswith(("sharded_set", "bcast_set")):
        import torch.distributed.checkpoint.state_dict as up

        return describe({"model": up.get_model_state_dict(model), "optim": up.get_optimizer_state_dict(model, optim)})
    return describe(res)


def _describe_plan(plan) -> dict[str, Any]:
    return {"items": len(plan.items), "keys": sorted({str(it.dest_index.fqn) for it in plan.items})}


def object_census(cases, ops, shims) -> dict[str, Any]:
    """Per dcp_optim operation: the peak of Python allocations during one
    call (``tracemalloc``: Python objects only -- tensor storage is not
    traced) and the number of gc-tracked objects the call leaves alive
    once its result is dropped (caches).  The smoke test compares them
    between worlds: an O(world) structure shows up as growth."""
    import tracemalloc

    out: dict[str, Any] = {}
    case = cases.get("dcp_optim")
    if case is None:
        return out
    for op in ops:
        fn, a, k = case.prepare(op)
        shims.start(f"{op}/dcp_optim")
        gc.collect()
        n0 = len(gc.get_objects())
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        res = fn(*a, **k)
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        del res, a, k, fn
        gc.collect()
        out[op] = {"py_peak_kb": peak / 1024, "objects_left": len(gc.get_objects()) - n0}
    return out


# --- driver ------------------------------------------------------------------------------


def launch(cfg: dict[str, Any], tmp: str, timeout_s: float) -> dict[str, Any]:
    tag = "-".join(f"{p['model']}_{p['layout']}_{p['world']}_{p['rank']}" for p in cfg["passes"])
    cfg_path = os.path.join(tmp, f"cfg-{tag}.json")
    out_path = os.path.join(tmp, f"out-{tag}.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    import resource

    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "benchmarks.scale", "--worker", cfg_path, "--out", out_path],
            env=env, cwd=root, timeout=timeout_s, stdout=subprocess.PIPE, stderr=None, text=True,
        )
        rc = p.returncode
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s", "wall_s": time.perf_counter() - t0}
    if rc != 0 or not os.path.exists(out_path):
        return {"error": f"worker exited with {rc}", "wall_s": time.perf_counter() - t0}
    with open(out_path) as f:
        res = json.load(f)
    res["wall_s"] = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res["cpu_s"] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    return res


def memory_estimate_mb(model_name: str, world: int) -> float:
    """A rough bound on one rank's peak for the largest call: the full
    optimizer dict (3x the parameter bytes) plus per-(rank, tensor) plan
    entries of the full gathers (~ 400 B each, measured at 4096 ranks)."""
    n_tensors = 200 if model_name == "rows" else 400
    return 600 + 3 * full_bytes(model_name) / 2**20 + 3 * n_tensors * world * 400 / 2**20


def run_scale(
    worlds, ranks=(0, 1), layouts=("fsdp", "dp_tp"), models=("rows", "tiles"), ops=None, reps=3,
    timeout_s=1800.0, out_dir="bench-out", saved_world=SAVED_WORLD, impls=None,
) -> dict[str, Any]:
    import tempfile

    res: dict[str, Any] = {
        "config": {
            "worlds": list(worlds), "ranks": list(ranks), "layouts": list(layouts), "models": list(models),
            "ops": list(ops or OPS), "impls": list(impls or IMPLS), "reps": reps, "saved_world": saved_world,
            "tp": TP,
            "alpha_s": ALPHA_S, "bandwidth_Bps": BANDWIDTH_BPS, "control_bytes": CONTROL_BYTES,
            "mem_limit_mb": MEM_LIMIT_MB,
            "timing": "process CPU time (time.process_time), best of reps after one warm-up",
            "peak": "VmHWM - VmRSS before the call, peak mark reset per call (clear_refs); "
                    "MALLOC_MMAP_THRESHOLD_=65536",
        },
        "runs": [],
    }
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="scale-", dir=out_dir) as tmp:
        for model_name in models:
            for layout in layouts:
                for world in worlds:
                    if layout == "dp_tp" and world % TP:
                        continue
                    est = memory_estimate_mb(model_name, world)
                    if est > MEM_LIMIT_MB:
                        msg = (f"skipped: estimated peak {est:.0f} MB per rank process > "
                               f"DCP_SCALE_MEM_LIMIT_MB={MEM_LIMIT_MB:.0f} (shared machine)")
                        print(f"[scale] {model_name}/{layout} W={world}: {msg}", file=sys.stderr, flush=True)
                        res["runs"].append({"model": model_name, "layout": layout, "world": world, "skipped": msg})
                        continue
                    script = os.path.join(tmp, f"script-{model_name}-{layout}-{world}.pkl")
                    for rank in ranks:
                        cfg = {
                            "passes": [{"world": world, "model": model_name, "layout": layout, "rank": rank}],
                            "ops": list(ops or OPS), "impls": list(impls or IMPLS), "reps": reps,
                            "saved_world": saved_world,
                            "script_out": script if rank == 0 else None,
                            "script_in": script if rank != 0 else None,
                        }
                        print(f"[scale] {model_name}/{layout} W={world} rank {rank} ...", file=sys.stderr, flush=True)
                        out = launch(cfg, tmp, timeout_s)
                        r = out["passes"][0] if out.get("passes") else {"error": out.get("error", "no result")}
                        r.update(model=model_name, layout=layout, world=world, rank=rank,
                                 wall_s=out.get("wall_s"), cpu_s=out.get("cpu_s"), shims=out.get("shims"))
                        res["runs"].append(r)
                        print(f"[scale] {model_name}/{layout} W={world} rank {rank}: {r.get('wall_s', 0):.0f} s"
                              + (f" ERROR {r['error']}" if "error" in r else ""), file=sys.stderr, flush=True)
    return res


# --- report --------------------------------------------------------------------------------


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if b >= div:
            return f"{b / div:.1f}{unit}"
    return f"{int(b)}B"


def tables(res: dict[str, Any]) -> str:
    lines = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in res["runs"]:
        groups.setdefault((r["model"], r["layout"]), []).append(r)
    for (model_name, layout), runs in groups.items():
        title = MODEL_TITLES.get(model_name, model_name)
        lines.append(f"\n-- {title}, layout {layout}, Adam; per rank: best-of CPU ms, peak MB (extra RSS), "
                     "collectives, bytes received, alpha-beta ms --")
        hdr = ["W", "rank", "op", "upstream ms", "dcp_optim ms", "up/dcp", "peak MB up/dcp",
               "colls up/dcp", "recv up/dcp", "model ms up/dcp"]
        rows = []
        for r in runs:
            if "skipped" in r:
                rows.append([str(r["world"]), "-", r["skipped"]] + [""] * 7)
                continue
            if "error" in r and "ops" not in r:
                rows.append([str(r["world"]), str(r["rank"]), "ERROR " + r["error"]] + [""] * 7)
                continue
            rank = str(r["rank"])
            if True:
                for op, per in r["ops"].items():
                    if "error" in per:
                        rows.append([str(r["world"]), rank, op, "ERROR " + per["error"][:60]] + [""] * 6)
                        continue
                    u, d = per.get("upstream", {}), per.get("dcp_optim", {})

                    def g(x, k, f="{:.1f}"):
                        v = x.get(k)
                        return f.format(v) if v is not None else "-"

                    ratio = (f"{u['cpu_ms'] / d['cpu_ms']:.2f}" if u.get("cpu_ms") and d.get("cpu_ms") else "-")
                    rows.append([
                        str(r["world"]), rank, op, g(u, "cpu_ms"), g(d, "cpu_ms"), ratio,
                        f"{g(u, 'peak_mb', '{:.0f}')}/{g(d, 'peak_mb', '{:.0f}')}",
                        f"{g(u, 'collectives', '{}')}/{g(d, 'collectives', '{}')}",
                        f"{_fmt_bytes(u.get('recv_bytes'))}/{_fmt_bytes(d.get('recv_bytes'))}",
                        f"{g(u, 'model_ms')}/{g(d, 'model_ms')}",
                    ])
        widths = [max(len(hdr[i]), *(len(x[i]) for x in rows)) if rows else len(hdr[i]) for i in range(len(hdr))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(hdr, widths)))
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        walls = {r["world"] for r in runs if r.get("wall_s")}
        if walls:
            lines.append("   processes' wall / CPU time per world (all ranks): " + ", ".join(
                f"W={w}: {sum(x.get('wall_s') or 0 for x in runs if x['world'] == w):.0f}"
                f" / {sum(x.get('cpu_s') or 0 for x in runs if x['world'] == w):.0f} s" for w in sorted(walls)))
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    series: dict[tuple, list] = {}
    for r in res["runs"]:
        rank = r.get("rank")
        if True:
            for op, per in r.get("ops", {}).items():
                for impl in IMPLS:
                    x = per.get(impl)
                    if x and x.get("cpu_ms") is not None:
                        series.setdefault((op, r["model"], r["layout"], rank, impl), []).append(
                            (r["world"], x["cpu_ms"], x.get("peak_mb")))
    ops = [op for op in OPS if any(k[0] == op for k in series)]
    if not ops:
        return "no plot: no data"
    fig, axes = plt.subplots(2, len(ops), figsize=(3.2 * len(ops), 6.5), squeeze=False)
    for j, op in enumerate(ops):
        for (o, model_name, layout, rank, impl), pts in sorted(series.items()):
            if o != op:
                continue
            pts.sort()
            ws = [p[0] for p in pts]
            style = "-" if impl == "dcp_optim" else "--"
            label = f"{impl} {model_name}/{layout} r{rank}"
            axes[0][j].plot(ws, [max(p[1], 1e-3) for p in pts], style, marker="o", ms=3, label=label)
            pk = [(w, p[2]) for w, p in zip(ws, pts) if p[2] is not None and p[2] > 0]
            if pk:
                axes[1][j].plot([a for a, _ in pk], [b for _, b in pk], style, marker="o", ms=3, label=label)
        for i in (0, 1):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_yscale("log")
            axes[i][j].grid(True, which="both", alpha=0.3)
            axes[i][j].set_xlabel("world size")
        axes[0][j].set_title(op, fontsize=9)
        axes[0][j].set_ylabel("CPU ms per rank")
        axes[1][j].set_ylabel("peak extra RSS MB")
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=4, fontsize=6)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--worlds", help="comma-separated simulated world sizes (default 8,64,512,4096)")
    p.add_argument("--big", action="store_true", help="add 16384 and 65536 (memory permitting)")
    p.add_argument("--quick", action="store_true", help="8,64,512, 1 rep")
    p.add_argument("--ranks", default="0,1")
    p.add_argument("--layouts", default="fsdp,dp_tp")
    p.add_argument("--models", default="rows,tiles")
    p.add_argument("--ops", help="comma-separated operations (default all)")
    p.add_argument("--impls", help="comma-separated implementations (default upstream,dcp_optim)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--saved-world", type=int, default=SAVED_WORLD)
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    args = p.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            cfg = json.load(f)
        res = worker(cfg)
        with open(args.out, "w") as f:
            json.dump(res, f, default=str)
        return 0
    res = run_from_args(args)
    print(tables(res))
    return 0


def worlds_from_args(args) -> list[int]:
    if args.worlds:
        return [int(x) for x in args.worlds.split(",") if x.strip()]
    if args.quick:
        return list(WORLDS_QUICK)
    return list(WORLDS_DEFAULT) + (list(WORLDS_BIG) if args.big else [])


def run_from_args(args, out_dir: str = "bench-out") -> dict[str, Any]:
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    return run_scale(
        worlds_from_args(args),
        ranks=[int(x) for x in args.ranks.split(",")],
        layouts=[x for x in args.layouts.split(",") if x],
        models=[x for x in args.models.split(",") if x],
        ops=[x for x in args.ops.split(",")] if args.ops else None,
        impls=[x for x in args.impls.split(",") if x] if args.impls else None,
        reps=reps,
        out_dir=out_dir,
        saved_world=args.saved_world,
    )


if __name__ == "__main__":
    sys.exit(main())
