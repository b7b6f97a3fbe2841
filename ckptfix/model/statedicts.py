"""What a state dict and an optimizer state look like, where they are in a tree, and the
wrapper prefixes (``module.``, ``_orig_mod.``, ``model.``) people meet on their keys."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from .paths import Path
from .refs import TensorRef, Tree, is_tensor_like
from .walk import ATTRS, copy_mapping, walk


def is_optimizer_state(value: Any) -> bool:
    """``Optimizer.state_dict()`` output: its keys are parameter ids and must never be renamed."""
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


#: a state dict may carry this many entries that are not tensors (a module's extra state, a
#: probabilistic library's ``..._param_store`` dict), as long as its tensors are keyed by dotted
#: module paths: it is still what ``load_state_dict`` is given
MAX_NON_TENSOR_ENTRIES = 4


def looks_like_state_dict(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """A ``Module.state_dict()``-shaped mapping: string keys, the values tensors.

    Values under keys ending in ``_extra_state`` may be anything (``get_extra_state``); beside
    tensors keyed by dotted names (``fc.weight``) up to :data:`MAX_NON_TENSOR_ENTRIES` other
    values may be too (fewer than the tensors). Optimizer states' inner dicts (``exp_avg``...)
    have undotted keys: they are state-dict-like only when every value is a tensor.
    """
    if not isinstance(value, Mapping) or not value:
        return False
    if set(map(type, value.values())) == {TensorRef} and set(map(type, value)) == {str}:
        return True  # the usual state dict, told in C loops: string keys, every value a tensor
    tensors = dotted = others = 0
    for key, item in value.items():
        if not isinstance(key, str):
            return False
        if is_tensor_like(item):
            tensors += 1
            dotted += "." in key
        elif not key.endswith("_extra_state"):
            others += 1
            if others > MAX_NON_TENSOR_ENTRIES:
                return False
    if not tensors:
        return False
    return not others or (dotted == tensors and others < tensors)


def holds_tensors_by_name(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """A string-keyed mapping holding at least one tensor: what a state dict is taken to be
    where the user names it (``--select PATH``, ``--key PATH``), whatever else it holds."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) for k in value)
        and any(is_tensor_like(v) for v in value.values())
    )


def find_state_dicts(root: Tree) -> list[tuple[Path, Mapping[str, Any]]]:
    """All state-dict-like mappings in the tree, outermost first, with their paths.

    Optimizer states and mappings with non-string keys are not searched: their inner dicts
    (``{"exp_avg": ..., "exp_avg_sq": ...}``) look like state dicts but are not.
    """
    found: list[tuple[Path, Mapping[str, Any]]] = []

    def descend(path: Path, value: Any) -> bool:
        if not isinstance(value, (Mapping, list, tuple)) or is_tensor_like(value):
            return False
        if looks_like_state_dict(value):
            found.append((path, value))
            return False
        if is_optimizer_state(value):
            return False
        return not (isinstance(value, Mapping) and not all(isinstance(k, str) for k in value))

    for _ in walk(root, descend):
        pass
    return [(p, v) for p, v in found if ATTRS not in p]


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "_forward_module.")
#: the wrappers that add a prefix and nothing else (DataParallel/DDP, torch.compile, Lightning
#: Fabric): ``--prefix auto`` strips these; ``model.`` is a real attribute of a LightningModule
PURE_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")
#: who adds each wrapper prefix, for hints
WRAPPER_ORIGINS = {
    "module.": "nn.DataParallel / DistributedDataParallel",
    "_orig_mod.": "torch.compile",
    "_forward_module.": "Lightning Fabric",
    "model.": "a LightningModule's model attribute",
}


def wrapper_chain(keys: Sequence[str], wrappers: Sequence[str] = WRAPPER_PREFIXES) -> list[str]:
    """The wrapper prefixes every key starts with, outermost first (``_orig_mod.module.``)."""
    chain: list[str] = []
    rest = list(keys)
    while rest:
        wrapper = next((w for w in wrappers if all(k.startswith(w) for k in rest)), None)
        if wrapper is None:
            break
        chain.append(wrapper)
        rest = [k[len(wrapper) :] for k in rest]
    return chain


#: where training code keeps an EMA copy of the weights beside the model, in timm's order of
#: preference: top-level entries of a checkpoint ...
EMA_ENTRIES = ("state_dict_ema", "model_ema", "ema")
#: ... or a submodule of the one state dict (a Lightning module holding ``model`` and ``model_ema``)
EMA_PREFIXES = ("model_ema.", "ema_model.", "ema.", "module_ema.")


def ema_prefix(state_dict: Mapping[Any, Any]) -> str | None:
    """The prefix of an EMA submodule when ``state_dict`` holds both a model and its EMA copy
    (some keys under the prefix, some not); None otherwise."""
    keys = [k for k in state_dict if isinstance(k, str)]
    for prefix in EMA_PREFIXES:
        inside = sum(1 for k in keys if k.startswith(prefix))
        if 0 < inside < len(keys):
            return prefix
    return None


def split_ema(state_dict: Mapping[Any, Any], ema: bool) -> tuple[Mapping[Any, Any], str]:
    """The model's part of a state dict holding an EMA submodule (``ema=False``), or the EMA
    copy under the model's own names (``ema=True``); and a note saying what was left out."""
    prefix = ema_prefix(state_dict)
    if prefix is None:
        return state_dict, ""
    if ema:
        items = [(k[len(prefix) :], v) for k, v in state_dict.items() if isinstance(k, str) and k.startswith(prefix)]
        note = f"took the EMA copy ({len(items)} keys under {prefix!r}); left out the model's own weights"
    else:
        items = [(k, v) for k, v in state_dict.items() if not (isinstance(k, str) and k.startswith(prefix))]
        note = f"left out the EMA copy ({len(state_dict) - len(items)} keys under {prefix!r}): --ema selects it"
    return copy_mapping(state_dict, items), note
