"""``inspect``: describe a checkpoint from its structure alone, without reading tensor data."""

from __future__ import annotations

import os
import pathlib
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, islice, repeat
from operator import attrgetter, countOf, eq, itemgetter, mul
from typing import Any

from ..errors import names_input
from ..fileio.extents import shared_bytes_of
from ..fileio.remote import consistent_reads, metadata_only
from ..fileio.sizes import format_size
from ..fileio.urls import is_url
from ..formats.checkpoint import Checkpoint, read_checkpoint
from ..model.paths import Path, format_path
from ..model.refs import (
    Global,
    OpaqueObject,
    Reduce,
    TensorRef,
    is_meta_tensor,
    is_tensor_like,
    is_torch_tensor,
    meta_shape,
)
from ..model.statedicts import WRAPPER_PREFIXES, find_state_dicts, is_optimizer_state, looks_like_state_dict
from ..model.walk import BulkMemo, census, iter_tensors, walk
from ..native import engine
from ..pickling.names import check_global_patterns
from ..pickling.vm import collector_paused, keep_until_exit
from ..transforms.foreign import unallowed_globals

#: how many layout entries the text report shows (``--full``: all; ``--json`` always has all)
MAX_TREE_LINES = 60
#: how deep the "layout" part of the report goes (deeper containers are one summarised entry)
_MAX_DEPTH = 4


def common_prefixes(keys: list[str]) -> list[dict[str, Any]]:
    """Prefixes shared by at least half the keys: the wrapper chain first, then first segments.

    ``_orig_mod.module.`` counts as one chain, so a compiled DDP model shows both wrappers.
    Counted in C loops (a regular expression per key, Counter over a list): no Python step per key.
    """
    if not keys:
        return []
    firsts = _first_segments(keys)
    half = (len(keys) + 1) // 2
    chains = _wrapper_chains(keys, firsts, half)
    result = [{"prefix": p, "keys": n} for p, n in chains.most_common() if n >= half]
    known = {r["prefix"] for r in result}
    result += [{"prefix": p, "keys": n} for p, n in firsts.most_common(3) if n >= half and p not in known]
    return result


def _first_segments(keys: list[str]) -> Counter[str]:
    """How many keys have each first segment (``module.``: up to its first dot, the dot
    included), in order of first appearance; keys without a dot are left out."""
    heads = Counter(map(_HEAD_AND_DOT, map(str.partition, keys, repeat("."))))
    return Counter({head + dot: n for (head, dot), n in heads.items() if dot})


def _wrapper_chains(keys: list[str], firsts: Counter[str], half: int) -> Counter[str]:
    """How many keys have each wrapper chain, exactly where a chain could be on ``half`` of them.

    Every wrapper prefix is one segment, so the keys starting with one are its count in
    ``firsts``. The one common case -- a single wrapper on at least half the keys, none of them
    followed by another wrapper (DDP's ``module.``) -- is counted from that and one C loop of
    ``str.startswith``; anything else by the regular expression on every key."""
    starts = [w for w in WRAPPER_PREFIXES if firsts.get(w, 0) >= half]
    if not starts:
        return Counter()  # a chain's keys all start with its first wrapper: none can reach half
    if len(starts) == 1:
        (wrapper,) = starts
        nested = tuple(wrapper + inner for inner in WRAPPER_PREFIXES)
        if not any(map(str.startswith, keys, repeat(nested))):
            return Counter({wrapper: firsts[wrapper]})
    return Counter([m[0] for m in map(_WRAPPER_CHAIN.match, keys) if m])


#: a key's first segment and its dot, from ``str.partition``
_HEAD_AND_DOT = itemgetter(0, 1)


#: a key's wrapper chain: wrapper prefixes one after another from its start. At most one of
#: them matches at any place (none is a prefix of another), so the greedy match is the chain
#: that peeling them off one at a time gives
_WRAPPER_CHAIN = re.compile("(?:" + "|".join(map(re.escape, WRAPPER_PREFIXES)) + ")+")


def _tensor_line(value: Any) -> str:
    if isinstance(value, TensorRef):
        kind = "parameter" if value.param else "tensor"
        return f"{kind} {value.dtype} {list(value.shape)} on {value.device}"
    if is_torch_tensor(value):
        return f"tensor {str(value.dtype).replace('torch.', '')} {list(value.shape)} on {value.device}"
    if isinstance(value, Reduce) and is_meta_tensor(value):
        dtype, shape = meta_shape(value)
        return f"tensor {dtype} {shape} on meta (no data)"
    if isinstance(value, Reduce):
        return f"{value.func.name.lstrip('_')} (kept as is)"
    return "tensor"


#: what an object of these globals is, in words (the last part of its class name otherwise)
_OBJECT_WORDS = {
    "numpy.core.multiarray._reconstruct": "a numpy array",
    "numpy._core.multiarray._reconstruct": "a numpy array",
    "numpy.core.multiarray.scalar": "a numpy scalar",
    "numpy._core.multiarray.scalar": "a numpy scalar",
    "argparse.Namespace": "an argparse.Namespace (command-line arguments)",
}


def holding(value: Any) -> str:
    """What ``value`` is, in the words ``inspect`` uses: "a tensor float32 [3, 4] on cpu",
    "a numpy array", "an argparse.Namespace ...", "a dict of 2 entries", "an int (3)"."""
    if is_tensor_like(value):
        return f"a {_tensor_line(value)}"
    if isinstance(value, (OpaqueObject, Reduce)):
        name = value.name if isinstance(value, OpaqueObject) else value.func.full
        return _OBJECT_WORDS.get(name, f"a {name} object")
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} of {len(value)} entries"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} items"
    kind = type(value).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} ({_scalar_text(value)})"


def not_a_mapping_fix(value: Any) -> str:
    """What to do when a checkpoint is one value, not names to tensors, and safetensors is asked for."""
    if is_tensor_like(value):
        return "store it under a name with --tensor-name KEY (KEY: the name, such as weight), or write a .pth file"
    if isinstance(value, (OpaqueObject, Reduce)) and "array" in holding(value):
        return (
            "turn it into a tensor and name it: --sanitize --tensor-name KEY (KEY: the name, such as weight), "
            "or write a .pth file"
        )
    return "write a .pth file (--sanitize makes it plain data that loads with weights_only=True)"


def _scalar_text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind_of(value: Any) -> str:
    if isinstance(value, Reduce):
        return value.func.full
    if isinstance(value, Global):
        return "torch global"
    return type(value).__name__


def _tensor_stats(value: Any, memo: BulkMemo, device: str | None = None) -> tuple[int, dict[str, int]]:
    """Tensor count and count per device tag under ``value`` (real tensors included): one pass.
    ``device``: the one device of every tensor record in the tree, where the caller knows it."""
    found = census(value, memo=memo)
    n = len(found.tensors)
    counts = _tally(_DEVICE, found.tensors) if device is None else Counter({device: n} if n else {})
    if found.records:
        extra = [_device_of(record) for record in found.records]
        if any(extra):
            return _tensor_stats_in_order(value)  # counts met in walk order: ties keep that order
    return n, dict(counts.most_common())


def _device_of(value: Any) -> str | None:
    """The device a record other than a tensor record counts under: a real tensor's, "meta"
    for a meta tensor's rebuild call; None for anything else."""
    if is_torch_tensor(value):
        return str(value.device)
    if is_meta_tensor(value):
        return "meta"
    return None


def _tensor_stats_in_order(value: Any) -> tuple[int, dict[str, int]]:
    """:func:`_tensor_stats` for trees holding real or meta tensors besides tensor records,
    counted in walk order as they are met (rare: a file read through torch, or saved on meta)."""
    counts: Counter[str] = Counter()
    n = 0
    for _, leaf in walk(value, leaves=True):
        device = leaf.device if isinstance(leaf, TensorRef) else _device_of(leaf)
        if device is not None:
            counts[device] += 1
            n += 1
    return n, dict(counts.most_common())


def _tally(getter: Callable[[Any], str], rows: list[Any]) -> Counter[str]:
    """``Counter(map(getter, rows))``. One dtype or one device for every tensor is the common
    case: ``countOf`` the first row's value finds it (compared by identity first: no hashing,
    no table), and its count is ``len(rows)``."""
    if rows:
        first = getter(rows[0])
        if countOf(map(getter, rows), first) == len(rows):
            return Counter({first: len(rows)})
    return Counter(map(getter, rows))


def _all_distinct(objects: list[Any]) -> bool:
    """Whether no object is in ``objects`` twice: their ``id`` numbers sorted, neighbours compared.
    Records made one after another lie in rising addresses, so the sort is one pass over runs;
    a set of 200 000 fresh numbers cost twice as much (its table misses the cache)."""
    ids = sorted(map(id, objects))
    return not any(map(eq, ids, islice(ids, 1, None)))


#: a tensor record's device tag and dtype, and its storage, read in C loops (``map``)
_DEVICE = attrgetter("storage.location")
_DTYPE = attrgetter("dtype")
_STORAGE = attrgetter("storage")
_LOCATION = attrgetter("location")
#: a storage record's size: numel x itemsize (its ``nbytes``, without a property call each)
_NUMEL = attrgetter("numel")
_ITEMSIZE = attrgetter("itemsize")


def describe_tree(
    root: Any, limit: int | None = None, memo: BulkMemo | None = None, device: str | None = None
) -> list[dict[str, Any]]:
    """One entry per interesting node: state dicts, optimizer states, tensors, plain values;
    the first ``limit`` of them (all with None).

    The walk goes at most ``_MAX_DEPTH`` levels down; deeper containers are summarised.
    ``memo``: what a :func:`census` of the same tree took in bulk (its counts are taken again).
    ``device``: the device tag of every tensor record in ``root``, where a census found only one
    (each entry's devices are then its count, without looking at its tensors again).
    """
    entries: list[dict[str, Any]] = []
    memo = {} if memo is None else memo

    def describe(path: Path, value: Any) -> bool:
        """Add the entry for ``value``; True when the walk should go into its children."""
        if limit is not None and len(entries) >= limit:
            return False
        where = format_path(path) or "(top level)"
        if looks_like_state_dict(value):
            n, devices = _tensor_stats(value, memo, device)
            entries.append({"path": where, "kind": "state dict", "tensors": n, "devices": devices})
        elif is_optimizer_state(value):
            n, devices = _tensor_stats(value, memo, device)
            entries.append({"path": where, "kind": "optimizer state", "tensors": n, "devices": devices})
        elif is_tensor_like(value):
            entries.append({"path": where, "kind": "tensor", "value": _tensor_line(value)})
        elif isinstance(value, (Mapping, list, tuple)) and value and len(path) < _MAX_DEPTH:
            if (
                path
                and not isinstance(value, Mapping)
                and all(not isinstance(v, (Mapping, list, tuple)) and not is_tensor_like(v) for v in value)
            ):
                entries.append({"path": where, "kind": type(value).__name__, "value": _scalar_text(value)})
                return False
            return True
        elif isinstance(value, (Mapping, list, tuple)):
            n, devices = _tensor_stats(value, memo, device)
            entries.append(
                {"path": where, "kind": type(value).__name__, "items": len(value), "tensors": n, "devices": devices}
            )
        else:
            entries.append({"path": where, "kind": _kind_of(value), "value": _scalar_text(value)})
        return False

    going_in: set[int] = set()  # the walk asks ``descend`` right after yielding a node
    for path, value in walk(root, lambda _, v: id(v) in going_in, leaves=True):
        if describe(path, value):
            going_in.add(id(value))
    return entries


def summarize(ckpt: Checkpoint) -> dict[str, Any]:
    """Everything ``inspect`` reports, as plain data (the ``--json`` document).

    One :func:`census` of the tree, then counts over its columns in C loops (``Counter``,
    ``map``): no Python step per tensor, except for the paths of tensors sharing a storage."""
    memo: BulkMemo = {}  # the census's bulk parts, taken again by describe_tree's counts
    found = census(ckpt.root, memo=memo)
    tensor_list = found.tensors
    tensors = len(tensor_list)
    dtypes = _tally(_DTYPE, tensor_list)
    storage_list = list(map(_STORAGE, tensor_list))
    devices = _tally(_LOCATION, storage_list)
    device = next(iter(devices)) if len(devices) == 1 else None  # the one of every tensor record
    if _all_distinct(storage_list):  # no storage used twice: the storages are the list itself
        storages = storage_list
        shared_ids: list[int] = []
    else:
        ids = list(map(id, storage_list))
        by_id = dict(zip(ids, storage_list))  # first use first, as met
        storages = list(by_id.values())
        # storages used by more than one tensor path (tied weights, views)
        shared_ids = [sid for sid, n in Counter(ids).items() if n > 1]
    meta = 0  # tensors saved from the meta device: counted, but they have no data
    for value in found.records:
        if isinstance(value, Reduce) and is_meta_tensor(value):
            meta += 1
            dtypes[meta_shape(value)[0]] += 1
            devices["meta"] += 1
        elif not ckpt.lazy and is_torch_tensor(value):
            tensors += 1
            dtypes[str(value.dtype).replace("torch.", "")] += 1
            devices[str(value.device)] += 1
    tensors += meta
    state_dicts = []
    for path, sd in find_state_dicts(ckpt.root):
        keys = list(compress(sd, map(isinstance, sd, repeat(str))))  # its string keys, in a C loop
        state_dicts.append(
            {
                "path": format_path(path),
                "keys": len(keys),
                "prefixes": common_prefixes(keys),
                "has_metadata": isinstance(getattr(sd, "_metadata", None), dict),
            }
        )
    unallowed = _unallowed(ckpt)
    shared = _shared_storages(ckpt.root, shared_ids)
    return {
        "input": ckpt.path,
        "diagnosis": _DIAGNOSIS.get(ckpt.format, ckpt.format),
        "format": ckpt.format,
        "engine": engine(),
        "input_bytes": ckpt.file_size,
        "tensors": tensors,
        "meta_tensors": meta,
        "storages": len(storages),
        "tensor_bytes": sum(map(mul, map(_NUMEL, storages), map(_ITEMSIZE, storages))),
        "dtypes": dict(dtypes.most_common()),
        "devices": dict(devices.most_common()),
        "state_dicts": state_dicts,
        "tree": describe_tree(ckpt.root, memo=memo, device=device),
        "shared_storages": shared,
        "globals": sorted(ckpt.globals),
        "unallowed_globals": unallowed,
        "shared_bytes": None if is_url(ckpt.path) else shared_bytes_of(_files_of(ckpt.path)),
        "notes": list(ckpt.notes),
        "warnings": _warnings(devices) + _meta_warning(meta) + _unallowed_warning(unallowed),
        **({"deepspeed": _deepspeed(ckpt)} if ckpt.deepspeed is not None else {}),
    }


@names_input
@collector_paused()
@consistent_reads
def inspect_checkpoint(
    path: str | os.PathLike[str],
    *,
    unsafe_load: bool = False,
    allow_globals: Sequence[str] = (),
    tag: str | None = None,
    weights: str | None = None,
) -> dict[str, Any]:
    """The ``inspect`` report as plain data; reads structure only, never tensor data.

    Here rather than in :mod:`ckptfix.pipeline` (which names it too): ``ckptfix inspect`` then
    imports only what reading and describing need, not the writers and transforms."""
    check_global_patterns(allow_globals)
    # unknown classes are shown as inert records (a warning names them): inspect writes nothing
    with metadata_only():  # a remote input: a few planned requests, whatever its size
        ckpt = read_checkpoint(
            path,
            unsafe_load=unsafe_load,
            allow_globals=allow_globals,
            inert_unknown=not unsafe_load,
            tag=tag,
            weights=weights,
        )
    summary = summarize(ckpt)
    keep_until_exit(ckpt)  # the command line's last command: the tree is left to the OS, never freed
    return summary


def _shared_storages(root: Any, shared_ids: list[int]) -> list[dict[str, Any]]:
    """``{"storage", "paths"}`` for each storage more than one tensor path uses, in the order
    storages are first met: the one walk that makes paths, run only when there are any."""
    if not shared_ids:
        return []
    users: dict[int, list[Path]] = {sid: [] for sid in shared_ids}
    keys: dict[int, str] = {}
    for path, tensor in iter_tensors(root):
        paths = users.get(id(tensor.storage))
        if paths is not None:
            paths.append(path)
            keys[id(tensor.storage)] = tensor.storage.key
    return [{"storage": keys[sid], "paths": [format_path(p) for p in paths]} for sid, paths in users.items()]


def _deepspeed(ckpt: Checkpoint) -> dict[str, Any]:
    """A DeepSpeed folder's layout: stage, world size, tags, dtype, counts, weight sources."""
    import dataclasses

    assert ckpt.deepspeed is not None
    info = dataclasses.asdict(ckpt.deepspeed)
    info["tags"] = list(info["tags"])
    info["weights_available"] = list(info["weights_available"])
    return info


def _files_of(path: str) -> list[str]:
    """The files a checkpoint is made of: the file, or those in its folder (shards, DCP)."""
    where = pathlib.Path(path)
    if where.is_dir():
        return sorted(str(p) for p in where.iterdir() if p.is_file())
    if where.name.endswith(".index.json"):
        return sorted(str(p) for p in where.parent.iterdir() if p.is_file())
    return [path]


def _unallowed(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Classes the file holds that no allow-list covers (read as inert records), with where."""
    found = unallowed_globals(ckpt)
    return {name: [format_path(p) or "(top level)" for p in paths] for name, paths in sorted(found.items())}


def _unallowed_warning(unallowed: dict[str, list[str]]) -> list[str]:
    if not unallowed:
        return []
    where = sorted({paths[0].split(".")[0].split("[")[0] for paths in unallowed.values()})
    return [
        f"{', '.join(where)} hold{'s' if len(where) == 1 else ''} classes outside the allow-list, read as inert "
        f"records (nothing run): {', '.join(list(unallowed)[:6])}{' ...' if len(unallowed) > 6 else ''}; "
        "torch.load(weights_only=True) refuses this file. Writing commands ignore them outside the part they "
        "write (--select state_dict), or take --sanitize (plain data) or --allow-global (kept as they are)"
    ]


_DIAGNOSIS = {
    "torch-zip": "a torch checkpoint in the zip format (torch.save since 1.6)",
    "torch-legacy": "a torch checkpoint in the legacy format (_use_new_zipfile_serialization=False)",
    "torch-tar": "a torch checkpoint in the tar format of torch before 0.4",
    "safetensors": "a safetensors file",
    "sharded": "an HF-style sharded checkpoint (index + shards)",
    "dcp": "a torch.distributed.checkpoint (DCP) folder",
    "deepspeed": "a DeepSpeed checkpoint folder (ZeRO partitions consolidated into one model)",
}


def meta_problem(count: int) -> str:
    """What a file with tensors on the ``meta`` device is: shapes without data."""
    return (
        f"{count} tensor{'s are' if count > 1 else ' is'} on the meta device and "
        f"hold{'' if count > 1 else 's'} no data (saved from a model built on meta): nothing can load "
        "weights from this file; save it again after the model's weights are materialised"
    )


def _meta_warning(count: int) -> list[str]:
    return [meta_problem(count)] if count else []


def _warnings(devices: Counter[str]) -> list[str]:
    if len(devices) <= 1:
        return []
    listed = ", ".join(f"{d} x{n}" for d, n in devices.most_common())
    return [
        f"tensors on several devices ({listed}): loading needs every one of them, or a map_location; "
        "to move them all: ckptfix remap IN OUT --map-location cpu"
    ]


def render(summary: dict[str, Any], full: bool = False) -> str:
    """The human-readable ``inspect`` report: the layout's first :data:`MAX_TREE_LINES` entries
    and how many more there are (``full``: every entry)."""
    lines = [f"{summary['input']}: {summary['diagnosis']}, {format_size(summary['input_bytes'])}"]
    if summary.get("shared_bytes"):  # a reflinked copy: its blocks are another file's too
        lines[0] += f" ({format_size(summary['shared_bytes'])} in blocks shared with another file)"
    lines.append(
        f"tensors: {summary['tensors']} in {summary['storages']} storages, "
        f"{format_size(summary['tensor_bytes'])} of tensor data"
        + (f"; {summary['meta_tensors']} on meta, with no data" if summary.get("meta_tensors") else "")
    )
    if summary["dtypes"]:
        lines.append("dtypes: " + ", ".join(f"{k} x{v}" for k, v in summary["dtypes"].items()))
    if summary["devices"]:
        lines.append("devices: " + ", ".join(f"{k} x{v}" for k, v in summary["devices"].items()))
    lines.append("layout:")
    shown = summary["tree"] if full else summary["tree"][:MAX_TREE_LINES]
    for entry in shown:
        detail = entry.get("value")
        if detail is None:
            detail = f"{entry['tensors']} tensors" + (f", {entry['items']} items" if "items" in entry else "")
            if entry.get("devices"):
                detail += " on " + ", ".join(
                    f"{d} x{n}" if len(entry["devices"]) > 1 else d for d, n in entry["devices"].items()
                )
        lines.append(
            f"  {entry['path']}: {entry['kind']}: {detail}"
            if entry["kind"] not in ("tensor",)
            else f"  {entry['path']}: {detail}"
        )
    if len(shown) < len(summary["tree"]):
        lines.append(
            f"  … {len(summary['tree']) - len(shown)} more entries (--full shows every one; --json has them all)"
        )
    for sd in summary["state_dicts"]:
        where = sd["path"] or "(top level)"
        prefixes = ", ".join(f"{p['prefix']!r} on {p['keys']}/{sd['keys']} keys" for p in sd["prefixes"])
        lines.append(f"state dict {where}: {sd['keys']} keys" + (f"; prefixes: {prefixes}" if prefixes else ""))
    for group in summary["shared_storages"][:10]:
        lines.append(f"shared storage {group['storage']}: " + ", ".join(group["paths"][:6]))
    if summary["globals"]:
        lines.append("pickle globals: " + ", ".join(summary["globals"]))
    lines.extend(f"note: {n}" for n in summary["notes"])
    lines.extend(f"warning: {w}" for w in summary["warnings"])
    return "\n".join(lines)
