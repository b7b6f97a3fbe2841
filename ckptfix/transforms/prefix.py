"""Pure transforms on a checkpoint tree: they return a new tree and say what they changed.

Prefix stripping follows ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``
(the reference) applied until no key has the prefix, so ``module.module.x`` becomes ``x``,
and renames the state dict's ``_metadata`` exactly as the reference does. Two deliberate
differences: keys keep their positions (the reference moves renamed keys to the end, which
``load_state_dict`` ignores but a reader of ``inspect`` would not), and a rename that would
make two keys collide is an error instead of silently dropping one tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, TypeAlias

from ..errors import CheckFailedError, InputMismatchError, UsageError
from ..model.paths import Path, format_path, select
from ..model.refs import Tree
from ..model.statedicts import (
    PURE_WRAPPER_PREFIXES,
    WRAPPER_ORIGINS,
    find_state_dicts,
    holds_tensors_by_name,
    wrapper_chain,
)
from ..model.walk import copy_mapping, substitute

#: a state dict as the transforms see it: string keys (what ``find_state_dicts`` finds), any values
StateDict: TypeAlias = Mapping[str, Any]
#: (old key, new key) for each key a transform renamed
Renames: TypeAlias = list[tuple[str, str]]


@dataclass
class StateDictChange:
    """What a transform did to one state dict."""

    path: str
    keys: int
    renamed: Renames = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "keys": self.keys, "renamed": len(self.renamed), "renames": self.renamed}


@dataclass
class TransformResult:
    """The transformed tree and a per-state-dict account of the changes."""

    root: Tree
    changes: list[StateDictChange]

    @property
    def renamed(self) -> int:
        return sum(len(c.renamed) for c in self.changes)


#: ``--prefix auto``: every pure wrapper prefix (:data:`PURE_WRAPPER_PREFIXES`), any nesting
AUTO = "auto"


def normalize_prefix(prefix: str) -> str:
    """Prefixes name modules, so they end with a dot: ``module`` means ``module.``.
    ``auto`` stays as it is: it names the pure wrapper prefixes, not one module."""
    if prefix == AUTO:
        return prefix
    if not prefix or prefix.strip(".") == "":
        raise UsageError(f"invalid prefix {prefix!r}: give a module name such as 'module.'")
    return prefix if prefix.endswith(".") else prefix + "."


def select_state_dicts(root: Tree, keys: Sequence[str] = ()) -> list[tuple[Path, StateDict]]:
    """The state dicts a prefix command acts on: all of them, or those under ``--key`` paths.

    A ``--key`` that names a string-keyed mapping holding tensors selects it even when it
    also holds other values; one that names a container selects the state dicts inside it.
    """
    if not keys:
        return find_state_dicts(root)
    selected: list[tuple[Path, StateDict]] = []
    for dotted in keys:
        path, target = select(root, dotted, flag="--key")
        found = [((), target)] if holds_tensors_by_name(target) else find_state_dicts(target)
        if not found:
            raise InputMismatchError(f"--key {dotted}: there is no state dict there")
        selected.extend((path + sub, sd) for sub, sd in found)
    return selected


def _check_collisions(originals: list[str], new_keys: list[str], prefix: str, verb: str) -> None:
    if len(set(new_keys)) == len(new_keys):
        return  # the usual case, in one C loop; the loop below finds the first clash to name it
    first: dict[str, str] = {}
    what = prefix if prefix.startswith("the ") else repr(prefix)
    for original, new in zip(originals, new_keys):
        if new in first:
            raise CheckFailedError(
                f"{verb} {what} would give two keys the same name {new!r}: "
                f"{first[new]!r} and {original!r}; nothing was written",
                hint="rename or drop one of them first, or restrict the change with --key",
            )
        first[new] = original


def _rekeyed(state_dict: StateDict, new_keys: list[str], metadata: Any) -> StateDict:
    """``state_dict`` with its keys replaced in order, and ``metadata`` as its ``_metadata``."""
    new_sd = copy_mapping(state_dict, zip(new_keys, state_dict.values()))
    if metadata is not None:
        new_sd._metadata = metadata  # type: ignore[attr-defined]  # an OrderedDict attribute, as torch sets it
    return new_sd


def _strip_metadata_pass(metadata: dict[str, Any], prefix: str) -> None:
    """One pass of the reference's ``_metadata`` renaming, literally (including its quirks)."""
    for key in list(metadata.keys()):
        if len(key) == 0:
            continue
        if key == prefix.replace(".", "") or key.startswith(prefix):
            metadata[key[len(prefix) :]] = metadata.pop(key)


def _starts(keys: Iterable[str], prefix: str) -> bool:
    """Whether any key starts with ``prefix`` (a C loop: no Python step per key)."""
    return any(map(str.startswith, keys, repeat(prefix)))


def _strip_one(state_dict: StateDict, prefix: str) -> tuple[StateDict, Renames]:
    if not _starts(state_dict, prefix):
        return state_dict, []  # the usual case for an optimizer's per-parameter state
    originals = list(state_dict.keys())
    current = list(originals)
    metadata = getattr(state_dict, "_metadata", None)
    metadata = type(metadata)(metadata) if isinstance(metadata, dict) else None
    cut = len(prefix)
    while _starts(current, prefix):
        current = [k[cut:] if k.startswith(prefix) else k for k in current]
        _check_collisions(originals, current, prefix, "stripping")
        if metadata is not None:
            _strip_metadata_pass(metadata, prefix)
    renamed = [(old, new) for old, new in zip(originals, current) if old != new]
    return (_rekeyed(state_dict, current, metadata), renamed) if renamed else (state_dict, [])


def _strip_wrappers(state_dict: StateDict) -> tuple[StateDict, Renames]:
    """``--prefix auto``: strip the pure wrapper prefixes every key shares, outermost first, in
    whatever order they nest (``_orig_mod.module.x``, ``module._orig_mod.x``, ``module.module.x``).
    A prefix only some keys carry is a real submodule's name, and stays."""
    keys = list(state_dict.keys())
    chain = wrapper_chain(keys, PURE_WRAPPER_PREFIXES)
    if not chain:
        return state_dict, []
    cut = sum(len(p) for p in chain)
    current = [k[cut:] for k in keys]
    _check_collisions(keys, current, "".join(chain), "stripping")
    metadata = getattr(state_dict, "_metadata", None)
    metadata = type(metadata)(metadata) if isinstance(metadata, dict) else None
    if metadata is not None:
        for prefix in chain:  # the reference's renaming, one wrapper at a time
            _strip_metadata_pass(metadata, prefix)
    return _rekeyed(state_dict, current, metadata), list(zip(keys, current))


def _add_one(state_dict: StateDict, prefix: str) -> tuple[StateDict, Renames]:
    originals = list(state_dict.keys())
    current = [k if k.startswith(prefix) else prefix + k for k in originals]
    _check_collisions(originals, current, prefix, "adding")
    renamed = [(old, new) for old, new in zip(originals, current) if old != new]
    if not renamed:
        return state_dict, []
    metadata = getattr(state_dict, "_metadata", None)
    new_metadata = _add_metadata(metadata, prefix) if isinstance(metadata, dict) else None
    return _rekeyed(state_dict, current, new_metadata), renamed


def _add_metadata(metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    """What a wrapper's ``state_dict()`` records: the wrapper at "", the model's entries under it.

    The exact inverse of the reference's stripping ('' -> 'module', 'x' -> 'module.x'), so a
    model that itself has a submodule named ``module`` round-trips too.
    """
    new = type(metadata)()
    if "" in metadata:
        new[""] = metadata[""]
    for key, value in metadata.items():
        new[prefix + key if key else prefix[:-1]] = value
    return new


def _apply(root: Tree, keys: Sequence[str], one: Callable[[StateDict], tuple[StateDict, Renames]]) -> TransformResult:
    """Run ``one`` on every selected state dict; replace the changed ones by identity."""
    changes: list[StateDictChange] = []
    replacements: dict[int, Tree] = {}
    for path, state_dict in select_state_dicts(root, keys):
        if id(state_dict) in replacements:
            continue  # the same object reached twice (e.g. by --key and by a parent)
        new_sd, renamed = one(state_dict)
        changes.append(StateDictChange(format_path(path), len(state_dict), renamed))
        if renamed:
            replacements[id(state_dict)] = new_sd
    return TransformResult(substitute(root, replacements) if replacements else root, changes)


def parse_rule(rule: str) -> tuple[re.Pattern[str], str]:
    """``REGEX=>REPLACEMENT`` (Python ``re`` syntax, backrefs as ``\\1`` or ``\\g<name>``)."""
    if "=>" not in rule:
        raise UsageError(f"invalid rename rule {rule!r}: write REGEX=>REPLACEMENT, e.g. '^backbone\\.=>encoder.'")
    pattern, replacement = rule.split("=>", 1)
    try:
        compiled = re.compile(pattern)
        compiled.sub(replacement, "")  # bad backrefs show up only when used
    except re.error as exc:
        raise UsageError(f"invalid rename rule {rule!r}: {exc}") from exc
    return compiled, replacement


def _rename_one(state_dict: StateDict, rules: Sequence[tuple[re.Pattern[str], str]]) -> tuple[StateDict, Renames]:
    def apply(key: str) -> str:
        for pattern, replacement in rules:
            try:
                key = pattern.sub(replacement, key)
            except (re.error, IndexError) as exc:
                raise InputMismatchError(
                    f"rename rule {pattern.pattern!r}=>{replacement!r} fails on {key!r}: {exc}"
                ) from exc
        return key

    originals = list(state_dict.keys())
    current = [apply(k) if isinstance(k, str) else k for k in originals]
    _check_collisions(originals, current, "the rename rules", "applying")
    renamed = [(old, new) for old, new in zip(originals, current) if old != new]
    if not renamed:
        return state_dict, []
    metadata = getattr(state_dict, "_metadata", None)
    renamed_meta = None
    if isinstance(metadata, dict):
        # a module path is the prefix of its keys: rename "path." the way its keys are renamed
        renamed_meta = type(metadata)()
        for key, value in metadata.items():
            new_key = apply(key + ".") if key else "."
            renamed_meta.setdefault(new_key[:-1] if new_key.endswith(".") else key, value)
    return _rekeyed(state_dict, current, renamed_meta), renamed


def rename_keys(root: Tree, rules: Sequence[str], keys: Sequence[str] = ()) -> TransformResult:
    """Apply ``REGEX=>REPLACEMENT`` rules, in order, to every state-dict key (like mmengine's
    ``revise_keys``). Each ``_metadata`` module path is renamed as ``path + "."`` would be (the
    prefix its keys share), so versioned modules such as BatchNorm keep their versions.
    Raises :class:`~ckptfix.errors.CheckFailedError` if two keys would end up the same."""
    compiled = [parse_rule(r) for r in rules]
    return _apply(root, keys, lambda sd: _rename_one(sd, compiled))


def strip_prefix(root: Tree, prefix: str = "module.", keys: Sequence[str] = ()) -> TransformResult:
    """Remove ``prefix`` (repeatedly) from the keys of every state dict in ``root``.

    Example::

        ckpt = ckptfix.read_checkpoint("ddp.pth")
        result = ckptfix.strip_prefix(ckpt.root, "module.")
        result.changes[0].renamed[:1]   # [('module.fc.weight', 'fc.weight')]

    ``keys`` restricts the change to the state dicts at or under those dotted paths.
    ``prefix="auto"`` strips every pure wrapper prefix (``module.``, ``_orig_mod.``,
    ``_forward_module.``) that all of a state dict's keys share, in any nesting.
    Raises :class:`~ckptfix.errors.CheckFailedError` if two keys would collide.
    """
    prefix = normalize_prefix(prefix)
    if prefix == AUTO:
        return _apply(root, keys, _strip_wrappers)
    return _apply(root, keys, lambda sd: _strip_one(sd, prefix))


@dataclass(frozen=True)
class WrapperFix:
    """The wrapper prefixes a state dict's keys all carry, and the options that strip them."""

    #: e.g. "'_orig_mod.' (torch.compile)"
    wrappers: str
    #: e.g. "--prefix auto"
    options: str


def wrapper_fix(root: Tree, keys: Sequence[str] = ()) -> WrapperFix | None:
    """What would strip the known wrapper prefixes (``module.``, ``_orig_mod.``, ``model.`` ...)
    every key of a state dict shares, when one does; None otherwise: ``--prefix auto`` when only
    pure wrappers are found, else each prefix in nesting order."""
    for _, state_dict in select_state_dicts(root, keys):
        chain = wrapper_chain(list(state_dict))
        if not chain:
            continue
        wrappers = " then ".join(f"{p!r} ({WRAPPER_ORIGINS[p]})" for p in dict.fromkeys(chain))
        if all(p in PURE_WRAPPER_PREFIXES for p in chain):
            return WrapperFix(wrappers, "--prefix auto")
        rest = "".join(f" --strip-prefix {p}" for p in dict.fromkeys(chain[1:]))
        return WrapperFix(wrappers, f"--prefix {chain[0]}{rest}")
    return None


def add_prefix(root: Tree, prefix: str = "module.", keys: Sequence[str] = ()) -> TransformResult:
    """Add ``prefix`` to every key of every state dict that lacks it (the inverse of strip)."""
    if prefix == AUTO:
        raise UsageError("--prefix auto strips the wrapper prefixes it finds; to add one, name it, e.g. module.")
    prefix = normalize_prefix(prefix)
    return _apply(root, keys, lambda sd: _add_one(sd, prefix))
