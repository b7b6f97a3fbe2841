"""On a real copy-on-write file system, surgery shares the input's blocks instead of copying them.

Makes a 300 MB XFS file system (reflink on) in a file and loop-mounts it: needs root, mkfs.xfs
(``apt-get install xfsprogs``) and loop devices. Where any is missing the tests are skipped
with the reason. The offsets rule itself is tested everywhere in ``test_cow.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import invoke_cli
from safetensors.torch import save_file

import ckptfix
from ckptfix.fileio.extents import shared_bytes

#: the share of tensor bytes that must come out shared (the rest: heads and tails of records
#: up to the block boundaries, small tensors, the pickle and the zip directory)
MIN_SHARED = 0.95


def _run(*cmd: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def xfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder on a fresh loop-mounted XFS with reflink; unmounted and deleted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount an XFS image")
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("needs mkfs.xfs (apt-get install xfsprogs)")
    base = tmp_path_factory.mktemp("xfs")
    image, mount = base / "img", base / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(300 << 20)
    made = _run("mkfs.xfs", "-q", "-m", "reflink=1", image)
    if made.returncode:
        pytest.skip(f"mkfs.xfs failed: {made.stderr.strip()}")
    mounted = _run("mount", "-o", "loop", image, mount)
    if mounted.returncode:
        image.unlink()
        pytest.skip(f"cannot loop-mount an XFS image here: {mounted.stderr.strip()}")
    try:
        yield mount
    finally:
        _run("umount", mount)
        image.unlink()


def _tensor_bytes(path: Path) -> int:
    return sum(t.storage.nbytes for t in ckptfix.read_checkpoint(path).root.values())


def _assert_shared(out: Path, data_bytes: int) -> int:
    with open(out, "rb") as f:
        shared = shared_bytes(f.fileno())
    assert shared is not None, "FIEMAP gave no answer on XFS"
    assert shared >= MIN_SHARED * data_bytes, f"{out.name}: {shared} of {data_bytes} tensor bytes shared"
    return shared


@pytest.fixture(scope="module")
def ddp(xfs: Path) -> Path:
    """~40 MB: 16 tensors of 2.5 MB and a few small ones, `module.` keys."""
    g = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(640_000 + 16 * i, generator=g) for i in range(16)}
    sd.update({f"module.norm{i}.bias": torch.randn(50, generator=g) for i in range(4)})
    path = xfs / "ddp.pth"
    torch.save(sd, path)
    return path


def test_strip_module_shares_blocks_and_xfs_io_agrees(xfs: Path, ddp: Path) -> None:
    out = xfs / "bare.pth"
    result = invoke_cli("strip-module", ddp, out, "--json")
    assert result.returncode == 0, result.stderr
    shared = _assert_shared(out, _tensor_bytes(ddp))
    assert json.loads(result.stdout)["shared_bytes"] == shared
    inspected = invoke_cli("inspect", out, "--json")  # inspect says it too, for any file
    assert (
        json.loads(inspected.stdout)["shared_bytes"] == shared and "blocks shared" in invoke_cli("inspect", out).stdout
    )
    # cross-check FIEMAP as read here with xfs_io's own listing (flag 0x2000: shared)
    listing = _run("xfs_io", "-c", "fiemap -v", out).stdout
    by_xfs_io = sum(
        int(total) * 512
        for total, flags in re.findall(r"^\s*\d+: \[\d+\.\.\d+\]:\s+\d+\.\.\d+\s+(\d+)\s+(0x[0-9a-f]+)", listing, re.M)
        if int(flags, 16) & 0x2000
    )
    assert by_xfs_io == shared, listing
    out.unlink()


@pytest.mark.parametrize(
    "command",
    [
        ("add-module",),
        ("rename", "--rule", r"^module\.layer=>encoder.layer"),
        ("remap", "--map-location", "cuda:0"),
    ],
    ids=["add-module", "rename", "remap"],
)
def test_surgery_shares_blocks(xfs: Path, ddp: Path, command: tuple[str, ...]) -> None:
    src, out = ddp, xfs / "out.pth"
    if command[0] == "add-module":
        src = xfs / "bare_src.pth"
        ckptfix.fix_prefix(ddp, src, force=True)
    result = invoke_cli(command[0], src, out, *command[1:])
    assert result.returncode == 0 and out.exists(), result.stderr + result.stdout
    _assert_shared(out, _tensor_bytes(ddp))
    out.unlink()


def test_safetensors_key_rename_shares_blocks(xfs: Path) -> None:
    g = torch.Generator().manual_seed(1)
    src, out = xfs / "a.safetensors", xfs / "b.safetensors"
    save_file({f"module.layer{i}.weight": torch.randn(640_000 + i, generator=g) for i in range(12)}, src)
    result = invoke_cli("convert", src, out, "--strip-prefix", "module.")
    assert result.returncode == 0, result.stderr
    _assert_shared(out, _tensor_bytes(src))
    for path in (src, out):
        path.unlink()


def test_in_place_shares_blocks(xfs: Path, ddp: Path) -> None:
    """--in-place writes a temporary file beside the input and renames it over the input: the
    new file shares the old one's blocks (kept alive here by a hard link, to look at them)."""
    work, keep = xfs / "inplace.pth", xfs / "inplace.orig"
    shutil.copyfile(ddp, work)  # itself a reflink copy
    os.link(work, keep)
    result = invoke_cli("strip-module", work, "--in-place", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["files"][0]["report"]  # --in-place runs as a batch of one
    assert report["shared_bytes"] >= MIN_SHARED * _tensor_bytes(keep)
    assert not os.path.samefile(work, keep)
    _assert_shared(work, _tensor_bytes(keep))
    for path in (work, keep):
        path.unlink()


def test_shards_share_blocks(xfs: Path) -> None:
    """Each shard shares its data; a shard that comes out unchanged is shared whole."""
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(2)
    hub, same, renamed = xfs / "hub", xfs / "same", xfs / "renamed"
    hub.mkdir()
    save_torch_state_dict(
        {f"layer{i}.weight": torch.randn(640_000 + i, generator=g) for i in range(8)}, str(hub), max_shard_size="6MB"
    )
    shards = sorted(hub.glob("*.safetensors"))
    assert len(shards) > 1
    for out, extra in ((same, ()), (renamed, ("--add-prefix", "model."))):
        result = invoke_cli("convert", hub, f"{out}/", "--max-shard-size", "6MB", *extra)
        assert result.returncode == 0, result.stderr
        for shard in shards:
            _assert_shared(out / shard.name, _tensor_bytes(shard))
    for shard in shards:  # unchanged: every block of the file, header included
        with open(same / shard.name, "rb") as f:
            assert shared_bytes(f.fileno()) == shard.stat().st_size
    for folder in (hub, same, renamed):
        shutil.rmtree(folder)
