"""A hypothesis fuzzer of untrusted checkpoints: ``.metadata`` files
(byte mutations of a real one, pickle opcode soup, well-formed metadata
with drawn chunk layouts, saved paths and file names) and ``.distcp`` data
files (byte mutations).  Whatever is drawn, ``dcp_optim.Checkpoint`` and
``python -m dcp_optim inspect --values`` either read the checkpoint or
fail with a ``CheckpointError`` / exit status 2 and one bounded line --
never another exception, a traceback or an allocation past the address
space cap -- and a tensor is only returned when its chunks cover it
exactly (checked against a brute-force count of each element's chunks).

Fixed budget for CI: ``derandomize=True`` (the same examples every run),
``deadline=None``, 570 examples in all (well under a minute).
``DCP_OPTIM_FUZZ_CKPT_SCALE=n`` draws n times as many new ones."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import resource
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from dcp_optim import Checkpoint, CheckpointError
from dcp_optim.__main__ import main
from dcp_optim.tools.checkpoint import MAX_MESSAGE

pytestmark = pytest.mark.timeout(300)


#: DCP_OPTIM_FUZZ_CKPT_SCALE=n: n times the examples, newly drawn (not the
#: fixed ones CI runs)
SCALE = int(os.environ.get("DCP_OPTIM_FUZZ_CKPT_SCALE", "0"))


def fuzz(examples):
    return settings(max_examples=examples * max(SCALE, 1), deadline=None, derandomize=not SCALE,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "clean"
    state = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)},
        "optim": {"state": {"w": {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "extra": {"step": 1, "note": "demo"},
    }
    dcp.save(state, checkpoint_id=str(path))
    return str(path)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_scratch")


@pytest.fixture(scope="module", autouse=True)
def capped_address_space():
    """Any allocation from a drawn size fails loudly (MemoryError, not a
    CheckpointError: the test fails) rather than swapping."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    capped = vm < (64 << 30)  # not under ASan
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), hard))
    yield
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _fresh(clean, scratch):
    path = os.path.join(scratch, "ck")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(clean, path)
    return path


def _read_all(path, trusted=False):
    """'read' (every value read) or the CheckpointError; anything else fails."""
    try:
        ck = Checkpoint(path, trusted=trusted)
        values = ck.read([it.key for it in ck.items], show_progress=False)
    except CheckpointError as exc:
        text = str(exc)
        assert "\n" not in text and 0 < len(text) <= MAX_MESSAGE, text[:300]
        return exc
    return ck, values


def _cli(path):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["inspect", path, "--values", "-q"])
    text = err.getvalue()
    assert code in (0, 2), (code, text[-500:])
    if code == 2:
        assert text.startswith("dcp-optim inspect: error: ") and text.count("\n") == 1, text[-500:]
        assert len(text) <= MAX_MESSAGE + 100
    return code


def _mutate(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for where, kind, payload in edits:
        if not buf:
            buf += payload
            continue
        i = where % len(buf)
        if kind == "flip":
            buf[i] ^= 1 << (payload[0] % 8) if payload else 0xFF
        elif kind == "insert":
            buf[i:i] = payload
        elif kind == "delete":
            del buf[i:i + 1 + len(payload)]
        elif kind == "overwrite":
            buf[i:i + len(payload)] = payload
        else:  # repeat a slice (memo references, nested tuples)
            buf[i:i] = bytes(buf[i:i + 1 + len(payload)]) * (2 + len(payload))
    return bytes(buf)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(["flip", "insert", "delete", "overwrite",
                                                                    "repeat"]),
                           st.binary(max_size=8)), min_size=1, max_size=4)


@fuzz(120)
@given(edits=EDITS, via_cli=st.booleans())
def test_fuzz_metadata_bytes(clean, scratch, edits, via_cli):
    path = _fresh(clean, scratch)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    with open(meta, "wb") as f:
        f.write(_mutate(data, edits))
    if via_cli:
        _cli(path)
    else:
        _read_all(path)


# opcode snippets: small values, memo, containers, calls, the classes the
# metadata may name (and one it may not)
SNIPPETS = [b"K\x01", b"K\xff", b"J\xff\xff\xff\x7f", b"N", b"\x88", b"G?\xf0\x00\x00\x00\x00\x00\x00",
            b"X\x01\x00\x00\x00a", b"C\x02ab", b"\x8c\x01k", b"q\x00", b"q\x01", b"h\x00", b"h\x01", b"\x94",
            b"2", b"0", b"(", b")", b"]", b"}", b"\x8f", b"t", b"\x85", b"\x86", b"\x87", b"l", b"d",
            b"a", b"e", b"s", b"u", b"\x90", b"\x91", b"R", b"\x81", b"b",
            b"ctorch\nSize\n", b"ctorch\nfloat32\n", b"c__builtin__\nobject\n", b"ccopy_reg\n_reconstructor\n",
            b"ctorch.distributed.checkpoint.metadata\nMetadata\n",
            b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n",
            b"ctorch.distributed.checkpoint.metadata\nTensorStorageMetadata\n",
            b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n", b"cposix\nsystem\n"]


@fuzz(150)
@given(ops=st.lists(st.sampled_from(SNIPPETS), max_size=60), protocol=st.sampled_from([b"", b"\x80\x02", b"\x80\x04"]))
def test_fuzz_metadata_opcodes(clean, scratch, ops, protocol):
    path = _fresh(clean, scratch)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(protocol + b"".join(ops) + b".")
    outcome = _read_all(path)
    assert isinstance(outcome, CheckpointError)  # none of these is a whole Metadata


def _coverage(shape, chunks):
    """How many chunks hold each element (brute force)."""
    count = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes in chunks:
        region = count
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            region = region.narrow(d, o, n)
        region += 1
    return count


BOX = st.tuples(st.tuples(st.integers(0, 4), st.integers(0, 5)), st.tuples(st.integers(0, 4), st.integers(0, 5)))


@fuzz(120)
@given(shape=st.tuples(st.integers(0, 4), st.integers(0, 5)), boxes=st.lists(BOX, max_size=6),
       real=st.booleans(), protocol=st.integers(0, 5))
def test_fuzz_chunk_layouts(clean, scratch, shape, boxes, real, protocol):
    """Drawn chunk layouts of 'model.w' (the real (3, 4) chunk among them or
    not), each chunk backed by that chunk's storage: a value is returned
    only when every element is in exactly one chunk, and then it holds the
    saved data."""
    path = _fresh(clean, scratch)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own checkpoint
    meta = md.state_dict_metadata["model.w"]
    info = next(v for i, v in md.storage_data.items() if i.fqn == "model.w")
    chunks = [((0, 0), (3, 4))] if real else []
    chunks += [b for b in boxes if all(o + n <= d for o, n, d in zip(b[0], b[1], shape))]
    meta.size = torch.Size(shape)
    meta.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]
    for o, _ in chunks:
        md.storage_data.setdefault(MetadataIndex("model.w", torch.Size(o)), info)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f, protocol=protocol)
    for trusted in (False, True):
        outcome = _read_all(path, trusted)
        fits = all(o + n <= d for o, n, d in zip((0, 0), (3, 4), shape)) or not real
        exact = fits and bool((_coverage(shape, chunks) == 1).all()) if fits else False
        if isinstance(outcome, CheckpointError):
            assert not exact or "declares" in str(outcome) or "holds" in str(outcome), str(outcome)
            continue
        assert exact, (shape, chunks)
        value = outcome[1]["model.w"]
        assert value.shape == shape
        if chunks == [((0, 0), (3, 4))]:
            assert torch.equal(value, torch.arange(12.0).reshape(3, 4))


PATH_PART = st.one_of(st.sampled_from(["model", "optim", "extra", "w", "b", "state", "param_groups", "step"]),
                      st.integers(-3, 1 << 40))


@fuzz(100)
@given(paths=st.dictionaries(st.sampled_from(["model.w", "model.b", "extra.step", "extra.note",
                                              "optim.param_groups.0.lr", "optim.state.w.step"]),
                             st.lists(PATH_PART, max_size=4).map(tuple), max_size=4),
       files=st.dictionaries(st.sampled_from(["model.w", "extra.note", "model.b"]),
                             st.sampled_from(["__0_0.distcp", "nope.distcp", "../x", "/etc/passwd", "a\0b",
                                              ".metadata", "", "sub/../__0_0.distcp"]), max_size=2))
def test_fuzz_paths_and_files(clean, scratch, paths, files):
    path = _fresh(clean, scratch)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    md.planner_data.update(paths)
    for index, info in list(md.storage_data.items()):
        if index.fqn in files:
            md.storage_data[index] = _StorageInfo(files[index.fqn], info.offset, info.length)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    outcome = _read_all(path)
    if not isinstance(outcome, CheckpointError):
        for it in outcome[0].items:
            assert all(type(p) is str or 0 <= p < 70 for p in it.path), it.path
    assert _cli(path) in (0, 2)


@fuzz(80)
@given(edits=EDITS)
def test_fuzz_data_file(clean, scratch, edits):
    """Byte mutations of the .distcp file (torch.save archives of every
    entry): read, or a CheckpointError naming the file."""
    path = _fresh(clean, scratch)
    data_file = os.path.join(path, "__0_0.distcp")
    with open(data_file, "rb") as f:
        data = f.read()
    with open(data_file, "wb") as f:
        f.write(_mutate(data, edits))
    outcome = _read_all(path)
    if isinstance(outcome, CheckpointError):
        assert path in str(outcome)
