"""Bad input gets one clear line on stderr, exit 3, no traceback, and no output file."""

from __future__ import annotations

import gzip
import pickle
import random
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, invoke_cli, no_temp_files

DP = FIXTURES / "dataparallel_tinynet.pth"


def _cases(tmp: Path) -> dict[str, tuple[bytes, str]]:
    good = DP.read_bytes()
    buf = tmp / "plain.zip"
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "hello")
    return {
        "empty": (b"", "empty file"),
        "lfs": (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n", "git lfs pull"),
        "html": (b"<!DOCTYPE html><html><body>404 Not Found</body></html>", "HTML"),
        "gzip": (gzip.compress(good), "gzip-compressed torch checkpoint"),
        "text": (b"just some notes about the model\n", "plain text"),
        "pickle": (pickle.dumps({"a": 1}, protocol=4), "plain Python pickle"),
        "random": (random.Random(0).randbytes(4096), "not a checkpoint"),
        "zip-no-torch": (buf.read_bytes(), "not a torch checkpoint"),
        "truncated-end": (good[: len(good) - 10], "truncated"),
        "truncated-half": (good[: len(good) // 2], "truncated"),
    }


@pytest.mark.parametrize(
    "name",
    [
        "empty",
        "lfs",
        "html",
        "gzip",
        "text",
        "pickle",
        "random",
        "zip-no-torch",
        "truncated-end",
        "truncated-half",
    ],
)
@pytest.mark.parametrize("command", ["strip-module", "inspect"])
def test_not_a_checkpoint(tmp_path: Path, name: str, command: str) -> None:
    data, expected = _cases(tmp_path)[name]
    src = tmp_path / "model.pth"
    src.write_bytes(data)
    out = tmp_path / "out.pth"
    result = invoke_cli(command, src, *([out] if command != "inspect" else []))
    assert result.returncode == 3, result.stderr
    assert expected.lower() in result.stderr.lower(), result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists() and no_temp_files(tmp_path)


def test_every_truncation_point_fails_cleanly(tmp_path: Path) -> None:
    """Cut the file anywhere: a clean exit 3 (or, cut inside nothing that matters, a valid output)."""
    good = DP.read_bytes()
    src = tmp_path / "cut.pth"
    for cut in range(0, len(good), 97):
        src.write_bytes(good[:cut])
        result = invoke_cli("strip-module", src, tmp_path / "out.pth")
        assert result.returncode == 3, (cut, result.stderr)
        assert "Traceback" not in result.stderr and not (tmp_path / "out.pth").exists()


def test_storage_record_shorter_than_its_tensors_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "short.pth"
    with zipfile.ZipFile(DP) as z, zipfile.ZipFile(src, "w") as out:
        for info in z.infolist():
            data = z.read(info)
            out.writestr(info.filename, data[:4] if info.filename.endswith("/data/0") else data)
    result = invoke_cli("strip-module", src, tmp_path / "out.pth")
    assert result.returncode == 3 and "truncated or corrupt" in result.stderr


def test_missing_input_and_directory(tmp_path: Path) -> None:
    missing = invoke_cli("strip-module", tmp_path / "nope.pth", tmp_path / "out.pth")
    assert missing.returncode == 3 and "no such file" in missing.stderr
    folder = invoke_cli("inspect", tmp_path)
    assert folder.returncode == 3 and "a folder without a checkpoint" in folder.stderr


def test_unwritable_destination_is_exit_4(tmp_path: Path) -> None:
    """A folder nobody may create files in (sysfs refuses even root): exit 4, one line."""
    result = invoke_cli("strip-module", DP, "/sys/out.pth")
    assert result.returncode == 4, result.stderr
    assert "cannot write" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_output_folder_is_exit_4(tmp_path: Path) -> None:
    result = invoke_cli("strip-module", DP, tmp_path / "no" / "such" / "out.pth")
    assert result.returncode == 4 and "does not exist" in result.stderr


def test_safetensors_whose_header_length_looks_like_a_pickle_header(tmp_path: Path) -> None:
    """0x0280 little-endian starts with 80 02, the bytes that open a protocol-2 pickle."""
    from ckptfix.formats.detect import sniff

    head = (0x280).to_bytes(8, "little") + b"{" + b" " * 0x27F
    assert sniff(head + bytes(64), len(head) + 64).kind == "safetensors"


def test_zip_wrapping_a_checkpoint_says_so(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "download.zip", "w") as z:
        z.write(DP, "weights/model.pth")
    result = invoke_cli("inspect", tmp_path / "download.zip")
    assert result.returncode == 3 and "containing weights/model.pth: extract" in result.stderr


def test_inspect_prints_the_diagnosis_first() -> None:
    first = invoke_cli("inspect", FIXTURES / "legacy_dataparallel_tinynet.pth").stdout.splitlines()[0]
    assert "legacy format" in first
