"""DeepSpeed folders through the command line: every command reads one, the outputs load into a
fresh model with ``load_state_dict(strict=True)`` and with ``safetensors.torch.load_file``, and a
broken folder is exit 3 with nothing written. The folders are real DeepSpeed saves
(fixtures/make_deepspeed_fixtures.py); values are checked bitwise in tests/unit/test_deepspeed.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, invoke_cli, no_temp_files
from deepspeed_models import ZeroNet
from safetensors import safe_open
from safetensors.torch import load_file

DS = FIXTURES / "deepspeed"
CASES = sorted(p.name for p in DS.iterdir() if p.is_dir())


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """load_file, plus the tied names its metadata records (stored once, as save_model does)."""
    loaded = load_file(path)
    with safe_open(path, "pt") as f:
        aliases = {k: v for k, v in (f.metadata() or {}).items() if v in loaded and k not in loaded}
    return {**loaded, **{alias: loaded[kept] for alias, kept in aliases.items()}}


@pytest.mark.parametrize("case", CASES)
def test_convert_loads_strictly_into_a_fresh_model(case: str, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = invoke_cli("convert", DS / case, out)
    assert result.returncode == 0, result.stderr
    assert "DeepSpeed ZeRO-" in result.stderr  # the note says what was read
    state = _load_safetensors(out)
    expected = torch.load(DS / f"{case}.module.pth", weights_only=True)
    assert list(state) == list(expected) or set(state) == set(expected)
    model = ZeroNet()
    model.load_state_dict(state, strict=True)
    reference = torch.load(DS / f"{case}.fp32.pth", weights_only=True) if not case.startswith("z0") else expected
    assert torch.equal(model.mid.weight.data, reference["mid.weight"].to(model.mid.weight.dtype))
    pth = tmp_path / "model.pth"
    assert invoke_cli("convert", DS / case, pth).returncode == 0
    loaded = torch.load(pth, weights_only=True, mmap=True)
    assert list(loaded) == list(expected)  # the model's state_dict() order
    assert loaded["head.weight"].data_ptr() == loaded["emb.weight"].data_ptr()  # the tie, restored
    ZeroNet().load_state_dict(loaded, strict=True)


def test_hub_shards_and_module_weights(tmp_path: Path) -> None:
    """ZeRO folder -> safetensors shards for the hub; --weights module keeps the trained dtype."""
    shards = tmp_path / "hub"
    result = invoke_cli("convert", DS / "z3_bf16_w3", shards, "--max-shard-size", "300B", "--weights", "module")
    assert result.returncode == 0, result.stderr
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(_load_safetensors(shards / shard))
    engine = torch.load(DS / "z3_bf16_w3.module.pth", weights_only=True)
    for key, value in engine.items():
        if key in state:
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    assert state["emb.weight"].dtype == torch.bfloat16


def test_inspect_json_and_every_reading_command(tmp_path: Path) -> None:
    result = invoke_cli("inspect", DS / "z2_fp16_w3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["format"] == "deepspeed"
    info = report["deepspeed"]
    assert (info["stage"], info["world_size"], info["dtype"], info["tag"]) == (2, 3, "float16", "global_step2")
    assert (info["parameters"], info["frozen_parameters"], info["weights"]) == (162, 42, "fp32")
    assert info["weights_available"] == ["fp32", "module"]
    module = invoke_cli("inspect", DS / "z2_fp16_w3", "--weights", "module", "--json")
    assert json.loads(module.stdout)["dtypes"]["float16"] == 11
    # diff: the module weights are the engine's
    same = invoke_cli("diff", DS / "z2_fp16_w3", DS / "z2_fp16_w3.module.pth", "--weights", "module")
    assert same.returncode == 0, same.stdout + same.stderr
    differs = invoke_cli("diff", DS / "z2_fp16_w3", DS / "z2_fp16_w3.module.pth")
    assert differs.returncode == 1  # fp32 master weights are not the fp16 ones
    for argv in (
        ["strip-module", DS / "z2_bf16_w2", tmp_path / "s.pth", "--prefix", "emb."],
        ["publish", DS / "z2_bf16_w2", tmp_path / "pub"],
        ["fit", DS / "z2_bf16_w2", tmp_path / "f.pth", "--reference", DS / "z2_bf16_w2.module.pth"],
        ["verify", DS / "z3_fp32_w2"],
        ["scan", DS / "z3_fp32_w2"],
    ):
        result = invoke_cli(*argv)
        assert result.returncode in (0, 1), (argv, result.stderr)
        assert "Traceback" not in result.stderr


def test_tag_option(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(DS / "z2_bf16_w2", run)
    shutil.copytree(run / "global_step2", run / "global_step1")
    result = invoke_cli("inspect", run, "--tag", "global_step1", "--json")
    assert json.loads(result.stdout)["deepspeed"]["tags"] == ["global_step1", "global_step2"]
    assert json.loads(result.stdout)["deepspeed"]["tag"] == "global_step1"
    wrong = invoke_cli("convert", DS / "z2_bf16_w2.module.pth", tmp_path / "x.pth", "--tag", "global_step1")
    assert wrong.returncode == 2 and "not one" in wrong.stderr


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda run: (run / "latest").write_text("../x"), "latest names '../x', which is not a folder name inside"),
        (
            lambda run: (run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
            r"rank\(s\) \[1\] missing",
        ),
        (
            lambda run: shutil.copy(
                run / "global_step2" / "mp_rank_00_model_states.pt", run / "global_step2" / "mp_rank_01_model_states.pt"
            ),
            "tensor-parallel",
        ),
    ],
)
def test_broken_folders_are_exit_3_and_nothing_written(tmp_path: Path, break_it: object, message: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(DS / "z2_fp32_w3", run)
    (tmp_path / "x").mkdir()
    break_it(run)  # type: ignore[operator]
    out = tmp_path / "out"
    out.mkdir()
    for target in (out / "model.safetensors", out / "model.pth", out / "shards"):
        result = invoke_cli("convert", run, f"{target}/" if target.name == "shards" else target)
        assert result.returncode == 3, result.stderr
        assert result.stderr.count("\n") <= 2 and "Traceback" not in result.stderr
        assert re.search(message, result.stderr), result.stderr
        assert not target.exists()
    assert list(out.iterdir()) == [] and no_temp_files(out)
