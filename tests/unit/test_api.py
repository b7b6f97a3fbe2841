"""The Python API that returns torch objects: ckptfix.load and ckptfix.load_into."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_tree
from models import TinyNet, tiny_net
from safetensors.torch import save_file

import ckptfix
from ckptfix.model.walk import iter_storages

X = torch.randn(2, 3, 8, 8)


def _retag(src: Path, dst: Path, location: str) -> None:
    ckpt = ckptfix.read_checkpoint(src)
    for storage in iter_storages(ckpt.root):
        storage.location = location
    ckptfix.write_checkpoint(ckpt, ckpt.root, dst)


def test_load_matches_torch_load_for_every_format(tmp_path: Path) -> None:
    expected = torch.load(FIXTURES / "dataparallel_tinynet.pth", weights_only=True)
    save_file(dict(expected), tmp_path / "dp.safetensors")
    ckptfix.convert(
        FIXTURES / "dataparallel_tinynet.pth",
        str(tmp_path / "shards") + "/",
        ckptfix.ConvertOptions(max_shard_size=300),
    )
    for source in (FIXTURES / "dataparallel_tinynet.pth", FIXTURES / "legacy_dataparallel_tinynet.pth"):
        assert_same_tree(ckptfix.load(source), expected)
    for source in (tmp_path / "dp.safetensors", tmp_path / "shards"):
        loaded = ckptfix.load(source)
        assert set(loaded) == set(expected)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key


def test_load_accepts_every_map_location_form_without_a_gpu(tmp_path: Path) -> None:
    tagged = tmp_path / "cuda3.pth"
    _retag(FIXTURES / "dataparallel_tinynet.pth", tagged, "cuda:3")
    expected = torch.load(FIXTURES / "dataparallel_tinynet.pth", weights_only=True)
    for location in ("cpu", torch.device("cpu"), {"cuda:3": "cpu"}, lambda storage, loc: storage):
        assert_same_tree(ckptfix.load(tagged, map_location=location), expected)
    stripped = ckptfix.load(tagged, map_location="cpu", strip_prefixes=["module."])
    assert set(stripped) == set(tiny_net().state_dict())


def test_load_refuses_unsafe_pickles(tmp_path: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"x": Payload()}, tmp_path / "bad.pth")
    with pytest.raises(ckptfix.UnsafeInputError):
        ckptfix.load(tmp_path / "bad.pth")


@pytest.mark.parametrize(
    ("fixture", "wrap"),
    [
        ("dataparallel_tinynet.pth", lambda m: m),
        ("ddp_cpu_tinynet.pth", lambda m: m),
        ("compile_ddp_tinynet.pth", lambda m: m),
        ("dataparallel2_tinynet.pth", lambda m: m),
        ("legacy_dataparallel_tinynet.pth", lambda m: m),
        ("lightning_tinynet.ckpt", lambda m: m),
        ("bare_tinynet.pth", torch.nn.DataParallel),
        ("dataparallel_tinynet.pth", torch.compile),
        ("bare_tinynet.pth", torch.compile),
    ],
)
def test_load_into_fixes_wrapping_on_both_sides(fixture: str, wrap) -> None:
    model = wrap(TinyNet())
    report = ckptfix.load_into(model, FIXTURES / fixture)
    assert report.missing == [] and report.unexpected == []
    assert report.matched == len(model.state_dict())
    reference = tiny_net().eval()
    bare = model.module if isinstance(model, torch.nn.DataParallel) else getattr(model, "_orig_mod", model)
    bare.eval()
    with torch.no_grad():
        assert torch.equal(bare(X), reference(X))


def test_load_into_reports_a_new_head_with_strict_false(tmp_path: Path) -> None:
    sd = torch.nn.DataParallel(tiny_net()).state_dict()
    del sd["module.fc.weight"], sd["module.fc.bias"]
    torch.save(sd, tmp_path / "headless.pth")
    with pytest.raises(ckptfix.LoadIntoError, match="Missing key") as caught:
        ckptfix.load_into(TinyNet(), tmp_path / "headless.pth")
    assert isinstance(caught.value, ckptfix.CkptfixError)
    assert sorted(caught.value.report.missing) == ["fc.bias", "fc.weight"]
    report = ckptfix.load_into(TinyNet(), tmp_path / "headless.pth", strict=False)
    assert sorted(report.missing) == ["fc.bias", "fc.weight"] and report.stripped == ["module."]
    assert report.added == []  # one type per field: a list, as stripped is


def test_load_into_shape_mismatch_is_a_ckptfix_error_carrying_the_report(tmp_path: Path) -> None:
    sd = tiny_net().state_dict()
    sd["fc.weight"] = torch.zeros(sd["fc.weight"].shape[0], sd["fc.weight"].shape[1] + 1)
    torch.save(sd, tmp_path / "wide.pth")
    with pytest.raises(ckptfix.LoadIntoError, match="size mismatch") as caught:
        ckptfix.load_into(TinyNet(), tmp_path / "wide.pth")
    assert str(tmp_path / "wide.pth") in str(caught.value)
    assert [m["key"] for m in caught.value.report.shape_mismatches] == ["fc.weight"]
    wrapped = ckptfix.load_into(torch.nn.DataParallel(TinyNet()), FIXTURES / "bare_tinynet.pth")
    assert wrapped.added == ["module."] and wrapped.stripped == []


def test_batch_results_are_reported_in_input_order() -> None:
    from ckptfix.batch import FileResult, InOrder

    seen: list[str] = []
    in_order = InOrder(lambda r: seen.append(r.input))
    for index in (2, 0, 3, 1, 5):  # finishing order of a parallel run; 4 never ran (stopped)
        in_order.add(index, FileResult(f"f{index}", None, "written"))
    assert seen == ["f0", "f1", "f2", "f3"]
    in_order.flush()
    assert seen == ["f0", "f1", "f2", "f3", "f5"]
