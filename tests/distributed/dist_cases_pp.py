"""Rank functions for the pipeline-parallel (MPMD) tests (tests/distributed/test_pipeline.py).

Stages are built as torchtitan builds them: a copy of the full model with the
layers a stage does not own deleted, so every stage keeps the full model's
FQNs.  Each stage has its own optimizer, with groups made by a rule (decay /
no-decay / frozen) so that some stages get an empty group and one gets a
frozen-only group, plus a custom group key.  The embedding and the output
head are tied in the full model; in a pipeline they live on the first and the
last stage and stay equal because both receive the summed gradient (as the
pipeline's tied-weight all-reduce does).

No schedule and no point-to-point traffic are needed: every rank runs the
full reference model, and each stage copies the gradients of its own
parameters from it (by FQN) before stepping its optimizer.  The stages then
hold exactly what a real pipeline would, and the reference model + one
optimizer over it is the oracle for every parameter, state tensor and group
hyperparameter at any layout.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as upstream
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import dcp_optim
from dcp_optim import StateDictOptions as Opts

from ..support.oracle import assert_same_tree

VOCAB, DIM, LAYERS = 11, 8, 4
FLAT = Opts(flatten_optimizer_state_dict=True)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        # a frozen parameter: it lands in a frozen-only group
        self.layers["1"].norm.weight.requires_grad_(False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def full_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def build_stage(layer_ids: list[int], first: bool, last: bool, seed: int) -> TinyLM:
    """A stage module keeping the full model's FQNs (torchtitan's way)."""
    torch.manual_seed(seed)
    stage = copy.deepcopy(TinyLM())
    if not first:
        stage.tok_embeddings = None
    for name in list(stage.layers):
        if int(name) not in layer_ids:
            del stage.layers[name]
    if not last:
        stage.norm = None
        stage.output = None
    return stage


# stage layouts: for every rank, its stages as (layer ids, first, last)
LAYOUTS: dict[str, list[list[tuple[list[int], bool, bool]]]] = {
    # one stage holding everything
    "1x1": [[([0, 1, 2, 3], True, True)]],
    # two stages on two ranks
    "2x1": [[([0, 1], True, False)], [([2, 3], False, True)]],
    # four stages on two ranks, interleaved (rank 0: stages 0 and 2)
    "4i2": [
        [([0], True, False), ([2], False, False)],
        [([1], False, False), ([3], False, True)],
    ],
    # two stages x two data-parallel ranks (FSDP2 inside a stage): ranks
    # (pp, dp) = (r // 2, r % 2)
    "2x2dp": [
        [([0, 1], True, False)], [([0, 1], True, False)],
        [([2, 3], False, True)], [([2, 3], False, True)],
    ],
}


def group_rule(model: nn.Module) -> list[dict[str, Any]]:
    """decay (2-D trainable weights), no_decay (other trainable), frozen;
    the same rule for every stage and for the reference model."""
    decay, no_decay, frozen = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            frozen.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    # "tag" and "custom" are custom group keys.  They exist from
    # construction on: a DCP template can only ask for the keys a fresh
    # optimizer has (true of upstream too)
    return [
        {"params": decay, "weight_decay": 0.1, "tag": "decay", "custom": [0, "decay"]},
        {"params": no_decay, "weight_decay": 0.0, "tag": "no_decay", "custom": [0, "no_decay"]},
        {"params": frozen, "lr": 0.0, "tag": "frozen", "custom": [0, "frozen"]},
    ]


def make_optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(group_rule(model), lr=0.01)


def _adjust_hyperparameters(optim: torch.optim.Optimizer, step: int) -> None:
    """What a schedule and a user do between steps: hyperparameters that a
    fresh optimizer does not have, so that a load must restore them."""
    for group in optim.param_groups:
        group["lr"] = group["lr"] * 0.5 + 0.001 * step
        group["tag"] = f"{group['tag']}@{step}"
        group["custom"] = [step, group["tag"]]


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(100 + step))


class Pipeline:
    """This rank's stages of `layout`, with an optimizer each, and the full
    reference model with one optimizer over it."""

    def __init__(self, layout: str, rank: int, seed: int, mesh=None):
        self.layout = layout
        self.specs = LAYOUTS[layout][rank]
        # every stage starts from the same full model (seed): as in a real
        # pipeline, where stage i is cut out of one initialised model
        self.stages = [build_stage(ids, first, last, seed) for ids, first, last in self.specs]
        if mesh is not None:
            for stage in self.stages:
                for block in stage.layers.values():
                    fully_shard(block, mesh=mesh)
                fully_shard(stage, mesh=mesh)
        self.optims = [make_optim(stage) for stage in self.stages]
        self.ref = full_model()
        self.ref_optim = make_optim(self.ref)
        self.steps = 0

    def train(self, steps: int = 2, stages: bool = True) -> None:
        """One pipeline step = the reference's gradients copied into every
        stage by FQN (tied: the head gets the embedding's summed grad)."""
        ref_params = dict(self.ref.named_parameters(remove_duplicate=False))
        for _ in range(steps):
            self.steps += 1
            self.ref_optim.zero_grad()
            logits = self.ref(_batch(self.steps))
            logits.float().pow(2).mean().backward()
            for stage, optim in zip(self.stages if stages else [], self.optims):
                for name, p in stage.named_parameters():
                    grad = ref_params[name].grad
                    if grad is None or not p.requires_grad:
                        continue
                    if isinstance(p, DTensor):
                        grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
                    p.grad = grad.clone()
                optim.step()
                optim.zero_grad()
                _adjust_hyperparameters(optim, self.steps)
            self.ref_optim.step()
            _adjust_hyperparameters(self.ref_optim, self.steps)

    # --- state dicts, torchtitan style: one merged flat dict per rank -------

    def get(self, impl=dcp_optim) -> tuple[dict[str, Any], dict[str, Any]]:
        opts = impl.StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        for stage, optim in zip(self.stages, self.optims):
            model_sd.update(impl.get_model_state_dict(stage, options=opts))
            optim_sd.update(impl.get_optimizer_state_dict(stage, optim, options=opts))
        return model_sd, optim_sd

    def set(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        for stage, optim in zip(self.stages, self.optims):
            dcp_optim.set_model_state_dict(stage, model_sd, options=Opts(strict=False))
            dcp_optim.set_optimizer_state_dict(stage, optim, optim_sd, options=FLAT)

    # --- the oracle ----------------------------------------------------------

    def check_against_reference(self) -> int:
        """Every full parameter, optimizer state tensor and group
        hyperparameter of every stage equals the reference's (by FQN).
        Returns the number of values compared."""
        compared = 0
        ref_params = dict(self.ref.named_parameters(remove_duplicate=False))
        ref_group = _group_by_param(self.ref_optim)
        full = Opts(full_state_dict=True)
        for stage, optim in zip(self.stages, self.optims):
            msd = dcp_optim.get_model_state_dict(stage, options=full)
            osd = dcp_optim.get_optimizer_state_dict(stage, optim, options=full)
            for name, _ in stage.named_parameters():
                assert torch.equal(msd[name], ref_params[name].detach()), name
                compared += 1
            ref_state = _state_by_fqn(self.ref, self.ref_optim)
            for fqn, st in osd["state"].items():
                assert_same_tree(ref_state[fqn], st, f"$.state[{fqn!r}]")
                compared += len(st)
            stage_params = dict(stage.named_parameters())
            mine = _group_by_param(optim)
            for name, p in stage_params.items():
                assert mine[id(p)] == ref_group[id(ref_params[name])], (name, mine[id(p)], ref_group[id(ref_params[name])])
                compared += 1
        return compared


def _group_by_param(optim) -> dict[int, dict[str, Any]]:
    out = {}
    for group in optim.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            out[id(p)] = hyper
    return out


def _state_by_fqn(model, optim) -> dict[str, dict[str, Any]]:
    """The reference optimizer's state under every FQN of its parameter
    (tied: both names)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p in optim.state:
            out[name] = {k: v.detach().clone() for k, v in optim.state[p].items()}
    return out


def _pp_mesh(layout: str):
    if layout == "2x2dp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        return mesh["dp"]
    return None


# --- rank functions --------------------------------------------------------------


def save(rank: int, ws: int, path: str, layout: str) -> dict[str, Any]:
    """Train at `layout`, check the flattened dicts (disjoint keys across
    stages, equal to upstream's wherever upstream works), save with DCP."""
    pipe = Pipeline(layout, rank, seed=0, mesh=_pp_mesh(layout))
    pipe.train(steps=2)
    model_sd, optim_sd = pipe.get()
    # per-stage keys never collide: every state and hyperparameter key
    # names an FQN (or an empty group's reserved anchor)
    per_stage = [set(dcp_optim.get_optimizer_state_dict(s, o, options=FLAT)) for s, o in zip(pipe.stages, pipe.optims)]
    for i in range(len(per_stage)):
        for j in range(i + 1, len(per_stage)):
            assert not (per_stage[i] & per_stage[j]), sorted(per_stage[i] & per_stage[j])[:5]
    assert not any(k.startswith("param_groups.0.") or k.startswith("state.0.") for k in optim_sd)
    # upstream's keys and values are ours; upstream leaves an empty group's
    # hyperparameters out (and cannot load such a dict back:
    # pytorch/pytorch#143828, tests/unit/test_deviations.py)
    upstream_equal = empty_groups = 0
    for stage, optim in zip(pipe.stages, pipe.optims):
        has_empty = any(not g["params"] for g in optim.param_groups)
        empty_groups += has_empty
        theirs = upstream.get_optimizer_state_dict(
            stage, optim, options=upstream.StateDictOptions(flatten_optimizer_state_dict=True)
        )
        ours = dcp_optim.get_optimizer_state_dict(stage, optim, options=FLAT)
        if has_empty:
            # upstream drops the empty group's hyperparameters; everything
            # else is the same
            ours = {k: v for k, v in ours.items() if "__empty_group_" not in k and "__optimizer_" not in k}
        assert_same_tree(theirs, ours)
        upstream_equal += 1
        assert_same_tree(
            upstream.get_model_state_dict(stage, options=upstream.StateDictOptions(flatten_optimizer_state_dict=True)),
            dcp_optim.get_model_state_dict(stage, options=FLAT),
        )
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    compared = pipe.check_against_reference()
    dist.barrier()
    return {"compared": compared, "upstream_equal": upstream_equal, "empty_groups": empty_groups,
            "keys": len(optim_sd)}


def load(rank: int, ws: int, path: str, layout: str) -> dict[str, Any]:
    """Fresh stages at `layout` (never-stepped optimizers) -> flattened
    templates -> DCP load -> set; every value equals the reference trained
    as the saved run was, and one more step keeps them equal."""
    pipe = Pipeline(layout, rank, seed=7, mesh=_pp_mesh(layout))
    # the saved run's trajectory, on the reference only
    pipe.train(steps=2, stages=False)
    model_sd, optim_sd = pipe.get()
    state = {"model": model_sd, "optim": optim_sd}
    # the saved layout's empty groups sit elsewhere: their reserved keys may
    # be absent from the checkpoint, which dcp_optim's planner tolerates
    planner = dcp_optim.LoadPlanner()
    dcp.load(state, checkpoint_id=path, planner=planner)
    pipe.set(state["model"], state["optim"])
    compared = pipe.check_against_reference()
    pipe.train(steps=1)
    compared += pipe.check_against_reference()
    dist.barrier()
    return {"compared": compared, "skipped": sorted(planner.skipped_empty_group_keys)}
