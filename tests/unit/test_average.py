"""``average``: the mean of N checkpoints, checked bitwise against timm's averaging loop.

timm (``avg_checkpoints.py``) needs torchvision, which this environment does not install; the
reference below is its loop written out with torch (from timm 1.0's script): every tensor
``.to(torch.float64)``, summed in input order, ``div_(count)``, clamped to float32's range and
cast to float32. ckptfix keeps each tensor's dtype and takes integer tensors from the last
input, so the comparison is bitwise on float32 models (where timm's output dtype is the
tensor's own), and for float16/bfloat16 against the same loop cast back with ``.to(dtype)``.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file, save_file

from ckptfix.errors import BadInputError, UsageError
from ckptfix.pipeline import ConvertOptions, average_checkpoints, convert


def timm_average(state_dicts: Sequence[dict[str, torch.Tensor]], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """timm's avg_checkpoints.py loop (float64 sum, divide by the count, clamp, cast); ``dtype``
    None: timm's float32 for every tensor, else this dtype (ckptfix's cast back)."""
    avg: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for sd in state_dicts:
        for k, v in sd.items():
            if k not in avg:
                avg[k] = v.clone().to(dtype=torch.float64)
                counts[k] = 1
            else:
                avg[k] += v.to(dtype=torch.float64)
                counts[k] += 1
    for k, v in avg.items():
        v.div_(counts[k])
    info = torch.finfo(torch.float32)
    return {k: v.clamp(info.min, info.max).to(dtype or torch.float32) for k, v in avg.items()}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))


def trained(seed: int, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    net = Net()
    for p in net.parameters():
        p.data.normal_()
    net.bn.running_mean.normal_()
    net.bn.running_var.uniform_(0.5, 2.0)
    net.bn.num_batches_tracked.fill_(100 * seed + 7)
    net.mask[seed % 5] = True
    return net.to(dtype)


def as_float_keys(sd: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in sd.items() if v.is_floating_point()]


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], keys: list[str]) -> None:
    for k in keys:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.parametrize("layout", ["plain", "timm-ema", "lightning-ema"])
def test_bitwise_equal_to_timms_loop_on_timm_style_checkpoints(tmp_path: Path, layout: str) -> None:
    nets = [trained(s) for s in (1, 2, 3)]
    emas = [trained(s + 10) for s in (1, 2, 3)]
    paths = []
    for i, (net, ema) in enumerate(zip(nets, emas, strict=True)):
        sd, ema_sd = net.state_dict(), ema.state_dict()
        tree: Any = {
            "plain": sd,
            "timm-ema": {"state_dict": sd, "state_dict_ema": ema_sd, "epoch": i, "arch": "net"},
            "lightning-ema": {
                "state_dict": {
                    **{f"model.{k}": v for k, v in sd.items()},
                    **{f"model_ema.{k}": v for k, v in ema_sd.items()},
                },
                "epoch": i,
                "optimizer_states": [{"state": {}}],
            },
        }[layout]
        paths.append(tmp_path / f"ep{i}.pth")
        torch.save(tree, paths[-1])
    use_ema = layout != "plain"
    sources = [e.state_dict() for e in emas] if use_ema else [n.state_dict() for n in nets]
    want = timm_average(sources)
    out = tmp_path / "avg.pth"
    report = average_checkpoints(paths, out, options=ConvertOptions(ema=use_ema))
    got = torch.load(out, weights_only=True, mmap=True)
    assert list(got) == list(sources[0])
    assert_bitwise(got, want, as_float_keys(sources[0]))
    # integer and bool tensors: the last input's, in their own dtype (timm writes float32 means)
    for k in ("bn.num_batches_tracked", "mask"):
        assert got[k].dtype == sources[-1][k].dtype and torch.equal(got[k], sources[-1][k])
    assert report.averaged == 8 and sorted(report.from_last) == ["bn.num_batches_tracked", "mask"]
    assert report.reads == 8 * 3 + 2  # every float tensor once per input, the rest once
    fresh = Net()
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(fresh.fc.weight, got["fc.weight"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_and_double_models_stay_in_their_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    sds = [trained(s, dtype).state_dict() for s in (4, 5, 6)]  # 3: x / 3 is not x * (1 / 3)
    paths = []
    for i, sd in enumerate(sds):
        paths.append(tmp_path / f"c{i}.safetensors")
        save_file(sd, paths[-1])
    out = tmp_path / "avg.safetensors"
    average_checkpoints(paths, out)
    got = load_file(out)
    assert_bitwise(got, timm_average(sds, dtype), as_float_keys(sds[0]))
    Net().to(dtype).load_state_dict(got, strict=True)


def test_weighted_mean(tmp_path: Path) -> None:
    sds = [trained(s).state_dict() for s in (1, 2, 3)]
    paths = []
    for i, sd in enumerate(sds):
        paths.append(tmp_path / f"c{i}.pth")
        torch.save(sd, paths[-1])
    coefficients = [0.5, 2.0, 1.25]
    out = tmp_path / "soup.pth"
    report = average_checkpoints(paths, out, "0.5,2,1.25")
    got = torch.load(out, weights_only=True)
    for k in as_float_keys(sds[0]):
        total = sum(c * sd[k].to(torch.float64) for c, sd in zip(coefficients, sds, strict=True))
        want = (total / sum(coefficients)).to(sds[0][k].dtype)
        assert torch.equal(got[k].view(torch.uint8), want.view(torch.uint8)), k
    assert report.coefficients == coefficients
    # a weight of 0 leaves an input out: the mean of the other two
    average_checkpoints(paths, tmp_path / "two.pth", [1, 0, 1])
    two = torch.load(tmp_path / "two.pth", weights_only=True)
    assert_bitwise(two, timm_average([sds[0], sds[2]]), as_float_keys(sds[0]))


def test_any_input_formats_mixed(tmp_path: Path) -> None:
    """A zip .pth, a legacy .pth, safetensors and a shard folder of one model; a DCP folder
    (its largest state dict, read by ckptfix: its values are checked against torch elsewhere)
    with a safetensors file; two DeepSpeed ZeRO folders against zero_to_fp32's own output."""
    sds = [trained(s).state_dict() for s in range(4)]
    zip_pth, legacy, st = tmp_path / "a.pth", tmp_path / "b.pth", tmp_path / "c.safetensors"
    torch.save(sds[0], zip_pth)
    torch.save(sds[1], legacy, _use_new_zipfile_serialization=False)
    save_file(sds[2], st)
    torch.save(sds[3], tmp_path / "d.pth")
    convert(tmp_path / "d.pth", tmp_path / "shards", ConvertOptions(max_shard_size=400))
    inputs = [zip_pth, legacy, st, tmp_path / "shards"]
    report = average_checkpoints(inputs, tmp_path / "avg.pth")
    assert [i["input_format"] for i in report.inputs] == ["torch-zip", "torch-legacy", "safetensors", "sharded"]
    got = torch.load(tmp_path / "avg.pth", weights_only=True)
    assert_bitwise(got, timm_average(sds), as_float_keys(sds[0]))
    assert torch.equal(got["mask"], sds[3]["mask"])

    dcp = FIXTURES / "dcp_sharded_2ranks"
    convert(dcp, tmp_path / "dcp.safetensors", ConvertOptions(select="model"))
    base = load_file(tmp_path / "dcp.safetensors")
    other = {k: (v.double() * 3 - 1).to(v.dtype) for k, v in base.items()}
    save_file(other, tmp_path / "other.safetensors")
    report = average_checkpoints([dcp, tmp_path / "other.safetensors"], tmp_path / "dcp_avg.safetensors")
    assert report.inputs[0]["input_format"] == "dcp" and report.inputs[0]["state_dict"] == "model"
    mixed = load_file(tmp_path / "dcp_avg.safetensors")
    assert_bitwise(mixed, {k: timm_average([base, other], v.dtype)[k] for k, v in base.items()}, list(base))

    ds = FIXTURES / "deepspeed"
    refs = [torch.load(ds / f"{case}.fp32.pth", weights_only=True) for case in ("z2_fp32_w3", "z3_fp32_w2")]
    report = average_checkpoints([ds / "z2_fp32_w3", ds / "z3_fp32_w2"], tmp_path / "ds.pth")
    got = torch.load(tmp_path / "ds.pth", weights_only=True)
    assert sorted(got) == sorted(refs[0]) and report.tied == ["head.weight"]  # tied to emb.weight, kept
    assert_bitwise(got, timm_average(refs), as_float_keys(got))
    assert len(as_float_keys(got)) == len(got) - 1  # bn.num_batches_tracked: int64 as DeepSpeed saved it


def test_mismatched_models_are_refused_naming_the_key_and_file(tmp_path: Path) -> None:
    base = trained(1).state_dict()
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "missing": ({k: v for k, v in base.items() if k != "fc.bias"}, "lacks 'fc.bias'"),
        "extra": ({**base, "head.weight": torch.ones(2)}, "has 'head.weight' beyond it"),
        "shape": ({**base, "fc.bias": torch.ones(6)}, "'fc.bias' is float32[6] where"),
        "dtype": ({**base, "fc.bias": base["fc.bias"].half()}, "'fc.bias' is float16[5]"),
    }
    first = tmp_path / "first.pth"
    torch.save(base, first)
    out = tmp_path / "out.pth"
    for name, (sd, words) in cases.items():
        other = tmp_path / f"{name}.pth"
        torch.save(sd, other)
        with pytest.raises(BadInputError) as info:
            average_checkpoints([first, other], out)
        assert str(other) in str(info.value) and words in str(info.value), name
        assert not out.exists()
    complex_sd = {"w": torch.ones(2, dtype=torch.complex64)}
    torch.save(complex_sd, tmp_path / "z1.pth")
    torch.save(complex_sd, tmp_path / "z2.pth")
    with pytest.raises(BadInputError, match="'w' is complex64"):
        average_checkpoints([tmp_path / "z1.pth", tmp_path / "z2.pth"], out)
    for bad in ("1,2", "1,x,2", "1,-1,1", "0,0,0", "1,nan,1"):
        with pytest.raises(UsageError, match="--coefficients"):
            average_checkpoints([first, first, first], out, bad)
    with pytest.raises(UsageError, match="at least two inputs"):
        average_checkpoints([first], out)
    with pytest.raises(UsageError, match="does not take dtype"):
        average_checkpoints([first, first], out, options=ConvertOptions(dtype="float16"))
    assert not out.exists()


def test_tied_weights_stay_tied(tmp_path: Path) -> None:
    paths = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        emb = torch.randn(6, 3)
        paths.append(tmp_path / f"t{seed}.pth")
        torch.save({"emb.weight": emb, "head.weight": emb, "head.bias": torch.randn(6)}, paths[-1])
    report = average_checkpoints(paths, tmp_path / "avg.pth")
    got = torch.load(tmp_path / "avg.pth", weights_only=True)
    assert report.tied == ["head.weight"] and report.reads == 4
    assert got["emb.weight"].untyped_storage().data_ptr() == got["head.weight"].untyped_storage().data_ptr()


def _peak_bytes(paths: Sequence[Path], out: Path) -> int:
    tracemalloc.start()
    try:
        average_checkpoints(paths, out, options=ConvertOptions(force=True))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_inputs_or_model_size(tmp_path: Path) -> None:
    """16 float32 tensors of 256 KiB per input (4 MiB), 2 and 6 inputs: the write holds one
    tensor's float64 sum, one input's copy and its cast -- about 7x one float32 tensor -- never the
    model, and the same for 6 inputs as for 2 (numpy's buffers are traced by tracemalloc)."""
    tensor_bytes = 256 << 10
    paths = []
    for seed in range(6):
        torch.manual_seed(seed)
        paths.append(tmp_path / f"m{seed}.safetensors")
        save_file({f"layer{i}.weight": torch.randn(tensor_bytes // 4) for i in range(16)}, paths[-1])
    two = _peak_bytes(paths[:2], tmp_path / "two.safetensors")
    six = _peak_bytes(paths, tmp_path / "six.safetensors")
    assert six < two + tensor_bytes, (two, six)
    assert six < 8 * tensor_bytes < 16 * tensor_bytes, six  # the model: 16 tensors per input, 6 inputs


def test_average_of_zip_files_does_not_import_torch(tmp_path: Path) -> None:
    """The mean is numpy arithmetic: the library path imports no torch (checked in this process
    by hiding torch from imports for the call)."""
    three = []
    for seed in (1, 2, 3):
        three.append(tmp_path / f"c{seed}.pth")
        torch.save(trained(seed).state_dict(), three[-1])
    saved = {name: mod for name, mod in sys.modules.items() if name == "torch" or name.startswith("torch.")}
    for name in saved:
        sys.modules[name] = None  # type: ignore[assignment]  # an import of torch now fails
    try:
        report = average_checkpoints(three, tmp_path / "avg.safetensors")
    finally:
        sys.modules.update(saved)
    assert report.written and report.averaged == 8


def test_views_expanded_beyond_their_storage_are_bounded(tmp_path: Path) -> None:
    """A 4-byte storage seen as 2 GiB (stride 0) would be computed in full: refused before
    anything is read, by the --max-expand budget every write of views in full has."""
    for name in ("x1.pth", "x2.pth"):
        torch.save({"w": torch.zeros(1).expand(1 << 29), "b": torch.ones(3)}, tmp_path / name)
    paths = [tmp_path / "x1.pth", tmp_path / "x2.pth"]
    tracemalloc.start()
    try:
        with pytest.raises(BadInputError, match=r"tensor 'w' .* more than the --max-expand budget"):
            average_checkpoints(paths, tmp_path / "avg.pth")
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()
    assert not (tmp_path / "avg.pth").exists()
    for i, name in enumerate(("y1.pth", "y2.pth")):  # 4 MiB in full: within the default budget
        torch.save({"w": torch.full((1,), float(i)).expand(1 << 20)}, tmp_path / name)
    small = [tmp_path / "y1.pth", tmp_path / "y2.pth"]
    with pytest.raises(BadInputError, match="--max-expand"):
        average_checkpoints(small, tmp_path / "avg.pth", options=ConvertOptions(max_expand="1MB"))
    average_checkpoints(small, tmp_path / "avg.pth")
    assert torch.equal(torch.load(tmp_path / "avg.pth", weights_only=True)["w"], torch.full((1 << 20,), 0.5))
