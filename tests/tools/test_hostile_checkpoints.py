"""Hostile checkpoints: ``python -m dcp_optim`` (inspect, diff, plan,
convert) and ``dcp_optim.Checkpoint`` never run code from a checkpoint,
and fail with a clear error -- no crash, no hang, no large allocation --
on truncated, corrupted and not-a-pickle metadata and on enormous declared
sizes.  Legitimate checkpoints read exactly as with torch's own
(unrestricted) unpickling.  The cases of bounded work (hash bombs, memo
references, unbounded reprs, chunk lists that leave memory unwritten,
saved list indices, symlinks out of the folder, the metadata size cap)
run the command line in a child process and bound its time and peak RSS
against a baseline run (see "bounded work and memory" below).

A marker file proves nothing ran: every payload creates it when unpickled
(shown by the ``trusted=True`` / ``--trust`` runs, which do run it)."""

from __future__ import annotations

import builtins
import collections
import io
import json
import os
import pickle
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import dcp_optim
from dcp_optim import Checkpoint, MalformedCheckpointError, NotLoaded, UnsafeCheckpointError
from dcp_optim.__main__ import main

from ..distributed import dist_cases_adoption as cases

# above the sum of a test's own bounds: test_hash_bombs_bounded runs five
# commands, each killed after ``measure``'s 60 s, and the first test
# starts the zygote (torch's import alone takes 20 s and more on a loaded
# machine)
pytestmark = pytest.mark.timeout(360)

ENTRY = "tests.distributed.dist_cases_adoption:plan_entry"
SYSTEM = f"{os.system.__module__}.{os.system.__name__}"  # what a pickle of os.system names


class RunsShell:
    """Unpickling it runs a shell command (os.system) creating ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


class RunsPython:
    """Unpickling it runs Python code (builtins.exec) creating ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').close()",)


def _save(path, *, evil=None):
    model, optim = cases.build(1, seed=3, sharded=False)
    cases.train(model, optim, 1)
    msd, osd = dcp_optim.get_state_dict(model, optim)
    extra = {"step": 1, "note": "demo"}
    if evil is not None:
        osd["param_groups"][0]["lr"] = evil
        extra["evil"] = evil
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=str(path))
    return str(path)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("hostile") / "clean")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own test checkpoint


def _write_metadata(path, obj=None, raw=None):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        if raw is not None:
            f.write(raw)
        else:
            pickle.dump(obj, f)


def _zip(records, compress=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as z:
        for name, data in records.items():
            z.writestr(name, data)
    return buf.getvalue()


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def all_commands(capsys, bad, clean, tmp_path, *extra):
    """Every command on ``bad``: (name, exit code, stdout, stderr)."""
    out_dir = tmp_path / f"converted{len(list(tmp_path.iterdir()))}"
    calls = {
        "inspect": ("inspect", bad, "-q"),
        "inspect --json": ("inspect", bad, "--json", "-q"),
        "inspect --metadata-only": ("inspect", bad, "--metadata-only", "-q"),
        "inspect --values": ("inspect", bad, "--values", "-q"),
        "diff A": ("diff", bad, clean, "-q"),
        "diff B --values": ("diff", clean, bad, "--values", "-q"),
        "plan": ("plan", bad, "--entry", ENTRY),
        "convert": ("convert", bad, str(out_dir), "--to", "flat", "-q"),
    }
    return {name: run(capsys, *argv, *extra) for name, argv in calls.items()}


# --- code in the metadata ---------------------------------------------------------------------


@pytest.mark.parametrize("payload", [RunsShell, RunsPython], ids=["os.system", "exec"])
@pytest.mark.parametrize("where", ["inside", "whole"])
def test_metadata_payload_never_runs(clean, tmp_path, capsys, payload, where):
    marker = tmp_path / "ran"
    bad = _copy(clean, tmp_path / "bad")
    if where == "inside":  # a legitimate Metadata carrying the payload
        md = _metadata(bad)
        md.planner_data["model.head.weight"] = payload(marker)
        _write_metadata(bad, md)
    else:
        _write_metadata(bad, payload(marker))
    name = SYSTEM if payload is RunsShell else "builtins.exec"
    with pytest.raises(UnsafeCheckpointError) as info:
        Checkpoint(bad)
    assert isinstance(info.value, pickle.UnpicklingError)
    assert name in str(info.value) and os.path.join(bad, ".metadata") in str(info.value)
    for what, (code, out, err) in all_commands(capsys, bad, clean, tmp_path).items():
        assert code == 2 and out == "", what
        assert err.startswith(f"dcp-optim {what.split()[0]}: error: {bad}/.metadata: ")
        assert name in err and "--trust" in err, err
    assert not list(tmp_path.glob("converted*"))
    assert not marker.exists()
    # what the restricted reader prevents: torch's own unpickling runs it
    try:
        Checkpoint(bad, trusted=True)
    except dcp_optim.CheckpointError:
        pass  # the payload's return value is no Metadata
    assert marker.exists()


# --- code in a non-tensor entry ---------------------------------------------------------------------


def test_entry_payload_never_runs(tmp_path, capsys, clean):
    marker = tmp_path / "ran"
    bad = _save(tmp_path / "bad", evil=RunsShell(marker))
    shown = f"<object of class {SYSTEM}, not loaded>"
    ck = Checkpoint(bad)
    value = ck.value("extra.evil")
    assert isinstance(value, NotLoaded) and repr(value) == shown
    assert ck.value("optim.param_groups.0.lr") == value  # the same pickled bytes
    results = all_commands(capsys, bad, clean, tmp_path)
    code, out, _ = results["inspect"]
    assert code == 0
    assert any(line.split()[:2] == ["extra.evil", "object"] and shown in line for line in out.splitlines())
    assert f"lr={shown}" in out
    code, out, _ = results["inspect --json"]
    report = json.loads(out)
    assert {e["key"]: e["value"] for e in report["other"]}["extra.evil"] == shown
    assert report["optimizers"][0]["param_groups"][0]["hyperparameters"]["lr"] == shown
    code, out, _ = results["diff A"]
    assert code == 1 and f"lr: {shown} vs 0.01" in out and "extra.evil: only in A (object)" in out
    assert results["diff B --values"][0] == 1
    code, out, _ = results["plan"]
    assert code in (0, 1) and f"lr 0.01 -> {shown}" in out
    code, out, err = results["convert"]  # cannot write what it did not read
    assert code == 2 and out == ""
    assert err.startswith(f"dcp-optim convert: error: {bad}/__0_0.distcp: '")
    assert f"pickles {SYSTEM}, which the safe reader does not unpickle" in err and "--trust" in err
    with pytest.raises(UnsafeCheckpointError, match="'extra.evil' pickles"):
        Checkpoint(bad).read(["extra.evil"], placeholders=False)
    assert not marker.exists()
    # --trust opts back into full unpickling: the payload runs
    code, out, _ = run(capsys, "inspect", bad, "--trust", "-q")
    assert code == 0 and marker.exists()


# --- truncated, corrupted, not a pickle -------------------------------------------------------------


NOT_PICKLES = ["empty", "truncated to 1 byte", "truncated to half", "truncated by 1 byte", "text", "json",
               "zeros", "bad opcode", "a dict", "a zip"]


def _not_pickles(clean_bytes):
    return {
        "empty": b"",
        "truncated to 1 byte": clean_bytes[:1],
        "truncated to half": clean_bytes[: len(clean_bytes) // 2],
        "truncated by 1 byte": clean_bytes[:-1],
        "text": b"this is not a pickle\n",
        "json": json.dumps({"state_dict_metadata": {}}).encode(),
        "zeros": bytes(4096),
        "bad opcode": clean_bytes[:2] + b"\xff" + clean_bytes[3:],
        "a dict": pickle.dumps({"state_dict_metadata": {}}),
        "a zip": _zip({"archive/data.pkl": pickle.dumps(1, 2)}),
    }


@pytest.mark.parametrize("case", NOT_PICKLES)
def test_metadata_not_a_checkpoint_pickle(clean, tmp_path, capsys, case):
    with open(os.path.join(clean, ".metadata"), "rb") as f:
        raw = _not_pickles(f.read())[case]
    bad = _copy(clean, tmp_path / "bad")
    _write_metadata(bad, raw=raw)
    with pytest.raises(MalformedCheckpointError, match="cannot read the checkpoint metadata: "):
        Checkpoint(bad)
    for what, (code, out, err) in all_commands(capsys, bad, clean, tmp_path).items():
        assert code == 2 and out == "", what
        assert err.startswith(f"dcp-optim {what.split()[0]}: error: {bad}/.metadata: cannot read the "
                              "checkpoint metadata: "), err


@pytest.mark.parametrize("kind", ["directory", "fifo", "/dev/zero"])
def test_metadata_not_a_regular_file(clean, tmp_path, capsys, kind):
    bad = _copy(clean, tmp_path / "bad")
    meta = os.path.join(bad, ".metadata")
    os.remove(meta)
    if kind == "directory":
        os.mkdir(meta)
    elif kind == "fifo":
        os.mkfifo(meta)  # opening it for reading would block
    else:
        os.symlink("/dev/zero", meta)  # reading it would never end
    with pytest.raises(MalformedCheckpointError, match="not a regular file"):
        Checkpoint(bad)
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        assert code == 2 and "cannot read the checkpoint metadata: not a regular file" in err, what


def test_metadata_byte_flips(clean, tmp_path):
    """Every corruption of one byte reads or fails with a CheckpointError."""
    with open(os.path.join(clean, ".metadata"), "rb") as f:
        raw = f.read()
    bad = _copy(clean, tmp_path / "bad")
    outcomes = collections.Counter()
    for pos in range(0, len(raw), max(1, len(raw) // 150)):
        for flip in (0x01, 0x80):
            _write_metadata(bad, raw=raw[:pos] + bytes([raw[pos] ^ flip]) + raw[pos + 1:])
            try:
                ck = Checkpoint(bad)
                ck.read(["extra.step", "optim.param_groups.0.lr"])
                outcomes["read"] += 1
            except dcp_optim.CheckpointError as exc:
                outcomes[type(exc).__name__] += 1
    assert outcomes["MalformedCheckpointError"] > 30, outcomes
    assert set(outcomes) <= {"read", "MalformedCheckpointError", "UnsafeCheckpointError", "CheckpointError"}


def _with_entry(clean, dst, key, blob, offset=None):
    """A copy of ``clean`` whose entry ``key`` (a tensor's chunk at
    ``offset``) holds ``blob``."""
    bad = _copy(clean, dst)
    with open(os.path.join(bad, "extra.distcp"), "wb") as f:
        f.write(blob)
    md = _metadata(bad)
    md.storage_data[MetadataIndex(key, offset)] = _StorageInfo("extra.distcp", 0, len(blob))
    _write_metadata(bad, md)
    return bad


class _Storage:
    pass


class _TensorPickler(pickle.Pickler):
    """Pickles like torch.save: _Storage objects become persistent ids."""

    def __init__(self, file, numel):
        super().__init__(file, protocol=2)
        self.numel = numel

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", self.numel)
        return None


class _Tensor:
    def __init__(self, size, stride):
        self.size, self.stride = size, stride

    def __reduce__(self):
        from torch._utils import _rebuild_tensor_v2

        return _rebuild_tensor_v2, (_Storage(), 0, self.size, self.stride, False, collections.OrderedDict())


def _torch_save_blob(obj, *, numel=2, record=8):
    buf = io.BytesIO()
    _TensorPickler(buf, numel).dump(obj)
    return _zip({"archive/data.pkl": buf.getvalue(), "archive/byteorder": b"little",
                 "archive/data/0": bytes(record)})


ENTRY_CASES = ["not an archive", "truncated archive", "compressed record", "truncated pickle",
               "nested too deep", "shared containers", "huge int", "storage bigger than its record",
               "tensor bigger than its storage", "negative stride"]


def _entry_case(case):
    if case == "not an archive":
        return b"garbage" * 10
    if case == "truncated archive":
        return torch_blob()[:-30]
    if case == "compressed record":  # deflate: the declared size is not bounded by the entry
        return _zip({"archive/data.pkl": pickle.dumps(1, 2) + bytes(10**6)}, zipfile.ZIP_DEFLATED)
    if case == "truncated pickle":
        return _zip({"archive/data.pkl": pickle.dumps([1, 2, 3], 2)[:-3]})
    if case == "nested too deep":  # 5000 nested lists: beyond Python's recursion limit when printed
        return _zip({"archive/data.pkl": b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."})
    if case == "shared containers":  # L(i) = (L(i-1), L(i-1)): 2**64 leaves when printed
        return _zip({"archive/data.pkl": b"\x80\x02K\x01" + b"q\x000h\x00h\x00\x86" * 64 + b"."})
    if case == "huge int":  # 8 million bits: too long to print
        return _zip({"archive/data.pkl": b"\x80\x02\x8b" + struct.pack("<i", 10**6) + b"\x01" * 10**6 + b"."})
    if case == "storage bigger than its record":
        return _torch_save_blob(_Tensor((2,), (1,)), numel=1 << 50)
    if case == "tensor bigger than its storage":
        return _torch_save_blob(_Tensor((1 << 40,), (1,)))
    assert case == "negative stride"
    return _torch_save_blob(_Tensor((2,), (-1,)))


def torch_blob():
    buf = io.BytesIO()
    torch.save({"a": (torch.ones(2), 1.5)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("case", ENTRY_CASES)
def test_corrupt_entry(clean, tmp_path, capsys, case):
    bad = _with_entry(clean, tmp_path / "bad", "extra.note", _entry_case(case))
    with pytest.raises(MalformedCheckpointError, match="extra.distcp: cannot read 'extra.note': "):
        Checkpoint(bad).read(["extra.note"])
    for what, (code, out, err) in all_commands(capsys, bad, clean, tmp_path).items():
        if what == "inspect --metadata-only":
            assert code == 0, err
            continue
        assert code == 2 and out == "", what
        assert "extra.distcp: cannot read 'extra.note': " in err, (what, err)


@pytest.mark.parametrize("payload", ["os.system", "bytearray(2**40)", "not a tensor", "wrong shape"])
def test_tensor_chunk_payloads(clean, tmp_path, capsys, bounded_memory, payload):
    """Tensor data goes through the same restricted unpickler (torch.load's
    weights_only would call bytearray(2**40))."""
    marker = tmp_path / "ran"
    obj = {"os.system": RunsShell(marker), "not a tensor": [1.5],
           "wrong shape": torch.zeros(2, 2)}.get(payload)
    if payload == "bytearray(2**40)":
        data = b"\x80\x02c__builtin__\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85R."
        blob = _zip({"archive/data.pkl": data})
    else:
        buf = io.BytesIO()
        torch.save(obj, buf)
        blob = buf.getvalue()
    bad = _with_entry(clean, tmp_path / "bad", "model.head.weight", blob, torch.Size([0, 0]))
    error = UnsafeCheckpointError if payload == "os.system" else MalformedCheckpointError
    with pytest.raises(error, match="extra.distcp: .*'model.head.weight'"):
        Checkpoint(bad).value("model.head.weight")
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        if what in ("inspect --values", "diff B --values", "convert"):
            assert code == 2 and "'model.head.weight'" in err, (what, err)
        else:
            assert code in (0, 1), (what, err)
    assert not marker.exists()


@pytest.mark.parametrize("params", ["payload", "an int"])
def test_group_params_unreadable(clean, tmp_path, capsys, params):
    """A nested param group's 'params' list decides group membership: when
    it is not loaded, or not a list, the commands that need it stop."""
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(RunsShell(marker) if params == "payload" else 5, buf)
    bad = _with_entry(clean, tmp_path / "bad", "optim.param_groups.0.params", buf.getvalue())
    error = UnsafeCheckpointError if params == "payload" else MalformedCheckpointError
    text = f"pickles {SYSTEM}" if params == "payload" else "is a int, not a list of parameters"
    with pytest.raises(error, match=f"{bad}: 'optim.param_groups.0.params' {text}"):
        ck = Checkpoint(bad)
        ck.optimizers[0].logical_groups(ck.read([it.key for it in ck.optimizers[0].group_items()]))
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        if what == "inspect --metadata-only":
            assert code == 0
        elif what == "convert" and params == "payload":
            assert code == 2 and "'optim.param_groups.0.params' pickles" in err
        elif what != "convert":  # converting the nested 'params' list needs no list
            assert code == 2 and f"'optim.param_groups.0.params' {text}" in err, (what, err)
    assert not marker.exists()


def test_legit_tensor_in_an_entry(clean, tmp_path):
    """A tuple of tensors (a non-tensor entry holding tensors) reads as with
    torch.load."""
    bad = _with_entry(clean, tmp_path / "ok", "extra.note", torch_blob())
    got = Checkpoint(bad).value("extra.note")
    want = Checkpoint(bad, trusted=True).value("extra.note")
    assert list(got) == ["a"] and got["a"][1] == 1.5
    assert torch.equal(got["a"][0], want["a"][0]) and got["a"][0].dtype == want["a"][0].dtype


# --- enormous declared sizes --------------------------------------------------------------------


@pytest.fixture
def bounded_memory():
    """Python allocations traced (peak checked) and the address space capped
    at 1 GiB above the current size (so any allocation from a declared size
    fails loudly; not under ASan, whose shadow memory is huge)."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    capped = vm < (64 << 30)
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), hard))
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak < (64 << 20), f"peak Python allocation {peak} bytes"
    finally:
        tracemalloc.stop()
        if capped:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _big_tensor(md, key, size, dtype=torch.float32):
    md.state_dict_metadata[key] = TensorStorageMetadata(
        TensorProperties(dtype=dtype), torch.Size(size),
        [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))])
    for index in [i for i in md.storage_data if i.fqn == key]:
        info = md.storage_data.pop(index)
    md.storage_data[MetadataIndex(key, torch.Size([0] * len(size)))] = info


def test_enormous_tensor_sizes(clean, tmp_path, capsys, bounded_memory):
    # 4 TiB declared, a few bytes stored: listed, never allocated
    bad = _copy(clean, tmp_path / "bad")
    md = _metadata(bad)
    _big_tensor(md, "model.head.weight", (1 << 40,))
    _write_metadata(bad, md)
    ck = Checkpoint(bad)
    assert ck.by_key["model.head.weight"].nbytes == 1 << 42
    with pytest.raises(MalformedCheckpointError, match=r"'model.head.weight': chunk at \(0,\) declares "
                       r"4398046511104 bytes, its storage holds \d+"):
        ck.read(["model.head.weight"])
    results = all_commands(capsys, bad, clean, tmp_path)
    assert results["inspect"][0] == 0 and "(1099511627776,)" in results["inspect"][1]
    assert results["inspect --metadata-only"][0] == 0
    assert results["diff A"][0] == 1 and "shape (1099511627776,) vs (3, 8)" in results["diff A"][1]
    assert results["plan"][0] == 1 and "shape: checkpoint (1099511627776,), live (3, 8)" in results["plan"][1]
    for what in ("inspect --values", "convert"):
        code, out, err = results[what]
        assert code == 2 and "cannot read 'model.head.weight': chunk at (0,) declares" in err, (what, err)
    # more bytes than any tensor can hold: the metadata itself is refused
    md = _metadata(bad)
    _big_tensor(md, "model.head.weight", (1 << 31, 1 << 31, 1 << 31))
    _write_metadata(bad, md)
    with pytest.raises(MalformedCheckpointError, match="'model.head.weight' declares .* more bytes than"):
        Checkpoint(bad)
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        assert code == 2 and "more bytes than a tensor can hold" in err, what


def test_enormous_storage_lengths(clean, tmp_path, capsys, bounded_memory):
    bad = _copy(clean, tmp_path / "bad")
    md = _metadata(bad)
    index = next(i for i in md.storage_data if i.fqn == "extra.note")
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 1 << 62)
    _write_metadata(bad, md)
    with pytest.raises(MalformedCheckpointError, match=f"cannot read 'extra.note': it declares {1 << 62} bytes"):
        Checkpoint(bad).read(["extra.note"])
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        if what != "inspect --metadata-only":
            assert code == 2 and f"cannot read 'extra.note': it declares {1 << 62} bytes" in err, what


@pytest.mark.parametrize("stream", [
    b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"xx.",  # BINBYTES8
    b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"xx.",  # BINUNICODE8
    b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"xx.",  # BYTEARRAY8
    b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N.",  # FRAME
    b"\x80\x04N" + b"r\xff\xff\xff\xff" + b".",  # LONG_BINPUT 2**32-1 (a memo list would be 32 GiB)
    b"\x80\x02\x8b" + struct.pack("<i", (1 << 31) - 1) + b"xx.",  # LONG4
    b"\x80\x02}K\x01" + b"\x85" * 10**6 + b"Ns.",  # a dict key nested 10**6 deep (hashing it overflows the C stack)
], ids=["BINBYTES8", "BINUNICODE8", "BYTEARRAY8", "FRAME", "LONG_BINPUT", "LONG4", "deep tuple key"])
def test_enormous_lengths_in_the_pickle(clean, tmp_path, capsys, bounded_memory, stream):
    bad = _copy(clean, tmp_path / "bad")
    _write_metadata(bad, raw=stream)
    with pytest.raises(MalformedCheckpointError, match="cannot read the checkpoint metadata: "):
        Checkpoint(bad)
    for what, (code, _, err) in all_commands(capsys, bad, clean, tmp_path).items():
        assert code == 2 and "cannot read the checkpoint metadata: " in err, what
    # the same streams inside a non-tensor entry (NONE, LONG_BINPUT: None,
    # fine as a value)
    bad = _with_entry(clean, tmp_path / "entry", "extra.note", _zip({"archive/data.pkl": stream}))
    if stream[2:3] == b"N":
        assert Checkpoint(bad).value("extra.note") is None
    else:
        with pytest.raises(MalformedCheckpointError, match="cannot read 'extra.note': "):
            Checkpoint(bad).read(["extra.note"])


# --- legitimate checkpoints read exactly as before -----------------------------------------------------


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                b.view(-1).view(torch.uint8) if b.numel() else b))
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def _legit_states():
    """State dicts of every kind the tests write, one process."""

    def trained():
        model, optim = cases.build(1, seed=3, sharded=False)
        cases.train(model, optim, 2)
        return model, optim

    def nested():
        model, optim = trained()
        msd, osd = dcp_optim.get_state_dict(model, optim)
        return {"model": msd, "optim": osd, "extra": {"step": 2, "note": "demo"}}

    def flat():
        model, optim = trained()
        msd, osd = dcp_optim.get_state_dict(
            model, optim, options=dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True))
        return {"app": {"model": msd, "optim": osd}}

    def titan():  # torchtitan: model FQNs at the top level, flat optimizer, schedulers, train state
        model, optim = cases.build(1, seed=3, sharded=False)
        scheds = [torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)]
        scheds.append(torch.optim.lr_scheduler.SequentialLR(optim, [
            torch.optim.lr_scheduler.LinearLR(optim, 0.5, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(optim, 10)], milestones=[2]))
        scheds.append(torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.1, total_steps=10))
        scheds.append(torch.optim.lr_scheduler.ReduceLROnPlateau(optim))
        scheds.append(torch.optim.lr_scheduler.CyclicLR(optim, 0.001, 0.01))
        cases.train(model, optim, 2)
        for s in scheds[:3]:
            s.step()
        msd, osd = dcp_optim.get_state_dict(
            model, optim, options=dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True))
        state = dict(msd)
        state["optimizer"] = osd
        state["lr_schedulers"] = {f"sched_{i}": s.state_dict() for i, s in enumerate(scheds)}
        state["train_state"] = {"step": 2, "global_avg_losses": [1.5, 1.25], "ntokens": 10**12}
        return state

    def tensor_hyperparameters():  # tensor lr, tensor betas (a tuple of tensors), empty group
        model, optim = cases.build(1, seed=3, sharded=False)
        optim.add_param_group({"params": [], "lr": 0.5})
        for group in optim.param_groups[:2]:
            group["lr"] = torch.tensor(0.01)
            group["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
        cases.train(model, optim, 2)
        nested = dcp_optim.get_state_dict(model, optim)
        flat = dcp_optim.get_state_dict(
            model, optim, options=dcp_optim.StateDictOptions(flatten_optimizer_state_dict=True))
        return {"n": {"model": nested[0], "optim": nested[1]}, "f": {"optim": flat[1]},
                "misc": {"s": {1, 2}, "c": 1j, "b": b"xy", "dt": torch.bfloat16, "dev": torch.device("cpu"),
                         "size": torch.Size([2, 3]), "od": collections.OrderedDict(a=1), "none": None,
                         "nan": float("nan"), "fs": frozenset({"x"})}}

    return {"nested": nested, "flat_app": flat, "torchtitan": titan, "tensor_hyper": tensor_hyperparameters}


def assert_reads_as_trusted(path, capsys=None):
    safe, trusted = Checkpoint(path), Checkpoint(path, trusted=True)
    safe.metadata.storage_meta.load_id = trusted.metadata.storage_meta.load_id = None
    assert safe.metadata == trusted.metadata
    assert [(i.key, i.path, i.meta) for i in safe.items] == [(i.key, i.path, i.meta) for i in trusted.items]
    assert [(m.name, list(m.entries)) for m in safe.models] == [(m.name, list(m.entries)) for m in trusted.models]
    assert [(o.name, o.layout, {f: list(s) for f, s in o.state.items()}) for o in safe.optimizers] == [
        (o.name, o.layout, {f: list(s) for f, s in o.state.items()}) for o in trusted.optimizers]
    keys = [it.key for it in safe.items]
    a, b = safe.read(keys), trusted.read(keys)
    assert not any(isinstance(v, NotLoaded) for v in a.values())
    bad = [k for k in keys if not _same(a[k], b[k])]
    assert not bad, bad
    if capsys is not None:
        outputs = [run(capsys, "inspect", path, "--json", "--values", "-q", *t) for t in ((), ("--trust",))]
        assert outputs[0][0] == 0 and outputs[0] == outputs[1]
    return len(keys)


@pytest.mark.parametrize("kind", list(_legit_states()))
def test_legit_checkpoints_read_as_before(tmp_path, capsys, kind):
    state = _legit_states()[kind]()
    dcp.save(state, checkpoint_id=str(tmp_path / kind))
    assert assert_reads_as_trusted(str(tmp_path / kind), capsys) > 10


def save_distributed_kinds(rank, ws, base):
    """Rank function: the sharded checkpoints the distributed tests write."""
    from ..distributed import dist_cases, dist_cases_fsdp1, dist_cases_pp

    for kind in ("fsdp1", "fsdp1_orig", "fsdp2"):
        dist_cases_fsdp1.save(rank, ws, os.path.join(base, kind), kind)
    dist_cases.dcp_save(rank, ws, os.path.join(base, "tp"), "tp", False)
    dist_cases.dcp_save(rank, ws, os.path.join(base, "fsdp2_flat"), "fsdp2", True)
    dist_cases_pp.save(rank, ws, os.path.join(base, "pipeline"), "2x1")
    return "saved"


@pytest.mark.dist
def test_legit_sharded_checkpoints_read_as_before(tmp_path, capsys):
    """FSDP1 (ShardedTensor; flat and original params), FSDP2 and TP
    (DTensor; nested and flattened) and a two-stage pipeline (flattened,
    an empty group's reserved keys), saved by 2 gloo ranks."""
    from ..support.harness import run_ranks

    assert run_ranks(2, save_distributed_kinds, str(tmp_path)) == ["saved", "saved"]
    kinds = ["fsdp1", "fsdp1_orig", "fsdp2", "tp", "fsdp2_flat", "pipeline"]
    for kind in kinds:
        assert assert_reads_as_trusted(str(tmp_path / kind), capsys) > 10, kind


# --- bounded work and memory, measured out of process ------------------------------------------------
#
# Each hostile case runs the command line in a process of its own, next
# to a baseline run of the same command on the clean checkpoint in the
# same test: it must end with exit status 2 and one line naming the file and
# the cause, within 5 s and 300 MB of peak RSS above the baseline (a hash
# bomb, or a list grown to 300 million entries, took a minute and
# gigabytes).  Time is checked twice: CPU time (user + system, of the
# child alone) within 5 s of the baseline's -- the bound that holds
# whatever the load -- and wall time within 5 s of the baseline's times
# the slowdown the runs saw for want of a core (wall time over CPU time,
# the larger of the two runs', at most 10): on an idle machine that is the
# 5 s of the issue; on a loaded one (several test runs sharing 2 cores,
# the load changing between the two runs) it grows with the load instead
# of failing at random, and a hang still fails (killed at 60 s).

REPO = os.path.dirname(os.path.dirname(os.path.abspath(dcp_optim.__file__)))
WALL_MARGIN_S, RSS_MARGIN = 5.0, 300 << 20
# Under AddressSanitizer (make test-asan preloads libasan; the interpreter
# then allocates through malloc with redzones, at about 2-3x the memory and
# time) the same work costs more: the margins scale by 3 there.
if "libasan" in os.environ.get("LD_PRELOAD", ""):
    WALL_MARGIN_S, RSS_MARGIN = 3 * WALL_MARGIN_S, 3 * RSS_MARGIN


# The commands run in children forked from one long-lived process (the
# "zygote", started once per test session) that has imported the command
# line and torch: the same ``main(argv)`` as ``python -m dcp_optim`` runs,
# without the interpreter start and torch's import (4-6 s a command on this
# machine, 23 commands).  Each child's exit status, wall and CPU time and
# peak RSS are its own (wait4); a forked child's peak RSS starts from the
# zygote's RSS at the fork, which every command, the baselines included,
# shares, so the margins above a baseline are what a command adds.
ZYGOTE = """
import json, os, select, signal, sys, time, traceback
from dcp_optim.__main__ import main
import torch.distributed.checkpoint  # what the commands import on their first call
report = sys.stdout
for line in sys.stdin:
    argv, out, err, timeout = json.loads(line)
    report.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], timeout)[0]:
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    os.close(pidfd)
    code = os.waitstatus_to_exitcode(status)
    report.write(json.dumps([-9 if code == -signal.SIGKILL else code, time.monotonic() - start,
                             usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024]) + "\\n")
    report.flush()
"""


@pytest.fixture(scope="module")
def zygote():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=REPO, env=env, text=True)
    yield proc
    proc.stdin.close()  # its loop ends
    proc.wait(60)
    proc.stdout.close()


def measure(zygote, *argv, timeout=60.0):
    """``python -m dcp_optim *argv``, as a child of ``zygote``: (exit
    status, stdout, stderr, (wall seconds, CPU seconds), peak RSS in bytes),
    of that child alone.  Killed (exit status -9) after ``timeout``."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        zygote.stdin.write(json.dumps([list(map(str, argv)), out, err, timeout]) + "\n")
        zygote.stdin.flush()
        reply = zygote.stdout.readline()
        assert reply, f"the zygote ended (exit status {zygote.poll()})"
        code, wall, cpu, rss = json.loads(reply)
        if code == -9:
            return -9, "", "killed", (timeout, timeout), 0
        with open(out, "rb") as o, open(err, "rb") as e:
            return code, o.read().decode(), e.read().decode(), (wall, cpu), rss


def assert_bounded(zygote, baseline, bad_argv, *needles):
    """Run ``bad_argv``; exit 2, one line of stderr holding ``needles``, in
    bounded time and memory above ``baseline`` (a ``measure`` result)."""
    code, out, err, (wall, cpu), rss = measure(zygote, *bad_argv)
    _, _, _, (base_wall, base_cpu), base_rss = baseline
    # how much slower than its CPU time a run went for want of a core (the
    # baseline's, or this run's when the load rose in between), at most 10:
    # a process blocked off the CPU still fails
    slowdown = min(10.0, max(1.0, base_wall / max(base_cpu, 0.1), wall / max(cpu, 0.1)))
    what = f"{' '.join(map(str, bad_argv))}: exit {code}, {wall:.1f} s wall, {cpu:.1f} s CPU (baseline " \
           f"{base_wall:.1f} s, {base_cpu:.1f} s), {rss >> 20} MB (baseline {base_rss >> 20} MB), " \
           f"stderr {err[-2000:]!r}"
    assert code == 2 and out == "", what
    assert err.endswith("\n") and err.count("\n") == 1 and len(err) < 2200, what
    assert err.startswith(f"dcp-optim {bad_argv[0]}: error: "), what
    assert "Traceback" not in err, what
    for needle in needles:
        assert needle in err, (needle, what)
    assert cpu <= base_cpu + WALL_MARGIN_S, what
    assert wall <= base_wall + WALL_MARGIN_S * slowdown, what
    assert rss <= base_rss + RSS_MARGIN, what
    return err


def _hash_bomb(use, levels=60):
    """A tuple of two references to the level below, ``levels`` deep (2**60
    nodes in 1 KB), used as a dict key or as the callable of a call."""
    bomb = b"K\x01" + b"q\x00h\x00h\x00\x86" * levels  # PUT 0, GET 0, GET 0, TUPLE2
    return {
        "SETITEM": b"\x80\x02}" + bomb + b"K\x00s.",
        "SETITEMS": b"\x80\x02}(" + bomb + b"K\x00u.",
        "REDUCE": b"\x80\x02" + bomb + b")R.",
        "NEWOBJ": b"\x80\x02" + bomb + b")\x81.",
    }[use]


@pytest.mark.process_bounds
def test_hash_bombs_bounded(zygote, clean, tmp_path):
    baseline = measure(zygote, "inspect", clean, "-q")
    assert baseline[0] == 0, baseline[2]
    for use in ("SETITEM", "SETITEMS", "REDUCE", "NEWOBJ"):
        bad = _copy(clean, tmp_path / use)
        _write_metadata(bad, raw=_hash_bomb(use))
        assert len(_hash_bomb(use)) < 1024
        assert_bounded(zygote, baseline, ("inspect", bad, "-q"), f"{bad}/.metadata: cannot read the checkpoint "
                       "metadata: more work than the budget of")


def _nested_refs(levels, refs, leaf):
    value = leaf
    for _ in range(levels):
        value = [value] * refs
    return value


@pytest.mark.process_bounds
def test_unbounded_repr_and_memo_multiplication_bounded(zygote, clean, tmp_path):
    """A path nested as a list referenced 10 times per level, 30 levels
    deep (its repr in an error message would be 10**30 elements), and a
    20 MB metadata whose chunk list is one chunk repeated 10 million times."""
    baseline = measure(zygote, "inspect", clean, "-q")
    assert baseline[0] == 0, baseline[2]
    bad = _copy(clean, tmp_path / "repr")
    md = _metadata(bad)
    md.planner_data["model.head.weight"] = ("model", _nested_refs(30, 10, "x"))
    _write_metadata(bad, md)
    assert os.path.getsize(os.path.join(bad, ".metadata")) < 64 << 10
    assert_bounded(zygote, baseline, ("inspect", bad, "-q"), f"{bad}/.metadata: cannot read the checkpoint metadata: ")
    bad = _copy(clean, tmp_path / "memo")
    md = _metadata(bad)
    meta = md.state_dict_metadata["model.head.weight"]
    meta.chunks = meta.chunks * 10_000_000
    _write_metadata(bad, md)
    assert os.path.getsize(os.path.join(bad, ".metadata")) > 20_000_000
    assert_bounded(zygote, baseline, ("inspect", bad, "-q"), f"{bad}/.metadata: cannot read the checkpoint metadata: "
                   "more work than the budget of")


def _declare(bad, key, size, chunks):
    """``key`` declared as ``size`` with chunks (offsets, sizes) all
    backed by the real chunk's storage."""
    md = _metadata(bad)
    meta = md.state_dict_metadata[key]
    real = meta.chunks[0]
    meta.size = torch.Size(size)
    meta.chunks = [real if (tuple(o), tuple(s)) == (tuple(real.offsets), tuple(real.sizes))
                   else ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    info = next(v for i, v in md.storage_data.items() if i.fqn == key)
    for o, _ in chunks:
        md.storage_data.setdefault(MetadataIndex(key, torch.Size(o)), info)
    _write_metadata(bad, md)


UNCOVERED = {
    # the real (3, 8) chunk listed 100 times for a (300, 8) tensor: rows 3
    # to 299 were torch.empty's memory
    "duplicates": ((300, 8), [((0, 0), (3, 8))] * 100, "chunk at (0, 0) of size (3, 8) is listed twice"),
    # a small data file declaring a large tensor the same way
    "duplicates, large": ((3 * 10**5, 8), [((0, 0), (3, 8))] * 10**5, "is listed twice"),
    "gap": ((300, 8), [((0, 0), (3, 8))], "elements [3:300, 0:8] are in no chunk"),
    "overlap": ((4, 8), [((0, 0), (3, 8)), ((1, 0), (3, 8))],
                "chunk at (1, 0) of size (3, 8) overlaps the chunk at (0, 0) of size (3, 8)"),
}


@pytest.mark.process_bounds
def test_uncovered_tensors_bounded(zygote, clean, tmp_path):
    """A tensor is returned only when every element was written from the
    checkpoint: duplicate, overlapping and missing chunks are refused (both
    modes), naming the region."""
    baseline = measure(zygote, "inspect", clean, "--values", "-q")
    assert baseline[0] == 0, baseline[2]
    for case, (size, chunks, text) in UNCOVERED.items():
        bad = _copy(clean, tmp_path / case.replace(", ", "_"))
        _declare(bad, "model.head.weight", size, chunks)
        for trusted in (False, True):
            with pytest.raises(MalformedCheckpointError, match=re.escape(text)):
                Checkpoint(bad, trusted=trusted)
        assert_bounded(zygote, baseline, ("inspect", bad, "--values", "-q"),
                       f"{bad}/.metadata: malformed checkpoint metadata: entry 'model.head.weight': ", text)


def test_chunk_cover_of_grids():
    """The cover check accepts exact grids (row, column, 2-D, uneven, empty
    chunks) and names what is wrong otherwise."""
    from dcp_optim.tools.checkpoint import _cover_problem

    def problem(shape, boxes, budget=None):
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        return _cover_problem(shape, chunks, [budget])

    assert problem((6, 4), [((r, c), (2, 2)) for r in (0, 2, 4) for c in (0, 2)]) is None
    assert problem((5, 4), [((0, 0), (3, 4)), ((3, 0), (2, 4)), ((5, 0), (0, 4))]) is None
    assert problem((4, 5), [((0, 0), (4, 3)), ((0, 3), (4, 2))]) is None
    assert problem((), [((), ())]) is None and problem((0, 3), []) is None
    assert problem((), []) == "elements [] are in no chunk (its chunks cover 0 of 1 elements; a read " \
                              "would return memory the checkpoint never wrote)"
    assert "elements [0:2, 2:4] are in no chunk" in problem((2, 4), [((0, 0), (2, 2))])
    assert "overlaps" in problem((4, 4), [((0, 0), (3, 3)), ((2, 2), (2, 2))])
    # an irregular layout cut into more cells than the budget is refused
    assert "more than the 3 left to check" in problem((6, 4), [((r, c), (2, 2)) for r in (0, 2, 4)
                                                                for c in (0, 2)], budget=3)


@pytest.mark.process_bounds
def test_path_integers_bounded(zygote, clean, tmp_path):
    """convert rebuilds lists from the saved paths' integers: an index far
    beyond the entries saved under a list, or negative, is refused."""
    baseline = measure(zygote, "convert", clean, str(tmp_path / "base_out"), "--to", "flat", "-q")
    assert baseline[0] == 0, baseline[2]
    for path, text in [(("extra", 300_000_000), "the path of 'extra.note' uses 'note' where the path of "
                                                "'extra.step' uses a list index"),
                       (("extra", -5), "the path of 'extra.step' holds the list index -5")]:
        bad = _copy(clean, tmp_path / f"bad{path[1]}")
        md = _metadata(bad)
        md.planner_data["extra.step"] = path
        _write_metadata(bad, md)
        assert_bounded(zygote, baseline, ("convert", bad, str(tmp_path / "out"), "--to", "flat", "-q"),
                       f"{bad}/.metadata: malformed checkpoint metadata: the path of 'extra.", text)
        assert not (tmp_path / "out").exists()
    # every path of the list an index: the range is checked
    md.planner_data["extra.step"], md.planner_data["extra.note"] = ("extra", 300_000_000), ("extra", 0)
    _write_metadata(bad, md)
    with pytest.raises(MalformedCheckpointError, match="holds the list index 300000000, for 2 saved entries"):
        Checkpoint(bad)
    md.planner_data["extra.step"], md.planner_data["extra.note"] = ("extra", 1), ("extra", 0)
    _write_metadata(bad, md)
    assert Checkpoint(bad).by_key["extra.step"].path == ("extra", 1)


@pytest.mark.parametrize("paths,text", [
    ({"extra.step": ("extra", "note")}, "is also the path of another entry"),
    ({"extra.step": ("model", "head.weight", "x")}, "runs through the entry 'model.head.weight'"),
    ({"extra.step": (0, "x")}, "starts with 0, not a key"),
])
def test_inconsistent_paths(clean, tmp_path, paths, text):
    bad = _copy(clean, tmp_path / "bad")
    md = _metadata(bad)
    md.planner_data.update(paths)
    _write_metadata(bad, md)
    with pytest.raises(MalformedCheckpointError, match=re.escape(text)):
        Checkpoint(bad)


def _symlinked(clean, tmp_path, how):
    bad = _copy(clean, tmp_path / "bad")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(os.path.join(bad, "__0_0.distcp"), outside / "__0_0.distcp")
    if how == "file":
        os.symlink(outside / "__0_0.distcp", os.path.join(bad, "__0_0.distcp"))
    else:  # every relative_path through a symlinked subfolder
        os.symlink(outside, os.path.join(bad, "sub"))
        md = _metadata(bad)
        for index, info in list(md.storage_data.items()):
            md.storage_data[index] = _StorageInfo("sub/" + info.relative_path, info.offset, info.length)
        _write_metadata(bad, md)
    return bad


@pytest.mark.process_bounds
def test_symlinks_out_of_the_folder(zygote, clean, tmp_path):
    """A .distcp symlinked to a file elsewhere, or read through a symlinked
    subfolder, is refused unless trusted."""
    baseline = measure(zygote, "inspect", clean, "--values", "-q")
    assert baseline[0] == 0, baseline[2]
    for how in ("file", "subfolder"):
        base = tmp_path / how
        base.mkdir()
        bad = _symlinked(clean, base, how)
        name = os.path.join(bad, "__0_0.distcp" if how == "file" else "sub/__0_0.distcp")
        real = os.path.realpath(base / "outside" / "__0_0.distcp")
        text = f"the file resolves to {real}, outside the checkpoint directory"
        for argv in (("inspect", bad, "--values", "-q"), ("convert", bad, str(base / "out"), "--to", "flat", "-q")):
            assert_bounded(zygote, baseline, argv, f"{name}: cannot read '", text, "--trust")
        with pytest.raises(UnsafeCheckpointError, match=re.escape(text)):
            Checkpoint(bad).read(["model.head.weight"])
        # trusted: followed, and the values are those of the clean checkpoint
        keys = [it.key for it in Checkpoint(clean).items]
        got, want = Checkpoint(bad, trusted=True).read(keys), Checkpoint(clean, trusted=True).read(keys)
        assert all(_same(got[k], want[k]) for k in keys)
    # a symlink inside the folder is fine
    ok = _copy(clean, tmp_path / "ok")
    os.rename(os.path.join(ok, "__0_0.distcp"), os.path.join(ok, "real.bin"))
    os.symlink("real.bin", os.path.join(ok, "__0_0.distcp"))
    assert _same(Checkpoint(ok).value("model.head.weight"), Checkpoint(clean).value("model.head.weight"))


@pytest.mark.process_bounds
def test_metadata_size_cap(zygote, clean, tmp_path, monkeypatch):
    """The .metadata file is read with a size cap, checked before reading."""
    from dcp_optim.tools import _safe_unpickle

    baseline = measure(zygote, "inspect", clean, "-q")
    bad = _copy(clean, tmp_path / "bad")
    cap = _safe_unpickle.MAX_METADATA_BYTES
    with open(os.path.join(bad, ".metadata"), "r+b") as f:
        f.truncate(cap + 1)  # sparse: nothing is written
    assert_bounded(zygote, baseline, ("inspect", bad, "-q"), f"{bad}/.metadata: cannot read the checkpoint metadata: "
                   f"the file holds {cap + 1} bytes, more than the {cap} read")
    # the cap itself
    monkeypatch.setattr(_safe_unpickle, "MAX_METADATA_BYTES", 100)
    with pytest.raises(MalformedCheckpointError, match="more than the 100 read from an untrusted checkpoint"):
        Checkpoint(clean)
    assert Checkpoint(clean, trusted=True).items


@pytest.mark.parametrize("protocol", [0, 1])
def test_legit_protocol_0_and_1_metadata(clean, tmp_path, capsys, protocol):
    """Valid pickles of any protocol read (they were refused as "not a
    pickle (no protocol header)"), exactly as with torch's unpickling."""
    ok = _copy(clean, tmp_path / "ok")
    md = _metadata(ok)
    with open(os.path.join(ok, ".metadata"), "wb") as f:
        pickle.dump(md, f, protocol=protocol)
    assert assert_reads_as_trusted(ok, capsys) > 10


def test_work_budget_and_messages():
    """The budget counts expanded work, and error messages stay short."""
    from dcp_optim.tools import _safe_unpickle as safe
    from dcp_optim.tools.checkpoint import _brief

    shared = _nested_refs(30, 10, "x")
    assert _brief(shared).startswith("[[[[[[[[[..., ..., ...") and len(_brief(shared)) == 60
    assert len(_brief("x" * 10**6)) == 60 and _brief((1, 2)) == "(1, 2)" and _brief({}) == "{}"
    assert _brief(1 << 100000) == "<int of 100001 bits>"
    assert _brief(torch.Size([2, 3])) == "torch.Size([2, 3])" and _brief(["a", None]) == "['a', None]"
    err = dcp_optim.CheckpointError("a\nb" + "x" * 10**6)
    assert "\n" not in str(err) and len(str(err)) <= 2000
    with pytest.raises(safe.Malformed, match="more work than the budget of 1000 units"):
        safe.load_metadata(pickle.dumps([list(range(10))] * 200, 2), budget=1000)
    # a hash bomb built with DUP (no memo reference): counted when hashed
    with pytest.raises(safe.Malformed, match="more work than the budget"):  # as a key
        safe.load_metadata(b"\x80\x02}K\x01" + b"2\x86" * 60 + b"K\x00s.")
    with pytest.raises(safe.Malformed, match="shared containers expand to more than"):  # as a value
        safe.check_value(safe._unpickle(b"\x80\x02]K\x01" + b"2\x86" * 60 + b"a.", safe._policy("object")))
    # a key referenced many times: each hash is counted
    key = tuple(range(100))
    with pytest.raises(safe.Malformed, match="more work than the budget"):
        safe._unpickle(pickle.dumps({(i, key): 0 for i in range(100)}, 2), safe._policy("object"), budget=5000)
    assert safe._unpickle(pickle.dumps({(i, key): 0 for i in range(10)}, 2), safe._policy("object"),
                          budget=5000)[(0, key)] == 0
