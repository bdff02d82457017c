"""The torch floor (pyproject.toml: torch>=2.11) where CI runs 2.13 alone.

The whole suite runs on 2.11 and 2.12 only through ``make
test-torch-floor`` (docs/testing.md, "Supported versions"), which CI does
not run.  Two guards run everywhere:

* the names newer releases added that 2.11 lacks appear in the package
  only behind a ``getattr(obj, name, default)`` fallback (an AST scan of
  ``dcp_optim``);
* ``fsdp2_param_groups`` reads both FSDP2 layouts and raises on neither.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from dcp_optim._engine.distribute import fsdp2_param_groups

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "dcp_optim"

# name -> where torch 2.11 lacks it
MISSING_ON_FLOOR = {
    "all_gather_single": "torch.distributed (2.13+)",
    "reduce_scatter_single": "torch.distributed (2.13+)",
    "_fsdp_param_groups": "FSDP2's FSDPState (2.12+; 2.11 has _fsdp_param_group)",
    "ShardPlacementResult": "FSDP2's _fsdp_common (2.12+)",
}

def _uncovered(source: str, filename: str) -> set[str]:
    """Names of MISSING_ON_FLOOR that ``source`` uses other than as the
    attribute of a ``getattr(obj, name, default)`` (the fallback form:
    ``getattr(dist, "all_gather_single", None) or ...``): attribute
    accesses, imports, other string constants."""
    tree = ast.parse(source, filename=filename)
    guarded = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)):
            guarded.add(id(node.args[1]))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in guarded:
            name = node.value
        elif isinstance(node, ast.alias):
            name = node.name
        else:
            continue
        if name in MISSING_ON_FLOOR:
            found.add(name)
    return found


def test_names_the_floor_lacks_are_used_only_behind_a_fallback():
    uncovered = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in sorted(_uncovered(path.read_text(), str(path))):
            uncovered.append(f"{path.relative_to(PACKAGE).as_posix()}: {name} ({MISSING_ON_FLOOR[name]})")
    assert not uncovered, (
        "names torch 2.11 lacks, used without a getattr(obj, name, default) fallback "
        "(add one, and run make test-torch-floor): " + ", ".join(uncovered)
    )


@pytest.mark.parametrize("source, expected", [
    ("fn = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor", set()),
    ("dist.all_gather_single(out, inp)", {"all_gather_single"}),
    ("fn = getattr(dist, 'reduce_scatter_single')", {"reduce_scatter_single"}),
    ("from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult",
     {"ShardPlacementResult"}),
    ("groups = state._fsdp_param_groups", {"_fsdp_param_groups"}),
])
def test_the_scan_tells_a_fallback_from_a_bare_use(source, expected):
    assert _uncovered(source, "<case>") == expected


class _State213:
    def __init__(self, groups):
        self._fsdp_param_groups = groups


class _State211:
    def __init__(self, group):
        self._fsdp_param_group = group


def test_fsdp2_param_groups_reads_either_layout():
    a, b = object(), object()
    assert fsdp2_param_groups(_State213([a, b])) == [a, b]
    assert fsdp2_param_groups(_State213([])) == []
    assert fsdp2_param_groups(_State211(a)) == [a]
    assert fsdp2_param_groups(_State211(None)) == []


def test_fsdp2_param_groups_raises_on_another_layout():
    with pytest.raises(AttributeError, match="_fsdp_param_group"):
        fsdp2_param_groups(object())
