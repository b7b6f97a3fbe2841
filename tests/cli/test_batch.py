"""Many files per command (CI use): outputs checked against torch, failures reported, verify."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch
from conftest import FIXTURES, assert_same_tree, invoke_cli, reference_strip

import ckptfix
from ckptfix.model.walk import iter_storages


def _many(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        torch.manual_seed(i)
        for p in model.parameters():
            p.data.normal_()
        path = folder / f"ckpt_{i:03d}.pth"
        torch.save(torch.nn.DataParallel(model).state_dict(), path)
        paths.append(path)
    return paths


def test_two_hundred_files_with_two_jobs_match_torch(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 200)
    result = invoke_cli("strip-module", *inputs, "-o", tmp_path / "out", "--jobs", "2", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["counts"]["written"] == 200 and report["counts"]["failed"] == 0 and report["exit_code"] == 0
    assert [f["input"] for f in report["files"]] == [str(p) for p in inputs]
    for src in inputs:
        out = tmp_path / "out" / src.name
        assert_same_tree(torch.load(out, weights_only=True), reference_strip(src))


def test_broken_inputs_with_continue_on_error(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 50)
    for index, junk in ((5, b""), (20, b"<html>404</html>"), (41, inputs[41].read_bytes()[:100])):
        inputs[index].write_bytes(junk)
    result = invoke_cli(
        "strip-module",
        tmp_path / "in",
        "-o",
        tmp_path / "out",
        "--jobs",
        "2",
        "--continue-on-error",
        "--json",
        timeout=300,
    )
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert (report["counts"]["written"], report["counts"]["failed"]) == (47, 3)
    failed = [f for f in report["files"] if f["status"] == "failed"]
    assert [Path(f["input"]).name for f in failed] == ["ckpt_005.pth", "ckpt_020.pth", "ckpt_041.pth"]
    assert all(f["message"] and f["exit_code"] == 3 for f in failed)
    assert len(list((tmp_path / "out").iterdir())) == 47
    assert result.stderr.count("ckptfix: error:") == 3


def test_default_stops_at_the_first_failure(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 6)
    inputs[2].write_bytes(b"not a checkpoint")
    result = invoke_cli("strip-module", *inputs, "-o", tmp_path / "out", "--jobs", "1", "--json")
    assert result.returncode == 3
    report = json.loads(result.stdout)
    assert report["stopped_early"] and [f["status"] for f in report["files"]] == ["written", "written", "failed"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpt_000.pth", "ckpt_001.pth"]


def test_report_order_does_not_depend_on_jobs(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 12)
    reports = []
    for jobs in ("1", "3"):
        out = tmp_path / f"out{jobs}"
        result = invoke_cli("strip-module", *inputs, "-o", out, "--jobs", jobs, "--json")
        reports.append(
            [(Path(f["input"]).name, f["status"], Path(f["output"]).name) for f in json.loads(result.stdout)["files"]]
        )
    assert reports[0] == reports[1]


def test_in_place_with_backup_and_format_change(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 3)
    originals = [p.read_bytes() for p in inputs]
    result = invoke_cli("strip-module", *inputs, "--in-place", "--backup", ".orig")
    assert result.returncode == 0, result.stderr
    for path, original in zip(inputs, originals):
        assert Path(str(path) + ".orig").read_bytes() == original
        assert all(not k.startswith("module.") for k in torch.load(path, weights_only=True))
    converted = invoke_cli("convert", *inputs, "-o", tmp_path / "st", "--format", "safetensors")
    assert converted.returncode == 0
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == [p.stem + ".safetensors" for p in inputs]


def test_batch_usage_errors(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 3)
    assert invoke_cli("strip-module", *inputs).returncode == 2  # three paths, no -o
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / inputs[0].name).write_bytes(inputs[0].read_bytes())
    clash = invoke_cli("strip-module", inputs[0], tmp_path / "b" / inputs[0].name, "-o", tmp_path / "out")
    assert clash.returncode == 2 and "would both be written" in clash.stderr


def test_progress_lines_and_quiet(tmp_path: Path) -> None:
    inputs = _many(tmp_path / "in", 3)
    lines = invoke_cli("strip-module", *inputs, "-o", tmp_path / "out")
    assert lines.returncode == 0 and lines.stderr.count("wrote") == 3
    assert "3 written, 0 unchanged, 0 failed" in lines.stdout
    quiet = invoke_cli("strip-module", *inputs, "-o", tmp_path / "out2", "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""


def test_verify_gate(tmp_path: Path) -> None:
    ok = invoke_cli("verify", FIXTURES / "bare_tinynet.pth", "--expect-prefix", "none", "--expect-device", "cpu")
    assert ok.returncode == 0, ok.stderr
    legacy = invoke_cli("verify", FIXTURES / "legacy_dataparallel_tinynet.pth", FIXTURES / "lightning_tinynet.ckpt")
    assert legacy.returncode == 0 and "2 ok, 0 failed" in legacy.stdout
    wrapped = invoke_cli("verify", FIXTURES / "dataparallel_tinynet.pth", "--expect-prefix", "none", "--json")
    assert wrapped.returncode == 1
    assert "wrapper prefix" in json.loads(wrapped.stdout)["files"][0]["problems"][0]
    assert invoke_cli("verify", FIXTURES / "dataparallel_tinynet.pth", "--expect-prefix", "module.").returncode == 0
    ckpt = ckptfix.read_checkpoint(FIXTURES / "bare_tinynet.pth")
    for storage in iter_storages(ckpt.root):
        storage.location = "cuda:0"
    ckptfix.write_checkpoint(ckpt, ckpt.root, tmp_path / "gpu.pth")
    gpu = invoke_cli("verify", tmp_path / "gpu.pth", "--expect-device", "cpu")
    assert gpu.returncode == 1 and "cuda:0" in gpu.stderr


def test_verify_catches_a_corrupted_record(tmp_path: Path) -> None:
    data = bytearray((FIXTURES / "bare_tinynet.pth").read_bytes())
    with zipfile.ZipFile(FIXTURES / "bare_tinynet.pth") as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    header = info.header_offset
    name_len = int.from_bytes(data[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(data[header + 28 : header + 30], "little")
    start = header + 30 + name_len + extra_len  # the record's data, as the local header places it
    data[start + 3] ^= 0xFF
    (tmp_path / "flipped.pth").write_bytes(bytes(data))
    result = invoke_cli("verify", tmp_path / "flipped.pth")
    assert result.returncode == 1 and "data/0: CRC32" in result.stderr
    shards = tmp_path / "shards"
    ckptfix.convert(FIXTURES / "bare_tinynet.pth", str(shards) + "/", ckptfix.ConvertOptions(max_shard_size=300))
    assert invoke_cli("verify", shards).returncode == 0
    next(shards.glob("model-00001-*")).unlink()
    broken = invoke_cli("verify", shards)
    assert broken.returncode == 1 and "is missing" in broken.stderr
