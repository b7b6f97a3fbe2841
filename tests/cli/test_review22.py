"""Findings of the adversarial review of issue 22, each compared with what torch resolves (the
oracle): a safetensors file not named .safetensors is unpickled by torch.load from byte 0, and
code-running standard-library and torch names that were missing from the deny-list."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hostile import PROTO, assert_refused, ck, g, items, make_base_zip, tensor, u, with_data_pkl
from oracle import torch_view
from safetensors.torch import load_file


def safetensors_pickle(marker: Path) -> bytes:
    """A valid safetensors file whose first byte is ``V`` (UNICODE): the header has no newline,
    so that text line runs into the tensor bytes, which end it and call os.system."""
    tail = b"\n0" + g("posix", "system") + b"(" + u(f"touch {marker}") + b"tR."
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(tail)], "data_offsets": [0, len(tail)]}})
    size = 0x156  # low byte 'V', no newline among the 8 length bytes
    return struct.pack("<Q", size) + header.encode().ljust(size) + tail


@pytest.mark.parametrize("name", ["model.bin", "pytorch_model.bin", "weights.pt", "model.ckpt"])
def test_a_safetensors_file_torch_unpickles_is_not_clean(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / name
    path.write_bytes(safetensors_pickle(marker))
    assert set(load_file(path)) == {"w"}  # a genuine safetensors file to the library
    assert "posix.system" in torch_view(path).globals and not marker.exists()
    scanned = ck("scan", path)
    assert scanned.returncode == 1 and "os.system" in scanned.stdout, scanned.stdout
    assert ck("verify", path).returncode == 1
    folder = ck("scan", tmp_path)
    assert folder.returncode == 1 and "os.system" in folder.stdout, folder.stdout
    named_right = tmp_path / "model.safetensors"  # torch hands this name to the safetensors library
    named_right.write_bytes(path.read_bytes())
    assert torch_view(named_right).globals == () and ck("scan", named_right).returncode == 0


def test_a_plain_safetensors_file_named_bin_is_clean(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "pytorch_model.bin"
    save_file({"w": torch.ones(3)}, path)
    assert torch_view(path).globals == ()
    assert ck("scan", path).returncode == 0 and ck("verify", path).returncode == 0


#: (module, name, argument opcodes): each runs a command or touches files when called, and is
#: resolved by torch.load(weights_only=False)
CALLS = {
    "_osx_support._read_output": lambda m: u(f"touch {m}"),
    "mailcap.findmatch": lambda m: (
        b"}" + u("a/b") + b"](}" + u("test") + u(f"touch {m}") + u("view") + u("v") + b"uau" + u("a/b")
    ),
    "_pyio.open": lambda m: u(str(m)) + u("w"),
    "sqlite3.connect": lambda m: u(str(m)),
    "logging.handlers.WatchedFileHandler": lambda m: u(str(m)),
    "torch.utils.model_zoo.load_url": lambda m: u("http://127.0.0.1:9/x.pth"),
}


@pytest.mark.parametrize("full", sorted(CALLS))
def test_code_running_names_are_dangerous_to_scan_and_unsafe_load(full: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    module, name = full.rsplit(".", 1)
    call = g(module, name) + b"(" + CALLS[full](marker) + b"tR"
    source = with_data_pkl(
        make_base_zip(tmp_path), PROTO + items(("w", tensor()), ("x", call)) + b".", tmp_path / "in.pth"
    )
    assert full in torch_view(source).globals and not marker.exists()
    scanned = ck("scan", source)
    assert scanned.returncode == 1 and "DANGEROUS" in scanned.stdout.upper(), scanned.stdout
    out = tmp_path / "out.pth"
    assert_refused(ck("convert", source, out, "--unsafe-load"), "hostile", out=out)
    assert not marker.exists(), "the payload ran"
