"""Hostile inputs against the core v2 reader (issue 12, classes 1-6 and 10), built here, byte by byte.

Every file is made in the test: raw pickle opcodes placed as ``data.pkl`` into a zip made by a
real ``torch.save``, or a legacy file whose pickles are spliced after torch's own header. Each
test asserts the exact outcome: exit 3 with one stderr line naming the problem, no output file,
no traceback, no signal, nothing executed (payloads ``touch`` a marker file) -- and for every
output that *is* written, a pickletools-level proof that its ``data.pkl`` names only globals
on ckptfix's allow-list or given with ``--allow-global``.

Tests marked ``xfail(strict=True)`` document bugs found by this file (the reason says exactly
what happens); they turn into failures the day the bug is fixed, so the marker is removed then.
Commands run in-process (``ckptfix.cli.main``, the same function ``python -m ckptfix`` runs);
inputs that may kill the interpreter, or whose memory is measured, run as processes in
tests/e2e/test_hostile_processes.py. The builders and checks are in tests/hostile.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import re
import shutil
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile import (
    CRASHY,
    DEPTH_REFUSED,
    NAMESPACE,
    POSIX_STATE,
    PROTO,
    allow_args,
    assert_no_signal,
    assert_output_safe,
    assert_refused,
    assert_verify_fails,
    binbytes,
    ck,
    ckpt,
    data_pkl,
    g,
    get,
    id_reuse_key,
    items,
    key_of,
    legacy_file,
    make_legacy_header,
    n,
    pickle_globals,
    pid,
    put,
    su,
    system_call,
    tensor,
    tensor_v3,
    tup,
    u,
    with_data_pkl,
)

from ckptfix.analysis.scan import _plain, scan_path
from ckptfix.errors import CkptfixError
from ckptfix.model.refs import make_storage
from ckptfix.pickling.reader import ReaderHooks
from ckptfix.pickling.recording import RecordingHooks
from ckptfix.pickling.vm import PickleVM
from ckptfix.pickling.writer import dumps

# =========================================================================== files


@pytest.fixture(scope="module")
def legacy_header() -> bytes:
    return make_legacy_header()


def test_output_proof_catches_what_it_must(tmp_path: Path) -> None:
    """The helper itself: a pickle naming os.system fails it; STACK_GLOBAL is not guessed at."""
    assert pickle_globals(system_call(tmp_path / "m")) == {"posix.system"}
    with pytest.raises(AssertionError, match="STACK_GLOBAL"):
        pickle_globals(system_call(tmp_path / "m", proto=4))
    bad = tmp_path / "bad.pth"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("archive/data.pkl", system_call(tmp_path / "m"))
    with pytest.raises(AssertionError, match=r"posix\.system"):
        assert_output_safe(bad)
    assert_output_safe(bad, allow=("posix.*",))


# =========================================================================== 1. laundering

UNTYPED = g("torch.storage", "UntypedStorage")


@dataclass
class Variant:
    hostile: bytes
    clean: bytes  # the same pickle without the hostile step: must read fine (the refusal is about that step)
    needle: str
    allow: tuple[str, ...] = ()


def _laundering() -> dict[str, Variant]:
    fs = g("torch", "FloatStorage")
    size = g("torch", "Size") + tup((2, 2)) + b"\x85R"
    v3 = lambda dtype: tensor_v3(pid(numel=16, cls=UNTYPED), dtype)  # noqa: E731
    return {
        "BUILD on a Global": Variant(ckpt(fs + POSIX_STATE + b"b"), ckpt(fs), "BUILD on a Global"),
        "SETITEMS on a Global": Variant(
            ckpt(fs + b"(" + u("module") + u("posix") + b"u"), ckpt(fs), "SETITEMS on a Global"
        ),
        "SETITEM on a Global": Variant(ckpt(fs + u("name") + u("system") + b"s"), ckpt(fs), "SETITEMS on a Global"),
        "APPENDS on a Global": Variant(ckpt(fs + b"(" + u("posix") + b"e"), ckpt(fs), "APPENDS on a Global"),
        "APPEND on a Global": Variant(ckpt(fs + u("posix") + b"a"), ckpt(fs), "APPENDS on a Global"),
        "BUILD on a persistent id's storage class": Variant(
            ckpt(get(200) + POSIX_STATE + b"b", weight=tensor(pid(cls=fs + put(200)))),
            ckpt(get(200), weight=tensor(pid(cls=fs + put(200)))),
            "BUILD on a Global",
        ),
        "BUILD on a storage class before its persistent id": Variant(
            ckpt(weight=tensor(pid(cls=fs + POSIX_STATE + b"b"))), ckpt(weight=tensor(pid(cls=fs))), "BUILD on a Global"
        ),
        "BUILD on a storage": Variant(
            ckpt(get(201) + POSIX_STATE + b"b", weight=tensor(pid() + put(201))),
            ckpt(weight=tensor(pid() + put(201))),
            "BUILD on a StorageRef",
        ),
        "SETITEMS on a storage": Variant(
            ckpt(get(201) + b"(" + u("numel") + n(10**6) + b"u", weight=tensor(pid() + put(201))),
            ckpt(weight=tensor(pid() + put(201))),
            "SETITEMS on a StorageRef",
        ),
        "BUILD on a _rebuild_tensor_v3 dtype": Variant(
            ckpt(get(202) + POSIX_STATE + b"b", weight=v3(g("torch", "float32") + put(202))),
            ckpt(get(202), weight=v3(g("torch", "float32") + put(202))),
            "BUILD on a Global",
        ),
        "BUILD on a dtype before the tensor": Variant(
            ckpt(weight=v3(g("torch", "float32") + POSIX_STATE + b"b")),
            ckpt(weight=v3(g("torch", "float32"))),
            "BUILD on a Global",
        ),
        "BUILD on torch.Size": Variant(ckpt(size + POSIX_STATE + b"b"), ckpt(size), "BUILD on a Reduce"),
        "SETITEMS on torch.Size": Variant(
            ckpt(size + b"(" + u("a") + u("b") + b"u"), ckpt(size), "SETITEMS on a Reduce"
        ),
        "APPENDS on torch.Size": Variant(ckpt(size + b"(" + n(7) + b"e"), ckpt(size), "APPENDS on a Reduce"),
        "BUILD on torch.device": Variant(
            ckpt(g("torch", "device") + u("cpu") + b"\x85R" + POSIX_STATE + b"b"),
            ckpt(g("torch", "device") + u("cpu") + b"\x85R"),
            "BUILD on a Reduce",
        ),
        "BUILD on a tensor": Variant(ckpt(weight=tensor() + POSIX_STATE + b"b"), ckpt(), "BUILD on a TensorRef"),
        "SETITEMS on a tensor": Variant(
            ckpt(weight=tensor() + b"(" + u("shape") + tup((100,)) + b"u"), ckpt(), "SETITEMS on a TensorRef"
        ),
        "APPENDS on a tensor": Variant(ckpt(weight=tensor() + b"(" + n(1) + b"e"), ckpt(), "APPENDS on a TensorRef"),
        "NEWOBJ of a torch class": Variant(ckpt(fs + b")\x81"), ckpt(fs), "NEWOBJ of"),
        "REDUCE on a record": Variant(ckpt(size + b")R"), ckpt(size), "it calls a Reduce"),
        "REDUCE on a string": Variant(ckpt(u("posix.system") + b")R"), ckpt(u("posix.system")), "it calls a str"),
        "persistent id naming a non-storage class": Variant(
            ckpt(weight=tensor(pid(cls=g("torch", "Size")))), ckpt(), "malformed storage persistent id"
        ),
        "BUILD twice on an allowed object": Variant(
            ckpt(g("argparse", "Namespace") + b")\x81" + items() + b"b" + POSIX_STATE + b"b"),
            ckpt(g("argparse", "Namespace") + b")\x81" + items() + b"b"),
            "BUILD on a OpaqueObject",
            ("argparse.Namespace",),
        ),
    }


LAUNDERING = _laundering()


def assert_every_command_refuses(src: Path, tmp_path: Path, *needles: str, allow: tuple[str, ...] = ()) -> None:
    """inspect, strip-module IN OUT, convert IN OUT.safetensors: exit 3 naming the problem, nothing
    written; verify: one FAIL line, exit 1."""
    extra = allow_args(allow)
    out_pth, out_st = tmp_path / "out.pth", tmp_path / "out.safetensors"
    assert_refused(ck("inspect", src, *extra), *needles)
    assert_refused(ck("strip-module", src, out_pth, *extra), *needles, out=out_pth)
    assert_refused(ck("convert", src, out_st, "--select", "sd", *extra), *needles, out=out_st)
    assert_verify_fails(ck("verify", src))


@pytest.mark.parametrize("name", list(LAUNDERING))
def test_laundering_is_refused_by_every_command(base_zip: Path, tmp_path: Path, name: str) -> None:
    variant = LAUNDERING[name]
    clean = with_data_pkl(base_zip, variant.clean, tmp_path / "clean.pth")
    written = tmp_path / "clean-out.pth"
    result = ck("strip-module", clean, written, *allow_args(variant.allow))
    assert result.returncode == 0, f"the clean twin must read: {result.stderr}"
    assert_output_safe(written, variant.allow)
    src = with_data_pkl(base_zip, variant.hostile, tmp_path / "hostile.pth")
    assert_every_command_refuses(src, tmp_path, variant.needle, allow=variant.allow)


@pytest.mark.parametrize(
    "name",
    [
        k
        for k in (
            "BUILD on a Global",
            "BUILD on a persistent id's storage class",
            "BUILD on a _rebuild_tensor_v3 dtype",
            "BUILD on torch.Size",
            "BUILD on a tensor",
            "REDUCE on a string",
            "BUILD twice on an allowed object",
        )
    ],
)
def test_scan_never_calls_a_laundering_pickle_ok(base_zip: Path, tmp_path: Path, name: str) -> None:
    src = with_data_pkl(base_zip, LAUNDERING[name].hostile, tmp_path / "hostile.pth")
    result = ck("scan", src)
    assert result.returncode in (1, 3), result.stdout
    assert not result.stdout.startswith("ok "), result.stdout


# --- torch.storage._load_from_bytes and the other never-allowed names ----------------------------


@pytest.mark.parametrize(
    ("module", "name", "pattern"),
    [
        ("torch.storage", "_load_from_bytes", "torch.storage.*"),
        ("torch.storage", "_load_from_bytes", "torch.*"),
        ("torch.storage", "_load_from_bytes", "torch.storage._load_from_bytes"),
        ("torch.storage", "_load_from_bytes", "*"),
        ("torch", "load", "torch.*"),
        ("builtins", "eval", "builtins.*"),
        ("__builtin__", "eval", "builtins.*"),
        ("builtins", "exec", "builtins.*"),
    ],
)
def test_never_allowed_globals_stay_refused_whatever_allow_global_says(
    base_zip: Path, tmp_path: Path, module: str, name: str, pattern: str
) -> None:
    marker = tmp_path / "PWNED"
    payload = system_call(marker)
    src = with_data_pkl(base_zip, ckpt(g(module, name) + binbytes(payload) + b"\x85R"), tmp_path / "h.pth")
    shown = f"{'builtins' if module == '__builtin__' else module}.{name}"
    assert_every_command_refuses(src, tmp_path, f"references {shown},", allow=(pattern,))
    scan = ck("scan", "--json", src)
    assert scan.returncode == 1
    assert shown in json.loads(scan.stdout)["files"][0]["dangerous"]
    assert not marker.exists()


def test_torch_load_under_its_module_name_is_never_allowed_either(base_zip: Path, tmp_path: Path) -> None:
    assert torch.serialization.load is torch.load
    src = with_data_pkl(
        base_zip, ckpt(g("torch.serialization", "load") + u("/tmp/other.pth") + b"\x85R"), tmp_path / "h.pth"
    )
    assert_refused(ck("inspect", src, "--allow-global", "torch.*"), "torch.serialization.load")


# --- pickles carried as bytes inside an allowed-by-name object ----------------------------------


def _namespace_file(path: Path, proto: int = 2, **fields: Any) -> Path:
    """What a training script saves: its argparse.Namespace (torch.save: NEWOBJ + BUILD; bytes are
    _codecs.encode calls under protocol 2, BINBYTES opcodes under 3+), beside a state dict."""
    torch.save({"sd": {"module.w": torch.arange(4.0)}, "x": argparse.Namespace(**fields)}, path, pickle_protocol=proto)
    return path


def _raw_namespace(body: bytes) -> bytes:
    return ckpt(g("argparse", "Namespace") + body)


def _nested_variants(marker: Path) -> dict[str, Any]:
    evil = system_call(marker)
    return {
        "state bytes (torch.save)": lambda p: _namespace_file(p, blob=evil),
        "state bytes, payload protocol 4": lambda p: _namespace_file(p, blob=system_call(marker, proto=4)),
        "state bytes (torch.save protocol 4)": lambda p: _namespace_file(p, proto=4, blob=evil),
        "state bytearray": lambda p: _namespace_file(p, blob=bytearray(evil)),
        "bytes in a list in the state": lambda p: _namespace_file(p, blobs=[1, [evil]]),
        "bytes in a dict in a tuple": lambda p: _namespace_file(p, cfg=({"k": evil},)),
        "bytes in a nested Namespace": lambda p: _namespace_file(p, inner=argparse.Namespace(blob=evil)),
        "NEWOBJ args": lambda p: with_data_pkl(p.parent / "base.pth", _raw_namespace(binbytes(evil) + b"\x85\x81"), p),
        "REDUCE args": lambda p: with_data_pkl(p.parent / "base.pth", _raw_namespace(binbytes(evil) + b"\x85R"), p),
        "SETITEMS items": lambda p: with_data_pkl(
            p.parent / "base.pth", _raw_namespace(b")\x81(" + u("k") + binbytes(evil) + b"u"), p
        ),
        "APPENDS items": lambda p: with_data_pkl(
            p.parent / "base.pth", _raw_namespace(b")\x81(" + binbytes(evil) + b"e"), p
        ),
        "payload calling _load_from_bytes": lambda p: _namespace_file(
            p, blob=PROTO + g("torch.storage", "_load_from_bytes") + binbytes(evil) + b"\x85R."
        ),
    }


@pytest.fixture
def nested_dir(base_zip: Path, tmp_path: Path) -> Path:
    shutil.copy(base_zip, tmp_path / "base.pth")
    return tmp_path


@pytest.mark.parametrize("variant", list(_nested_variants(Path("m"))))
def test_allowed_object_carrying_a_hostile_pickle_is_refused(nested_dir: Path, variant: str) -> None:
    marker = nested_dir / "PWNED"
    src = _nested_variants(marker)[variant](nested_dir / "hostile.pth")
    named = "torch.storage._load_from_bytes" if "_load_from_bytes" in variant else "os.system"
    assert_every_command_refuses(src, nested_dir, f"references {named}", allow=NAMESPACE)
    assert not marker.exists()


@pytest.mark.parametrize(
    "variant",
    [
        "NEWOBJ args",
        "REDUCE args",
        "state bytes (torch.save)",
        pytest.param("state bytes (torch.save protocol 4)"),
        "SETITEMS items",
    ],
)
def test_scan_reports_the_pickle_inside_an_allowed_object(nested_dir: Path, variant: str) -> None:
    src = _nested_variants(nested_dir / "PWNED")[variant](nested_dir / "hostile.pth")
    result = ck("scan", "--json", src)
    assert result.returncode == 1, result.stdout
    assert "os.system" in json.loads(result.stdout)["files"][0]["dangerous"]


@pytest.mark.parametrize(
    "proto",
    [
        0,
        1,
    ],
)
def test_headerless_pickle_inside_an_allowed_object_is_refused(nested_dir: Path, proto: int) -> None:
    marker = nested_dir / "PWNED"
    payload = system_call(marker, proto=proto)
    assert payload[:1] != b"\x80"
    src = _namespace_file(nested_dir / "hostile.pth", blob=payload)
    out = nested_dir / "out.pth"
    result = ck("strip-module", src, out, "--allow-global", "argparse.Namespace")
    assert_refused(result, "references os.system", out=out)


def test_doubly_nested_pickle_inside_an_allowed_object_is_refused(nested_dir: Path) -> None:
    marker = nested_dir / "PWNED"
    inner = pickle.dumps(argparse.Namespace(blob=system_call(marker)), protocol=2)
    src = _namespace_file(nested_dir / "hostile.pth", blob=inner)
    out = nested_dir / "out.pth"
    result = ck("strip-module", src, out, "--allow-global", "argparse.Namespace")
    assert_refused(result, "references os.system", out=out)


def test_allowed_object_with_harmless_bytes_is_kept_and_the_output_is_proven(nested_dir: Path) -> None:
    """The other side: an allowed object whose bytes are a harmless pickle and plain data passes
    through; the output's data.pkl names only allowed globals plus argparse.Namespace."""
    fields = {"blob": pickle.dumps({"lr": [0.1, 0.01]}, protocol=2), "raw": b"plain bytes", "n": 3}
    src = _namespace_file(nested_dir / "ok.pth", **fields)
    for out, flag in (
        (nested_dir / "out.pth", "--allow-global=argparse.Namespace"),
        (nested_dir / "out2.pth", "--sanitize"),
    ):
        result = ck("strip-module", src, out, flag)
        assert result.returncode == 0, result.stderr
        assert_output_safe(out, allow=NAMESPACE if flag != "--sanitize" else ())
    assert vars(torch.load(nested_dir / "out.pth", weights_only=False)["x"]) == fields
    assert torch.load(nested_dir / "out2.pth", weights_only=True)["x"] == fields


def test_ordered_dict_attributes_that_shadow_methods_are_not_an_internal_error(base_zip: Path, tmp_path: Path) -> None:
    odict = g("collections", "OrderedDict") + b")R" + items(("items", n(1))) + b"b"
    src = with_data_pkl(base_zip, ckpt(odict), tmp_path / "h.pth")
    for result in (ck("inspect", src), ck("strip-module", src, tmp_path / "o.pth"), ck("verify", src)):
        assert result.returncode in (0, 1, 3) and "internal error" not in result.stderr, result.stderr


# =========================================================================== 2. out-of-bounds bytes

OOB = {  # data/0 holds 16 bytes: four float32
    "offset past the end": (ckpt(weight=tensor(offset=1)), "needs 20 bytes"),
    "shape past the end": (ckpt(weight=tensor(size=(5,))), "needs 20 bytes"),
    "stride past the end": (ckpt(weight=tensor(size=(2, 2), stride=(3, 1))), "needs 20 bytes"),
    "offset 2**62": (ckpt(weight=tensor(offset=2**62)), "holds 16"),
    "stride 2**62": (ckpt(weight=tensor(size=(2,), stride=(2**62,))), "holds 16"),
    "shape and stride 2**32": (ckpt(weight=tensor(size=(2**32, 2**32), stride=(2**32, 1))), "more elements than"),
    "declared numel over the record": (ckpt(weight=tensor(pid(numel=5))), "declares 20"),
    "declared numel 2**62": (ckpt(weight=tensor(pid(numel=2**62), size=(1,))), "data/0"),
    "v3 dtype wider than the storage": (
        ckpt(weight=tensor_v3(pid(numel=16, cls=UNTYPED), g("torch", "float64"))),
        "needs 32 bytes",
    ),
    "storage record missing": (ckpt(weight=tensor(pid(key="7"))), "data/7"),
    "tensor in tensor metadata": (ckpt(weight=tensor(metadata=items(("m", tensor(offset=3))))), "needs 28 bytes"),
}


@pytest.mark.parametrize("name", list(OOB))
def test_tensor_outside_its_storage_is_refused(base_zip: Path, tmp_path: Path, name: str) -> None:
    payload, needle = OOB[name]
    src = with_data_pkl(base_zip, payload, tmp_path / "oob.pth")
    assert_every_command_refuses(src, tmp_path, needle)


def test_tensor_whose_element_count_overflows_is_refused_like_torch(base_zip: Path, tmp_path: Path) -> None:
    src = with_data_pkl(base_zip, ckpt(weight=tensor(size=(2**40, 2**40), stride=(0, 0))), tmp_path / "h.pth")
    with pytest.raises(Exception, match="overflow"):
        torch.load(src, weights_only=True)
    assert_every_command_refuses(src, tmp_path, "module.w")


def _mutated_size_variants() -> dict[str, tuple[bytes, Any]]:
    """A tensor whose size/stride is a list the pickle keeps (memo) and appends to after the
    tensor was built; the list itself is also kept under "x" (real data, so it must stay [2, 2, 7])."""
    size_list = b"](" + n(2) + n(2) + b"e" + put(210)
    stride_list = b"](" + n(2) + n(1) + b"e" + put(211)
    grow = lambda i: get(i) + n(7) + b"a"  # noqa: E731
    return {
        "size list": (ckpt(grow(210), weight=tensor(size=size_list, stride=(2, 1))), [2, 2, 7]),
        "stride list": (ckpt(grow(211), weight=tensor(size=(2, 2), stride=stride_list)), [2, 1, 7]),
        "torch.Size of a list": (
            ckpt(grow(210), weight=tensor(size=g("torch", "Size") + size_list + b"\x85R", stride=(2, 1))),
            [2, 2, 7],
        ),
        "size list, APPENDS": (
            ckpt(get(210) + b"(" + n(9) + n(9) + b"e", weight=tensor(size=size_list, stride=(2, 1))),
            [2, 2, 9, 9],
        ),
    }


@pytest.mark.parametrize("name", list(_mutated_size_variants()))
def test_size_list_changed_after_the_tensor_keeps_the_original_shape(base_zip: Path, tmp_path: Path, name: str) -> None:
    payload, grown = _mutated_size_variants()[name]
    src = with_data_pkl(base_zip, payload, tmp_path / "in.pth")
    out = tmp_path / "out.pth"
    result = ck("strip-module", src, out)
    if result.returncode == 3:  # refusing is allowed too
        assert_refused(result, out=out)
        return
    assert result.returncode == 0, result.stderr
    assert_output_safe(out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["sd"]["w"].shape == (2, 2) and loaded["sd"]["w"].stride() == (2, 1)
    assert loaded["sd"]["w"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert loaded["x"] == grown
    assert torch.load(src, weights_only=True)["sd"]["module.w"].shape == (2, 2)  # what torch itself builds
    assert ck("verify", out).returncode == 0


# --- the legacy format: views and storages checked against the real bytes -------------------------

_FOUR = struct.pack("<4f", 1, 2, 3, 4)


def _legacy_tensor(storage: bytes, size: tuple[int, ...], offset: int = 0) -> bytes:
    """A contiguous tensor on a legacy persistent id."""
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= s
    return tensor(storage, offset, size, tuple(reversed(strides)))


def _lpid(key: str = "0", numel: int = 4, view: tuple[str, int, int] | None = None, cls: str = "FloatStorage") -> bytes:
    return pid(key, numel, g("torch", cls), legacy=True, view=view)


LEGACY_BAD = {  # storages in the file, the state dict's tensors, what the error names
    "view past its root": ([("0", 4, _FOUR)], [_legacy_tensor(_lpid(view=("v", 2, 3)), (3,))], "lies outside"),
    "tensor past its view": ([("0", 4, _FOUR)], [_legacy_tensor(_lpid(view=("v", 1, 2)), (3,))], "needs 12 bytes"),
    "float view past a byte root": (
        [("0", 8, bytes(range(8)))],
        [
            _legacy_tensor(_lpid(numel=8, cls="ByteStorage"), (8,)),
            _legacy_tensor(_lpid(numel=2, view=("v", 1, 2)), (2,)),
        ],
        "lies outside",
    ),
    "view offset 2**40": ([("0", 4, _FOUR)], [_legacy_tensor(_lpid(view=("v", 2**40, 1)), (1,))], "lies outside"),
    "storage shorter than declared": ([("0", 3, _FOUR[:12])], [_legacy_tensor(_lpid(), (4,))], "holds 3 elements"),
    "file ends inside a storage": ([("0", 4, _FOUR[:10])], [_legacy_tensor(_lpid(), (4,))], "past the end"),
    # torch loads this one: its tensor holds whatever uninitialized memory the allocation had
    "storage never listed": ([], [_legacy_tensor(_lpid(), (4,))], "missing"),
}


def _legacy_tree(*tensors: bytes) -> bytes:
    return PROTO + items(("sd", items(*((f"module.w{i}", t) for i, t in enumerate(tensors))))) + b"."


@pytest.mark.parametrize("name", list(LEGACY_BAD))
def test_legacy_file_torch_refuses_is_refused(legacy_header: bytes, tmp_path: Path, name: str) -> None:
    storages, tensors, needle = LEGACY_BAD[name]
    src = legacy_file(legacy_header, _legacy_tree(*tensors), storages, tmp_path / "legacy.pth")
    if name != "storage never listed":
        with pytest.raises(Exception):  # noqa: B017 -- torch's own failure (RuntimeError, EOFError...)
            torch.load(src, weights_only=True)
    assert_every_command_refuses(src, tmp_path, needle)


def test_legacy_view_inside_its_root_reads_like_torch(legacy_header: bytes, tmp_path: Path) -> None:
    """The control: a legacy view inside its root is read, and the output holds the view's values."""
    tree = _legacy_tree(_legacy_tensor(_lpid(view=("v", 1, 3)), (3,)))
    src = legacy_file(legacy_header, tree, [("0", 4, _FOUR)], tmp_path / "legacy.pth")
    out = tmp_path / "out.pth"
    assert ck("strip-module", src, out).returncode == 0
    assert_output_safe(out)
    assert torch.load(out, weights_only=True)["sd"]["w0"].tolist() == [2.0, 3.0, 4.0]
    assert torch.load(src, weights_only=True)["sd"]["module.w0"].tolist() == [2.0, 3.0, 4.0]


def test_legacy_view_key_colliding_with_a_root_key_reads_like_torch(legacy_header: bytes, tmp_path: Path) -> None:
    tree = _legacy_tree(_legacy_tensor(_lpid(), (4,)), _legacy_tensor(_lpid("1", view=("0", 1, 2)), (2,)))
    src = legacy_file(
        legacy_header, tree, [("0", 4, _FOUR), ("1", 4, struct.pack("<4f", 10, 20, 30, 40))], tmp_path / "legacy.pth"
    )
    theirs = torch.load(src, weights_only=True)["sd"]
    assert theirs["module.w1"].tolist() == [1.0, 2.0]
    out = tmp_path / "out.pth"
    result = ck("strip-module", src, out)
    if result.returncode == 3:  # refusing the ambiguous key is allowed (what ckptfix does today)
        assert_refused(result, "storage key '0' names both a storage and a view of another storage", out=out)
        return
    assert result.returncode == 0, result.stderr
    ours = torch.load(out, weights_only=True)["sd"]
    assert ours["w1"].tolist() == theirs["module.w1"].tolist()


# =========================================================================== 3. cycles and sharing


def test_raw_dict_that_contains_itself_is_stripped_in_place(base_zip: Path, tmp_path: Path) -> None:
    """A plain dict (memo BINGET of itself, not torch.save's OrderedDict) whose "module.self" is
    itself: the output's stripped dict contains *itself*, as torch's in-place edit would."""
    inner = b"}" + put(220) + b"(" + u("module.w") + tensor() + u("module.self") + get(220) + b"u"
    src = with_data_pkl(base_zip, PROTO + items(("state_dict", inner)) + b".", tmp_path / "in.pth")
    out = tmp_path / "out.pth"
    result = ck("strip-module", src, out, "--key", "state_dict")
    assert result.returncode == 0, result.stderr
    assert_output_safe(out)
    sd = torch.load(out, weights_only=True)["state_dict"]
    assert list(sd) == ["w", "self"] and sd["self"] is sd
    assert sd["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    for command in (("inspect", src), ("verify", src), ("diff", src, src), ("inspect", out), ("verify", out)):
        assert ck(*command).returncode == 0, command


def test_state_dict_whose_extra_state_is_itself_is_stripped_without_key(base_zip: Path, tmp_path: Path) -> None:
    """`*_extra_state` values may be anything, so a top-level state dict whose extra state is itself
    is found without --key; stripping keeps the self-reference."""
    sd = b"}" + put(221) + b"(" + u("module.w") + tensor() + u("module._extra_state") + get(221) + b"u"
    src = with_data_pkl(base_zip, PROTO + sd + b".", tmp_path / "in.pth")
    out = tmp_path / "out.pth"
    result = ck("strip-module", src, out)
    assert result.returncode == 0, result.stderr
    assert_output_safe(out)
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == ["w", "_extra_state"] and loaded["_extra_state"] is loaded


def test_list_that_contains_itself(tmp_path: Path) -> None:
    loop: list[Any] = [torch.arange(2.0)]
    loop.append(loop)
    src = tmp_path / "in.pth"
    torch.save({"sd": {"module.w": torch.arange(4.0)}, "l": loop}, src)
    out = tmp_path / "out.pth"
    assert ck("strip-module", src, out).returncode == 0
    assert_output_safe(out)
    loaded = torch.load(out, weights_only=True)
    assert loaded["l"][1] is loaded["l"] and loaded["l"][0].tolist() == [0.0, 1.0]
    for command in (
        ("inspect", src),
        ("verify", out),
        ("diff", src, src),
        ("prune", src, tmp_path / "p.pth"),
        ("convert", src, tmp_path / "d.pth", "--drop", "l"),
    ):
        assert ck(*command).returncode == 0, command


#: each command on the 40-level DAG must finish within this (a walk that enters shared nodes twice never does)
DAG_SECONDS = 30


@pytest.fixture(scope="module")
def dag40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 levels, each a dict referencing the level below twice: 2**40 paths, 41 dicts."""
    level: Any = {"module.w": torch.arange(4.0)}
    for _ in range(40):
        level = {"a": level, "b": level}
    path = tmp_path_factory.mktemp("dag") / "dag.pth"
    torch.save(level, path)
    return path


@pytest.mark.parametrize(
    "command",
    [
        ("inspect", "{src}"),
        ("inspect", "--json", "{src}"),
        ("diff", "{src}", "{src}"),
        ("verify", "{src}"),
        ("prune", "{src}", "{tmp}/p.pth", "--drop", "*x*"),
        ("convert", "{src}", "{tmp}/d.pth", "--drop", "*x*"),
        ("convert", "{src}", "{tmp}/k.pth", "--keep", "*w*"),
        ("strip-module", "{src}", "{tmp}/s.pth", "--verify"),
        ("strip-module", "{copy}", "--in-place"),
        ("scan", "{src}"),
    ],
)
def test_shared_dag_40_levels_deep_is_walked_once(dag40: Path, tmp_path: Path, command: tuple[str, ...]) -> None:
    copy = tmp_path / "copy.pth"
    shutil.copy(dag40, copy)
    args = [a.format(src=dag40, tmp=tmp_path, copy=copy) for a in command]
    result = ck(*args, timeout=DAG_SECONDS)
    assert result.returncode == 0, result.stderr
    written = [Path(a) for a in args if a.startswith(str(tmp_path)) and a.endswith(".pth")]
    if command[0] == "prune":  # --drop matches nothing, and the DAG holds no optimizer state
        assert "nothing to prune" in result.stdout and all(out.exists() for out in written)  # unchanged copies
        return
    assert written or command[0] in ("inspect", "diff", "verify", "scan"), args
    for out in written:
        assert_output_safe(out)
        loaded = torch.load(out, weights_only=True)
        node, depth = loaded, 0
        while "a" in node:
            assert node["a"] is node["b"], f"sharing lost at level {depth}"
            node, depth = node["a"], depth + 1
        assert depth == 40 and set(node) <= {"w", "module.w"}


def test_allowed_objects_sharing_a_subtree_are_walked_once(base_zip: Path, tmp_path: Path) -> None:
    count = 20_000
    shared = b"](" + b"K\x01" * count + b"e" + put(1) + b"0"
    namespace = g("argparse", "Namespace") + put(2) + b"0"
    many = b"](" + (get(2) + get(1) + b"\x85R") * count + b"e"
    src = with_data_pkl(base_zip, ckpt(shared + namespace + many), tmp_path / "h.pth")
    result = ck("inspect", src, "--allow-global", "argparse.Namespace", timeout=2)  # a linear walk: well under 1 s
    assert result.returncode == 0, result.stderr


# =========================================================================== 4. depth


@pytest.mark.parametrize("name", [name for name in DEPTH_REFUSED if name not in CRASHY])
def test_nesting_beyond_the_limit_is_refused_without_a_crash(base_zip: Path, tmp_path: Path, name: str) -> None:
    """The inputs that cannot crash an interpreter; the others: tests/e2e/test_hostile_processes.py."""
    src = with_data_pkl(base_zip, DEPTH_REFUSED[name], tmp_path / "deep.pth")
    allow = allow_args(NAMESPACE) if "allowed" in name else []
    for args in (("inspect", src, *allow), ("strip-module", src, tmp_path / "o.pth", *allow), ("scan", src)):
        result = ck(*args)
        assert_no_signal(result)
        if args[0] == "scan":
            assert result.returncode in (0, 3), result.stdout  # deep but nothing dangerous
            continue
        assert_refused(result, "deep", out=tmp_path / "o.pth")


def test_key_depth_cache_address_reuse_small(base_zip: Path, tmp_path: Path) -> None:
    src = with_data_pkl(base_zip, id_reuse_key(1100), tmp_path / "deep.pth")
    assert_refused(ck("inspect", src), "deep")


@pytest.mark.parametrize("depth", [100, 999])
def test_keys_have_their_own_smaller_depth_limit(base_zip: Path, tmp_path: Path, depth: int) -> None:
    """Dict keys nest at most 100 deep (MAX_KEY_NESTING): CPython hashes, compares and repr()s a
    nested tuple recursively in C, so a 999-deep key -- within the 1000 limit for values -- made
    inspect and diff exit 5. At 100 every command handles it; deeper is exit 3 at read time --
    but scan reads on as CPython does (the key is kept unhashed), so a payload after it is seen."""
    src = with_data_pkl(base_zip, key_of(u("x") + b"\x85" * (depth - 1)), tmp_path / "deep.pth")
    if depth > 100:
        for args in (("inspect", src), ("strip-module", src, tmp_path / "o.pth")):
            result = ck(*args)
            assert result.returncode == 3 and "nested more than 100 deep" in (result.stdout + result.stderr), args
        assert ck("scan", src).returncode == 0
        return
    assert ck("strip-module", src, tmp_path / "o.pth").returncode == 0
    assert ck("verify", src).returncode == 0
    for args in (("inspect", src), ("inspect", "--json", src), ("diff", src, src)):
        result = ck(*args)
        assert result.returncode == 0 and "internal error" not in result.stderr, (args, result.stderr)


@pytest.mark.parametrize("depth", [600, 999])
def test_lists_within_the_limit_work_everywhere(base_zip: Path, tmp_path: Path, depth: int) -> None:
    """One limit, enforced while reading: what the reader accepts every command handles (exit 0).
    (inspect, whose report nests as deep: tests/e2e/test_hostile_processes.py.)"""
    src = with_data_pkl(base_zip, ckpt(b"]" * depth + b"a" * (depth - 1)), tmp_path / "deep.pth")
    out = tmp_path / "o.pth"
    for args in (
        ("strip-module", src, out),
        ("verify", src),
        ("convert", src, tmp_path / "c.pth"),
        ("diff", src, src),
        ("verify", out),
        ("scan", src),
    ):
        result = ck(*args)
        assert result.returncode == 0, (args, result.stderr[-500:])
    assert_output_safe(out)
    value, levels = torch.load(out, weights_only=True)["x"], 0
    while value:
        value, levels = value[0], levels + 1
    assert levels == depth - 1


# =========================================================================== 5. bombs


def test_deflated_genuine_storage_reads(tmp_path: Path) -> None:
    src, deflated = tmp_path / "z.pth", tmp_path / "deflated.pth"
    torch.save({"module.w": torch.zeros((4 << 20) + 1, dtype=torch.uint8)}, src)
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            out.writestr(info.filename, z.read(info))
    assert torch.load(deflated, weights_only=True)["module.w"].shape == ((4 << 20) + 1,)
    assert ck("verify", deflated).returncode == 0
    assert ck("strip-module", deflated, tmp_path / "out.pth").returncode == 0


# =========================================================================== 6. scan

_Q = struct.Struct("<Q").pack
_I4 = struct.Struct("<I").pack


def _touch(marker: Path) -> bytes:
    return u(f"touch {marker}")


def _juggled(marker: Path) -> dict[str, bytes]:
    """os.system reached without a literal GLOBAL posix/system pair: names through memo, DUP, POP."""
    s = _touch(marker)
    return {
        "STACK_GLOBAL of BINGET strings after POPs": PROTO
        + su("posix")
        + put(0)
        + b"0"
        + su("decoy")
        + b"2"
        + b"0"
        + put(1)
        + b"0"
        + su("system")
        + put(2)
        + b"0"
        + get(0)
        + get(2)
        + b"\x93"
        + s
        + b"\x85R.",
        "MEMOIZE and FRAME (protocol 4)": (lambda body: b"\x80\x04\x95" + _Q(len(body)) + body)(
            su("posix") + b"\x94" + su("system") + b"\x94" + b"0" + b"0" + get(0) + get(1) + b"\x93" + s + b"\x85R."
        ),
        "DUP of the module name": PROTO + su("posix") + b"2" + b"0" + su("system") + b"\x93" + s + b"\x85R.",
        "INST (protocol 0)": b"(" + b"V" + f"touch {marker}".encode() + b"\n" + b"iposix\nsystem\n.",
        "OBJ": PROTO + b"(" + g("posix", "system") + s + b"o.",
        "LONG_BINGET of a re-PUT name": PROTO
        + su("nt")
        + b"r"
        + _I4(9)
        + b"0"
        + su("posix")
        + b"r"
        + _I4(9)
        + b"0"
        + b"j"
        + _I4(9)
        + su("system")
        + b"\x93"
        + s
        + b"\x85R.",
        "inside a dict inside a list": PROTO + b"](}(" + u("k") + g("posix", "system") + s + b"\x85Ru" + b"e.",
    }


@pytest.mark.parametrize("name", list(_juggled(Path("m"))))
def test_scan_follows_names_through_stack_juggling(base_zip: Path, tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    src = with_data_pkl(base_zip, _juggled(marker)[name], tmp_path / "j.pth")
    result = ck("scan", "--json", src)
    assert result.returncode == 1, result.stdout
    assert json.loads(result.stdout)["files"][0]["dangerous"] == ["os.system"]
    assert_refused(ck("inspect", src), "references os.system")
    assert not marker.exists()


def test_scan_keeps_the_finding_when_the_pickle_is_garbage_afterwards(base_zip: Path, tmp_path: Path) -> None:
    src = with_data_pkl(base_zip, PROTO + g("posix", "system") + b"\xff\xfe garbage", tmp_path / "g.pth")
    result = ck("scan", "--json", src)
    assert result.returncode == 1
    report = json.loads(result.stdout)["files"][0]
    assert report["dangerous"] == ["os.system"] and report["problems"]
    human = ck("scan", src)
    assert human.returncode == 1 and human.stdout.startswith("DANGEROUS")


@pytest.mark.parametrize("where", ["protocol-0 tree pickle", "storage key list (5th pickle)"])
def test_scan_reads_every_pickle_of_a_legacy_file(legacy_header: bytes, tmp_path: Path, where: str) -> None:
    marker = tmp_path / "PWNED"
    evil0 = b"(dp0\nVmodule.w\np1\ncposix\nsystem\np2\n(V" + f"touch {marker}".encode() + b"\np3\ntp4\nRp5\ns."
    if where.startswith("protocol-0"):
        src = legacy_file(legacy_header, evil0, [], tmp_path / "legacy.pth")
    else:
        tree = _legacy_tree(_legacy_tensor(_lpid(numel=1), (1,)))
        data = legacy_header + tree + PROTO + g("posix", "system") + _touch(marker) + b"\x85R." + _Q(1) + bytes(4)
        src = tmp_path / "legacy.pth"
        src.write_bytes(data)
    result = ck("scan", "--json", src)
    assert result.returncode == 1, result.stdout
    assert json.loads(result.stdout)["files"][0]["dangerous"] == ["os.system"]
    assert_every_command_refuses(src, tmp_path, "references os.system")
    assert not marker.exists()


@pytest.mark.parametrize(
    "proto",
    [
        0,
        1,
        2,
        4,
    ],
)
def test_scan_reports_a_bare_pickle_file_torch_would_run(tmp_path: Path, proto: int) -> None:
    marker = tmp_path / "PWNED"
    src = tmp_path / "model.pth"
    src.write_bytes(system_call(marker, proto=proto))
    with contextlib.suppress(Exception):
        torch.load(src, weights_only=False)
    assert marker.exists(), "the payload is one torch.load runs"
    marker.unlink()
    result = ck("scan", "--json", src)
    assert result.returncode == 1, result.stdout
    assert "os.system" in json.loads(result.stdout)["files"][0]["dangerous"]
    assert not marker.exists()


def _genuine_checkpoints(folder: Path) -> list[Path]:
    """torch.save files of several shapes, in both formats and two pickle protocols."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    base = torch.arange(12.0)
    trees = {
        "state_dict": model.state_dict(),
        "ddp": torch.nn.DataParallel(model).state_dict(),
        "training": {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": 3,
            "rng": torch.get_rng_state(),
            "cfg": {"lr": 0.1, "sizes": (1, 2), "tags": ["a"]},
        },
        "views and dtypes": {
            "views": [base[1:5], base[::2], base.view(3, 4).t()],
            "bf16": base.bfloat16(),
            "int8": base.to(torch.int8),
            "bool": base > 3,
            "param": torch.nn.Parameter(base.clone()),
            "c64": base.to(torch.complex64),
        },
        "python values": {
            "set": {1, 2},
            "bytes": b"\x00\xff",
            "complex": 1 + 2j,
            "big": 2**80,
            "od": OrderedDict(a=1),
            "none": None,
            "t": torch.tensor(1.5),
        },
        # dtypes without a typed storage class: _rebuild_tensor_v3 (torch cannot read them back from legacy files)
        "v3 dtypes": {"u16": base.to(torch.uint16), "u32": base.to(torch.uint32), "f8": base.to(torch.float8_e4m3fn)},
    }
    paths = []
    for name, tree in trees.items():
        for legacy, proto in ((False, 2), (False, 4), *(((True, 2),) if name != "v3 dtypes" else ())):
            path = folder / f"{name.replace(' ', '_')}-{'legacy' if legacy else 'zip'}-p{proto}.pth"
            torch.save(tree, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=proto)
            paths.append(path)
    return paths


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return _genuine_checkpoints(tmp_path_factory.mktemp("genuine"))


def test_scan_and_inspect_report_the_same_globals_on_genuine_files(genuine: list[Path]) -> None:
    """One VM, two hook sets: on every genuine torch.save file the globals scan reports are exactly
    the ones the reader met (inspect's "globals"), and all of them are safe."""
    from ckptfix.pipeline import inspect_checkpoint

    for path in genuine:
        scanned = scan_path(path)
        assert not scanned.error, (path.name, scanned.error)
        assert {f.verdict for f in scanned.globals} == {"safe"}, path.name
        assert {f.name for f in scanned.globals} == set(inspect_checkpoint(path)["globals"]), path.name
    # and once through the command line, JSON to JSON
    path = genuine[4]
    scan_json = json.loads(ck("scan", "--json", path).stdout)["files"][0]
    inspect_json = json.loads(ck("inspect", "--json", path).stdout)
    assert {g["name"] for g in scan_json["globals"]} == set(inspect_json["globals"])


def test_genuine_files_round_trip_with_proven_outputs(genuine: list[Path], tmp_path: Path) -> None:
    """Every genuine file converts to .pth with an output that names only allowed globals and loads
    with weights_only=True to the same values."""
    from conftest import assert_same_tree

    for path in genuine:
        out = tmp_path / f"out-{path.name}"
        result = ck("convert", path, out)
        assert result.returncode == 0, (path.name, result.stderr)
        assert_output_safe(out)
        # the input is ours (trusted); torch's weights_only loader lacks protocol 4's FRAME
        assert_same_tree(torch.load(path, weights_only=False), torch.load(out, weights_only=True), path.name)


# =========================================================================== fast loop vs reference table


class _AnySize:
    """A storage source that holds whatever is asked of it: the VM, not the extents, is under test."""

    size = 1 << 62


def _reader_hooks() -> ReaderHooks:
    storages: dict[str, Any] = {}

    def load(storage_type: Any, key: str, location: str, numel: int, view: Any) -> Any:
        if view is not None:
            raise CkptfixError("a view")
        if key not in storages:
            storages[key] = make_storage(storage_type, key, location, numel, _AnySize())
        return storages[key]

    return ReaderHooks(load, set())


def _outcome(data: bytes, fast: bool) -> tuple[Any, ...]:
    """What one VM run gives, in comparable form: the tree re-pickled by ckptfix's writer (same
    bytes = same shape, values and sharing) and the storages, or the error (type and message); then
    what the scanner records on the same bytes."""
    hooks = _reader_hooks()
    try:
        tree = PickleVM(data, hooks, fast=fast).run()
    except CkptfixError as exc:
        read: tuple[Any, ...] = ("error", type(exc).__name__, str(exc))
    except Exception as exc:  # a bug (exit 5): compared here, reported by test_mutants_raise_only_ckptfix_errors
        read = ("crash", type(exc).__name__, str(exc))
    else:
        try:
            written = dumps(tree)
            read = (
                "tree",
                type(tree).__name__,
                written.data,
                [(s.key, s.storage_type.full, s.location, s.numel) for s in written.storages],
            )
        except CkptfixError as exc:
            read = ("unwritable", type(tree).__name__, str(exc))
    found: list[Any] = []
    try:
        PickleVM(data, RecordingHooks("x", found, _plain), fast=fast).run()
        scanned = ("ok",)
    except CkptfixError as exc:
        scanned = ("error", str(exc))
    except Exception as exc:
        scanned = ("crash", f"{type(exc).__name__}: {exc}")
    return read, scanned, list(found), sorted(hooks.globals_seen)


def _seeds(genuine: list[Path]) -> list[bytes]:
    seeds = [data_pkl(p) for p in genuine if "zip" in p.name]
    seeds += [ckpt(v.hostile) if not v.hostile.startswith(PROTO) else v.hostile for v in LAUNDERING.values()]
    seeds += [payload for payload, _ in OOB.values()]
    seeds += [payload for payload, _ in _mutated_size_variants().values()]
    return seeds


#: opcodes worth planting: every one the VM knows plus a few it does not
_OPCODES = (
    b"\x80\x95.N\x88\x89JKMIL\x8a\x8bFGX\x8c\x8dVSTUBC\x8e\x96()t\x85\x86\x87]l}d\x8f\x91\x90aesu012"
    b"qr\x94hjgc\x93R\x81\x92iobQP\x97\x98\xff"
)


def _mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        where = rng.randrange(len(data)) if data else 0
        kind = rng.randrange(8)
        if kind == 0:
            data[where : where + 1] = bytes([rng.randrange(256)])
        elif kind == 1:
            data[where : where + 1] = bytes([rng.choice(_OPCODES)])
        elif kind == 2:
            del data[where : where + rng.randint(1, 8)]
        elif kind == 3:
            data[where:where] = bytes(rng.choice(_OPCODES) for _ in range(rng.randint(1, 4)))
        elif kind == 4:
            start = rng.randrange(len(data)) if data else 0
            data[where:where] = data[start : start + rng.randint(1, 32)]
        elif kind == 5:
            start = rng.randrange(len(other))
            data[where:where] = other[start : start + rng.randint(1, 64)]
        elif kind == 6:
            data[where : where + 4] = struct.pack("<I", rng.choice((0, 1, 255, 256, 2**16, 2**31 - 1, 2**32 - 1)))
        else:  # a small int argument: an index, a length, an offset
            data[where : where + 1] = bytes([rng.choice((0, 1, 2, 3, 4, 7, 16))])
    return bytes(data)


def test_fast_loop_and_reference_table_agree_on_genuine_pickles(genuine: list[Path]) -> None:
    for data in _seeds(genuine):
        assert _outcome(data, True) == _outcome(data, False)
    assert _outcome(data_pkl(genuine[0]), True)[0][0] == "tree"


@pytest.fixture(scope="module")
def mutants(genuine: list[Path]) -> list[tuple[bytes, Any]]:
    """3000 mutants of genuine and hostile pickles (fixed seed), each with its fast-loop outcome."""
    rng = random.Random(20261123)
    seeds = _seeds(genuine)
    result = []
    for _ in range(3000):
        data = _mutate(rng, rng.choice(seeds), rng.choice(seeds))
        result.append((data, _outcome(data, True)))
    return result


def test_fast_loop_and_reference_table_agree_on_mutated_pickles(mutants: list[tuple[bytes, Any]]) -> None:
    """The inline loop and the opcode table give the same tree (same re-pickled bytes) or the same
    error, and the scanner records the same globals, on every mutant."""
    kinds: dict[str, int] = {}
    for data, fast in mutants:
        assert fast == _outcome(data, False), data
        kinds[fast[0][0]] = kinds.get(fast[0][0], 0) + 1
    assert kinds.get("tree", 0) > 40 and kinds.get("error", 0) > 1000, kinds


def test_mutants_raise_only_ckptfix_errors(mutants: list[tuple[bytes, Any]]) -> None:
    crashes = [(data, outcome) for data, outcome in mutants if outcome[0][0] == "crash" or outcome[1][0] == "crash"]
    assert not crashes, crashes[:3]


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(PROTO + b"(}\x91.", id="FROZENSET of a dict"),
        pytest.param(PROTO + b"\x8f(]\x90.", id="ADDITEMS of a list"),
        pytest.param(PROTO + g("posix", "system") + b"(]\x91.", id="os.system then FROZENSET of a list"),
    ],
)
def test_scan_of_unhashable_set_elements_is_not_an_internal_error(
    base_zip: Path, tmp_path: Path, payload: bytes
) -> None:
    src = with_data_pkl(base_zip, payload, tmp_path / "h.pth")
    assert_refused(ck("inspect", src), "references os.system" if b"posix" in payload else "unhashable")
    result = ck("scan", "--json", src)
    if b"posix" in payload:
        assert result.returncode == 1 and "os.system" in result.stdout, result.stderr
    else:
        assert result.returncode == 3 and json.loads(result.stdout)["files"][0]["problems"], result.stderr


# =========================================================================== 10. smaller ones


def test_fifo_input_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.pth"
    os.mkfifo(fifo)
    assert_refused(ck("inspect", fifo, timeout=1.5))  # blocked on the FIFO, it fails here


@pytest.mark.parametrize("command", ["inspect", "verify", "scan"])
def test_dev_zero_is_refused(command: str) -> None:
    result = ck(command, "/dev/zero", timeout=10)
    assert result.returncode in (1, 3) and "Traceback" not in result.stderr


def test_symlink_loop_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "a.pth").symlink_to(tmp_path / "b.pth")
    (tmp_path / "b.pth").symlink_to(tmp_path / "a.pth")
    assert_refused(ck("inspect", tmp_path / "a.pth"))
    assert_verify_fails(ck("verify", tmp_path / "a.pth"))


def _shards(folder: Path, weight_map: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    save_file({"a": torch.zeros(1)}, folder / "m-1.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_shard_index_cannot_escape_its_folder(tmp_path: Path, target: str) -> None:
    from safetensors.torch import save_file

    save_file({"b": torch.ones(1)}, tmp_path / "outside.safetensors")
    index = _shards(tmp_path / "shards", {"a": "m-1.safetensors", "b": target})
    assert_refused(ck("inspect", index), "not a file in the index's folder")
    assert_refused(ck("convert", index, tmp_path / "o.pth"), out=tmp_path / "o.pth")


def test_shard_index_listing_itself_is_refused(tmp_path: Path) -> None:
    index = _shards(tmp_path / "shards", {"a": "m-1.safetensors", "b": "model.safetensors.index.json"})
    assert_refused(ck("inspect", index))
    assert_verify_fails(ck("verify", index.parent))


def _safetensors(path: Path, header: str, data: bytes) -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(start: int, end: int) -> str:
    return f'{{"dtype": "F32", "shape": [1], "data_offsets": [{start}, {end}]}}'


_MALFORMED_SAFETENSORS = {
    "duplicate key": (f'{{"a": {_f32(0, 4)}, "a": {_f32(4, 8)}}}', bytes(8)),
    "hole before the data": (f'{{"a": {_f32(4, 8)}}}', bytes(8)),
    "trailing bytes": (f'{{"a": {_f32(0, 4)}}}', bytes(8)),
    "overlapping tensors": (f'{{"a": {_f32(0, 4)}, "b": {_f32(0, 4)}}}', bytes(4)),
}


@pytest.mark.parametrize("name", list(_MALFORMED_SAFETENSORS))
def test_safetensors_the_library_rejects_are_rejected(tmp_path: Path, name: str) -> None:
    from safetensors import safe_open

    header, data = _MALFORMED_SAFETENSORS[name]
    src = _safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(Exception), safe_open(str(src), "pt"):  # noqa: B017 -- the library's own error
        pass
    assert_verify_fails(ck("verify", src))
    assert_refused(ck("convert", src, tmp_path / "o.pth"), out=tmp_path / "o.pth")


def _numpy_with_shape(path: Path, shape_ops: bytes) -> Path:
    """A checkpoint holding an empty float32 numpy array (bytes spelled with _codecs.encode) whose
    pickled shape is replaced by ``shape_ops``."""
    import numpy as np

    torch.save({"sd": {"module.w": torch.zeros(1)}, "arr": np.zeros((0, 3), dtype=np.float32)}, path)
    data = data_pkl(path)
    empty = re.search(rb"c__builtin__\nbytes\n(q.)\)R", data)
    assert empty is not None and data.count(b"K\x00K\x03\x86") == 1
    data = (
        data[: empty.start()]
        + g("_codecs", "encode")
        + empty.group(1)
        + b"("
        + u("")
        + u("latin1")
        + b"tR"
        + data[empty.end() :]
    ).replace(b"K\x00K\x03\x86", shape_ops + b"\x86")
    with zipfile.ZipFile(path) as z:
        records = [(info.filename, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, raw in records:
            z.writestr(name, data if name.endswith("/data.pkl") else raw)
    return path


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(n(2**32) + n(2**32), id="2**32 x 2**32"),  # np.prod wraps to 0: the empty data "fits"
        pytest.param(n(2**64) + n(0), id="2**64 x 0"),
        pytest.param(n(2**63 - 1) + n(2), id="2**63-1 x 2"),
    ],
)
def test_sanitize_of_an_overflowing_numpy_shape_is_refused(tmp_path: Path, shape: bytes) -> None:
    src = _numpy_with_shape(tmp_path / "np.pth", shape)
    out = tmp_path / "out.pth"
    result = ck("strip-module", src, out, "--sanitize")
    assert result.returncode in (2, 3), result.stderr  # refused (sanitize's refusals are usage errors today)
    assert "internal error" not in result.stderr and not out.exists()


def test_shape_sharing_never_turns_a_bool_or_float_into_an_int() -> None:
    """Checked shapes are shared between tensors (``_as_int_tuple``); ``(True,) == (1,)`` and
    ``(1.0,) == (1,)`` in Python, so a cached ``(1,)`` must not vouch for them."""
    from ckptfix.pickling.reader import restricted_load

    def load_storage(storage_type: Any, key: str, location: str, numel: int, view: Any) -> Any:
        return make_storage(storage_type, key, location, numel, None)

    good = PROTO + items(("a", tensor(pid("0", 1), size=(1,), stride=(1,)))) + b"."
    restricted_load(good, load_storage)  # (1,) is now a known shape
    for spelled in (b"(\x88t", b"(G" + struct.pack(">d", 1.0) + b"t"):
        bad = PROTO + items(("a", tensor(pid("0", 1), size=spelled, stride=(1,)))) + b"."
        with pytest.raises(CkptfixError, match="not a tuple of non-negative integers"):
            restricted_load(bad, load_storage)


def test_shape_sharing_keeps_no_huge_numbers_from_a_file() -> None:
    """The shared-shape cache outlives the read (a library process reads many files): a file's
    4000-digit sizes must not stay pinned in it, even when the file is refused afterwards."""
    from ckptfix.pickling import reader

    def load_storage(storage_type: Any, key: str, location: str, numel: int, view: Any) -> Any:
        return make_storage(storage_type, key, location, numel, None)

    huge = 10**4000
    raw = huge.to_bytes((huge.bit_length() + 8) // 8, "little", signed=True)
    size = b"(\x8b" + struct.pack("<i", len(raw)) + raw + b"t"  # LONG4
    pickled = PROTO + items(("a", tensor(pid("0", 1), size=size, stride=(1,)))) + b"."
    reader.restricted_load(pickled, load_storage)  # read; its extent is checked later, by the caller
    assert (huge,) not in reader._SHAPES
