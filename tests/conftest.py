"""Shared helpers: run the real CLI, compare checkpoints the way torch sees them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(FIXTURES))


def run_cli(*args: Any, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m ckptfix ARGS`` as a user would; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-m", "ckptfix", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's values as raw bytes in logical (row-major) order: bitwise, NaN-safe."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype in (torch.qint8, torch.quint8, torch.qint32):
        flat = flat.int_repr()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_tensor_equal(a: torch.Tensor, b: torch.Tensor, where: str, *, check_stride: bool = True) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    if check_stride:
        assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
    assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert tensor_bytes(a) == tensor_bytes(b), f"{where}: values differ"


def assert_same_tree(a: Any, b: Any, where: str = "root", *, check_stride: bool = True) -> None:
    """Structural equality of two loaded checkpoints, tensors compared bit for bit."""
    if isinstance(a, torch.Tensor):
        assert_tensor_equal(a, b, where, check_stride=check_stride)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Mapping):
        assert set(a.keys()) == set(b.keys()), f"{where}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}", check_stride=check_stride)
        meta_a, meta_b = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        assert (meta_a is None) == (meta_b is None), f"{where}: _metadata present in only one"
        if meta_a is not None:
            assert dict(meta_a) == dict(meta_b), f"{where}: _metadata {dict(meta_a)} != {dict(meta_b)}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", check_stride=check_stride)
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def sharing_groups(tree: Any) -> set[frozenset[str]]:
    """Which (non-empty) tensors share one storage, as a set of groups of tensor paths."""
    groups: dict[tuple[str, int], set[str]] = {}

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel():  # an empty tensor holds no data to share
                storage = value.untyped_storage()
                groups.setdefault((str(value.device), storage.data_ptr()), set()).add(path)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{path}[{i}]")

    visit(tree, "")
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def reference_strip(path: Path, prefix: str = "module.") -> Any:
    """What torch itself gives: load, consume_prefix_in_state_dict_if_present until done."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    tree = torch.load(path, weights_only=True)
    for sd in _state_dicts(tree):
        while any(k.startswith(prefix) for k in sd):
            consume_prefix_in_state_dict_if_present(sd, prefix)
    return tree


def _state_dicts(tree: Any) -> list[dict]:
    if isinstance(tree, Mapping) and tree and all(isinstance(v, torch.Tensor) for v in tree.values()):
        return [tree]
    if isinstance(tree, Mapping) and not ("state" in tree and "param_groups" in tree):
        return [sd for v in tree.values() for sd in _state_dicts(v)]
    if isinstance(tree, (list, tuple)):
        return [sd for v in tree for sd in _state_dicts(v)]
    return []


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


def no_temp_files(folder: Path) -> bool:
    return not any(p.name.endswith(".ckptfix-tmp") for p in folder.iterdir())


# CI runs a fixed set of generated examples (reproducible verdicts); local runs explore new ones.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")
