"""HF-hub style sharded checkpoints: shard files plus a ``*.index.json`` weight map.

Layout written (the one ``huggingface_hub.save_torch_state_dict`` and ``transformers`` use)::

    model-00001-of-00003.safetensors ...        (or pytorch_model-00001-of-00003.bin)
    model.safetensors.index.json                (or pytorch_model.bin.index.json)
        {"metadata": {"total_size": N, ALIAS: KEPT ...}, "weight_map": {name: shard file}}

A single shard is written as ``model.safetensors`` / ``pytorch_model.bin`` with no index, as
the hub does. Shards are filled greedily in key order up to the size limit; a tensor larger
than the limit gets a shard of its own. Reading checks the index against the shards: a missing
shard, a key listed for a shard that lacks it, a key in two shards, or a shard key the index
does not list is an error, never a silently incomplete model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInputError, CannotWriteError, CkptfixError, ExitCode
from ..fileio import strictjson
from ..fileio.atomic import atomic_output
from ..fileio.held import held_outputs
from ..model.refs import TensorRef
from .detect import checkpoint_like, open_input
from .safetensors import SafetensorsPlan, plan_safetensors, write_safetensors
from .torchzip import write_torch_zip

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")
#: an index is a few MB even for the largest models; a bigger one is not an index
MAX_INDEX_BYTES = 100_000_000


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy sharding in key order; an oversized tensor gets its own shard."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes.items():
        if size > max_bytes:
            if current:
                shards.append(current)
            shards.append([name])
            current, current_size = [], 0
            continue
        if current and current_size + size > max_bytes:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class Split:
    """This process's part of one sharded write split over ``world`` processes (``torchrun``
    ranks): it writes the shards whose number is ``rank`` modulo ``world``, and rank 0 writes
    the index once every process has committed its shards. ``agree(code)`` is a collective
    every process calls at the same points with its exit code so far (0: its part succeeded);
    it returns the worst code of all (so a failure anywhere undoes every process's shards and
    no index is written, and every process fails with the others' code if not its own)."""

    rank: int
    world: int
    agree: Callable[[int], int]

    def mine(self, number: int) -> bool:
        return number % self.world == self.rank


@dataclass
class ShardedWrite:
    files: list[Path]
    index: Path | None
    aliases: dict[str, str]
    total_size: int


def _code_of(failure: BaseException | None) -> int:
    """The exit code a failure gives (see :class:`~ckptfix.errors.ExitCode`)."""
    if failure is None:
        return 0
    if isinstance(failure, CkptfixError):
        return int(failure.exit_code)
    return int(ExitCode.INTERRUPTED if isinstance(failure, KeyboardInterrupt) else ExitCode.INTERNAL)


def together(
    split: Split | None, work: Callable[[], None], out: str | Path, undo: Callable[[], None] | None = None
) -> None:
    """Run this process's part of one step of a split write (``work``); then every process
    agrees whether all parts succeeded, and if any failed, each undoes what it wrote
    (``undo``), waits until all have (so no process exits while another still cleans up),
    and fails: with its own error, or the worst code of the others'. Without a split, ``work``
    runs and a failure is undone and raised."""
    failure: BaseException | None = None
    try:
        work()
    except BaseException as exc:
        failure = exc
    worst = split.agree(_code_of(failure)) if split is not None else _code_of(failure)
    if worst == 0:
        return
    if undo is not None:
        undo()
    if split is not None:
        split.agree(0)  # no process leaves before every one has cleaned up
    if failure is not None:
        raise failure
    error = BadInputError if worst == ExitCode.BAD_INPUT else CannotWriteError
    raise error(f"{out}: another process of the split write failed (exit {worst}); nothing written")


def write_sharded(
    state_dict: Mapping[str, Any],
    out_dir: Path,
    max_bytes: int,
    *,
    shard_format: str = "safetensors",
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    max_data_bytes: int | None = None,
    split: Split | None = None,
    plan: SafetensorsPlan | None = None,
) -> ShardedWrite:
    """Write ``state_dict`` as shards in ``out_dir``; all files or none.

    The write goes in steps, each finished by every process before the next begins: no shard
    name is taken (unless ``overwrite``); every shard is written in full but held (a temporary
    file; an upload with every part sent and not completed, so no object exists yet); all are
    committed (renamed; uploads completed); then the index, the folder's completion marker,
    is written. A failure at any step undoes
    all of it (held shards dropped, uploads aborted, committed shards deleted), so a failed
    write leaves no index, no upload in progress and, before the commit step, not even a shard
    (:func:`~ckptfix.fileio.held.held_outputs`).

    ``max_data_bytes`` bounds what safetensors shards would hold, checked before any file is
    written (see :func:`~ckptfix.formats.safetensors.check_expand_budget`); .bin shards keep
    views as views, so they are not bounded. ``split``: this process writes only its shards
    (see :class:`Split`); every process plans the same layout, so the files are the same as
    one process writes. The returned ``files`` are all of them, from every process. ``plan``:
    what :func:`plan_safetensors` gave for this ``state_dict``, ``metadata`` and budget (a caller
    that checked it before), so it is not worked out twice.
    """
    budget = max_data_bytes if shard_format == "safetensors" else None
    if plan is None:  # checks every value, finds ties once
        plan = plan_safetensors(state_dict, metadata, max_data_bytes=budget)
    kept = dict(plan.tensors)
    size_of = dict(zip(kept, plan.sizes)) if plan.sizes is not None else {k: t.nbytes for k, t in kept.items()}
    ordered = {name: size_of[name] for name in state_dict if name in size_of}
    shards = plan_shards(ordered, max_bytes)
    stem, ext = ("model", "safetensors") if shard_format == "safetensors" else ("pytorch_model", "bin")
    count = len(shards)
    names = [f"{stem}.{ext}"] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]
    index_path = out_dir / f"{stem}.{ext}.index.json" if count > 1 else None
    targets = [out_dir / n for n in names] + ([index_path] if index_path else [])
    writes_index = split is None or split.rank == 0
    mine = [n for n, _ in enumerate(names) if split is None or split.mine(n)]
    with held_outputs() as held:

        def step(work: Callable[[], None]) -> None:
            together(split, work, out_dir, undo=held.undo)

        def refuse_existing() -> None:  # each process looks at its own files, before any writes
            own = [targets[n] for n in mine] + ([index_path] if index_path and writes_index else [])
            existing = [] if overwrite else [t for t in own if t.exists()]
            if existing:
                raise CannotWriteError(f"{existing[0]}: already exists", hint="pass --force to overwrite")

        def write_shards() -> None:
            for number in mine:
                shard = {k: kept[k] for k in shards[number]}
                shard_aliases = {a: k for a, k in plan.aliases.items() if k in shard}
                with atomic_output(out_dir / names[number]) as out:
                    if shard_format == "safetensors":
                        write_safetensors(shard, out, {**(metadata or {}), **shard_aliases}, progress=progress)
                    else:
                        shard.update({a: kept[k] for a, k in shard_aliases.items()})
                        write_torch_zip(shard, out, progress=progress)

        def write_index() -> None:  # the completion marker, written last
            if index_path is None or not writes_index:
                return
            weight_map = {k: n for n, keys in zip(names, shards) for k in keys}
            if shard_format != "safetensors":
                weight_map.update({a: weight_map[k] for a, k in plan.aliases.items()})
                aliases = {}
            else:
                aliases = dict(plan.aliases)
            document = {"metadata": {"total_size": plan.data_bytes, **aliases}, "weight_map": weight_map}
            with atomic_output(index_path) as out:
                out.write((json.dumps(document, indent=2) + "\n").encode())
            held.commit()

        step(refuse_existing)
        step(write_shards)
        step(held.commit)
        step(write_index)
    return ShardedWrite(targets, index_path, dict(plan.aliases), plan.data_bytes)


def find_index(folder: Path) -> Path | None:
    """The index (or single-file checkpoint) a model folder holds, by the hub's names."""
    for name in INDEX_NAMES + SINGLE_NAMES:
        if (folder / name).is_file():
            return folder / name
    indexes = sorted(folder.glob("*.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        raise BadInputError(f"{folder}: holds several indexes ({', '.join(p.name for p in indexes)}); name one")
    return None


def read_index(index_path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The weight map and metadata of an index, checked so that reading the shards it names
    stays inside the index's folder and terminates.

    The index must be a regular file of at most 100 MB of strict JSON (no repeated key, which
    ``json`` would resolve silently by keeping the last; no nesting deep enough to exhaust the
    recursion limit). Every shard must be a plain file name in the index's folder (no ``..``,
    no absolute path, no ``/`` or ``\\``, no NUL) and not itself an index: an index naming
    itself, or another index, as a shard would send the reader round in circles.
    """
    f, size = open_input(index_path)
    with f:
        if size > MAX_INDEX_BYTES:
            raise BadInputError(f"{index_path}: {size} bytes, too large for a shard index (at most {MAX_INDEX_BYTES})")
        raw = f.read(MAX_INDEX_BYTES + 1)
    try:
        document = strictjson.loads(raw)
    except strictjson.JSONError as exc:
        raise BadInputError(f"{index_path}: not a valid shard index ({exc})") from exc
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise BadInputError(f'{index_path}: not a valid shard index (no "weight_map" object)')
    weight_map, metadata = document["weight_map"], document.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise BadInputError(f'{index_path}: not a valid shard index ("metadata" must be an object)')
    if not all(isinstance(v, str) for v in weight_map.values()):
        raise BadInputError(f"{index_path}: weight_map must map names to shard file names")
    for shard in dict.fromkeys(weight_map.values()):
        if not _is_plain_name(shard):
            raise BadInputError(f"{index_path}: shard name {shard!r:.200} is not a file in the index's folder")
        if shard.lower().endswith(".index.json"):
            what = "itself" if shard == index_path.name else f"the index {shard!r:.200}"
            raise BadInputError(f"{index_path}: lists {what} as a shard; shards must be checkpoint files")
    return weight_map, metadata


def _is_plain_name(name: str) -> bool:
    """A file name with no folder part on any system: what a shard entry may be."""
    return (
        name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and os.path.basename(name) == name
        and not os.path.isabs(name)
        and not (len(name) >= 2 and name[0].isalpha() and name[1] == ":")  # a Windows drive (C:model.bin)
    )


def merge_shards(
    index_path: Path,
    weight_map: dict[str, str],
    metadata: Mapping[str, Any],
    read_shard: Callable[[Path], Mapping[str, Any]],
) -> dict[str, Any]:
    """Read every shard (lazily) and merge them, checking each against the index."""
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for shard in dict.fromkeys(weight_map.values()):
        path = index_path.parent / shard
        if not path.is_file():  # a folder (or a link to one, even to this folder) is not a shard
            if path.exists() or path.is_symlink():
                raise BadInputError(
                    f"{index_path}: shard {shard} is not a regular file (a folder, a broken link or a special file)"
                )
            raise BadInputError(f"{index_path}: shard {shard} is missing (listed for {_count(weight_map, shard)} keys)")
        content = read_shard(path)
        for name, value in content.items():
            if name in owner:
                raise BadInputError(f"{index_path}: key {name!r} is in both {owner[name]} and {shard}")
            listed = weight_map.get(name)
            if listed is None and not (isinstance(metadata.get(name), str)):
                raise BadInputError(f"{index_path}: shard {shard} holds {name!r}, which the index does not list")
            if listed is not None and listed != shard:
                raise BadInputError(f"{index_path}: key {name!r} is listed for {listed} but found in {shard}")
            owner[name] = shard
            merged[name] = value
    missing = [k for k in weight_map if k not in merged]
    if missing:
        raise BadInputError(
            f"{index_path}: {len(missing)} keys listed in the index are in no shard, e.g. {missing[0]!r} "
            f"(expected in {weight_map[missing[0]]})"
        )
    ordered = {k: merged[k] for k in weight_map}
    ordered.update((k, v) for k, v in merged.items() if k not in ordered)
    for alias, kept in metadata.items():
        if alias not in ordered and isinstance(kept, str) and isinstance(ordered.get(kept), TensorRef):
            ordered[alias] = ordered[kept]
    return ordered


def _count(weight_map: Mapping[str, str], shard: str) -> int:
    return sum(1 for v in weight_map.values() if v == shard)


def other_checkpoints(folder: Path, marker: Path) -> list[Path]:
    """The checkpoint-like files of ``folder`` (:func:`~.detect.checkpoint_like`) that the
    checkpoint ``marker`` names (a DCP ``.metadata``, a shard index or the single model file
    chosen by :func:`find_index`) does not cover: decoys as far as ckptfix's reader goes, but
    files torch or ``transformers`` would load (``pytorch_model.bin`` next to
    ``model.safetensors``, a second hub index and its shards, ``training_args.bin``). Other
    indexes are listed as themselves (checking one checks its shards)."""
    from .dcp import METADATA_NAME, dcp_items

    covered = {marker.name}
    if marker.name == METADATA_NAME:
        try:
            covered |= {item.relative_path for item in dcp_items(folder, [])}
        except BadInputError:
            covered |= {p.name for p in folder.glob("*.distcp")}
    elif marker.name.lower().endswith(".index.json"):
        with contextlib.suppress(BadInputError):  # the checkpoint's own check reports it
            covered |= set(read_index(marker)[0].values())
    others = []
    for entry in sorted(folder.iterdir()):
        if entry.name in covered or (entry.name.startswith(".") and entry.name.endswith(".ckptfix-tmp")):
            continue
        if entry.name.lower().endswith(".index.json") or (entry.is_file() and checkpoint_like(entry)):
            others.append(entry)
    return others
