"""Python-only conveniences that hand real torch objects back: ``load`` and ``load_into``.

Both read the file with ckptfix's own readers (restricted unpickler, any format), apply any
fixes to the lazy tree, and only then let torch materialise tensors -- from a temporary .pth
that ckptfix wrote, loaded with ``weights_only=True`` and ``mmap=True`` so the data is mapped,
not copied. ``map_location`` is passed to ``torch.load`` untouched: every form torch accepts
(a string, a ``torch.device``, a dict, a callable) means what it means there.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .formats.checkpoint import Checkpoint, read_checkpoint
from .model.paths import format_path, get_at
from .model.paths import select as select_path
from .model.refs import Tree
from .transforms.fit import best_fit, shapes_of
from .transforms.prefix import add_prefix, strip_prefix

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.serialization import MAP_LOCATION


def _materialize(ckpt: Checkpoint, root: Tree, map_location: MAP_LOCATION, mmap: bool) -> Any:
    import torch

    if not ckpt.lazy:  # already real tensors (read through torch): let torch.load move them
        with tempfile.TemporaryDirectory(prefix="ckptfix-load-") as tmp:
            path = Path(tmp) / "tree.pth"
            torch.save(root, path)
            return torch.load(path, map_location=map_location, weights_only=False)
    if root is ckpt.root and ckpt.archive is not None and ckpt.archive.path == ckpt.path:
        return torch.load(ckpt.path, map_location=map_location, weights_only=True, mmap=mmap)
    with tempfile.TemporaryDirectory(prefix="ckptfix-load-") as tmp:
        path = Path(tmp) / "tree.pth"
        with open(path, "wb") as out:
            ckpt.write(root, out)
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def load(
    path: str | os.PathLike[str],
    map_location: MAP_LOCATION = None,
    *,
    select: str | None = None,
    strip_prefixes: Sequence[str] = (),
    unsafe_load: bool = False,
    mmap: bool = True,
) -> Any:
    """What ``torch.load(path, map_location=...)`` returns, for any format ckptfix reads.

    The file is vetted by ckptfix's restricted reader first (a pickle global outside the
    allow-list raises :class:`~ckptfix.UnsafeInputError` before anything runs), and may be a
    .pth, a legacy torch file, a .safetensors file or a shard folder. ``select`` takes a
    sub-tree (``"state_dict"``), ``strip_prefixes`` strips key prefixes on the way.

    Example::

        sd = ckptfix.load("ddp_8gpu.pth", map_location="cpu", strip_prefixes=["module."])
    """
    ckpt = read_checkpoint(path, unsafe_load=unsafe_load)
    root = ckpt.root
    if select:
        root = select_path(root, select, flag="select=")[1]
    for prefix in strip_prefixes:
        root = strip_prefix(root, prefix).root
    return _materialize(ckpt, root, map_location, mmap)


@dataclass
class LoadIntoReport:
    """How a checkpoint was fitted to a model by :func:`load_into`."""

    source: str
    state_dict: str
    stripped: list[str] = field(default_factory=list)
    added: str = ""
    matched: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    map_location: str = ""


def load_into(
    model: Module,
    path: str | os.PathLike[str],
    *,
    map_location: MAP_LOCATION = None,
    strict: bool = True,
    select: str | None = None,
    unsafe_load: bool = False,
) -> LoadIntoReport:
    """Load any checkpoint into ``model``, whatever the wrapping on either side.

    Finds the state dict in the file (``state_dict``, ``model``, ``ema`` ... or ``select``),
    works out the wrapper prefixes to strip (``module.``, ``_orig_mod.``, ``model.`` ...) and the
    one the model itself needs (a DataParallel or compiled model wants its own), and loads onto
    the model's device unless ``map_location`` says otherwise. Never matches keys by position.

    Example::

        report = ckptfix.load_into(model, "ddp_checkpoint.pth")
        print(report.stripped, report.missing)
    """
    import torch

    ckpt = read_checkpoint(path, unsafe_load=unsafe_load)
    if select:
        plan = best_fit(ckpt.root, shapes_of(model.state_dict()), *select_path(ckpt.root, select, flag="select="))
    else:
        plan = best_fit(ckpt.root, shapes_of(model.state_dict()))
    root = get_at(ckpt.root, plan.state_dict)
    for prefix in plan.strips:
        root = strip_prefix(root, prefix).root
    if plan.add:
        root = add_prefix(root, plan.add).root
    if map_location is None:
        first = next(iter(model.state_dict().values()), None)
        map_location = str(first.device) if isinstance(first, torch.Tensor) else "cpu"
    state_dict = _materialize(ckpt, root, map_location, mmap=False)
    result = model.load_state_dict(state_dict, strict=strict)
    return LoadIntoReport(
        source=str(path),
        state_dict=format_path(plan.state_dict) or "(top level)",
        stripped=list(plan.strips),
        added=plan.add,
        matched=plan.matched,
        missing=list(result.missing_keys),
        unexpected=list(result.unexpected_keys),
        map_location=str(map_location),
    )
