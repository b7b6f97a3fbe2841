"""Hostile pickles built byte by byte, and the checks on what ckptfix does with them: shared by
tests/cli/test_hostile_core.py (in-process runs) and tests/e2e/test_hostile_processes.py (inputs
that may kill an interpreter, hang it, or whose memory is measured)."""

from __future__ import annotations

import fnmatch
import io
import json
import os
import pickle
import pickletools
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from conftest import CliResult, invoke_cli

from ckptfix.pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS

# =========================================================================== pickle assembly

PROTO = b"\x80\x02"
HOOKS = b"ccollections\nOrderedDict\n)R"  # the empty backward hooks torch.save writes per tensor


def u(text: str) -> bytes:
    """BINUNICODE"""
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def su(text: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4)"""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def g(module: str, name: str) -> bytes:
    """GLOBAL"""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def n(value: int) -> bytes:
    """The shortest int opcode: BININT1 / BININT / LONG1."""
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tup(values: Any) -> bytes:
    return b"(" + b"".join(n(v) for v in values) + b"t"


def put(index: int) -> bytes:
    return b"q" + bytes([index])


def get(index: int) -> bytes:
    return b"h" + bytes([index])


def binbytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def items(*pairs: tuple[str, bytes]) -> bytes:
    """EMPTY_DICT MARK key value ... SETITEMS"""
    return b"}(" + b"".join(u(k) + v for k, v in pairs) + b"u"


def pid(
    key: str = "0",
    numel: int = 4,
    cls: bytes | None = None,
    *,
    legacy: bool = False,
    view: tuple[str, int, int] | None = None,
) -> bytes:
    """A storage persistent id: ("storage", cls, key, "cpu", numel[, view]) BINPERSID."""
    tail = b""
    if legacy:
        tail = b"N" if view is None else b"(" + u(view[0]) + n(view[1]) + n(view[2]) + b"t"
    return b"(" + u("storage") + (cls or g("torch", "FloatStorage")) + u(key) + u("cpu") + n(numel) + tail + b"tQ"


def tensor(
    storage: bytes | None = None, offset: int = 0, size: Any = (4,), stride: Any = (1,), metadata: bytes = b""
) -> bytes:
    """_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()[, metadata]);
    ``size``/``stride`` are int tuples or ready opcodes, ``metadata`` the opcodes of the optional
    seventh argument."""
    size_ops = size if isinstance(size, bytes) else tup(size)
    stride_ops = stride if isinstance(stride, bytes) else tup(stride)
    return (
        g("torch._utils", "_rebuild_tensor_v2")
        + b"("
        + (storage if storage is not None else pid())
        + n(offset)
        + size_ops
        + stride_ops
        + b"\x89"
        + HOOKS
        + metadata
        + b"tR"
    )


def tensor_v3(storage: bytes, dtype: bytes, offset: int = 0, size: Any = (4,), stride: Any = (1,)) -> bytes:
    return (
        g("torch._utils", "_rebuild_tensor_v3")
        + b"("
        + storage
        + n(offset)
        + tup(size)
        + tup(stride)
        + b"\x89"
        + HOOKS
        + dtype
        + b"tR"
    )


def ckpt(extra: bytes | None = None, weight: bytes | None = None) -> bytes:
    """``{"sd": {"module.w": weight}, "x": extra}``: strip-module has a state dict to change, and
    ``extra`` rides beside it."""
    pairs = [("sd", items(("module.w", weight if weight is not None else tensor())))]
    if extra is not None:
        pairs.append(("x", extra))
    return PROTO + items(*pairs) + b"."


#: the state a laundering BUILD would give a Global marker: "become os.system"
POSIX_STATE = items(("module", u("posix")), ("name", u("system")))


def system_call(marker: Path, proto: int = 2) -> bytes:
    """A pickle that runs ``touch marker`` when unpickled."""

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    return pickle.dumps(Evil(), protocol=proto)


# =========================================================================== files


def make_base_zip(folder: Path) -> Path:
    """A genuine torch.save zip: one float32 storage data/0 of 16 bytes (arange(4)) (the test
    modules' ``base_zip`` fixture)."""
    path = folder / "base.pth"
    torch.save({"module.w": torch.arange(4.0)}, path)
    return path


def with_data_pkl(base: Path, payload: bytes, dest: Path, compress: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(base) as z, zipfile.ZipFile(dest, "w") as out:
        for info in z.infolist():
            if info.filename.endswith("/data.pkl"):
                out.writestr(info.filename, payload, compress_type=compress)
            else:
                out.writestr(info.filename, z.read(info))
    return dest


def make_legacy_header() -> bytes:
    """The first three pickles of a legacy torch file (magic, protocol 1001, sys_info), from torch."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(1)}, buffer, _use_new_zipfile_serialization=False)
    data, pos = buffer.getvalue(), 0
    for _ in range(3):
        pos += list(pickletools.genops(data[pos:]))[-1][2] + 1
    return data[:pos]


def legacy_file(header: bytes, tree: bytes, storages: list[tuple[str, int, bytes]], dest: Path) -> Path:
    """header + the tree pickle + the storage key list + per storage: int64 count, raw bytes."""
    data = header + tree + pickle.dumps([k for k, _, _ in storages], protocol=2)
    for _, count, raw in storages:
        data += struct.pack("<q", count) + raw
    dest.write_bytes(data)
    return dest


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


# =========================================================================== tar-era files (torch < 0.4)


def tar_of(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pkl(obj_code: bytes) -> bytes:
    return b"\x80\x02" + obj_code + b"."


FLOAT_ARGS = pkl(b"(X\x01\x00\x00\x000X\x03\x00\x00\x00cpuctorch\nFloatStorage\nt")
TENSOR_ARGS = pkl(b"(X\x01\x00\x00\x001X\x01\x00\x00\x000ctorch\nFloatTensor\nt")


def tar_era(marker: Path, where: str) -> dict[str, bytes]:
    """The three members torch's tar reader unpickles, with a payload in one place: the ``pickle``
    member, the storage views (after one storage's raw bytes, which look like a pickle and are
    not one to torch), a tensor record (after another one's raw shape) or a storage count;
    ``framed``: the views after a storage record pickled in a FRAME longer than its pickle."""
    evil = system_call(marker)
    raw = b"cos\nsystem\n"  # 11 raw bytes torch never unpickles
    args = FLOAT_ARGS
    if where == "framed":  # a FRAME that runs 8 bytes past the STOP: torch reads on after them
        body = FLOAT_ARGS[2:] + struct.pack("<q", 0)  # a linear reader's "0 elements"
        args = b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body
    storages = pickle.dumps(1, 2) + args + struct.pack("<q", 3) + raw.ljust(12, b"\0")
    storages += evil if where in ("views", "framed") else pickle.dumps([], 2)
    tensor = TENSOR_ARGS + struct.pack("<ii", 2, 0) + struct.pack("<5q", 3, 1, 1, 1, 0)
    tensors = pickle.dumps(2, 2) + tensor + (evil if where == "tensor" else tensor)
    members = {
        "storages": evil if where == "count" else storages,
        "tensors": pickle.dumps(0, 2) if where == "count" else tensors,
        "pickle": evil if where == "pickle" else pickle.dumps({"w": 1}, 2),
    }
    return members


# =========================================================================== running ckptfix


def ck(*args: Any, timeout: float = 120) -> CliResult:
    """``ckptfix ARGS`` in-process, through the same ``main`` as the console script."""
    return invoke_cli(*args, timeout=timeout)


def allow_args(allow: tuple[str, ...]) -> list[str]:
    return [arg for name in allow for arg in ("--allow-global", name)]


NAMESPACE = ("argparse.Namespace",)


def assert_refused(result: CliResult, *needles: str, out: Path | None = None) -> None:
    """Exit 3, exactly one stderr line that names the problem, no traceback, no output file."""
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("ckptfix: error: "), lines
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if out is not None:
        assert not out.exists(), f"{out} was written"
        assert not any(p.name.endswith(".ckptfix-tmp") for p in out.parent.iterdir())


def assert_verify_fails(result: CliResult, *needles: str) -> None:
    """``verify`` reports a problem as exit 1 with one FAIL line (it never raises)."""
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:], result.stdout[-500:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def assert_no_signal(result: CliResult) -> None:
    assert result.returncode >= 0, f"killed by signal {-result.returncode}"
    assert result.returncode != 5, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# =========================================================================== output proof

_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


def pickle_globals(data: bytes) -> set[str]:
    """Every global a pickle names, read with pickletools (not with ckptfix). GLOBAL and INST carry
    the name in the opcode; STACK_GLOBAL takes it from the stack, which ckptfix's protocol-2
    writer never uses: meeting one fails the proof rather than guessing."""
    names: set[str] = set()
    for opcode, arg, pos in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST"):
            module, name = arg.split(" ", 1)
            names.add(f"{_PY2_MODULES.get(module, module)}.{name}")
        assert opcode.name != "STACK_GLOBAL", f"STACK_GLOBAL at byte {pos}: global names not provable statically"
    return names


def output_globals(path: Path) -> set[str]:
    """The globals a written output can make a loader resolve: its one data.pkl's (zip), none for
    safetensors (a JSON header and raw bytes)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            pickles = [name for name in z.namelist() if name.lower().endswith(".pkl")]
            assert len(pickles) == 1 and pickles[0].endswith("/data.pkl"), pickles
            return pickle_globals(z.read(pickles[0]))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    json.loads(path.read_bytes()[8 : 8 + header_len])  # a safetensors file: no code can be referenced
    return set()


def assert_output_safe(path: Path, allow: tuple[str, ...] = ()) -> None:
    """The pickletools-level proof: the output names only allow-listed globals or --allow-global ones."""
    assert path.exists(), path
    unexpected = {
        name
        for name in output_globals(path)
        if name not in TORCH_GLOBALS
        and name not in PYTHON_GLOBALS
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in allow)
    }
    assert not unexpected, f"{path} references {sorted(unexpected)}"


# =========================================================================== 4. depth

#: deep enough that recursion left in C would overflow an 8 MiB C stack (ulimit -s's default, the CI
#: machine's): CPython 3.11 crashes hashing a tuple chain from about 130 000 deep (measured: 120 000
#: hashes, 140 000 is SIGSEGV), so 250 000 is twice that -- and far past MAX_NESTING (1000) and
#: MAX_KEY_NESTING (100), the limits the reader must apply first. It was 500 000; scan reads such
#: an input to the end (as CPython does), so its time per input halved (about 15 s of CPU per pass).
DEEP = 250_000


def key_of(key: bytes) -> bytes:
    """``{key: 1}`` as the "x" value."""
    return ckpt(b"}" + key + n(1) + b"s")


DEPTH_REFUSED = {
    "tuple key 250 000 deep": key_of(u("x") + b"\x85" * DEEP),
    "frozenset key 250 000 deep": key_of(b"(" * DEEP + b"\x91" * DEEP),
    "tuple and frozenset key alternating": key_of(b"(" * (DEEP // 2) + u("x") + b"\x85\x91" * (DEEP // 2)),
    "set element 250 000 deep": ckpt(b"\x8f(" + u("x") + b"\x85" * DEEP + b"\x90"),
    "frozenset of a deep tuple": key_of(b"(" + u("x") + b"\x85" * DEEP + b"\x91"),
    "list 250 000 deep": ckpt(b"]" * DEEP + b"a" * (DEEP - 1)),
    "list 1100 deep": ckpt(b"]" * 1100 + b"a" * 1099),
    "dict 1100 deep": ckpt((b"}" + u("k")) * 1100 + b"N" + b"s" * 1100),
    "tuple 1100 deep as a value": ckpt(u("x") + b"\x85" * 1100),
    "_metadata 2000 deep": ckpt(
        g("collections", "OrderedDict")
        + b")R"
        + b"}"
        + u("_metadata")
        + (b"}" + u("k")) * 2000
        + b"N"
        + b"s" * 2000
        + b"s"
        + b"b"
    ),
    "tensor metadata 2000 deep": ckpt(weight=tensor(metadata=b"]" * 2000 + b"a" * 1999)),
    "torch.Size args 2000 deep": ckpt(g("torch", "Size") + b"]" * 2000 + b"a" * 1999 + b"\x85R"),
    "allowed object state 2000 deep": ckpt(g("argparse", "Namespace") + b")\x81" + b"]" * 2000 + b"a" * 1999 + b"b"),
}


#: inputs CPython hashes (dict keys, set elements) or so deep that any recursion left in C would overflow the
#: C stack: a crash there would take pytest down with it, so they run in a subprocess
CRASHY = {name for name in DEPTH_REFUSED if "key" in name or "set" in name or "250 000" in name}


def id_reuse_key(depth: int) -> bytes:
    """A tuple chain ``depth`` deep used as a key, whose last TUPLE1 reuses the address of a small key
    tuple checked (and cached by id) just before and then freed: CPython's 1-tuple free list hands a
    freed address to the next 1-tuple. A hundred such keys are freed, so whichever address comes
    next is a cached one."""
    chain = u("x") + b"\x85" * (depth - 1)
    small = b"}" + b"".join(u(f"a{i}") + b"\x85" + n(1) + b"s" for i in range(100)) + b"0"  # checked, popped
    return ckpt(b"}" + chain + small + b"\x85" + n(1) + b"s")
