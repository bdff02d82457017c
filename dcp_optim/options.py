"""``StateDictOptions``: the same eight fields, order and defaults as torch's.

``_as_options`` accepts both this class and torch's own
``torch.distributed.checkpoint.state_dict.StateDictOptions`` (code that
builds options from torch keeps working).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StateDictOptions:
    """
    This dataclass specifies how get_state_dict/set_state_dict will work.

    - ``full_state_dict``: if this is set to True, all the tensors in the
      returned state_dict will be gathered. No ShardedTensor and DTensor
      will be in the returned state_dict.

    - ``cpu_offload``: offload all the tensors to cpu. To prevent CPU OOM, if
      ``full_state_dict`` is also true, then only the rank0 will get the
      state_dict and all other ranks will get empty state_dict.

    - ``ignore_frozen_params``: if the value is True, the returned state_dict
      won't contain any frozen parameters -- the ``requires_grad`` is False.
      The default value is False.

    - ``keep_submodule_prefixes`` (deprecated): when ``submodules`` is not None, this option
      indicates whether to keep the submodule prefixes from the state_dict keys.
      or example, if the submodule is ``module.pretrain`` and the full FQN of
      the parameter is ``pretrain.layer1.weight`` of the param. When this option
      is True, the parameter's key in the returned state_dict will be
      ``pretrain.layer1.weight``. If the options is False, the key will be
      ``layer1.weight``.
      Note that if ``keep_submodule_prefixes`` is False, there may be conflicted
      FQNs, hence there should be only one submodule in ``submodules``.

    - ``strict``: the ``strict`` option when ``set_state_dict`` calls
      model.load_state_dict().

    - ``broadcast_from_rank0``: when the option is True, rank0 should receive a
       full state_dict and will broadcast the tensors in the state_dict/
       optim_state_dict one by one to other ranks. Other ranks will receive
       the tensors and shard according to the local shards in the model and
       optimizer. ``full_state_dict`` must be set to True when using this option.
       This option currently only supports DTensor, not the legacy ShardedTensor.

    dcp_optim adds (after torch's fields, which keep their order and
    defaults):

    - ``verify_checksums``: for the ``set_*`` functions, a dict from
      ``dcp_optim.verify.checksums`` taken at save time (stored in the
      checkpoint, loaded with ``dcp_optim.verify.template()``).  After the
      load, the checksums of the loaded tensors are recomputed -- independent
      of sharding, one small collective -- and compared: a mismatch raises
      ``dcp_optim.verify.ChecksumMismatchError`` naming the FQN and state
      name, on every rank.  ``set_model_state_dict`` checks the model
      entries, ``set_optimizer_state_dict`` the optimizer entries,
      ``set_state_dict`` both.  The check runs after the load (a failed
      check does not undo it).  Getters ignore it.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"
    # --- dcp_optim's own options (after torch's eight) ---------------------
    verify_checksums: dict | None = None


_FIELD_NAMES = tuple(f.name for f in fields(StateDictOptions))
# torch's fields; ours follow them and default when torch's options are given
_TORCH_FIELD_NAMES = _FIELD_NAMES[: _FIELD_NAMES.index("verify_checksums")]


def _as_options(options: object | None) -> StateDictOptions:
    """Our options from ``None``, ours, or torch's StateDictOptions."""
    if options is None:
        return StateDictOptions()
    if type(options) is StateDictOptions:
        return options
    try:
        values = {name: getattr(options, name) for name in _TORCH_FIELD_NAMES}
        values.update(
            (name, getattr(options, name))
            for name in _FIELD_NAMES[len(_TORCH_FIELD_NAMES):]
            if hasattr(options, name)
        )
    except AttributeError as exc:
        from .errors import StateDictTypeError

        raise StateDictTypeError(
            f"options must be a StateDictOptions, not {type(options).__name__}"
        ) from exc
    return StateDictOptions(**values)
