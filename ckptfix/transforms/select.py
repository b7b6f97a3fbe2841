"""``--drop`` / ``--keep`` and the ``prune`` preset: choose which parts of a checkpoint to write.

Patterns are shell globs (``fnmatch``), matched against

* the dotted path of any entry of the tree (``optimizer_state_dict``, ``ema``,
  ``optimizer_states.0``, ``state_dict.backbone.conv1.weight``), and
* inside a state dict, the key itself (``backbone.*``, ``*.num_batches_tracked``).

``--drop`` removes every matching entry, wherever it is. ``--keep`` filters state-dict keys:
in each state dict only the keys matching a keep pattern stay; the rest of the tree is
untouched (use ``--select`` to write just one sub-tree). Dropped tensors' storages are simply
not written, so the output shrinks by their bytes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..model.paths import Path, format_path
from ..model.refs import Tree, is_tensor_like
from ..model.statedicts import find_state_dicts, is_optimizer_state
from ..model.walk import census, copy_mapping, substitute, walk

#: entries a training loop saves besides the weights (Lightning, plain PyTorch, timm, mmengine...)
TRAINING_STATE = (
    "optimizer",
    "optimizers",
    "optimizer_state",
    "optimizer_states",
    "optimizer_state_dict",
    "optim",
    "optim_state",
    "opt",
    "opt_state",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "schedulers",
    "scheduler_state_dict",
    "loops",
    "callbacks",
    "scaler",
    "grad_scaler",
    "amp",
    "amp_scaling_state",
    "native_amp_scaling_state",
    "MixedPrecision",
    "rng_state",
    "rng_states",
    "message_hub",
)


@dataclass
class SelectionReport:
    dropped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def _matches(patterns: Sequence[str], *names: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns for name in names)


def literal_glob(name: str) -> str:
    """A ``--drop``/``--keep`` pattern that matches ``name`` alone (its ``* ? [`` escaped)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def shell_word(text: str) -> str:
    """``text`` as one shell word, quoted only where it needs to be (for commands we print)."""
    import shlex

    return shlex.quote(text)


def filter_tree(root: Tree, drop: Sequence[str] = (), keep: Sequence[str] = ()) -> tuple[Tree, SelectionReport]:
    """A copy of ``root`` without the entries ``drop`` matches and the state-dict keys ``keep`` does not.

    One walk decides, per container, which entries go (a shared container is decided once, at
    its first path); :func:`substitute` then writes the smaller containers in, keeping sharing
    and cycles. Dropped sub-trees are not entered.
    """
    report = SelectionReport(bytes_before=census(root).nbytes())
    state_dict_ids = {id(sd) for _, sd in find_state_dicts(root)}
    replacements: dict[int, Tree] = {}
    dropped: set[Path] = set()

    def descend(path: Path, value: Any) -> bool:
        if path in dropped or not isinstance(value, (Mapping, list, tuple)) or is_tensor_like(value):
            return False
        in_state_dict = id(value) in state_dict_ids
        items = list(value.items()) if isinstance(value, Mapping) else list(enumerate(value))
        kept_items = []
        for key, item in items:
            full = format_path(path + (key,))
            names = (full, str(key)) if in_state_dict else (full,)
            if _matches(drop, *names) or (in_state_dict and keep and not _matches(keep, *names)):
                report.dropped.append(full)
                dropped.add(path + (key,))
            else:
                kept_items.append((key, item))
        if len(kept_items) != len(items):
            if isinstance(value, Mapping):
                replacements[id(value)] = copy_mapping(value, kept_items)
            else:
                replacements[id(value)] = type(value)(v for _, v in kept_items)
        return True

    for _ in walk(root, descend):
        pass
    new_root = substitute(root, replacements)
    report.bytes_after = census(new_root).nbytes()
    return new_root, report


def _escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def prune_patterns(root: Tree) -> list[str]:
    """Exact ``--drop`` paths that leave only the weights: entries named like training state
    (optimizer, schedulers, loops, callbacks, AMP scaler, RNG state) and every sub-tree shaped
    like an optimizer state. State dicts (the weights, EMA included) are never entered."""
    state_dict_ids = {id(sd) for _, sd in find_state_dicts(root)}
    patterns: list[str] = []

    def descend(path: Path, value: Any) -> bool:
        if id(value) in state_dict_ids or is_tensor_like(value):
            return False
        if path and ((isinstance(path[-1], str) and path[-1] in TRAINING_STATE) or is_optimizer_state(value)):
            patterns.append(_escape(format_path(path)))
            return False
        return isinstance(value, (Mapping, list, tuple))

    for _ in walk(root, descend):
        pass
    return patterns
