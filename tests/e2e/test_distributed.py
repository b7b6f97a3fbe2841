"""One conversion split over processes by output shard (issue 25): ``torchrun`` starts the ranks
(torch.distributed with gloo on this machine), each writes its shards, rank 0 the index after
all are written; the folder must be byte for byte what one process writes, on local disk and
in a bucket (moto's S3 API on 127.0.0.1, in a thread of this process, as tests/cli/test_remote.py
uses it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import invoke_cli
from safetensors.torch import load, load_file


def _torchrun() -> list[str]:
    here = Path(sys.executable).parent / "torchrun"
    found = str(here) if here.exists() else shutil.which("torchrun")
    if found is None:
        pytest.skip("torchrun is not installed (it comes with torch)")
    return [found]


@pytest.mark.distributed  # torchrun and two ranks importing torch: 11-17 s, its own CI step (-m distributed)
def test_torchrun_split_writes_the_same_folder_as_one_process(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(32, 32, generator=gen) for i in range(12)}
    torch.save(sd, tmp_path / "in.pth")
    args = ["convert", str(tmp_path / "in.pth"), "--strip-prefix", "module.", "--max-shard-size", "9KB"]
    one = invoke_cli(*args[:2], str(tmp_path / "one") + "/", *args[2:])
    assert one.returncode == 0, one.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "ckptfix"]
    split = subprocess.run(
        [*cmd, *args[:2], str(tmp_path / "split") + "/", *args[2:], "--distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert split.returncode == 0, split.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(names) == 7 and names == sorted(p.name for p in (tmp_path / "split").iterdir())
    for name in names:  # byte for byte, index included
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "split" / name).read_bytes(), name
    merged = {k: v for p in (tmp_path / "split").glob("*.safetensors") for k, v in load_file(p).items()}
    assert merged.keys() == {k.removeprefix("module.") for k in sd}


def _state_and_args(tmp_path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """12 tensors of 4 KiB into shards of 9 KB: 6 shards (3 per rank) and the index."""
    gen = torch.Generator().manual_seed(0)
    sd = {f"module.layer{i}.weight": torch.randn(32, 32, generator=gen) for i in range(12)}
    torch.save(sd, tmp_path / "in.pth")
    return sd, ["--strip-prefix", "module.", "--max-shard-size", "9KB"]


def _launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``torchrun`` with two ranks on this machine running ``ckptfix ARGS --distributed``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*cmd, "-m", "ckptfix", *args, "--distributed"], env=env, capture_output=True, text=True, timeout=120
    )


def _ranks(args: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Two ranks of ``ckptfix ARGS --distributed`` started with the environment torchrun gives
    its workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT for gloo's rendezvous), each one's exit
    code and stderr its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    base |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "ckptfix", *args, "--distributed"]
    ranks = [
        subprocess.Popen(
            cmd,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    return [subprocess.CompletedProcess(cmd, rank.returncode, out, err) for rank, (out, err) in zip(ranks, outs)]


@pytest.fixture
def s3() -> Iterator[tuple[Any, Any, list[str]]]:
    pytest.importorskip("s3fs", reason="the S3 tests need the [remote] extra (s3fs) and moto[server]")
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
    import s3fs
    from remote_servers import start_s3

    server = start_s3()
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=server.endpoint, skip_instance_cache=True)
    fs.mkdir("ckpts")
    options = [f"endpoint_url={server.endpoint}", "key=testing", "secret=testing"]
    yield server, fs, [a for o in options for a in ("--storage-option", o)]
    server.stop()


def _objects(fs: Any, prefix: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[1]: fs.cat(p) for p in fs.find(prefix)}


def _uploads_in_progress(fs: Any) -> list[Any]:
    return fs.call_s3("list_multipart_uploads", Bucket="ckpts").get("Uploads", [])


@pytest.mark.distributed  # two torchrun launches, ~10 s each
def test_torchrun_split_to_a_bucket_is_the_single_process_upload(
    tmp_path: Path, s3: tuple[Any, Any, list[str]]
) -> None:
    """Each rank uploads only its shards (streamed multipart uploads), completes them once
    every rank has sent all its parts, then rank 0 the index: the objects are byte for byte
    those one process uploads. A shard refused by the server on one rank: every rank exits 4
    with one line, and the bucket holds nothing of the run -- no shard (no upload was completed:
    the ranks agree before completing), no index, no multipart upload in progress."""
    server, fs, storage = s3
    sd, args = _state_and_args(tmp_path)
    one = invoke_cli("convert", tmp_path / "in.pth", "s3://ckpts/one/", *args, *storage)
    assert one.returncode == 0, one.stderr
    server.traffic.reset()
    split = _launch(["convert", str(tmp_path / "in.pth"), "s3://ckpts/split/", *args, *storage])
    assert split.returncode == 0, split.stderr[-3000:]
    expected, got = _objects(fs, "ckpts/one/"), _objects(fs, "ckpts/split/")
    assert len(expected) == 7 and got.keys() == expected.keys()
    for name in expected:  # object by object, index included
        assert got[name] == expected[name], name
    assert _uploads_in_progress(fs) == []
    completes = [r[1] for r in server.traffic.requests if r[0] == "POST" and "uploadId=" in r[1]]
    assert len(completes) == 7 and "index.json" in completes[-1], completes  # the index last
    merged = {k: v for v in expected.values() if v[:1] != b"{" for k, v in load(v).items()}
    assert merged.keys() == {k.removeprefix("module.") for k in sd}

    # the folder exists now: without --force rank 0 asks once (one listing question, before any
    # reading) and every rank refuses, exit 4, the objects untouched
    server.traffic.reset()
    again = _ranks(["convert", str(tmp_path / "in.pth"), "s3://ckpts/split/", *args, *storage])
    assert [rank.returncode for rank in again] == [4, 4], [rank.stderr for rank in again]
    assert "already exists" in again[0].stderr and "--force" in again[0].stderr
    assert "another process" in again[1].stderr
    assert _objects(fs, "ckpts/split/") == expected
    assert [r for r in server.traffic.requests if r[0] not in ("HEAD", "GET") or "uploads" in r[1]] == []

    def refuse_one_shard(method: str, path: str, range_: str) -> int | None:
        return 403 if method == "PUT" and "partNumber=" in path and "failing/model-00002" in path else None

    server.traffic.on_request = refuse_one_shard
    server.traffic.reset()
    try:  # the two ranks as torchrun starts them, so that each one's own exit code is seen (torchrun
        # reports the ranks that exited before its next poll and stops the rest with SIGTERM)
        failed = _ranks(["convert", str(tmp_path / "in.pth"), "s3://ckpts/failing/", *args, *storage])
    finally:
        server.traffic.on_request = None
    assert [rank.returncode for rank in failed] == [4, 4], [rank.stderr[-2000:] for rank in failed]
    assert failed[1].stderr.splitlines() == [  # rank 1 (shards 2, 4, 6) names its shard; rank 0 says why it stopped
        "ckptfix: error: s3://ckpts/failing/model-00002-of-00006.safetensors: upload failed: "
        "PermissionError: Forbidden; nothing written"
    ]
    assert failed[0].stderr.splitlines() == [
        "ckptfix: error: s3://ckpts/failing: another process of the split write failed (exit 4); nothing written"
    ]
    assert _objects(fs, "ckpts/failing/") == {}
    assert _uploads_in_progress(fs) == []
    log = server.traffic.requests
    assert not [r for r in log if r[0] == "POST" and "failing/" in r[1] and "uploadId=" in r[1]]  # none completed
    begun = {r[1].split("?")[0] for r in log if r[0] == "POST" and r[1].endswith("?uploads")}
    aborted = {r[1].split("?")[0] for r in log if r[0] == "DELETE" and "uploadId=" in r[1]}
    # rank 0 had sent all of its three shards, rank 1 stopped at its first: each upload aborted
    assert len(begun) == 4 and aborted == begun, (begun, aborted)


def test_distributed_outside_torchrun_or_for_one_file_is_a_usage_error(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "in.pth")
    result = invoke_cli("convert", tmp_path / "in.pth", str(tmp_path / "out") + "/", "--distributed")
    assert result.returncode == 2 and "torchrun" in result.stderr
    result = invoke_cli("convert", tmp_path / "in.pth", tmp_path / "out.safetensors", "--distributed")
    assert result.returncode == 2 and "folder" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pth"]
