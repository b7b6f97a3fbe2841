"""Deflated zip records are inflated against a ratio and an absolute budget everywhere (issue 22):
a 32 KB file whose storage record declares 32 MiB of zeros drove scan, safetensors output, diff
and --verify to several times that in RSS; a deflated ``.pkl`` record did the same to scan. Each
command runs in a fresh process under an address-space limit (``run_cli_batch(limit_as=...)``: a
peak RSS measured there starts at pytest's own, which the child inherits across fork and exec)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import CliResult, run_cli_batch
from hostile import assert_refused, assert_verify_fails
from oracle import torch_view

DECLARED = 1 << 25  # 32 MiB of zeros: ~32 KB deflated, ~1000x


def _deflated_zeros(out: zipfile.ZipFile, name: str) -> None:
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with out.open(info, "w", force_zip64=True) as w:
        chunk = bytes(1 << 22)
        for _ in range(DECLARED // len(chunk)):
            w.write(chunk)


@pytest.fixture(scope="module")
def bombs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``storage``: data/0 is the bomb (the pickle declares that many float32 elements);
    ``pickle``: a second ``.pkl`` record is (scan reads every one)."""
    folder = tmp_path_factory.mktemp("bombs")
    numel = DECLARED // 4
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    pkl = source.read("archive/data.pkl")
    pkl = pkl.replace(b"q\x06K\x04t", b"q\x06J" + numel.to_bytes(4, "little") + b"t")
    pkl = pkl.replace(b"K\x00K\x04\x85", b"K\x00J" + numel.to_bytes(4, "little") + b"\x85")
    assert pkl.count(numel.to_bytes(4, "little")) == 2
    paths = {"storage": folder / "storage.pth", "pickle": folder / "pickle.pth"}
    for kind, path in paths.items():
        with zipfile.ZipFile(path, "w") as out:
            for info in source.infolist():
                if kind == "storage" and info.filename == "archive/data/0":
                    _deflated_zeros(out, info.filename)
                else:
                    content = pkl if kind == "storage" and info.filename.endswith("data.pkl") else source.read(info)
                    out.writestr(info.filename, content)
            if kind == "pickle":
                _deflated_zeros(out, "archive/extra.pkl")
        assert path.stat().st_size < 2 << 20
    return paths


#: the address space each command runs in (``RLIMIT_AS``): ckptfix without torch needs far less,
#: inflating one bomb (32 MiB, held two or three times over before the fix) needs more
LIMIT_AS = 150 << 20


def test_deflated_bombs_are_refused_by_every_command_in_little_memory(bombs: dict[str, Path], tmp_path: Path) -> None:
    """A storage bomb (``storage``) through every command that inflates storages, and a second
    ``.pkl`` record bomb (``pickle``) through scan, which reads every pickle record."""
    src = bombs["storage"]
    assert torch_view(src).loads  # torch itself inflates all of it
    out_st, out_pth = tmp_path / "o.safetensors", tmp_path / "o.pth"

    def scan_refused(result: CliResult) -> None:
        assert result.returncode == 3 and "zip bomb" in result.stderr + result.stdout, result

    commands = {
        ("convert", src, out_st): lambda r: assert_refused(r, "zip bomb", out=out_st),
        ("diff", src, src): lambda r: assert_refused(r, "zip bomb"),
        ("verify", src): lambda r: assert_verify_fails(r, "zip bomb"),
        ("convert", "--format", "pth", "--verify", src, out_pth): lambda r: assert_refused(r, "zip bomb", out=out_pth),
        ("scan", bombs["pickle"]): scan_refused,
    }
    # one process: RLIMIT_AS bounds what each command holds at once, whatever ran before it
    results = run_cli_batch(list(commands), limit_as=LIMIT_AS)
    assert len(results) == len(commands)
    for result, check in zip(results, commands.values()):
        check(result)
