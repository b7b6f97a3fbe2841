"""Hostile pickles are refused before anything in them runs; --unsafe-load is the only way in."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, invoke_cli, no_temp_files

import ckptfix
from ckptfix.errors import UnsafeInputError


class _SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


def _replace_data_pkl(template: Path, dest: Path, payload: bytes) -> None:
    """A real torch zip whose data.pkl is ``payload``: what a tampered checkpoint looks like."""
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = payload if info.filename.endswith("/data.pkl") else src.read(info)
            out.writestr(info.filename, data)


def _malicious_checkpoints(tmp_path: Path, marker: Path) -> dict[str, Path]:
    files = {}
    for name, obj in {
        "os.system": {"state_dict": {"w": torch.zeros(2)}, "x": _SystemCall(marker)},
        "builtins.eval": [_EvalCall(marker)],
    }.items():
        path = tmp_path / f"{name}.pth"
        torch.save(obj, path)  # torch.save pickles the __reduce__ payload, as an attacker would
        files[name] = path
    # nested: the legacy-storage loader that would run torch.load on attacker bytes
    inner = io.BytesIO()
    torch.save(_SystemCall(marker), inner, _use_new_zipfile_serialization=False)
    nested = pickle.dumps({"w": _LoadFromBytes(inner.getvalue())}, protocol=2)
    path = tmp_path / "nested.pth"
    _replace_data_pkl(FIXTURES / "bare_tinynet.pth", path, nested)
    files["torch.storage._load_from_bytes"] = path
    return files


class _LoadFromBytes:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.payload,))


@pytest.mark.parametrize("command", ["strip-module", "add-module", "inspect"])
def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path: Path, command: str) -> None:
    marker = tmp_path / "pwned"
    for global_name, path in _malicious_checkpoints(tmp_path, marker).items():
        args = [command, path] + ([tmp_path / "out.pth"] if command != "inspect" else [])
        result = invoke_cli(*args)
        assert result.returncode == 3, (global_name, result.stderr)
        assert global_name in result.stderr
        # a file that runs code is hostile: no hint to load it or keep that global
        assert "the file is hostile" in result.stderr
        assert "--unsafe-load" not in result.stderr and f"--allow-global {global_name}" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not marker.exists(), f"{global_name} payload ran"
        assert not (tmp_path / "out.pth").exists()
        assert no_temp_files(tmp_path)


def test_refusal_happens_before_the_payload_is_reached(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _malicious_checkpoints(tmp_path, marker)["os.system"]
    with pytest.raises(UnsafeInputError) as info:
        ckptfix.read_checkpoint(path)
    assert info.value.global_name.startswith("os.system")
    assert info.value.global_names == ["posix.system"]  # the spelling --allow-global would need
    assert not marker.exists()


def test_a_refusal_names_every_global_at_once_with_the_ways_out(tmp_path: Path) -> None:
    """One run shows every disallowed global (not the first), as ready-to-paste options; the
    data-only ones suggest --sanitize, and --unsafe-load only for a file that runs no code."""
    import argparse
    import pathlib

    path = tmp_path / "config.pth"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1), "root": pathlib.PurePosixPath("/data")}, path)
    with pytest.raises(UnsafeInputError) as info:
        ckptfix.read_checkpoint(path)
    error = info.value
    assert error.global_names == ["argparse.Namespace", "pathlib.PurePosixPath"]
    text = str(error)
    assert "--allow-global argparse.Namespace --allow-global pathlib.PurePosixPath" in text
    assert "--sanitize" in text and "--unsafe-load" in text and "hostile" not in text
    ckpt = ckptfix.read_checkpoint(path, allow_globals=error.global_names)  # the suggestion works
    assert sorted(ckpt.root) == ["args", "root", "w"]


def test_unsafe_load_reads_a_trusted_checkpoint_with_foreign_objects(tmp_path: Path) -> None:
    src, out = tmp_path / "args.pth", tmp_path / "out.pth"
    sd = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
    torch.save({"state_dict": sd, "args": argparse.Namespace(lr=0.1)}, src)
    refused = invoke_cli("strip-module", src, out)
    assert refused.returncode == 3 and "argparse.Namespace" in refused.stderr
    accepted = invoke_cli("strip-module", src, out, "--unsafe-load")
    assert accepted.returncode == 0, accepted.stderr
    fixed = torch.load(out, weights_only=False)
    assert fixed["args"].lr == 0.1
    assert set(fixed["state_dict"]) == {"weight", "bias"}


def test_allowlist_is_a_subset_of_torchs_weights_only_allowlist() -> None:
    """Whatever we accept, torch.load(weights_only=True) accepts too."""
    from torch._weights_only_unpickler import _get_allowed_globals

    from ckptfix.pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS

    torch_allowed = set(_get_allowed_globals())
    assert TORCH_GLOBALS - torch_allowed == set()
    assert set(PYTHON_GLOBALS) - torch_allowed == set()


@pytest.mark.parametrize("protocol", [2, 4], ids=["global", "opcode"])
def test_frozensets_are_treated_as_torch_treats_them(tmp_path: Path, protocol: int) -> None:
    """torch's weights-only unpickler allows ``builtins.set`` but not ``frozenset`` (neither the
    global nor protocol 4's FROZENSET opcode): an output holding one would not load, so a write
    refuses it unless allowed by name, and what is allowed loads where torch is told so too."""
    src, out = tmp_path / "fs.pth", tmp_path / "out.pth"
    torch.save({"w": torch.ones(2), "tags": {1, 2}, "keys": {frozenset({"a"}): 1}}, src, pickle_protocol=protocol)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)
    refused = invoke_cli("strip-module", src, out)
    assert refused.returncode == 3 and "builtins.frozenset" in refused.stderr, refused.stderr
    assert "--allow-global builtins.frozenset" in refused.stderr and not out.exists()
    kept = invoke_cli("strip-module", src, out, "--allow-global", "builtins.frozenset")
    assert kept.returncode == 0, kept.stderr
    with pytest.raises(pickle.UnpicklingError):
        torch.load(out, weights_only=True)  # what torch needs told, as for the input
    with torch.serialization.safe_globals([frozenset]):
        loaded = torch.load(out, weights_only=True)
    assert loaded["keys"] == {frozenset({"a"}): 1} and loaded["tags"] == {1, 2}
    torch.save({"w": torch.ones(2), "tags": {1, 2}}, src, pickle_protocol=protocol)  # a set alone: read
    assert invoke_cli("strip-module", src, out, "--force").returncode == 0
    assert torch.load(out, weights_only=True)["tags"] == {1, 2}


def test_memory_bomb_arguments_are_refused(tmp_path: Path) -> None:
    """bytearray(10**12) is allow-listed by name but must not allocate."""
    payload = b"\x80\x02c__builtin__\nbytearray\nq\x00\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85R."
    path = tmp_path / "bomb.pth"
    _replace_data_pkl(FIXTURES / "bare_tinynet.pth", path, payload)
    result = invoke_cli("inspect", path)
    assert result.returncode == 3 and "bytearray" in result.stderr
