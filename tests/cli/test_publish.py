"""publish: weights only, prefixes stripped, cpu, named by the sha256 of the bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from conftest import FIXTURES, invoke_cli
from models import TinyNet
from safetensors.torch import load_file

from ckptfix.model.walk import iter_storages


def _retagged_lightning(tmp_path: Path) -> Path:
    import ckptfix

    ckpt = ckptfix.read_checkpoint(FIXTURES / "lightning_tinynet.ckpt")
    for storage in iter_storages(ckpt.root):
        storage.location = "cuda:1"
    ckptfix.write_checkpoint(ckpt, ckpt.root, tmp_path / "gpu.ckpt")
    return tmp_path / "gpu.ckpt"


def test_publish_name_matches_sha256_and_torch_hub_accepts_it(tmp_path: Path) -> None:
    src = _retagged_lightning(tmp_path)
    (tmp_path / "release").mkdir()
    for fmt in ("safetensors", "pth"):
        result = invoke_cli("publish", src, tmp_path / "release", "--name", "tinynet", "--format", fmt, "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        path = Path(report["output"])
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        ext = "safetensors" if fmt == "safetensors" else "pth"
        assert report["sha256"] == digest and path.name == f"tinynet-{digest[:8]}.{ext}"
        fetched = tmp_path / f"fetched.{fmt}"
        torch.hub.download_url_to_file(path.as_uri(), str(fetched), hash_prefix=digest[:8], progress=False)
        state = load_file(fetched) if fmt == "safetensors" else torch.load(fetched, weights_only=True)
        TinyNet().load_state_dict(state, strict=True)  # weights only, no "model." prefix, on cpu
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "release").iterdir()) == ["tinynet", "tinynet"]
