"""Type stubs of the C core ``dcp_optim._dcp_optim`` (csrc/).

Signatures match the functions' advertised ``__text_signature__`` and
what they accept (tests/core/refleak/test_signatures.py checks both).  The
core is internal: arguments are torch objects reached through a
``Context`` and plain containers; see each C function's comment.
"""

from typing import Any

#: "c": the compiled core (there is no other backend).
BACKEND: str

class Context:
    """The torch classes and base methods the native core compares against."""

    def __init__(self, **fields: Any) -> None: ...
    def __getattr__(self, name: str) -> Any: ...


class GatherPlan:
    """How one mesh's DTensors are gathered: buckets of per-tensor slots, closed form for evenly sharded tensors."""

    @property
    def world(self) -> int: ...
    @property
    def buckets(self) -> int: ...
    @property
    def tensors(self) -> int: ...
    @property
    def max_segment(self) -> int: ...
    def segment(self, bucket: int, /) -> int: ...
    def direct(self, bucket: int, /) -> tuple[int, Any, Any] | None: ...
    def describe(self, bucket: int, /) -> list[tuple[Any, ...]]: ...


class ModelIndex:
    """The result of one native walk over a module tree."""

    @property
    def ctx(self) -> Context: ...
    @property
    def model(self) -> Any: ...
    @property
    def modifiers_name(self) -> str: ...
    @property
    def trace(self) -> Any: ...
    @property
    def custom_load(self) -> int: ...
    @property
    def shared_modules(self) -> int: ...
    @property
    def raw_names(self) -> tuple[str, ...]: ...
    @property
    def fqns(self) -> tuple[str, ...]: ...
    @property
    def load_keys(self) -> tuple[str, ...]: ...
    @property
    def values(self) -> tuple[Any, ...]: ...
    @property
    def kinds(self) -> bytes: ...
    @property
    def tensors(self) -> tuple[Any, ...]: ...
    @property
    def tensor_fqns(self) -> tuple[tuple[str, ...], ...]: ...
    @property
    def tensor_loads(self) -> tuple[tuple[str, ...], ...]: ...
    @property
    def np_params(self) -> tuple[Any, ...]: ...
    @property
    def np_names(self) -> tuple[str, ...]: ...
    @property
    def np_fqns(self) -> tuple[str | None, ...]: ...
    @property
    def fsdp1_modules(self) -> tuple[Any, ...]: ...
    @property
    def load_modules(self) -> tuple[Any, ...]: ...
    def valid_state(self) -> list[tuple[str, Any]]: ...
    def slot_of(self, tensor: Any, /) -> int | None: ...


class LoadPlan:
    """The plan of a full -> local load (made by plan_full_load; read-only)."""

    @property
    def njobs(self) -> int: ...
    @property
    def nbuckets(self) -> int: ...
    @property
    def max_bucket_bytes(self) -> int: ...
    @property
    def bucket_bytes(self) -> tuple[int, ...]: ...
    @property
    def dests(self) -> tuple[Any, ...]: ...
    def chunks(self, bucket: int, /) -> list[tuple[Any, ...]]: ...


def broadcast_jobs(meta: Any, full: Any, local: Any, device: Any, dtensor_cls: Any, tensor_cls: Any, /) -> Any:
    """The work list of a model broadcast."""

def plain_state_dict(ctx: Any, model: Any, /) -> Any:
    """model.state_dict() built natively where torch's call would run none of the model's code; else None."""

def canonicalize_model_keys(ctx: Any, model: Any, state_dict: Any, modifiers_name: Any, /) -> Any:
    """Rename the keys of a fresh model.state_dict() to canonical FQNs, in place, as upstream does."""

def aliased_load(index: Any, state_dict: Any, dtensor_cls: Any, plain_types: Any, strided: Any, /) -> Any: ...
def check_model_load(index: Any, state_dict: Any, strict: Any, check_keys: Any, /) -> Any:
    """What model.load_state_dict would reject, before anything is copied."""

def copy_blocks(dst: Any, src: Any, blocks: Any, direction: Any, row_window: Any, /) -> Any:
    """Copy the sub-boxes of a shard layout between shard and full tensor."""

def drop_frozen(index: Any, state_dict: Any, /) -> Any:
    """Pop the FQNs of parameters with requires_grad=False."""

def filter_prefixes(state_dict: Any, prefixes: Any, keep: Any, /) -> Any:
    """Keep keys under the given prefixes, optionally stripping them."""

def finish_full_load(plan: LoadPlan, from_local: Any, offload: Any, /) -> list[Any]:
    """The loaded value of each job of a LoadPlan: shards wrapped as DTensors like their templates."""

def first_key_containing(mapping: Any, needle: Any, /) -> Any:
    """The first str key containing `needle`, or None."""

def flat_assemble(dest: Any, pieces: Any, values: Any, /) -> Any:
    """Copy per-parameter pieces into a flat shard."""

def flat_pieces(numels_with_padding: Any, is_padding_mask: Any, shard_numel: Any, rank: Any, /) -> Any:
    """(param, param start, shard start, length) of a rank's FSDP1 shard."""

def flat_unflatten(full: Any, numels_with_padding: Any, is_padding_mask: Any, shapes: Any, /) -> Any:
    """Views of the original parameters in an unsharded FSDP1 flat tensor."""

def flatten_optim(ctx: Any, osd: Any, group_counts: Any, keys: Any = None, /) -> Any:
    """The flattened optimizer format of a nested FQN-keyed dict."""

def full_load_merge(ctx: Any, full_sd: Any, local: Any, device: Any, /) -> Any:
    """Merge a full model state dict into the local one (private copy)."""

def get_fqns(ctx: Any, model: Any, name: Any, modifiers_name: Any, skip_ddp_prefix: Any, skip_compiler_prefix: Any, /) -> Any:
    """Canonical FQNs of a (possibly wrapper-prefixed) name, as a set."""

def indices_of(values: Any, cls: Any, /) -> Any:
    """Positions of the values that are instances of cls."""

def map_call(fn: Any, values: Any, extra: Any, /) -> Any:
    """[fn(v, *extra) for v in values], None passed through."""

def materialize_state(missing: Any, specs_by_group: Any, PARAM: Any, PARAM_DEVICE: Any, /) -> Any:
    """Pristine optimizer state for parameters without state."""

def optim_missing(index: Any, optimizer: Any, /) -> Any:
    """(param, group_index, fqn) of trainable parameters without state."""

def optim_pack(index: Any, optimizers: Any, extra_states: Any, out_state: Any, out_groups: Any, out_wide: Any = None, /) -> Any:
    """FQN-keyed equivalent of Optimizer.state_dict() for each optimizer, merged into out_state / out_groups."""

def optim_remap(index: Any, optimizer: Any, osd: Any, /) -> Any:
    """Re-key an integer-ID optimizer state dict by FQN, in place."""

def optim_state_jobs(index: Any, state: Any, dtensor_cls: Any, mode: Any, from_local: Any, existing: Any = None, /) -> Any:
    """Copy loaded optimizer state and list the tensors to localise."""

def parse_flat_key(key: str, known: set[str] | frozenset[str] | None, /) -> tuple[str, str, str] | None:
    """One key of the flattened optimizer format, parsed as unflatten_optim does."""

def plan_full_load(jobs: Any, dtensor_cls: Any, classes: Any, budget: Any, empty: Any, stream: Any, in_place: Any = False, /) -> LoadPlan:
    """The LoadPlan of a full -> local load: destinations and stream buckets."""

def pack_bucket(buffer: Any, plan: GatherPlan, bucket: Any, uint8: Any, /) -> Any:
    """Copy this rank's shards of the bucket's tensors into its segment."""

def plan_gather(
    leaves: Any, dtensor_cls: Any, placement_classes: Any, budget: Any, floor: Any = 0, /
) -> list[tuple[Any, GatherPlan, list[Any], list[int], int]]:
    """Bucketed gather plans for the DTensor leaves, per mesh: (mesh, plan, signature, leaf_indices, budget)."""

def prepare_install(
    ctx: Any, optimizer: Any, split_dict: Any, expected: Any, aliased: Any = False, first_dtypes: Any = None, /
) -> Any:
    """The (state, param_groups) Optimizer.load_state_dict would install, without its quadratic scan."""

def rename_for_load(index: Any, state_dict: Any, strict: Any, rename: Any, want_local: Any, /) -> Any:
    """Key a canonical model state dict the way model.load_state_dict expects, without mutating it."""

def reshard_plan(global_shape: Any, src_mesh_shape: Any, src_placements: Any, src_ranks: Any, dst_mesh_shape: Any, dst_placements: Any, dst_ranks: Any, rank: Any, /) -> Any:
    """This rank's (local, recv, send) boxes for moving a tensor from one shard layout to another."""

def shape_mismatches(jobs: Any, tensor_cls: Any, /) -> Any:
    """Jobs whose template tensor has another shape than the value."""

def shard_layouts(global_shape: Any, mesh_shape: Any, placements: Any, coords: Any, /) -> Any:
    """(local_shape, blocks) of the shard at each mesh coordinate."""

def split_optim(index: Any, optimizers: Any, view: Any, expect_state: Any, /) -> Any:
    """Match a loaded-state view to each optimizer by FQN: (per-optimizer
    dicts, missing FQNs, unexpected keys, group conflicts)."""

def tensor_devices(ctx: Any, values: Any, /) -> Any:
    """Distinct devices of the tensors with dim() > 0 among values."""

def tensors_to(tensors: Any, device: Any, /) -> Any:
    """[t.to(device) for t in tensors]."""

def tree_leaves(ctx: Any, obj: Any, type_check: Any, /) -> Any:
    """The tensor leaves of a state-dict tree, in traversal order."""

def str_key_twins(state: Any, /) -> Any:
    """The keys of `state` whose value is a dict holding, at any depth through dicts, a key k that is not a str beside the str str(k) (what dcp.load leaves); [] when none does."""

def tree_paths(ctx: Any, obj: Any, /) -> Any:
    """Dotted paths of the tensor leaves, in tree_leaves order."""

def tree_rebuild(ctx: Any, obj: Any, new_leaves: Any, type_check: Any, /) -> Any:
    """Copy the containers of a tree around replacement tensor leaves."""

def unflatten_optim(index: Any, flat: Any, /) -> Any:
    """Parse a flattened optimizer dict into a loaded-state view."""

def unpack_bucket(
    buffer: Any, plan: GatherPlan, bucket: Any, empty: Any, device: Any, results: Any, offload: Any, cat: Any = None, /
) -> Any:
    """Assemble the full tensors of a gathered bucket into results."""

def view_from_nested(osd: Any, /) -> Any:
    """A nested optimizer dict as a loaded-state view."""

def walk_model(ctx: Any, model: Any, modifiers_name: Any, /) -> ModelIndex:
    """Walk `model` once and return a ModelIndex."""

def write_slots(slots: Any, values: Any, /) -> Any:
    """container[key] = value for each slot."""
