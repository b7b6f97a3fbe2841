"""Device tags: parsing ``--map-location`` and rewriting the tags storages carry.

A torch checkpoint records, per storage, the device it was saved from (``cpu``, ``cuda:3``).
``torch.load`` restores it there, or fails ("Attempting to deserialize object on a CUDA device
but torch.cuda.is_available() is False"). Rewriting the tag in the file needs no GPU and no
tensor data: the output then loads with plain ``torch.load`` where the target device exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import UsageError
from ..model.walk import census, iter_storages, substitute

_DEVICE = re.compile(r"^(cpu|meta|mps|cuda|xpu|hpu|npu|mtia|xla|privateuseone)(:(\d+))?$")
_INDEXED = ("cuda", "xpu", "hpu", "npu", "mtia", "xla", "privateuseone")


def normalize_device(text: str, flag: str = "--map-location") -> str:
    """A device string as torch tags storages; a bare ``cuda`` means ``cuda:0``. ``flag``: the
    option it came from, for the error."""
    text = text.strip()
    match = _DEVICE.match(text)
    if not match:
        suggestion = _suggest(text)
        if flag != "--map-location":
            suggestion = suggestion.replace(" or FROM=TO pairs such as cuda:1=cuda:0", "")
        raise UsageError(f"invalid device {text!r} in {flag}: {suggestion}")
    kind, index = match.group(1), match.group(3)
    if index is None and kind in _INDEXED:
        return f"{kind}:0"
    return text


def _suggest(text: str) -> str:
    lowered = text.lower()
    glued = re.match(r"^(cuda|xpu|hpu|npu)(\d+)$", lowered)
    if glued:
        return f"write '{glued.group(1)}:{glued.group(2)}'"
    if lowered.isdigit():
        return f"a bare number is not a device; write 'cuda:{lowered}'"
    if lowered in ("gpu", "nvidia"):
        return "write 'cuda' (or 'cuda:0')"
    return "expected cpu, cuda, cuda:N, mps, meta, xpu:N ... or FROM=TO pairs such as cuda:1=cuda:0"


def parse_map_location(spec: str) -> Callable[[str], str]:
    """``cpu`` maps every storage; ``cuda:1=cuda:0,cuda:2=cpu`` maps only those tags.

    On the FROM side a bare type matches every index (``cuda=cpu`` moves all CUDA storages);
    on the TO side a bare ``cuda`` means ``cuda:0``, as in ``torch.load``. Several single
    devices, or a single device mixed with pairs, are refused: which one would win is unclear.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise UsageError("empty --map-location")
    if all("=" not in p for p in parts):
        if len(parts) > 1:
            raise UsageError(f"--map-location {spec!r} names several devices; give one, or FROM=TO pairs")
        target = normalize_device(parts[0])
        return lambda tag: target
    exact: dict[str, str] = {}
    by_type: dict[str, str] = {}
    for part in parts:
        if part.count("=") != 1:
            raise UsageError(f"invalid --map-location part {part!r}: write FROM=TO, e.g. cuda:1=cuda:0")
        source, target = (x.strip() for x in part.split("="))
        normalize_device(source)  # validates
        (by_type if ":" not in source else exact)[source] = normalize_device(target)
    return lambda tag: exact.get(tag, by_type.get(tag.split(":")[0], tag))


def remap_devices(root: Any, spec: str) -> tuple[Any, dict[str, int]]:
    """A copy of ``root`` with storage device tags rewritten; returns it and ``{"a->b": count}``."""
    mapping = parse_map_location(spec)
    replacements: dict[int, Any] = {}
    changes: dict[str, int] = {}
    for storage in iter_storages(root):
        target = mapping(storage.location)
        if target != storage.location:
            replacements[id(storage)] = replace(storage, location=target)
            change = f"{storage.location}->{target}"
            changes[change] = changes.get(change, 0) + 1
    if not replacements:
        return root, changes
    for tensor in census(root).tensors:
        new_storage = replacements.get(id(tensor.storage))
        if new_storage is not None and id(tensor) not in replacements:
            replacements[id(tensor)] = replace(tensor, storage=new_storage)
    return substitute(root, replacements), changes
