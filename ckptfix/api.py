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

from .errors import BadInputError, CheckFailedError, UnsafeInputError, UsageError
from .formats.checkpoint import Checkpoint, read_checkpoint
from .model.needs import need_torch
from .model.paths import format_path, get_at
from .model.paths import select as select_path
from .model.refs import OpaqueObject, Tree
from .model.walk import walk
from .pickling.names import check_global_patterns
from .pipeline import model_or_ema
from .transforms.fit import best_fit, shapes_of
from .transforms.foreign import check_output, has_foreign
from .transforms.prefix import add_prefix, strip_prefix
from .transforms.select import filter_tree

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.serialization import MAP_LOCATION


def _torch_load(path: str | Path, shown: str, **kwargs: Any) -> Any:
    """``torch.load`` of a file ckptfix has read and checked, its failures as one
    :class:`~ckptfix.BadInputError` naming ``shown`` (the user's file): an API that vets files
    does not let torch's ``UnpicklingError``/``RuntimeError`` through as if it had not."""
    need_torch()
    import torch

    try:
        return torch.load(path, **kwargs)
    except Exception as exc:  # UnpicklingError, RuntimeError, ValueError, EOFError ... whatever torch raises
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BadInputError(
            f"{shown}: torch refused what ckptfix read from it: {first[:200]}",
            hint="ckptfix reads this file (convert it, or inspect it); torch.load does not",
        ) from exc


def _materialize(ckpt: Checkpoint, root: Tree, map_location: MAP_LOCATION, mmap: bool) -> Any:
    need_torch()
    import torch

    if not ckpt.lazy:  # already real tensors (read through torch): let torch.load move them
        with tempfile.TemporaryDirectory(prefix="ckptfix-load-") as tmp:
            path = Path(tmp) / "tree.pth"
            torch.save(root, path)
            return _torch_load(path, ckpt.path, map_location=map_location, weights_only=False)
    if root is ckpt.root and ckpt.archive is not None and ckpt.archive.path == ckpt.path:
        return _torch_load(ckpt.path, ckpt.path, map_location=map_location, weights_only=True, mmap=mmap)
    with tempfile.TemporaryDirectory(prefix="ckptfix-load-") as tmp:
        path = Path(tmp) / "tree.pth"
        with open(path, "wb") as out:
            ckpt.write(root, out)
        return _torch_load(path, ckpt.path, map_location=map_location, weights_only=True, mmap=mmap)


def _read(
    path: str | os.PathLike[str], unsafe_load: bool, allow_globals: Sequence[str], sanitize: bool
) -> tuple[Checkpoint, Tree]:
    """Read as the CLI does with ``--unsafe-load``, ``--allow-global`` and ``--sanitize``: the
    checkpoint and its tree (sanitized when asked; the checkpoint's own root stays as read)."""
    check_global_patterns(allow_globals)
    # unknown classes are read as inert records; _refuse_opaque judges what is handed back
    ckpt = read_checkpoint(path, unsafe_load=unsafe_load, allow_globals=allow_globals, inert_unknown=not unsafe_load)
    if not sanitize:
        return ckpt, ckpt.root
    from .transforms.sanitize import sanitize as to_plain_data

    return ckpt, to_plain_data(ckpt.root)[0]


def _refuse_opaque(ckpt: Checkpoint, root: Tree, sanitize: bool, select: str | None) -> None:
    """What is handed back must be buildable without running code: no class outside the
    allow-list (those elsewhere in the file are ignored: :func:`check_output`), and no object
    kept by ``allow_globals`` either -- torch.load(weights_only=True) refuses them, and ckptfix
    does not import them."""
    if has_foreign(ckpt):
        try:
            check_output(ckpt.root, root, sanitize_requested=sanitize, select_given=bool(select))
        except UnsafeInputError as exc:
            raise exc.at(ckpt.path).for_api() from None
    kept = sorted({value.name for _, value in walk(root) if isinstance(value, OpaqueObject)})
    if kept:
        raise UsageError(
            f"the loaded tree would hold {', '.join(kept[:5])}, which cannot be built without running its code",
            hint="pass sanitize=True to turn them into plain data, or select= the part that holds the weights",
        )


def load(
    path: str | os.PathLike[str],
    map_location: MAP_LOCATION = None,
    *,
    select: str | None = None,
    strip_prefixes: Sequence[str] = (),
    unsafe_load: bool = False,
    allow_globals: Sequence[str] = (),
    sanitize: bool = False,
    mmap: bool = True,
) -> Any:
    """What ``torch.load(path, map_location=...)`` returns, for any format ckptfix reads.

    The file is vetted by ckptfix's restricted reader first (a pickle global outside the
    allow-list raises :class:`~ckptfix.UnsafeInputError` before anything runs), and may be a
    .pth, a legacy torch file, a .safetensors file or a shard folder. ``select`` takes a
    sub-tree (``"state_dict"``), ``strip_prefixes`` strips key prefixes on the way.
    ``allow_globals`` and ``sanitize`` read files holding other objects, as the CLI's
    ``--allow-global`` and ``--sanitize`` do: what is returned must still be buildable without
    running code (sanitized plain data, or a selected part without such objects).

    Example::

        sd = ckptfix.load("ddp_8gpu.pth", map_location="cpu", strip_prefixes=["module."])
    """
    need_torch()  # before the file is read: without torch there is nothing to hand back
    ckpt, root = _read(path, unsafe_load, allow_globals, sanitize)
    if select:
        root = select_path(root, select, flag="select=")[1]
    for prefix in strip_prefixes:
        root = strip_prefix(root, prefix).root
    _refuse_opaque(ckpt, root, sanitize, select)
    return _materialize(ckpt, root, map_location, mmap)


@dataclass
class LoadIntoReport:
    """How a checkpoint was fitted to a model by :func:`load_into`."""

    source: str
    state_dict: str
    #: the wrapper prefixes stripped from the file's keys, outermost first
    stripped: list[str] = field(default_factory=list)
    #: the prefixes added for the model (one, for a wrapped model; none for a bare one)
    added: list[str] = field(default_factory=list)
    matched: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    map_location: str = ""
    #: keys left out because their shape differs from the model's (``skip_mismatch=True``)
    skipped: list[str] = field(default_factory=list)
    #: keys whose shape differs from the model's: {"key", "checkpoint", "model"} shapes
    shape_mismatches: list[dict[str, Any]] = field(default_factory=list)


class LoadIntoError(CheckFailedError):
    """:func:`load_into` could not load the checkpoint into the model (shapes that differ, keys
    missing or unexpected with ``strict=True``); ``report`` says what matched and what did not,
    and the model is left as torch's ``load_state_dict`` left it."""

    def __init__(self, message: str, report: LoadIntoReport) -> None:
        super().__init__(message)
        self.report = report


def load_into(
    model: Module,
    path: str | os.PathLike[str],
    *,
    map_location: MAP_LOCATION = None,
    strict: bool = True,
    select: str | None = None,
    unsafe_load: bool = False,
    allow_globals: Sequence[str] = (),
    sanitize: bool = False,
    skip_mismatch: bool = False,
    ema: bool = False,
) -> LoadIntoReport:
    """Load any checkpoint into ``model``, whatever the wrapping on either side.

    Finds the state dict in the file (``state_dict``, ``model``, ``ema`` ... or ``select``),
    works out the wrapper prefixes to strip (``module.``, ``_orig_mod.``, ``model.`` ...) and the
    one the model itself needs (a DataParallel or compiled model wants its own), and loads onto
    the model's device unless ``map_location`` says otherwise. Never matches keys by position.

    Example::

        report = ckptfix.load_into(model, "ddp_checkpoint.pth")
        print(report.stripped, report.missing)

    ``allow_globals``/``sanitize`` read checkpoints that hold other objects (configs) beside the
    weights; ``skip_mismatch=True`` leaves out keys whose shape differs from the model's (a new
    head when fine-tuning) and lists them in ``skipped`` -- use it with ``strict=False``.
    A checkpoint holding an EMA copy beside the model loads the model; ``ema=True`` the copy.
    """
    need_torch()
    import torch

    ckpt, tree = _read(path, unsafe_load, allow_globals, sanitize)
    tree = model_or_ema(tree, ema)[0]  # the model's weights, or with ema= its EMA copy
    if select:
        plan = best_fit(tree, shapes_of(model.state_dict()), *select_path(tree, select, flag="select="))
    else:
        plan = best_fit(tree, shapes_of(model.state_dict()))
    root = get_at(tree, plan.state_dict)
    for prefix in plan.strips:
        root = strip_prefix(root, prefix).root
    if plan.add:
        root = add_prefix(root, plan.add).root
    if map_location is None:
        first = next(iter(model.state_dict().values()), None)
        map_location = str(first.device) if isinstance(first, torch.Tensor) else "cpu"
    skipped: list[str] = []
    if skip_mismatch and plan.shape_mismatches:
        # drop them from the lazy tree, before any tensor data is read
        skipped = sorted(m["key"] for m in plan.shape_mismatches)
        root = filter_tree(root, ["".join(f"[{c}]" if c in "*?[" else c for c in k) for k in skipped], ())[0]
    _refuse_opaque(ckpt, root, sanitize, select or format_path(plan.state_dict) or None)
    state_dict = _materialize(ckpt, root, map_location, mmap=False)
    report = LoadIntoReport(
        source=str(path),
        state_dict=format_path(plan.state_dict) or "(top level)",
        stripped=list(plan.strips),
        added=[plan.add] if plan.add else [],
        matched=plan.matched,
        map_location=str(map_location),
        skipped=skipped,
        shape_mismatches=[
            {"key": m["key"], "checkpoint": list(m["checkpoint"]), "model": list(m["reference"])}
            for m in plan.shape_mismatches
            if m["key"] not in skipped
        ],
    )
    try:
        result = model.load_state_dict(state_dict, strict=strict)
    except RuntimeError as exc:  # torch's own error: shapes that differ, or keys with strict=True
        report.missing, report.unexpected = list(plan.missing), list(plan.unexpected)
        first = str(exc).strip().splitlines()
        raise LoadIntoError(
            f"{path}: cannot load into {type(model).__name__}: {'; '.join(line.strip() for line in first[1:4])}",
            report,
        ) from exc
    report.missing, report.unexpected = list(result.missing_keys), list(result.unexpected_keys)
    return report
