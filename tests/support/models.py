"""Seeded generators of module trees and optimizers for differential tests.

Every case is built twice from the same seed ("twins"): one twin goes
through upstream's implementation, the other through dcp_optim, and the
outputs are compared.  Building twice (rather than deep-copying) keeps
wrapped modules (DDP, compiled, activation-checkpointed) independent.

The forward pass of every generated model touches every leaf module, so
every trainable parameter receives a gradient (upstream returns state only
for stepped parameters; dcp_optim adds pristine state for the others --
a deliberate difference tested separately).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

D = 4  # feature width of every leaf
V = 7  # embedding vocabulary
B = 3  # batch


class ExtraStateLinear(nn.Module):
    """A leaf with get/set_extra_state."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.counter = 0

    def get_extra_state(self):
        return {"counter": self.counter}

    def set_extra_state(self, state):
        self.counter = state["counter"]

    def forward(self, x):
        return self.lin(x)


class BufferLeaf(nn.Module):
    """A parameter plus a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.register_buffer("shift", torch.zeros(D))
        self.register_buffer("scratch", torch.zeros(D), persistent=False)

    def forward(self, x):
        return x * self.scale + self.shift


class Holder(nn.Module):
    """A custom container: children as attributes."""

    def forward(self, x):  # pragma: no cover - the model forward drives leaves
        raise NotImplementedError


LEAF_KINDS = ("linear", "linear_nobias", "layernorm", "bn", "embedding", "conv",
              "extra", "buffers", "plist")


def make_leaf(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(D, D)
    if kind == "linear_nobias":
        return nn.Linear(D, D, bias=False)
    if kind == "layernorm":
        return nn.LayerNorm(D)
    if kind == "bn":
        return nn.BatchNorm1d(D)
    if kind == "embedding":
        return nn.Embedding(V, D)
    if kind == "conv":
        return nn.Conv1d(D, D, 3, padding=1)
    if kind == "extra":
        return ExtraStateLinear()
    if kind == "buffers":
        return BufferLeaf()
    if kind == "plist":
        return nn.ParameterList([nn.Parameter(torch.randn(D)) for _ in range(2)])
    raise ValueError(kind)


def leaf_loss(leaf: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(leaf, nn.Embedding):
        return leaf(ids).pow(2).mean()
    if isinstance(leaf, nn.Conv1d):
        return leaf(x.unsqueeze(-1).expand(B, D, 5)).pow(2).mean()
    if isinstance(leaf, nn.ParameterList):
        return sum(((x * p).pow(2).mean() for p in leaf), torch.zeros(()))
    return leaf(x).pow(2).mean()


class GeneratedModel(nn.Module):
    """Root of a generated tree; forward = sum of every leaf's loss."""

    def __init__(self):
        super().__init__()
        # Leaves in creation order; kept outside _modules so the tree is
        # exactly the generated one.
        object.__setattr__(self, "_leaves", [])

    def forward(self, x, ids):
        total = torch.zeros(())
        for leaf in self._leaves:
            total = total + leaf_loss(leaf, x, ids)
        return total


def _make_tree(rng: random.Random, depth: int, leaves: list[nn.Module]) -> nn.Module:
    if depth == 0 or rng.random() < 0.35:
        leaf = make_leaf(rng.choice(LEAF_KINDS))
        leaves.append(leaf)
        return leaf
    n = rng.randint(1, 3)
    children = [_make_tree(rng, depth - 1, leaves) for _ in range(n)]
    kind = rng.choice(("seq", "list", "dict", "holder"))
    if kind == "seq":
        return nn.Sequential(*children)
    if kind == "list":
        return nn.ModuleList(children)
    if kind == "dict":
        return nn.ModuleDict({f"m{i}": c for i, c in enumerate(children)})
    holder = Holder()
    for i, c in enumerate(children):
        setattr(holder, f"child_{i}", c)
    return holder


@dataclass
class ModelSpec:
    seed: int
    depth: int = 3
    frozen_fraction: float = 0.0
    tie: bool = False
    ckpt_wrap: bool = False
    compile_wrap: bool = False


def build_model(spec: ModelSpec) -> GeneratedModel:
    """A deterministic model for `spec` (same spec -> identical twin)."""
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    root = GeneratedModel()
    leaves: list[nn.Module] = []
    n = rng.randint(1, 3)
    for i in range(n):
        setattr(root, f"block{i}", _make_tree(rng, spec.depth, leaves))
    root._leaves.extend(leaves)
    if spec.tie:
        linears = [m for m in leaves if isinstance(m, nn.Linear)]
        if len(linears) >= 2:
            a, b = rng.sample(linears, 2)
            b.weight = a.weight
    if spec.frozen_fraction:
        params = list(root.parameters())
        for p in params:
            if rng.random() < spec.frozen_fraction:
                p.requires_grad_(False)
        if not any(p.requires_grad for p in params):
            params[0].requires_grad_(True)
    if spec.ckpt_wrap:
        _wrap_random(root, rng, "ckpt")
    if spec.compile_wrap:
        _wrap_random(root, rng, "compile")
    return root


def _wrap_random(root: nn.Module, rng: random.Random, how: str) -> None:
    """Wrap a random non-root submodule in place (the leaves list keeps the
    original modules, so forward bypasses the wrapper)."""
    wrappers = ("OptimizedModule", "CheckpointWrapper")
    candidates = [
        (parent, name)
        for parent in root.modules()
        # compiled-inside-checkpoint-wrapper is D16 in docs/differences.md (tested on its own)
        if type(parent).__name__ not in wrappers
        for name, child in parent._modules.items()
        if child is not None and type(child).__name__ not in wrappers
    ]
    if not candidates:
        return
    parent, name = rng.choice(candidates)
    child = parent._modules[name]
    if how == "ckpt":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        parent._modules[name] = checkpoint_wrapper(child)
    else:
        parent._modules[name] = torch.compile(child, backend="eager")


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(B, D, generator=g), torch.randint(0, V, (B,), generator=g)


# --- optimizers ----------------------------------------------------------------

OPTIMIZER_KINDS = ("sgd", "sgd_momentum", "sgd_dampening", "adam", "adam_amsgrad", "adamw",
                   "adagrad", "rmsprop", "rmsprop_centered", "adamax", "nadam", "radam",
                   "adadelta", "asgd", "rprop")


def make_optimizer(kind: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1)
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "sgd_dampening":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-2, weight_decay=0.01)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(groups, lr=1e-2, amsgrad=True, foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5)
    if kind == "rmsprop_centered":
        return torch.optim.RMSprop(groups, lr=1e-2, centered=True)
    if kind == "adamax":
        return torch.optim.Adamax(groups, lr=1e-2)
    if kind == "nadam":
        return torch.optim.NAdam(groups, lr=1e-2)
    if kind == "radam":
        return torch.optim.RAdam(groups, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01)
    if kind == "adadelta":
        return torch.optim.Adadelta(groups, lr=1.0)
    if kind == "asgd":
        return torch.optim.ASGD(groups, lr=1e-2)
    if kind == "rprop":
        return torch.optim.Rprop(groups, lr=1e-2)
    raise ValueError(kind)


@dataclass
class OptimSpec:
    seed: int
    kinds: tuple[str, ...] = ("adam",)  # one optimizer per kind
    groups_per_optimizer: int = 1
    include_frozen: bool = False  # pass frozen params to the optimizer too


def build_optimizers(model: nn.Module, spec: OptimSpec) -> tuple[torch.optim.Optimizer, ...]:
    """Split the model's parameters over the optimizers and their groups,
    deterministically from `spec`."""
    rng = random.Random(spec.seed * 7919 + 1)
    params = [p for p in model.parameters() if spec.include_frozen or p.requires_grad]
    n_opt = len(spec.kinds)
    buckets: list[list[torch.Tensor]] = [[] for _ in range(n_opt * spec.groups_per_optimizer)]
    for i, p in enumerate(params):
        # every bucket gets at least one param when possible
        bucket = i if i < len(buckets) else rng.randrange(len(buckets))
        buckets[bucket].append(p)
    optimizers = []
    for o, kind in enumerate(spec.kinds):
        groups = []
        for g in range(spec.groups_per_optimizer):
            group_params = buckets[o * spec.groups_per_optimizer + g]
            groups.append({"params": group_params, "lr": 0.01 * (g + 1)})
        groups = [g for g in groups if g["params"]] or [{"params": []}]
        if not any(g["params"] for g in groups):
            continue
        optimizers.append(make_optimizer(kind, groups))
    return tuple(optimizers)


def train(model: nn.Module, optimizers, seed: int, steps: int = 1, fwd: Callable | None = None) -> None:
    for step in range(steps):
        x, ids = batch(seed + step)
        loss = (fwd or model)(x, ids)
        loss.backward()
        for o in optimizers:
            o.step()
        for o in optimizers:
            o.zero_grad(set_to_none=True)


@dataclass
class Case:
    model: ModelSpec
    optim: OptimSpec
    steps: int = 1
    tags: list[str] = field(default_factory=list)

    def build(self):
        model = build_model(self.model)
        optimizers = build_optimizers(model, self.optim)
        train(model, optimizers, self.model.seed, self.steps)
        return model, optimizers

    def __repr__(self) -> str:
        return (f"Case(seed={self.model.seed}, opt={self.optim.kinds}x{self.optim.groups_per_optimizer}, "
                f"frozen={self.model.frozen_fraction}, tie={self.model.tie}, "
                f"ckpt={self.model.ckpt_wrap}, compile={self.model.compile_wrap})")


def generated_cases(n: int, base_seed: int = 0) -> list[Case]:
    rng = random.Random(base_seed)
    cases = []
    for i in range(n):
        seed = base_seed * 100003 + i
        n_opt = 1 if rng.random() < 0.7 else 2
        kinds = tuple(rng.choice(OPTIMIZER_KINDS) for _ in range(n_opt))
        if n_opt > 1:
            # A stateless optimizer next to a stateful one trips upstream's
            # E18 (D5 in docs/differences.md); that combination is a deviation test.
            kinds = tuple("sgd_momentum" if k == "sgd" else k for k in kinds)
        cases.append(
            Case(
                model=ModelSpec(
                    seed=seed,
                    depth=rng.randint(1, 3),
                    frozen_fraction=rng.choice((0.0, 0.0, 0.2)),
                    tie=rng.random() < 0.2,
                    ckpt_wrap=rng.random() < 0.2,
                    compile_wrap=rng.random() < 0.15,
                ),
                optim=OptimSpec(
                    seed=seed,
                    kinds=kinds,
                    groups_per_optimizer=rng.randint(1, 3),
                    include_frozen=rng.random() < 0.3,
                ),
                steps=rng.randint(1, 2),
            )
        )
    return cases


def sharpness_aware_step(model: Any, opt: Any, x: Any, gsam: bool) -> None:
    """One step of a sharpness-aware optimizer (pytorch-optimizer's SAM
    family): gradients first, then ``step`` with a closure that clears and
    recomputes them (GSAM's closure returns ``(outputs, loss)``)."""
    model(x).backward()

    def closure() -> Any:
        opt.zero_grad()
        with torch.enable_grad():
            loss = model(x)
        loss.backward()
        return (None, loss.detach()) if gsam else loss

    opt.step(closure)


def fsdp2_with_adam_step(model: nn.Sequential, mesh: Any) -> torch.optim.Optimizer:
    """``model``'s layers, then ``model``, ``fully_shard``-ed on ``mesh``;
    returns an Adam optimizer after one step whose gradients were set to
    ones directly (no backward pass: FSDP2's backward on gloo costs seconds
    of setup, and the state-dict paths only need every parameter's state)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return adam_after_one_step(model)


def adam_after_one_step(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over ``model``'s parameters after one step whose gradients were
    set to ones (every parameter gets its state; no backward pass)."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim
