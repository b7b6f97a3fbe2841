"""``--unsafe-load`` hands a file to ``torch.load(weights_only=False)`` only when it is merely
unusual: a file in which ckptfix's reader has seen a global that runs code is refused before
torch is called, wherever that global sits (first, after a harmless unknown class, in a later
pickle of a legacy file). The payload's marker file proves nothing ran."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
from hostile import (
    PROTO,
    assert_refused,
    ck,
    g,
    items,
    legacy_file,
    make_base_zip,
    make_legacy_header,
    pid,
    system_call,
    tar_era,
    tar_of,
    tensor,
    with_data_pkl,
)
from oracle import torch_view

NAMESPACE = g("argparse", "Namespace") + b")\x81"  # argparse.Namespace() (NEWOBJ): unusual, harmless


def call(marker: Path) -> bytes:
    """The opcodes of ``os.system("touch marker")`` as a value inside another pickle."""
    return system_call(marker)[2:-1]


def zip_with(tmp_path: Path, payload: bytes) -> Path:
    return with_data_pkl(make_base_zip(tmp_path), payload, tmp_path / "in.pth")


def legacy_with_hostile_keys(tmp_path: Path, marker: Path) -> Path:
    """A legacy file whose tree holds only a harmless unknown class, and whose storage key list
    (a later pickle torch also runs) calls os.system."""
    tree = b"\x80\x02" + items(("w", tensor(pid("0", 1, legacy=True), size=(1,))), ("ns", NAMESPACE)) + b"."
    path = legacy_file(make_legacy_header(), tree, [("0", 1, bytes(4))], tmp_path / "in.pt")
    data = path.read_bytes()
    keys = pickle.dumps(["0"], protocol=2)
    at = data.index(keys)
    hostile_keys = b"\x80\x02" + call(marker) + b"0" + keys[2:]  # call it, POP the result, then the list
    path.write_bytes(data[:at] + hostile_keys + data[at + len(keys) :])
    assert struct.unpack_from("<q", path.read_bytes(), at + len(hostile_keys))[0] == 1
    return path


def tar_era_with(where: str) -> object:
    """A tar-era file (torch < 0.4) with ``os.system`` in one of the pickles torch's tar reader runs."""

    def make(tmp: Path, marker: Path) -> Path:
        path = tmp / "old.tar"
        path.write_bytes(tar_of(tar_era(marker, where)))
        return path

    return make


CASES = {
    "system_first": lambda tmp, marker: zip_with(tmp, PROTO + items(("x", call(marker)), ("w", tensor())) + b"."),
    "system_after_a_namespace": lambda tmp, marker: zip_with(
        tmp, PROTO + items(("w", tensor()), ("ns", NAMESPACE), ("x", call(marker))) + b"."
    ),
    "legacy_keys_pickle": legacy_with_hostile_keys,
    **{f"tar_era_{where}": tar_era_with(where) for where in ("pickle", "views", "tensor", "count")},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_unsafe_load_refuses_a_file_that_runs_code(case: str, command: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    source = CASES[case](tmp_path, marker)
    view = torch_view(source)  # torch would run it: the oracle records the call, runs nothing
    assert "posix.system" in view.globals and not marker.exists()
    out = tmp_path / "out.pth"
    args = ["convert", source, out] if command == "convert" else ["inspect", source]
    result = ck(*args, "--unsafe-load")
    assert not marker.exists(), "torch ran the payload"
    assert_refused(result, "os.system", "hostile", out=out)


def test_unsafe_load_still_reads_a_merely_unusual_file(tmp_path: Path) -> None:
    source = zip_with(tmp_path, PROTO + items(("w", tensor()), ("ns", NAMESPACE)) + b".")
    assert "argparse.Namespace" in torch_view(source).globals
    result = ck("convert", source, tmp_path / "out.pth", "--unsafe-load")
    assert result.returncode == 0, result.stderr
