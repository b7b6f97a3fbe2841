"""Hostile or odd inputs: each is one clear line on stderr and exit 3 (verify: exit 1), never a
traceback, an internal error (exit 5), a hang, or an output file.

Every input is built here, in tmp_path. For safetensors, the reference is the safetensors
library itself: each file ckptfix refuses, ``safetensors.safe_open`` refuses too, and the few
files the library accepts are either accepted by ckptfix as well or refused on purpose (a key
repeated in the header: documented in ``test_repeated_keys_are_refused_though_the_library_keeps_the_last``).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import invoke_cli, no_temp_files
from safetensors import safe_open
from safetensors.torch import save_file

import ckptfix
from ckptfix.errors import BadInputError


def _assert_refused(result, *words: str, code: int = 3) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word.lower() in result.stderr.lower(), (word, result.stderr)


# --- 1. inputs that are neither a regular file nor a folder ------------------------------------


def _socket(folder: Path) -> Path:
    path = folder / "model.pth"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the socket file stays until unlinked
    return path


def _fifo(tmp_path: Path, name: str = "model.pth") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _loop(tmp_path: Path) -> Path:
    (tmp_path / "a.pth").symlink_to(tmp_path / "b.pth")
    (tmp_path / "b.pth").symlink_to(tmp_path / "a.pth")
    return tmp_path / "a.pth"


def _link_to_fifo(tmp_path: Path) -> Path:
    link = tmp_path / "link.pth"
    link.symlink_to(_fifo(tmp_path, "pipe"))
    return link


SPECIAL: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (_fifo, "named pipe"),
    "fifo-index": (lambda tmp: _fifo(tmp, "model.safetensors.index.json"), "named pipe"),
    "link-to-fifo": (_link_to_fifo, "named pipe"),
    "dev-zero": (lambda tmp: Path("/dev/zero"), "character device"),
    "dev-null": (lambda tmp: Path("/dev/null"), "character device"),
    "socket": (_socket, "socket"),
    "symlink-loop": (_loop, "symlink loop"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL))
@pytest.mark.parametrize("command", ["inspect", "convert", "verify"])
def test_non_regular_inputs_are_refused_without_opening_them(tmp_path: Path, case: str, command: str) -> None:
    make, words = SPECIAL[case]
    out = tmp_path / "out.safetensors"
    # AF_UNIX socket paths are limited to about 100 bytes; pytest's tmp_path can be longer
    with tempfile.TemporaryDirectory(prefix="ckf") as short:
        src = make(Path(short) if case == "socket" else tmp_path)
        # a FIFO that were opened would block forever: the timeout turns a hang into a failure
        result = invoke_cli(command, src, *([out] if command == "convert" else []), timeout=60)
    if command == "verify":
        assert result.returncode == 1 and "FAIL" in result.stderr and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    else:
        _assert_refused(result, words)
    assert not out.exists() and no_temp_files(tmp_path)


def test_folder_whose_index_is_a_fifo_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    _fifo(folder, "weights.index.json")  # found by the *.index.json glob, not by a hub name
    _assert_refused(invoke_cli("inspect", folder, timeout=60), "named pipe")


def test_symlink_to_a_checkpoint_is_read(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(4.0)}, tmp_path / "real.pth")
    (tmp_path / "link.pth").symlink_to(tmp_path / "real.pth")
    result = invoke_cli("convert", tmp_path / "link.pth", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.arange(4.0))


# --- 2. safetensors headers: exactly what the safetensors library refuses -----------------------


def _st(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _f32(shape: list[int], begin: int, end: int, **extra: object) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end], **extra}


def _nested(depth: int) -> bytes:
    """A header whose first entry carries an unknown field nested so that the whole header is
    ``depth`` arrays/objects deep (the library parses, and limits, fields it then ignores)."""
    inner = depth - 2
    return b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"[" * inner + b"]" * inner + b"}}"


HOSTILE_SAFETENSORS: dict[str, tuple[bytes, str]] = {
    "duplicate tensor key": (
        _st(
            b'{"a":' + json.dumps(_f32([1], 0, 4)).encode() + b',"a":' + json.dumps(_f32([1], 4, 8)).encode() + b"}",
            bytes(8),
        ),
        "appears twice",
    ),
    "duplicate field in an entry": (
        _st(b'{"a":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "appears twice",
    ),
    "duplicate __metadata__": (_st(b'{"__metadata__":{"k":"1"},"__metadata__":{"k":"2"}}'), "appears twice"),
    "overlapping offsets": (_st({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12)), "overlap"),
    "same offsets twice": (_st({"a": _f32([1], 0, 4), "b": _f32([1], 0, 4)}, bytes(4)), "overlap"),
    "hole between tensors": (_st({"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, bytes(12)), "unused bytes"),
    "hole before the first tensor": (_st({"a": _f32([1], 4, 8)}, bytes(8)), "unused bytes"),
    "trailing bytes": (_st({"a": _f32([1], 0, 4)}, bytes(8)), "after the last"),
    "trailing bytes, no tensors": (_st({}, b"x"), "after the last"),
    "data shorter than the offsets": (_st({"a": _f32([4], 0, 16)}, bytes(8)), "truncated"),
    "length not dtype x shape": (_st({"a": _f32([2], 0, 4)}, bytes(4)), "does not fit"),
    "shape product overflows u64": (_st({"a": _f32([2**40, 2**40, 0], 0, 0)}), "too large"),
    "header length beyond the file": (struct.pack("<Q", 10**6) + b'{"a": 1}', "beyond the end of the file"),
    "header length above 100 MB": (struct.pack("<Q", 10**15) + b'{"a": 1}', "beyond"),
    "non-UTF-8 header": (_st(b'{"\xff":{}}'), "utf-8"),
    "invalid JSON": (_st(b'{"a": {"dtype": "F32",}}'), "invalid json"),
    "NaN": (_st(b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":NaN}}'), "nan"),
    "nested 100000 deep": (_st(b'{"a":' * 100_000 + b"1" + b"}" * 100_000), "nested too deeply"),
    "nested 128 deep": (_st(_nested(128), bytes(4)), "invalid"),
    "lone surrogate in a name": (
        _st(b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "unicode",
    ),
    "entry not an object": (_st(b'{"a": 5}'), "corrupt safetensors entry"),
    "entry null": (_st(b'{"a": null}'), "corrupt safetensors entry"),
    "missing shape": (_st(b'{"a":{"dtype":"F32","data_offsets":[0,0]}}'), "corrupt safetensors entry"),
    "unknown dtype": (_st({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "dtype"),
    "dtype not a string": (_st({"a": {"dtype": 1, "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "dtype"),
    "shape of strings": (_st({"a": _f32(["1"], 0, 4)}, bytes(4)), "shape"),
    "shape of booleans": (_st({"a": _f32([True], 0, 4)}, bytes(4)), "shape"),
    "shape of floats": (_st({"a": _f32([1.0], 0, 4)}, bytes(4)), "shape"),
    "negative zero in a shape": (_st(b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'), "shape"),
    "negative dimension": (_st({"a": _f32([-1], 0, 0)}), "shape"),
    "dimension beyond u64": (_st({"a": _f32([2**64, 0], 0, 0)}), "shape"),
    "float offsets": (_st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4]}}', bytes(4)), "data_offsets"),
    "three offsets": (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}}, bytes(4)), "data_offsets"),
    "__metadata__ with a number": (_st({"__metadata__": {"epoch": 3}}), "__metadata__"),
    "__metadata__ with null": (_st({"__metadata__": {"epoch": None}}), "__metadata__"),
    "__metadata__ a list": (_st({"__metadata__": []}), "__metadata__"),
    "__metadata__ a string": (_st({"__metadata__": ""}), "__metadata__"),
}


def _library_reads(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


@pytest.mark.parametrize("case", sorted(HOSTILE_SAFETENSORS))
def test_hostile_safetensors_refused_like_the_library(tmp_path: Path, case: str) -> None:
    data, words = HOSTILE_SAFETENSORS[case]
    src = tmp_path / "bad.safetensors"
    src.write_bytes(data)
    with pytest.raises(Exception):  # noqa: B017 (the library raises SafetensorError or its own kinds)
        _library_reads(src)
    out = tmp_path / "out.pth"
    _assert_refused(invoke_cli("convert", src, out), words)
    assert not out.exists() and no_temp_files(tmp_path)
    verify = invoke_cli("verify", src)
    assert verify.returncode == 1 and "FAIL" in verify.stderr and "Traceback" not in verify.stderr, verify.stderr
    with pytest.raises(BadInputError):
        ckptfix.read_checkpoint(src)


ACCEPTED_SAFETENSORS: dict[str, bytes] = {
    "no tensors": _st({}),
    "__metadata__ null": _st({"__metadata__": None, "a": _f32([1], 0, 4)}, bytes(4)),
    "unknown field": _st({"a": _f32([1], 0, 4, extra={"note": [1, 2]})}, bytes(4)),
    "nested 127 deep": _st(_nested(127), bytes(4)),
    "whitespace around the header": _st(b'\n\t {"a":' + json.dumps(_f32([1], 0, 4)).encode() + b"}  ", bytes(4)),
    "zero-size tensors at one offset": _st(
        {"a": _f32([0], 0, 0), "b": _f32([0], 0, 0), "c": _f32([1], 0, 4)}, bytes(4)
    ),
    "huge dimensions after a zero": _st({"a": _f32([0, 2**40, 2**40], 0, 0)}),
    "entries out of offset order": _st({"b": _f32([1], 4, 8), "a": _f32([1], 0, 4)}, bytes(8)),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_SAFETENSORS))
def test_what_the_library_accepts_is_read(tmp_path: Path, case: str) -> None:
    src = tmp_path / "ok.safetensors"
    src.write_bytes(ACCEPTED_SAFETENSORS[case])
    expected = _library_reads(src)
    ckpt = ckptfix.read_checkpoint(src)
    assert sorted(ckpt.root) == sorted(expected)
    assert {k: list(t.shape) for k, t in ckpt.root.items()} == {k: list(t.shape) for k, t in expected.items()}
    verify = invoke_cli("verify", src)
    assert verify.returncode == 0, verify.stderr


@pytest.mark.parametrize(
    ("header", "data", "library_sees"),
    [
        # the library keeps the last "a", an int32; a first-wins reader would see a float32
        (
            b'{"a":' + json.dumps(_f32([1], 0, 4)).encode() + b',"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}',
            b"\x01\x00\x00\x00",
            {"a": torch.int32},
        ),
        # ... and the last value of a repeated __metadata__ key: a tie record could point anywhere
        (b'{"__metadata__":{"tied":"x","tied":"y"}}', b"", {}),
    ],
)
def test_repeated_keys_are_refused_though_the_library_keeps_the_last(
    tmp_path: Path, header: bytes, data: bytes, library_sees: dict
) -> None:
    """A deliberate difference: the library (serde_json into a HashMap) accepts a repeated key
    when the surviving entries still tile the data, and keeps the last one. Two readers of such a
    header can disagree on what a tensor is, so ckptfix refuses it instead of picking one."""
    src = tmp_path / "dup.safetensors"
    src.write_bytes(_st(header, data))
    assert {k: t.dtype for k, t in _library_reads(src).items()} == library_sees
    _assert_refused(invoke_cli("inspect", src), "appears twice")
    assert invoke_cli("verify", src).returncode == 1


# --- 3. HF shard indexes ------------------------------------------------------------------------


def _shard_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(3)}, folder / "model-00002-of-00002.safetensors")
    return folder


def _write_index(folder: Path, weight_map: dict | bytes, name: str = "model.safetensors.index.json") -> Path:
    index = folder / name
    if isinstance(weight_map, bytes):
        index.write_bytes(weight_map)
    else:
        index.write_text(json.dumps({"metadata": {"total_size": 20}, "weight_map": weight_map}))
    return index


def _outside_shard(tmp_path: Path) -> str:
    save_file({"b": torch.zeros(3)}, tmp_path / "outside.safetensors")  # exists: refusal is not "missing"
    return "../outside.safetensors"


def _subfolder_shard(tmp_path: Path) -> str:
    (tmp_path / "model" / "sub").mkdir()
    save_file({"b": torch.zeros(3)}, tmp_path / "model" / "sub" / "x.safetensors")
    return "sub/x.safetensors"


HOSTILE_INDEXES: dict[str, tuple[Callable[[Path], object], str]] = {
    "parent folder": (_outside_shard, "not a file in the index's folder"),
    "absolute path": (lambda tmp: str(tmp / "outside.safetensors"), "not a file in the index's folder"),
    "sub-folder": (_subfolder_shard, "not a file in the index's folder"),
    "backslash": (lambda tmp: "..\\outside.safetensors", "not a file in the index's folder"),
    "NUL byte": (lambda tmp: "model-00002-of-00002.safetensors\0", "not a file in the index's folder"),
    "drive letter": (lambda tmp: "C:outside.safetensors", "not a file in the index's folder"),
    "itself": (lambda tmp: "model.safetensors.index.json", "lists itself as a shard"),
    "another index": (lambda tmp: "other.index.json", "as a shard"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INDEXES))
def test_index_shard_names_stay_in_the_folder_and_are_not_indexes(tmp_path: Path, case: str) -> None:
    folder = _shard_folder(tmp_path)
    make, words = HOSTILE_INDEXES[case]
    bad = make(tmp_path)
    if case == "absolute path":
        _outside_shard(tmp_path)
    if case == "another index":
        _write_index(folder, {"a": "model-00001-of-00002.safetensors"}, "other.index.json")
    index = _write_index(folder, {"a": "model-00001-of-00002.safetensors", "b": bad})
    for target in (index, folder):
        _assert_refused(invoke_cli("inspect", target, timeout=60), words)
    out = tmp_path / "out.safetensors"
    _assert_refused(invoke_cli("convert", index, out, timeout=60), words)
    assert not out.exists()
    assert invoke_cli("verify", index).returncode == 1


def test_index_naming_a_link_to_its_own_folder_terminates(tmp_path: Path) -> None:
    folder = _shard_folder(tmp_path)
    (folder / "loop").symlink_to(folder)  # a plain name, but a folder: reading it would recurse
    index = _write_index(folder, {"a": "model-00001-of-00002.safetensors", "b": "loop"})
    _assert_refused(invoke_cli("inspect", index), "not a regular file")


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (
            b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"}}',
            "appears twice",
        ),
        (b'{"weight_map":' * 100_000 + b"{}" + b"}" * 100_000, "nested too deeply"),
        (b'{"metadata": 5, "weight_map": {"a": "model-00001-of-00002.safetensors"}}', "metadata"),
        (b'{"weight_map": ["model-00001-of-00002.safetensors"]}', "weight_map"),
        (b"[1, 2]", "weight_map"),
        (b'{"weight_map": {"a": 1}}', "weight_map"),
        (b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}, "x": NaN}', "nan"),
        (b'\xff\xfe{"weight_map": {}}', "utf-8"),
    ],
)
def test_malformed_index_documents_are_refused(tmp_path: Path, document: bytes, words: str) -> None:
    index = _write_index(_shard_folder(tmp_path), document)
    _assert_refused(invoke_cli("inspect", index), words)
    assert invoke_cli("verify", index).returncode == 1


def test_a_valid_index_still_reads(tmp_path: Path) -> None:
    folder = _shard_folder(tmp_path)
    _write_index(folder, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    assert invoke_cli("verify", folder).returncode == 0
    tree = ckptfix.read_checkpoint(folder).root
    assert sorted(tree) == ["a", "b"]


# --- 4. --sanitize on numpy arrays whose shape lies ---------------------------------------------


class _PickledArray:
    """Pickles exactly as a numpy array does (``_reconstruct`` + a state tuple), with any shape
    and bytes, as a hostile file could."""

    def __init__(self, shape: tuple, raw: bytes, dtype: str = "<f4") -> None:
        self.shape, self.raw, self.dtype = shape, raw, dtype

    def __reduce__(self):
        reconstruct, args, _ = np.zeros(1).__reduce__()
        return reconstruct, args, (1, self.shape, np.dtype(self.dtype), False, self.raw)


@pytest.mark.parametrize(
    ("shape", "raw"),
    [
        ((7, pow(7, -1, 2**64)), bytes(4)),  # np.prod wraps to 1 in int64: the old check passed, numpy failed
        ((2**62, 2**62), bytes(16)),
        ((0, 2**62, 2**62), bytes(4)),  # no elements, yet too large for numpy
        ((3,), bytes(4)),  # fewer bytes than the shape needs
        ((1,), bytes(8)),  # more bytes than the shape needs
        ((1,) * 40, bytes(4)),  # more dimensions than numpy allows
    ],
)
def test_sanitize_refuses_arrays_whose_shape_does_not_match_their_bytes(
    tmp_path: Path, shape: tuple, raw: bytes
) -> None:
    src, out = tmp_path / "train.pth", tmp_path / "clean.pth"
    torch.save({"w": torch.ones(2), "array": _PickledArray(shape, raw)}, src)
    _assert_refused(invoke_cli("convert", src, out, "--sanitize"), "cannot sanitize a corrupt numpy array")
    assert not out.exists() and no_temp_files(tmp_path)


def test_sanitize_still_converts_an_honest_array(tmp_path: Path) -> None:
    src, out = tmp_path / "train.pth", tmp_path / "clean.pth"
    torch.save({"array": _PickledArray((2, 2), np.arange(4, dtype="<f4").tobytes())}, src)
    result = invoke_cli("convert", src, out, "--sanitize")
    assert result.returncode == 0, result.stderr
    assert torch.equal(torch.load(out, weights_only=True)["array"], torch.arange(4.0).reshape(2, 2))


# --- 5. writes that would materialise views: --max-expand ---------------------------------------


def _expanded(tmp_path: Path, rows: int = 10**6, cols: int = 10**6) -> Path:
    """A 4-byte storage viewed as rows x cols float32 with stride (0, 0): 4 TB written in full."""
    src = tmp_path / "expanded.pth"
    torch.save({"w": torch.zeros(1).expand(rows, cols)}, src)
    assert src.stat().st_size < 4096
    return src


@pytest.mark.parametrize("target", ["out.safetensors", "shards/"])
@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--max-expand", "1TB"]])
def test_stride_zero_view_is_refused_before_writing(tmp_path: Path, target: str, extra: list[str]) -> None:
    src = _expanded(tmp_path)
    out = tmp_path / target
    result = invoke_cli("convert", src, str(out) + ("/" if target.endswith("/") else ""), *extra, timeout=60)
    _assert_refused(result, "'w'", "stride [0, 0]", "--max-expand")
    assert not out.exists() or not any(out.iterdir())
    assert no_temp_files(tmp_path)


@pytest.mark.parametrize(
    "command",
    [
        ["publish", "{src}", "{tmp}"],
        ["fit", "{src}", "{tmp}/fit.safetensors", "--reference", "{src}"],
        ["add-module", "{src}", "{tmp}/s.safetensors"],
    ],
)
def test_every_writing_command_has_the_budget(tmp_path: Path, command: list[str]) -> None:
    src = _expanded(tmp_path)
    args = [a.format(src=src, tmp=tmp_path) for a in command]
    _assert_refused(invoke_cli(*args, timeout=60), "--max-expand")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expanded.pth"]


def test_max_expand_raises_and_lowers_the_budget(tmp_path: Path) -> None:
    src = _expanded(tmp_path, 1000, 1000)  # 4 MB once written out, under the 1 GiB default
    out = tmp_path / "out.safetensors"
    assert invoke_cli("convert", src, tmp_path / "default.safetensors").returncode == 0
    _assert_refused(invoke_cli("convert", src, out, "--max-expand", "1MB"), "'w'", "--max-expand")
    assert not out.exists()
    result = invoke_cli("convert", src, out, "--max-expand", "4000000")
    assert result.returncode == 0, result.stderr
    assert torch.equal(_library_reads(out)["w"], torch.zeros(1000, 1000))
    usage = invoke_cli("convert", src, tmp_path / "x.safetensors", "--max-expand", "lots")
    assert usage.returncode == 2 and "invalid size" in usage.stderr


def test_views_stay_views_in_pth_output(tmp_path: Path) -> None:
    src, out = _expanded(tmp_path), tmp_path / "out.pth"
    result = invoke_cli("convert", src, out, "--max-expand", "1KB")  # .pth keeps the 4-byte storage
    assert result.returncode == 0, result.stderr
    w = torch.load(out, weights_only=True, mmap=True)["w"]
    assert w.shape == (10**6, 10**6) and w.stride() == (0, 0) and w.untyped_storage().nbytes() == 4


def test_many_overlapping_views_add_up(tmp_path: Path) -> None:
    """No single view is large, but each is written out in full: 2000 x 1 MB from 1 MB."""
    base = torch.zeros(256 * 1024)
    src = tmp_path / "views.pth"
    torch.save({f"t{i:04d}": base[i:] for i in range(2000)}, src)
    out = tmp_path / "out.safetensors"
    _assert_refused(invoke_cli("convert", src, out), "the tensors would be written out", "largest", "--max-expand")
    assert not out.exists()


def test_budget_applies_to_tensors_read_through_torch(tmp_path: Path) -> None:
    """--unsafe-load gives real tensors, which .contiguous() would materialise in memory."""
    import fractions

    src, out = tmp_path / "unsafe.pth", tmp_path / "out.safetensors"
    torch.save({"w": torch.zeros(1).expand(10**6, 10**6), "f": fractions.Fraction(1, 3)}, src)
    assert not ckptfix.read_checkpoint(src, unsafe_load=True).lazy
    result = invoke_cli("convert", src, out, "--unsafe-load", "--drop", "f", timeout=60)
    _assert_refused(result, "'w'", "--max-expand")
    assert not out.exists()


def test_api_write_checkpoint_has_the_budget(tmp_path: Path) -> None:
    ckpt = ckptfix.read_checkpoint(_expanded(tmp_path))
    out = tmp_path / "api.safetensors"
    with pytest.raises(BadInputError, match="max-expand"):
        ckptfix.write_checkpoint(ckpt, ckpt.root, out)
    assert not out.exists() and no_temp_files(tmp_path)
