"""Review 17: the inert-unknown-globals policy under attack -- dangerous names spelled as dotted
names through another module, records hidden in tuple dict keys, files that make the output
check or --sanitize walk one shared sub-tree once per object, and dangerous names the registry
missed. Each pickle is hand-assembled into a real torch zip (what a tampered file looks like)."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import invoke_cli

_SENTINEL = "zz-review17-extra-zz"


def _s(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"


def _put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def _get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def _checkpoint(path: Path, extra: bytes, protocol: int = 2) -> Path:
    """A torch zip of ``{"state_dict": {"w": tensor}, "extra": <extra>}``, ``extra`` being raw
    opcodes that leave one object on the stack."""
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": _SENTINEL}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(_s(_SENTINEL)) == 1
                data = bytes([0x80, protocol]) + data[2:].replace(_s(_SENTINEL), extra)
            out.writestr(info.filename, data)
    return path


# -- dotted names: protocol 4 resolves them attribute by attribute, through other modules ------------

THROUGH_A_MODULE = {
    "pathlib + os.system": ("pathlib", "os.system"),  # pathlib imports os
    "collections + _sys.exit": ("collections", "_sys.exit"),  # import sys as _sys
    "omegaconf.omegaconf + os.system": ("omegaconf.omegaconf", "os.system"),
    "argparse + Namespace.__init__.__globals__.get": ("argparse", "Namespace.__init__.__globals__.get"),
}


@pytest.mark.parametrize("spelled", THROUGH_A_MODULE.values(), ids=list(THROUGH_A_MODULE))
def test_a_dangerous_name_reached_through_another_module_is_dangerous(tmp_path: Path, spelled: tuple) -> None:
    marker = tmp_path / "ran"
    path = _checkpoint(tmp_path / "c.pth", _call(_stack_global(*spelled), _s(f"touch {marker}")), protocol=4)
    scan = invoke_cli("scan", path)
    assert scan.returncode == 1 and "DANGEROUS" in scan.stdout, scan.stdout
    out = tmp_path / "out.pth"
    for extra in ((), ("--select", "state_dict"), ("--allow-global", f"{spelled[0].split('.')[0]}.*")):
        result = invoke_cli("convert", path, out, *extra)
        assert result.returncode == 3 and "hostile" in result.stderr, (extra, result.stderr)
        assert not out.exists() and not marker.exists()


def test_a_nested_class_name_is_still_only_unknown(tmp_path: Path) -> None:
    """No false alarm: a qualified name through classes (what protocol 4 writes for Outer.Inner)."""
    path = _checkpoint(tmp_path / "c.pth", _call(_stack_global("mymod", "Outer.Inner"), b"K\x01"), protocol=4)
    scan = invoke_cli("scan", path)
    assert scan.returncode == 0 and "unknown: mymod.Outer.Inner" in scan.stdout, scan.stdout
    assert invoke_cli("convert", path, tmp_path / "w.pth", "--select", "state_dict").returncode == 0


# -- records inside tuple dict keys: judged by the output check, not only by the writer's guard ------


def test_a_record_inside_a_tuple_key_is_refused_before_writing(tmp_path: Path) -> None:
    key = b"(" + _call(_global("mymod", "Split"), _s("train")) + b"K\x00t"
    path = _checkpoint(tmp_path / "c.pth", b"}" + key + b"K\x01s")
    out = tmp_path / "out.pth"
    dry = invoke_cli("convert", path, out, "--dry-run")  # used to say "would write"
    assert dry.returncode == 3 and "mymod.Split" in dry.stderr, dry.stderr + dry.stdout
    result = invoke_cli("convert", path, out)
    assert result.returncode == 3 and "--select state_dict" in result.stderr, result.stderr  # the ways out
    assert not out.exists()
    selected = invoke_cli("convert", path, out, "--select", "state_dict")
    assert selected.returncode == 0 and "extra holds mymod.Split" in selected.stderr, selected.stderr


# -- one shared sub-tree, many objects: linear, not quadratic -----------------------------------------

_MANY = 20_000  # before the fix: 64 s (output check) and 45 s (--sanitize) for these 600 KB files


def _shared_list() -> bytes:
    return b"](" + b"K\x01" * _MANY + b"e" + _put(900_000)


def test_many_keys_sharing_one_list_are_checked_in_linear_time(tmp_path: Path) -> None:
    keys = b"".join(
        _call(_global("mymod", "Key"), _shared_list() if i == 0 else _get(900_000), b"J" + struct.pack("<i", i))
        + b"K\x00"
        for i in range(_MANY)
    )
    path = _checkpoint(tmp_path / "c.pth", b"}(" + keys + b"u")
    result = invoke_cli("convert", path, tmp_path / "w.pth", "--select", "state_dict", timeout=20)
    assert result.returncode == 0 and "extra holds mymod.Key" in result.stderr, result.stderr


def test_sanitize_of_many_objects_sharing_one_list_is_linear(tmp_path: Path) -> None:
    objects = b"".join(
        _global("mymod", "Obj") + b")\x81}" + _s("a") + (_shared_list() if i == 0 else _get(900_000)) + b"sb"
        for i in range(_MANY)
    )
    path = _checkpoint(tmp_path / "c.pth", b"](" + objects + b"e")
    out = tmp_path / "plain.pth"
    result = invoke_cli("convert", path, out, "--sanitize", timeout=20)
    assert result.returncode == 0, result.stderr
    extra = torch.load(out, weights_only=True)["extra"]
    assert len(extra) == _MANY and extra[0] == {"a": [1] * _MANY} and extra[-1]["a"] is extra[0]["a"]


# -- dangerous names the registry missed -------------------------------------------------------------

MISSED = [
    ("torch.fx.graph_module", "reduce_graph_module"),  # execs the Python source it is given
    ("logging.config", "dictConfig"),  # "()": "os.system" in a plain dict
    ("logging.config", "fileConfig"),  # eval()s handler arguments
    ("hydra.utils", "instantiate"),  # {"_target_": "os.system"}
    ("hydra._internal.utils", "_locate"),
    ("_winapi", "CreateProcess"),
    ("zipimport", "zipimporter"),
    ("numpy.testing._private.utils", "runstring"),
    ("site", "addsitedir"),  # runs the import lines of .pth files in a folder
]


@pytest.mark.parametrize("spelled", MISSED, ids=[".".join(m) for m in MISSED])
def test_names_that_run_code_are_dangerous(tmp_path: Path, spelled: tuple) -> None:
    path = _checkpoint(tmp_path / "c.pth", _call(_global(*spelled), _s("payload")))
    scan = invoke_cli("scan", path)
    assert scan.returncode == 1 and f"dangerous: {'.'.join(spelled)}" in scan.stdout, scan.stdout
    result = invoke_cli("convert", path, tmp_path / "w.pth", "--select", "state_dict")
    assert result.returncode == 3 and "hostile" in result.stderr, result.stderr


# -- --sanitize converts record dict keys too ----------------------------------------------------------


def test_sanitize_converts_enum_dict_keys(tmp_path: Path) -> None:
    """``{Split.TRAIN: ...}`` (metrics per split) and ``(Split.TRAIN, 0)`` keys, plain or inside an
    omegaconf config: the keys become their values, as the Enum values do (they were refused)."""
    member = _call(_global("mymod", "Split"), _s("train"))
    plain = b"}" + member + b"K\x01s"
    tupled = b"}(" + member + b"K\x00t" + b"K\x02s"
    allowed_key = b"}(" + _global("torch", "float32") + b"K\x03" + member + b"K\x04u"
    extra = b"(" + plain + tupled + allowed_key + b"t"
    path = _checkpoint(tmp_path / "c.pth", extra)
    out = tmp_path / "plain.pth"
    result = invoke_cli("convert", path, out, "--sanitize")
    assert result.returncode == 0, result.stderr
    assert "ignored" not in result.stderr, result.stderr  # converted, not "left out"
    got = torch.load(out, weights_only=True)["extra"]
    assert got == ({"train": 1}, {("train", 0): 2}, {torch.float32: 3, "train": 4})


def test_a_pickle_carried_as_bytes_is_read_once_however_many_objects_hold_it(tmp_path: Path) -> None:
    """One memoized 60 KB protocol-0 pickle (a list of 20k ints) held by 2000 unknown objects: the
    nested-pickle check read it per holder (24 s); once is enough."""
    blob = b"(" + b"I1\n" * 20_000 + b"l."
    extra = b"](cevil\nObj\nq\x00B" + struct.pack("<I", len(blob)) + blob + b"q\x01\x85R"
    extra += b"h\x00h\x01\x85R" * 1999 + b"e"
    src = _checkpoint(tmp_path / "blob.pth", extra)
    result = invoke_cli("inspect", src, timeout=5)  # the inner deadline replaces an outer one
    assert result.returncode == 0 and "evil.Obj" in result.stdout, result.stderr
