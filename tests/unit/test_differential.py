"""ckptfix's prefix fixes against torch's own: generated state dicts, every dtype, every layout.

For each generated checkpoint we do the fix twice -- with ckptfix (bytes copied, torch never
involved) and with torch (``torch.load`` -> ``consume_prefix_in_state_dict_if_present`` ->
``torch.save``) -- and require the two outputs to load identically: keys, dtypes, shapes,
strides, bitwise values (NaNs included), devices, Parameters, storage sharing and ``_metadata``.
CI's two passes (one per engine) draw different halves of each test's examples (conftest's
``fuzz_share`` and ``pass_seed``); a single run draws them all.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import (
    _state_dicts,
    assert_same_checkpoint,
    assert_same_tree,
    fuzz_share,
    pass_seed,
    reference_strip,
    sharing_groups,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import ALL_DTYPES, FLOATING, draw_laid_out_tensor

import ckptfix

DTYPES = ALL_DTYPES
SLOW_INPUTS = [HealthCheck.too_slow, HealthCheck.data_too_large]
NAMES = ["conv", "bn", "fc", "layer1", "0", "1", "weight", "bias", "running_mean", "module", "modules"]


@st.composite
def state_dicts(draw: st.DrawFn, max_depth: int = 2) -> tuple[OrderedDict, dict]:
    """A state dict (keys under 0 to ``max_depth`` "module." prefixes) and the checkpoint holding it."""
    data = draw(st.data())
    sd: OrderedDict = OrderedDict()
    n = draw(st.integers(1, 7))
    names = set()
    for _ in range(n):
        depth = draw(st.integers(0, max_depth))
        base = ".".join(draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3)))
        key = "module." * depth + base
        if key in names:
            continue
        names.add(key)
        tensor = draw_laid_out_tensor(draw, data, draw(st.sampled_from(DTYPES)), sd)
        if draw(st.booleans()) and not isinstance(tensor, torch.nn.Parameter):
            grad = tensor.dtype in FLOATING and draw(st.booleans())
            tensor = torch.nn.Parameter(tensor, requires_grad=grad)
        sd[key] = tensor
    if draw(st.booleans()):
        metadata = OrderedDict({"": {"version": 1}})
        for key in sd:
            module = key.rsplit(".", 1)[0] if "." in key else ""
            metadata.setdefault(module, {"version": draw(st.integers(1, 3))})
        if draw(st.booleans()):
            metadata["module"] = {"version": 1}
        sd._metadata = metadata
    wrapper = draw(st.sampled_from(["bare", "training", "nested"]))
    if wrapper == "bare":
        return sd, sd
    if wrapper == "training":
        return sd, {"state_dict": sd, "epoch": draw(st.integers(0, 10**12)), "lr": 0.5, "tag": "é"}
    return sd, {"model": sd, "extra": [1, "two", (3.0, None, True)], "nested": {"ema": sd}}


def _strip_all(key: str) -> str:
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


def _would_collide(keys: list[str], mode: str) -> bool:
    """Would the rename map two keys to one name (torch's reference then silently drops one)?"""
    if mode == "strip":
        return len({_strip_all(k) for k in keys}) < len(keys)
    return any(not k.startswith("module.") and "module." + k in keys for k in keys)


def _roundtrip(tree: object, keys: list[str], mode: str, *, legacy: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, ours = Path(tmp) / "in.pth", Path(tmp) / "ours.pth"
        torch.save(tree, src, _use_new_zipfile_serialization=not legacy)
        if _would_collide(keys, mode):
            with pytest.raises(ckptfix.CheckFailedError, match="would give two keys the same name"):
                ckptfix.fix_prefix(src, ours, mode=mode)
            assert not ours.exists()
            return
        report = ckptfix.fix_prefix(src, ours, mode=mode)
        if mode == "strip":
            expected = reference_strip(src)
        else:
            expected = torch.load(src, weights_only=True)
            _add_reference(expected)
        if report.renamed == 0:  # nothing to rename: OUT is the input unchanged, as the reference is
            # unchanged only where the format stays: legacy -> zip is a format conversion
            assert report.written and report.unchanged == (report.input_format == report.output_format)
            assert_same_checkpoint(ours, src)
            original = torch.load(src, weights_only=True)
            assert [list(sd) for sd in _state_dicts(expected)] == [list(sd) for sd in _state_dicts(original)]
            return
        for loaded in (torch.load(ours, weights_only=True), torch.load(ours, mmap=True, weights_only=True)):
            assert_same_tree(loaded, expected)
            assert sharing_groups(loaded) == sharing_groups(expected)


def _add_reference(tree: object) -> None:
    """Adding is the inverse of stripping; the reference is the plain dict comprehension."""
    unique = {id(sd): sd for sd in _state_dicts(tree)}  # one object may sit at two paths
    for sd in unique.values():
        items = [(k if k.startswith("module.") else "module." + k, v) for k, v in sd.items()]
        metadata = getattr(sd, "_metadata", None)
        sd.clear()
        sd.update(items)
        if metadata is not None:
            new = OrderedDict({"": metadata[""]} if "" in metadata else {})
            for k, v in metadata.items():
                new["module." + k if k else "module"] = v
            sd._metadata = new


@pass_seed
@settings(max_examples=fuzz_share(150), deadline=None, suppress_health_check=SLOW_INPUTS)
@given(state_dicts())
def test_strip_module_matches_torch(case: tuple[OrderedDict, object]) -> None:
    _roundtrip(case[1], list(case[0]), "strip")


#: dtypes the legacy format can round-trip through torch itself (newer ones it saves but cannot load)
LEGACY_DTYPES = {
    d for d in DTYPES if d not in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2)
}


@pass_seed
@settings(max_examples=fuzz_share(100), deadline=None, suppress_health_check=SLOW_INPUTS)
@given(state_dicts())
def test_strip_module_on_legacy_format_matches_torch(case: tuple[OrderedDict, object]) -> None:
    """The legacy (non-zip) reader, read without torch, against torch's own legacy loader."""
    assume(all(t.dtype in LEGACY_DTYPES for t in case[0].values()))
    _roundtrip(case[1], list(case[0]), "strip", legacy=True)


@pass_seed
@settings(max_examples=fuzz_share(100), deadline=None, suppress_health_check=SLOW_INPUTS)
@given(state_dicts())
def test_add_module_matches_reference(case: tuple[OrderedDict, object]) -> None:
    _roundtrip(case[1], list(case[0]), "add")


@pass_seed
@settings(max_examples=fuzz_share(80), deadline=None, suppress_health_check=SLOW_INPUTS)
@given(state_dicts(max_depth=0))
def test_add_then_strip_restores_the_original(case: tuple[OrderedDict, object]) -> None:
    sd, tree = case
    assume(not any(k.startswith("module.") for k in sd))  # those cannot be told apart after adding it
    assume(not _would_collide(list(sd), "strip"))  # e.g. "modules.x" is fine, but "module" + "." can collide
    with tempfile.TemporaryDirectory() as tmp:
        src, wrapped, back = (Path(tmp) / n for n in ("in.pth", "wrapped.pth", "back.pth"))
        torch.save(tree, src)
        ckptfix.fix_prefix(src, wrapped, mode="add")
        ckptfix.fix_prefix(wrapped, back, mode="strip")
        original, restored = torch.load(src, weights_only=True), torch.load(back, weights_only=True)
        assert_same_tree(restored, original)
        assert sharing_groups(restored) == sharing_groups(original)
