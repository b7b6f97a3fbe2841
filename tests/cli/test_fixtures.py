"""Real wrapper-saved checkpoints from fixtures/: fixed by ckptfix, loaded strictly into the bare model."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_tree, invoke_cli, reference_strip
from models import TinyNet, tiny_net

import ckptfix
from ckptfix.model.walk import iter_tensors


def _load_strict(path: Path, key: str | None = None) -> TinyNet:
    model = TinyNet()
    state = torch.load(path, weights_only=True, map_location="cpu")
    model.load_state_dict(state[key] if key else state, strict=True)
    return model


def _assert_same_weights(model: torch.nn.Module) -> None:
    expected = tiny_net().state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize(
    ("fixture", "prefixes"),
    [
        ("dataparallel_tinynet.pth", ["module."]),
        ("dataparallel2_tinynet.pth", ["module."]),
        ("ddp_cpu_tinynet.pth", ["module."]),
        ("compiled_tinynet.pth", ["_orig_mod."]),
        ("compile_ddp_tinynet.pth", ["_orig_mod.", "module."]),
        ("legacy_dataparallel_tinynet.pth", ["module."]),
    ],
)
def test_wrapped_fixture_strips_into_bare_model(tmp_path: Path, fixture: str, prefixes: list[str]) -> None:
    src = FIXTURES / fixture
    for i, prefix in enumerate(prefixes):
        out = tmp_path / f"step{i}.pth"
        result = invoke_cli("strip-module", src, out, "--prefix", prefix)
        assert result.returncode == 0, result.stderr
        src = out
    _assert_same_weights(_load_strict(src))
    # torch's own fix: consume_prefix_in_state_dict_if_present, once per prefix, in the same order
    assert_same_tree(torch.load(src, weights_only=True), reference_strip(FIXTURES / fixture, *prefixes))


def test_lightning_checkpoint_strips_model_prefix_and_keeps_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "fixed.ckpt"
    result = invoke_cli("strip-module", FIXTURES / "lightning_tinynet.ckpt", out, "--prefix", "model.")
    assert result.returncode == 0, result.stderr
    fixed = torch.load(out, weights_only=True)
    original = torch.load(FIXTURES / "lightning_tinynet.ckpt", weights_only=True)
    _assert_same_weights(_load_strict(out, "state_dict"))
    for key in ("epoch", "global_step", "pytorch-lightning_version", "lr_schedulers", "hyper_parameters"):
        assert fixed[key] == original[key]
    assert_same_tree(fixed["optimizer_states"], original["optimizer_states"])  # never renamed
    opt = torch.optim.Adam(tiny_net().parameters())
    opt.load_state_dict(fixed["optimizer_states"][0])


def test_add_module_output_loads_into_dataparallel(tmp_path: Path) -> None:
    out = tmp_path / "dp.pth"
    assert invoke_cli("add-module", FIXTURES / "bare_tinynet.pth", out).returncode == 0
    wrapped = torch.nn.DataParallel(TinyNet())
    wrapped.load_state_dict(torch.load(out, weights_only=True), strict=True)
    _assert_same_weights(wrapped.module)
    reference = torch.nn.DataParallel(tiny_net()).state_dict()
    assert dict(torch.load(out, weights_only=True)._metadata) == dict(reference._metadata)


def _retag(src: Path, dst: Path, location: str) -> None:
    """Rewrite every storage's device tag, as a checkpoint saved on that device carries it."""
    ckpt = ckptfix.read_checkpoint(src)
    for _, tensor in iter_tensors(ckpt.root):
        tensor.storage.location = location
    ckptfix.write_checkpoint(ckpt, ckpt.root, dst)


def test_cuda_tagged_dataparallel_checkpoint_is_fixed_without_a_gpu(tmp_path: Path) -> None:
    """Device tags are copied, not interpreted: no CUDA needed to strip a cuda:3 checkpoint."""
    tagged, out = tmp_path / "cuda3.pth", tmp_path / "bare.pth"
    _retag(FIXTURES / "dataparallel_tinynet.pth", tagged, "cuda:3")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tagged, weights_only=True)  # what users hit on a CPU-only box
    result = invoke_cli("strip-module", tagged, out)
    assert result.returncode == 0, result.stderr
    assert ckptfix.inspect_checkpoint(out)["devices"] == {"cuda:3": 9}  # device tags kept
    _assert_same_weights(_load_strict(out))  # _load_strict maps to cpu


#: what fixtures/make_gpu_fixtures.py always writes (gpu_cuda1_tinynet.pth only with a second GPU)
GPU_FIXTURES = {
    "gpu_dataparallel_tinynet.pth": "module.",
    "gpu_ddp_tinynet.pth": "module.",
    "gpu_compiled_tinynet.pth": "_orig_mod.",
}


def check_gpu_fixtures(folder: Path, tmp_path: Path) -> list[str]:
    """Strip every GPU-saved TinyNet in ``folder`` and load it strictly on the CPU; the files checked."""
    found = sorted(p.name for p in folder.glob("gpu_*_tinynet.pth"))
    assert set(GPU_FIXTURES) <= set(found), f"make_gpu_fixtures.py writes all of {sorted(GPU_FIXTURES)}: {found}"
    for name in found:
        src, out = folder / name, tmp_path / name
        devices = ckptfix.inspect_checkpoint(src)["devices"]
        assert set(devices) <= {"cuda:0", "cuda:1"} and sum(devices.values()) == 9, (name, devices)
        if name == "gpu_cuda1_tinynet.pth":  # a bare model's state dict, saved on the second GPU
            result = invoke_cli("strip-module", src, out)
            assert result.returncode == 0 and "no key starts with 'module.'" in result.stdout, result.stderr
            assert not out.exists() and devices == {"cuda:1": 9}
            _assert_same_weights(_load_strict(src))
            continue
        result = invoke_cli("strip-module", src, out, "--prefix", GPU_FIXTURES[name])
        assert result.returncode == 0, (name, result.stderr)
        assert ckptfix.inspect_checkpoint(out)["devices"] == devices  # device tags kept
        model = _load_strict(out)  # maps to the CPU
        expected = tiny_net()
        for param, value in expected.named_parameters():
            assert torch.equal(model.get_parameter(param), value.detach()), (name, param)
        if "compiled" in name:  # saved after one compiled forward pass: BatchNorm counted one more batch
            assert model.bn1.num_batches_tracked.item() == expected.bn1.num_batches_tracked.item() + 1
        else:
            _assert_same_weights(model)
    return found


def test_gpu_saved_fixtures_when_present(tmp_path: Path) -> None:
    """GPU-made fixtures (fixtures/make_gpu_fixtures.py) strip and load strictly on the CPU."""
    if not list(FIXTURES.glob("gpu_*")):
        pytest.skip("no GPU-saved fixtures (fixtures/gpu_*.pth): make them with fixtures/make_gpu_fixtures.py on CUDA")
    assert check_gpu_fixtures(FIXTURES, tmp_path)


def test_torchscript_archive_is_refused_with_advice(tmp_path: Path) -> None:
    result = invoke_cli("strip-module", FIXTURES / "torchscript_tinynet.pt", tmp_path / "x.pth")
    assert result.returncode == 3
    assert "TorchScript" in result.stderr and "torch.jit.load" in result.stderr
    assert not (tmp_path / "x.pth").exists()


def test_tar_named_zip_checkpoint_goes_through_the_engine(tmp_path: Path) -> None:
    src = tmp_path / "model.tar"
    src.write_bytes((FIXTURES / "dataparallel_tinynet.pth").read_bytes())
    report = ckptfix.fix_prefix(src, tmp_path / "out.tar")
    assert report.input_format == "torch-zip" and report.written and not report.notes
    _assert_same_weights(_load_strict(tmp_path / "out.tar"))


def test_metadata_matches_torch_reference_on_dataparallel_fixture(tmp_path: Path) -> None:
    out = tmp_path / "bare.pth"
    ckptfix.fix_prefix(FIXTURES / "dataparallel_tinynet.pth", out)
    ours = torch.load(out, weights_only=True)
    reference = reference_strip(FIXTURES / "dataparallel_tinynet.pth")
    assert isinstance(ours, OrderedDict)
    assert dict(ours._metadata) == dict(reference._metadata)
    assert list(ours) == list(reference)
