"""Work out the key transformation that makes a checkpoint's state dict match a reference.

The reference is another checkpoint (any format) or a model built by an explicitly named
callable. Candidate transformations are "strip these prefixes, then add that prefix", where
the prefixes come from the keys themselves: the chain of wrapper prefixes every key shares
(``_orig_mod.module.``), or the first one or two segments every key shares (``encoder.``,
``backbone.body.``), on either side. The candidate matching the most reference keys wins
(ties: the smaller change). Keys are never matched by position, and shapes are checked.

``*.num_batches_tracked`` buffers missing from a checkpoint are reported apart when BatchNorm
fills them in on loading (module version < 2 or no ``_metadata``), since then they do not make
``load_state_dict`` fail; with version-2 metadata they are real missing keys.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputMismatchError, UsageError
from ..model.needs import need_torch
from ..model.paths import Path, format_path
from ..model.refs import TensorRef, Tree, is_torch_tensor
from ..model.statedicts import find_state_dicts, wrapper_chain

Shapes = dict[str, tuple[int, ...]]


@dataclass
class FitPlan:
    """The chosen transformation and what it leaves unmatched."""

    state_dict: Path
    strips: list[str]
    add: str
    renamed: dict[str, str] = field(default_factory=dict)  # new key -> original key
    matched: int = 0
    missing: list[str] = field(default_factory=list)
    missing_num_batches_tracked: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def loads_strictly(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_dict": format_path(self.state_dict) or "(top level)",
            "strip": self.strips,
            "add": self.add,
            "matched": self.matched,
            "missing": self.missing,
            "missing_num_batches_tracked": self.missing_num_batches_tracked,
            "unexpected": self.unexpected,
            "shape_mismatches": self.shape_mismatches,
            "loads_strictly": self.loads_strictly,
        }


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, TensorRef) or is_torch_tensor(value):
        return tuple(value.shape)
    return None


def shapes_of(state_dict: Mapping[Any, Any]) -> Shapes:
    return {k: s for k, v in state_dict.items() if isinstance(k, str) and (s := _shape(v)) is not None}


def reference_from_model(spec: str, model_path: Sequence[str | os.PathLike[str]] = ()) -> Shapes:
    """Shapes of ``module:callable()``'s state dict. Imports and runs that callable: only on
    this explicit request.

    The module is imported the way ``python -P`` (safe path) would, not the way ``python -m``
    does: the current folder is not searched, so a ``json.py`` or ``mypkg/`` left in whatever
    folder the command runs from cannot stand in for an installed module (or for anything the
    model's module imports). Folders the user names in ``model_path`` are searched first.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--model {spec!r}: write package.module:callable, e.g. torchvision.models:resnet18")
    need_torch()  # a model is an nn.Module: without torch its module cannot even be imported
    folders = []
    for folder in model_path:
        resolved = os.path.abspath(os.fspath(folder))
        if not os.path.isdir(resolved):
            raise UsageError(f"--model-path {os.fspath(folder)}: no such folder")
        folders.append(resolved)
    with _import_path(folders):
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            hint = "" if folders else "; the current folder is not searched: add --model-path DIR for a local module"
            raise UsageError(f"--model {spec!r}: cannot import it: {exc}{hint}") from exc
        model = factory()  # its own lazy imports get the same path
    if not hasattr(model, "state_dict"):
        raise UsageError(f"--model {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return shapes_of(model.state_dict())


def _is_current_folder(entry: str, cwd: str) -> bool:
    if entry in ("", "."):
        return True  # "" is how sys.path spells "the current folder, wherever that is now"
    try:
        return os.path.samefile(entry, cwd)
    except OSError:
        return False


@contextmanager
def _import_path(folders: Sequence[str]) -> Iterator[None]:
    """``sys.path`` without the current folder and with ``folders`` first, for the duration.

    ``python -m ckptfix`` (and ``python -c``) put the current folder at the front of
    ``sys.path``, which is why it is removed rather than merely not added. Folders named
    explicitly (``--model-path .``) stay: that is the user asking for it.
    """
    saved = list(sys.path)
    cwd = os.getcwd()
    sys.path[:] = [*folders, *(p for p in saved if p not in folders and not _is_current_folder(p, cwd))]
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = saved


def _common_segments(keys: Sequence[str], depth: int) -> str | None:
    firsts = {".".join(k.split(".")[:depth]) + "." for k in keys if k.count(".") >= depth}
    return firsts.pop() if len(firsts) == 1 and all(k.count(".") >= depth for k in keys) else None


def _strip_all(key: str, strips: Sequence[str]) -> str:
    for prefix in strips:  # as transforms.strip_prefix does: each prefix repeatedly
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def _candidates(keys: Sequence[str], ref_keys: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    chain = list(dict.fromkeys(wrapper_chain(keys)))
    strips: list[list[str]] = [[]] + [chain[:i] for i in range(1, len(chain) + 1)]
    for depth in (1, 2):
        common = _common_segments(keys, depth)
        if common and [common] not in strips:
            strips.append([common])
    adds = [""]
    ref_chain = "".join(wrapper_chain(ref_keys))
    for extra in [ref_chain] + [_common_segments(ref_keys, d) for d in (1, 2)]:
        if extra and extra not in adds:
            adds.append(extra)
    return strips, adds


def _module_versions(metadata: Any, strips: Sequence[str], add: str) -> dict[str, Any]:
    """``_metadata`` versions keyed by module path after the same strip/add as the keys."""
    versions: dict[str, Any] = {}
    if isinstance(metadata, Mapping):
        for path, entry in metadata.items():
            new = _strip_all(path + ".", strips) if path else ""
            new = new if not add or new.startswith(add) else add + new
            version = entry.get("version") if isinstance(entry, Mapping) else None
            versions[new[:-1] if new.endswith(".") else new] = version
    return versions


def plan_fit(state_dict_path: Path, shapes: Shapes, reference: Shapes, metadata: Any = None) -> FitPlan:
    """The best strip/add transformation of ``shapes``' keys onto ``reference``'s.

    A missing ``num_batches_tracked`` is excused only where BatchNorm really fills it in:
    when the module's ``_metadata`` version is absent or below 2 (checkpoints from before
    torch 0.4.1, or state dicts that lost their metadata, e.g. through safetensors).
    """
    keys, ref_keys = list(shapes), set(reference)
    best: FitPlan | None = None
    strips_options, add_options = _candidates(keys, list(ref_keys))
    for strips in strips_options:
        for add in add_options:
            renamed: dict[str, str] = {}
            for key in keys:
                new = _strip_all(key, strips)
                renamed.setdefault(new if new.startswith(add) else add + new, key)
            matched = len(ref_keys.intersection(renamed))
            cost = len(strips) + bool(add)
            if best is None or (matched, -cost) > (best.matched, -(len(best.strips) + bool(best.add))):
                best = FitPlan(state_dict_path, list(strips), add, renamed, matched)
    assert best is not None
    missing = sorted(ref_keys.difference(best.renamed))
    versions = _module_versions(metadata, best.strips, best.add)

    def filled_in(key: str) -> bool:
        if not key.endswith(".num_batches_tracked"):
            return False
        version = versions.get(key.rsplit(".", 1)[0])
        return version is None or (isinstance(version, int) and version < 2)

    best.missing_num_batches_tracked = [k for k in missing if filled_in(k)]
    best.missing = [k for k in missing if not filled_in(k)]
    best.unexpected = sorted(k for k in best.renamed if k not in ref_keys)
    for new, original in best.renamed.items():
        if new in reference and shapes[original] != reference[new]:
            best.shape_mismatches.append(
                {"key": new, "checkpoint": list(shapes[original]), "reference": list(reference[new])}
            )
    return best


def best_fit(root: Tree, reference: Shapes, select: Path | None = None, select_value: Tree = None) -> FitPlan:
    """Choose the state dict in ``root`` (or the selected one) that fits ``reference`` best."""
    candidates = [(select, select_value)] if select is not None else find_state_dicts(root)
    if not candidates:
        raise InputMismatchError("found no state dict in the checkpoint; name one with --select")
    plans = [
        plan_fit(path, shapes_of(sd), reference, getattr(sd, "_metadata", None))
        for path, sd in candidates
        if isinstance(sd, Mapping)
    ]
    if not plans:
        raise InputMismatchError("the selected entry is not a mapping of names to tensors")
    return max(plans, key=lambda p: (p.matched, -len(p.unexpected)))
