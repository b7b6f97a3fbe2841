"""The oracle itself (tests/oracle.py), kept honest: it records what torch resolves without running
it, it reads trees as torch does, and it fails when pointed at a reader that differs from torch."""

from __future__ import annotations

import pickletools
import struct
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tree
from hostile import g, make_base_zip, system_call, with_data_pkl
from oracle import assert_scan_sees_what_torch_resolves, missed_by_scan, torch_view


def frame_split_payload(command: bytes) -> bytes:
    """A protocol-4 pickle read differently by a linear reader and by CPython's C unpickler on a
    stream without ``peek()`` (how torch reads ``data.pkl``): a SHORT_BINUNICODE whose length runs
    past the end of its FRAME is taken whole from the bytes after the frame by CPython (the two
    bytes left in the frame are dropped), so the two readers continue at different offsets. The
    linear reader sees ``{}``; CPython calls ``posix.system(command)``."""
    after = b"A" * 10  # read as part of the string by both
    linear_tail = b"0."  # linear: POP the string, STOP with {}
    frame = b"}" + b"\x8c" + bytes([2 + len(after)]) + b"zz"  # linear: the string starts with the frame's last 2 bytes
    cpython_tail = b"00" + g("posix", "system") + b"C" + bytes([len(command)]) + command + b"\x85R."
    return b"\x80\x04\x95" + struct.pack("<Q", len(frame)) + frame + after + linear_tail + cpython_tail


def linear_globals(data: bytes) -> set[str]:
    """A reader that differs from torch: pickletools' linear decoding (frames ignored)."""
    names = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.add(arg.replace(" ", "."))
        if op.name == "STOP":
            break
    return names


def test_a_payload_is_recorded_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = with_data_pkl(make_base_zip(tmp_path), system_call(marker), tmp_path / "evil.pth")
    view = torch_view(hostile)
    assert not marker.exists(), "the oracle ran the payload"
    assert "posix.system" in view.globals and view.error is None, view
    assert view.weights_only_error and "posix.system" in view.weights_only_error
    assert_scan_sees_what_torch_resolves(hostile)


def test_a_real_checkpoint_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "real.pth"
    state = {"w": torch.arange(6.0).reshape(2, 3).t(), "n": torch.tensor(3), "meta": {"epoch": 7}}
    torch.save(state, path)
    view = torch_view(path)
    assert view.loads and view.error is None
    assert {"torch._utils._rebuild_tensor_v2", "torch.FloatStorage", "torch.LongStorage"} <= set(view.globals)
    assert_same_tree(view.tree, torch.load(path, weights_only=True))


def test_the_oracle_fails_a_reader_that_differs(tmp_path: Path) -> None:
    """The honesty check: a reader that ignores CPython's frame semantics misses the payload, and
    the oracle's comparison says so. (SHORT_BINBYTES would not do: CPython reads bytes through
    the frame's end, strings not.)"""
    payload = frame_split_payload(b"touch " + str(tmp_path / "ran").encode())
    hostile = with_data_pkl(make_base_zip(tmp_path), payload, tmp_path / "framed.pth")
    view = torch_view(hostile)
    assert not (tmp_path / "ran").exists()
    assert "posix.system" in view.globals
    assert linear_globals(payload) == set()
    assert missed_by_scan(view, linear_globals(payload)) == {"os.system"}
    with pytest.raises(AssertionError, match="torch resolves"):
        # a scan that saw what the linear reader saw would fail the comparison
        assert missed_by_scan(view, []) == set(), "torch resolves more than the reader"


@pytest.mark.engine_independent  # the torch oracle's own recovery; ckptfix reads nothing
def test_a_child_that_dies_is_reported_and_replaced(tmp_path: Path) -> None:
    """A file that kills torch's loader (a dict key nested 300 000 deep: CPython hashes it
    recursively in C) is an answer, ``crashed``, not a hang; the next question gets a new child."""
    path = tmp_path / "deep.pkl"
    path.write_bytes(b"\x80\x02}" + b")" + b"\x85" * 300_000 + b"Ns.")
    view = torch_view(path, timeout=60)
    assert view.crashed and "SIG" in view.crashed, view
    real = tmp_path / "after.pth"
    torch.save({"x": torch.ones(2)}, real)
    assert torch_view(real).loads


def test_a_dcp_folder_is_read_through_torch_dcp_loader() -> None:
    """DCP: ``dcp_to_torch_save``'s loader path, ``.metadata`` and items recorded, the tree returned."""
    folder = Path(__file__).resolve().parents[2] / "fixtures" / "dcp_sharded_2ranks"
    view = torch_view(folder, dcp=True)
    assert view.error is None and view.crashed is None, view
    assert "torch.distributed.checkpoint.metadata.Metadata" in view.globals
    assert set(view.tree) == {"model", "rep", "step"}
    assert_scan_sees_what_torch_resolves(folder, dcp=True)


FIXTURE_FILES = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "fixtures").iterdir() if p.suffix in (".pth", ".ckpt", ".pt")
)


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_scan_of_every_fixture_names_what_torch_resolves(path: Path) -> None:
    """Real checkpoints (CPU- and GPU-saved, legacy, Lightning, TorchScript): scan names every
    global torch resolves reading them."""
    assert_scan_sees_what_torch_resolves(path)
