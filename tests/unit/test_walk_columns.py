"""The column-wise tree passes (census, substitute's bulk checks, inspect's counts, the report
document) against the one-node-at-a-time code they replace: same results on generated trees,
shared and cyclic ones included, and on the real fixtures."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_v2 import assert_isomorphic, trees

from ckptfix.analysis.inspect import common_prefixes, summarize
from ckptfix.fileio.ranges import ComputedSource
from ckptfix.formats.checkpoint import read_checkpoint
from ckptfix.model.paths import format_path
from ckptfix.model.refs import EMPTY_HOOKS, Global, OpaqueObject, ParamInfo, Reduce, StorageRef, TensorRef
from ckptfix.model.statedicts import WRAPPER_PREFIXES
from ckptfix.model.walk import _ATOMS, BulkMemo, census, iter_storages, iter_tensors, substitute, walk
from ckptfix.pipeline import Report
from ckptfix.transforms.prefix import StateDictChange

_SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _storage(key: str, location: str = "cpu") -> StorageRef:
    return StorageRef(
        key, Global("torch", "FloatStorage"), location, 4, 4, "float32", ComputedSource(16, lambda _: bytes(16))
    )


def _containers(tree: Any) -> list[Any]:
    """The plain containers of ``tree``, those inside records (a tensor's hooks, a Reduce's
    arguments) left out: the oracle below keeps records as they are."""
    outside = walk(tree, lambda _, v: not isinstance(v, (TensorRef, Reduce)))
    return [v for _, v in outside if isinstance(v, (dict, list, tuple, set))]


def _with_tensors(tree: Any, draw: st.DrawFn) -> Any:
    """``tree`` with tensor records put into its lists and dicts: some shared by two places,
    some on a second device, some with hooks or parameter state (walked into), a storage on
    its own, a Reduce record."""
    storages = [_storage("0"), _storage("1", "cuda:0")]
    plain = [TensorRef(storages[i % 2], 0, (2,), (1,), "float32") for i in range(3)]
    hooked = TensorRef(storages[0], 0, (1,), (1,), "float16", hooks=OrderedDict(h=[1, 2]))
    param = TensorRef(storages[1], 1, (1,), (1,), "float32", param=ParamInfo(True, EMPTY_HOOKS, {"s": plain[0]}))
    extras = [*plain, hooked, param, storages[0], Reduce(Global("torch", "Size"), ((2, 3),))]
    for container in _containers(tree):
        if isinstance(container, list):
            container.extend(draw(st.lists(st.sampled_from(extras), max_size=3)))
        elif isinstance(container, dict):
            for i, extra in enumerate(draw(st.lists(st.sampled_from(extras), max_size=3))):
                container[f"t{i}"] = extra
    if draw(st.booleans()):  # a state dict of tensors, and an optimizer-like dict of dicts: the bulk paths
        tree["sd"] = {f"module.l{i}.weight": plain[i % 3] for i in range(draw(st.integers(1, 5)))}
        state = {i: {"exp_avg": plain[i % 3], "step": i} for i in range(draw(st.integers(1, 4)))}
        if draw(st.booleans()):
            state[9] = state[0]  # a dict reached twice: its tensors count once
        tree["state"] = state
    return tree


@st.composite
def tensor_trees(draw: st.DrawFn) -> Any:
    return _with_tensors(draw(trees()), draw)


def _census_by_walk(tree: Any) -> tuple[list[int], list[int], list[int]]:
    tensors, storages, records = [], [], []
    for _, value in walk(tree, leaves=True):
        if isinstance(value, TensorRef):
            tensors.append(id(value))
        elif isinstance(value, StorageRef):
            storages.append(id(value))
        elif isinstance(value, (Reduce, OpaqueObject)) or (
            type(value) not in _ATOMS and not isinstance(value, (dict, list, tuple, set, frozenset))
        ):
            records.append(id(value))
    return tensors, storages, records


@_SETTINGS
@given(tensor_trees())
def test_census_finds_what_walk_yields_in_the_same_order(tree: Any) -> None:
    found = census(tree)
    assert (
        [id(t) for t in found.tensors],
        [id(s) for s in found.storages],
        [id(r) for r in found.records],
    ) == _census_by_walk(tree)
    storages = list(iter_storages(tree))
    assert {id(s) for s in found.distinct_storages()} == {id(s) for s in storages}
    assert len(found.distinct_storages()) == len(storages)
    assert found.nbytes() == sum(s.nbytes for s in storages)
    memo: BulkMemo = {}  # what inspect does: one census of the tree, then of its parts, sharing the memo
    assert [id(t) for t in census(tree, memo=memo).tensors] == [id(t) for t in found.tensors]
    for part in _containers(tree):
        assert [id(t) for t in census(part, memo=memo).tensors] == [id(t) for t in census(part).tensors]


def test_census_keeps_the_depth_limit() -> None:
    deep: Any = {"t": TensorRef(_storage("0"), 0, (1,), (1,), "float32")}
    for _ in range(12):
        deep = {"x": deep}
    assert len(census(deep, limit=13).tensors) == 1
    with pytest.raises(Exception, match="nested more than 10 deep"):
        census(deep, limit=10)


def _replaced_by_deepcopy(tree: Any, replacements: dict[int, Any]) -> Any:
    """The oracle: ``copy.deepcopy`` with the replacements (and every record) in its memo
    copies everything and keeps sharing and cycles, the replacements standing in for the
    objects they replace."""
    memo: dict[int, Any] = dict(replacements)
    for _, value in walk(tree, leaves=True):
        if type(value) not in (dict, OrderedDict, list, tuple, set):
            memo[id(value)] = value  # atoms and records are shared, as substitute shares them
    return copy.deepcopy(tree, memo)


@_SETTINGS
@given(st.data())
def test_substitute_agrees_with_a_deepcopy_that_replaces(data: st.DataObject) -> None:
    tree = data.draw(tensor_trees())
    candidates = [c for c in _containers(tree) if c is not tree] + [t for t in iter_tensors(tree)]
    chosen = data.draw(st.lists(st.sampled_from(candidates), max_size=3)) if candidates else []
    replacements = {id(old): {"replaced": i} for i, old in enumerate(chosen)}
    result = substitute(tree, replacements)
    assert_isomorphic(result, _replaced_by_deepcopy(tree, replacements))
    untouched = {id(c) for c in _containers(result)} & {id(c) for c in _containers(tree)}
    for old in chosen:
        assert id(old) not in untouched


def test_substitute_redirects_a_back_edge_met_before_the_change() -> None:
    # b is finished before a learns it changes: b's reference back to a must follow a's copy
    replaced, b = {"r": 1}, {}
    a = {"b": b, "x": replaced}
    b["a"] = a
    new = substitute(a, {id(replaced): {"r": 2}})
    assert new["x"] == {"r": 2} and new["b"] is not b and new["b"]["a"] is new


def test_substitute_leaves_clean_dicts_of_tensors_shared() -> None:
    tensor = TensorRef(_storage("0"), 0, (1,), (1,), "float32")
    inner = [{"exp_avg": tensor, "step": 1} for _ in range(4)]
    sd = {"module.w": tensor}
    root = {"sd": sd, "state": dict(enumerate(inner))}
    new = substitute(root, {id(sd): {"w": tensor}})
    assert new["sd"] == {"w": tensor} and new["state"] is root["state"]
    cast = substitute(root, {id(tensor): "cast"})  # a tensor inside the bulk-checked dicts
    assert cast["state"][3] == {"exp_avg": "cast", "step": 1} and root["state"][3]["exp_avg"] is tensor


def _common_prefixes_by_loop(keys: list[str]) -> list[dict[str, Any]]:
    """inspect's prefix counting as written before, one key at a time."""
    chains: Counter[str] = Counter()
    firsts: Counter[str] = Counter()
    for key in keys:
        chain, rest = "", key
        while True:
            wrapper = next((p for p in WRAPPER_PREFIXES if rest.startswith(p)), None)
            if wrapper is None:
                break
            chain += wrapper
            rest = rest[len(wrapper) :]
        if chain:
            chains[chain] += 1
        if "." in key:
            firsts[key.split(".", 1)[0] + "."] += 1
    half = (len(keys) + 1) // 2
    result = [{"prefix": p, "keys": n} for p, n in chains.most_common() if n >= half]
    known = {r["prefix"] for r in result}
    return result + [{"prefix": p, "keys": n} for p, n in firsts.most_common(3) if n >= half and p not in known]


_key_parts = st.sampled_from([*WRAPPER_PREFIXES, "modul", "model", ".", "a.", "b", "_orig_mod", "fc.weight"])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(_key_parts, max_size=5).map("".join), max_size=12))
def test_common_prefixes_count_as_the_loop_did(keys: list[str]) -> None:
    assert common_prefixes(keys) == _common_prefixes_by_loop(keys)


def _summary_by_walk(ckpt: Any) -> dict[str, Any]:
    """The counting part of ``inspect``'s summary as it was computed, one tensor at a time."""
    dtypes: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    storages: dict[int, Any] = {}
    users: dict[int, list[Any]] = {}
    tensors = 0
    for path, tensor in iter_tensors(ckpt.root):
        tensors += 1
        dtypes[tensor.dtype] += 1
        devices[tensor.device] += 1
        storages[id(tensor.storage)] = tensor.storage
        users.setdefault(id(tensor.storage), []).append(path)
    return {
        "tensors": tensors,
        "storages": len(storages),
        "tensor_bytes": sum(s.nbytes for s in storages.values()),
        "dtypes": dict(dtypes.most_common()),
        "devices": dict(devices.most_common()),
        "shared_storages": [
            {"storage": storages[sid].key, "paths": [format_path(p) for p in paths]}
            for sid, paths in users.items()
            if len(paths) > 1
        ],
    }


_FIXTURES = sorted(p for p in (ROOT / "fixtures").iterdir() if p.suffix in (".pth", ".ckpt"))


@pytest.mark.parametrize("path", _FIXTURES, ids=lambda p: p.name)
def test_inspect_counts_as_the_tensor_by_tensor_walk_did(path: Path) -> None:
    ckpt = read_checkpoint(path, inert_unknown=True)
    summary = summarize(ckpt)
    assert {k: summary[k] for k in _summary_by_walk(ckpt)} == _summary_by_walk(ckpt)


def test_inspect_lists_shared_storages_with_every_path() -> None:
    path = ROOT / "fixtures" / "bare_tinynet.pth"
    ckpt = read_checkpoint(path)
    first = next(t for _, t in iter_tensors(ckpt.root))
    ckpt.root["tied"] = first  # one tensor reached by two names
    ckpt.root["also"] = [first, TensorRef(first.storage, 0, (1,), (1,), first.dtype)]
    summary = summarize(ckpt)
    assert summary["shared_storages"] == _summary_by_walk(ckpt)["shared_storages"]
    assert len(summary["shared_storages"][0]["paths"]) == 4


def test_the_report_document_is_what_asdict_made() -> None:
    change = StateDictChange("state_dict", 3, [("module.a", "a"), ("module.b", "b")])
    report = Report("strip-module", "in.pth", "out.pth", "torch-zip", "torch-zip", dry_run=False)
    report.state_dicts = [change.to_dict() | {"change": "strip 'module.'"}]
    report.device_moves, report.cast, report.notes = {"cuda:1->cpu": 2}, {"dtype": "bfloat16", "kept": ["x"]}, ["n"]
    expected = asdict(report)
    expected["steps"] = []
    document = report.to_dict()
    assert document == expected
    document["state_dicts"][0]["keys"] = 0  # a copy: changing it leaves the report as it was
    document["notes"].append("m")
    assert report.state_dicts[0]["keys"] == 3 and report.notes == ["n"]
