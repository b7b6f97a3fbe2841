"""``verify``: check that checkpoints load safely and completely, as a CI gate.

For each file: it must be read by ckptfix's safe readers (every offset and size in range,
every tensor inside its storage, shard indexes consistent with their shards and naming only
files in their folder, safetensors headers exactly as strict as the safetensors library's: no
repeated key, no overlapping, holey or trailing data); every byte of
every zip record is read back and checked against its CRC32 (files saved with torch's CRC
check disabled carry CRC 0, which is reported, not failed); safetensors and legacy data are
read through to the end. Optionally the keys' prefixes and the storages' devices must be
as expected.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CkptfixError, UsageError, group_by_module
from ..fileio.ranges import OpenFiles, crc_of, iter_chunks
from ..fileio.remote import consistent_reads
from ..formats.checkpoint import (
    FORMAT_SAFETENSORS,
    FORMAT_SHARDED,
    Checkpoint,
    read_checkpoint,
)
from ..formats.dcp import METADATA_NAME, is_dcp_folder
from ..formats.detect import FORMAT_NAME_ALIASES, FORMAT_NAMES
from ..formats.sharded import find_index, other_checkpoints
from ..model.dtypes import CAST_ALIASES, CASTABLE
from ..model.paths import format_path
from ..model.refs import TensorRef, is_meta_tensor
from ..model.statedicts import WRAPPER_PREFIXES, find_state_dicts
from ..model.walk import iter_storages, iter_tensors, walk
from ..pickling.reader import foreign_globals
from ..transforms.devices import normalize_device
from ..transforms.foreign import unallowed_globals, ways_out
from ..transforms.prefix import normalize_prefix
from .inspect import meta_problem


@dataclass
class VerifyResult:
    input: str
    ok: bool = True
    #: the words inspect prints; "unknown" when the file could not be read as a checkpoint
    format: str = "unknown"
    tensors: int = 0
    tensor_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Expectations:
    """What ``verify --expect-*`` requires beyond a safe, complete read; each is named after the
    writing option that makes a file meet it, and a failure names that fix.

    ``prefix``: ``"none"`` (no key starts with a wrapper prefix: what ``strip-module`` /
    ``--strip-prefix`` give) or a prefix every key has (``add-module --prefix``); ``device``: every
    storage's tag (``--map-location``); ``dtype``: every floating-point state-dict tensor's dtype
    (``--dtype``; integers, bools, float8 and complex are not counted, as ``--dtype`` leaves them);
    ``format``: the format ``inspect`` reports (``--format``; ``pth`` means ``torch-zip``);
    ``keys``: the number of state-dict keys; ``metadata``: ``KEY=VALUE`` pairs the safetensors
    ``__metadata__`` (or a shard index's ``metadata``) must hold, e.g. ``format=pt``.
    """

    prefix: str | None = None
    device: str | None = None
    dtype: str | None = None
    format: str | None = None
    keys: int | None = None
    metadata: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # a bad expectation is a usage error before any file is read
        if self.device is not None:
            normalize_device(self.device, flag="--expect-device")
        if self.dtype is not None and CAST_ALIASES.get(self.dtype, self.dtype) not in CASTABLE:
            raise UsageError(f"--expect-dtype {self.dtype}: choose one of {', '.join([*CASTABLE, *CAST_ALIASES])}")
        if self.format is not None and FORMAT_NAME_ALIASES.get(self.format, self.format) not in FORMAT_NAMES:
            choices = ", ".join([*FORMAT_NAMES, *FORMAT_NAME_ALIASES])
            raise UsageError(f"--expect-format {self.format}: choose one of {choices}")
        for pair in self.metadata:
            if "=" not in pair:
                raise UsageError(f"--expect-metadata {pair!r}: write KEY=VALUE, e.g. format=pt")


def _unallowed_classes(ckpt: Checkpoint) -> list[str]:
    """The classes torch.load(weights_only=True) refuses, with fixes that work (tried here)."""
    names = list(unallowed_globals(ckpt))
    if not names:
        return []
    state_dicts = [p for p, sd in find_state_dicts(ckpt.root) if p and not foreign_globals(sd).unallowed]
    weights = f"; --select {shlex.quote(format_path(state_dicts[0]))} (the weights only)" if state_dicts else ""
    ways = ways_out(ckpt.root)
    if ways.sanitizable:
        fix = "--sanitize (plain data)"
    else:
        drops = " ".join(f"--drop {shlex.quote(p)}" for p in ways.drop)
        fix = f"{'--sanitize ' if ways.converts_some else ''}{drops} (what no rule turns into plain data left out)"
    return [
        f"holds classes outside the allow-list, which torch.load(weights_only=True) refuses: "
        f"{group_by_module(names)}; fix: ckptfix convert IN OUT {fix}{weights}"
    ]


@consistent_reads
def _pickled_by_torch(path: str | os.PathLike[str]) -> list[str]:
    """A safetensors file whose name does not end ``.safetensors``: ``torch.load`` (and
    ``transformers`` for ``pytorch_model.bin``) unpickles it from byte 0, and a length and header
    can be made to be a pickle that names code. Whatever that reading resolves is a failure."""
    from .scan import scan_path

    names = sorted({g.name for g in scan_path(os.fspath(path)).globals})
    if not names:
        return []
    return [
        f"torch.load unpickles this file from byte 0 (its name does not end .safetensors) and resolves "
        f"{', '.join(names)[:200]}: a safetensors file that is also a pickle"
    ]


def verify_path(
    path: str | os.PathLike[str],
    expect: Expectations | None = None,
    *,
    expect_prefix: str | None = None,
    expect_device: str | None = None,
) -> VerifyResult:
    """Every check on one checkpoint; problems are collected, never raised.

    ``expect`` holds the expectations (``expect_prefix``/``expect_device`` are its first two
    fields, kept for existing callers)."""
    if expect is None:
        expect = Expectations(prefix=expect_prefix, device=expect_device)
    result = VerifyResult(str(path))
    try:
        # classes outside the allow-list are read as inert records, so the other checks still
        # run, and are then a failure of their own (torch.load(weights_only=True) refuses them)
        ckpt = read_checkpoint(path, inert_unknown=True)
    except CkptfixError as exc:
        result.ok, result.problems = False, [str(exc)]
        return result
    result.format = ckpt.format
    result.problems += _unallowed_classes(ckpt)
    if ckpt.format == FORMAT_SAFETENSORS and Path(path).is_file() and not str(path).endswith(".safetensors"):
        result.problems += _pickled_by_torch(path)
    with OpenFiles() as files:
        if ckpt.archive is not None:
            zero_crc = 0
            for name, record in ckpt.archive.records.items():
                if record.crc == 0 and record.size:
                    zero_crc += 1
                    continue
                try:
                    actual = crc_of(record.source(ckpt.archive.path), files)
                except CkptfixError as exc:
                    result.problems.append(str(exc))
                    continue
                if actual != record.crc:
                    result.problems.append(
                        f"record {name}: CRC32 {actual:08x} does not match the recorded {record.crc:08x}"
                    )
            if zero_crc:
                result.notes.append(f"{zero_crc} records carry CRC 0 (saved with CRC checking disabled): not checked")
        result.tensors = sum(1 for _ in iter_tensors(ckpt.root))
        for storage in iter_storages(ckpt.root):
            result.tensor_bytes += storage.nbytes
            if ckpt.archive is None and storage.source is not None:
                try:
                    for _ in iter_chunks(storage.source, files):
                        pass
                except (CkptfixError, OSError) as exc:
                    result.problems.append(f"storage {storage.key}: {exc}")
    meta = sum(1 for _, value in walk(ckpt.root, leaves=True) if is_meta_tensor(value))
    if meta:
        result.problems.append(meta_problem(meta))
    _check_expectations(ckpt, result, expect)
    _verify_other_files(Path(path), result)
    result.ok = not result.problems
    return result


def _verify_other_files(folder: Path, result: VerifyResult) -> None:
    """A folder's other checkpoint-like files (what torch or ``transformers`` would load besides
    the checkpoint its marker names: :func:`~ckptfix.formats.sharded.other_checkpoints`) must
    pass verify too (without the expectations, which are about the folder's checkpoint)."""
    if not folder.is_dir():
        return
    try:
        marker = folder / METADATA_NAME if is_dcp_folder(folder) else find_index(folder)
        others = other_checkpoints(folder, marker) if marker is not None else []
    except (OSError, CkptfixError) as exc:
        result.problems.append(f"the folder's other files were not checked: {exc}")
        return
    for other in others:
        part = verify_path(other)
        result.problems += [p if p.startswith(str(other)) else f"{other.name}: {p}" for p in part.problems]
    if others:
        names = ", ".join(p.name for p in others)
        result.notes.append(f"also verified the folder's other checkpoint-like files: {names}"[:400])


def _check_expectations(ckpt: Checkpoint, result: VerifyResult, expect: Expectations) -> None:
    root = ckpt.root
    state_dicts = find_state_dicts(root)
    keys = [k for _, sd in state_dicts for k in sd if isinstance(k, str)]
    problems = result.problems
    if expect.prefix is not None:
        if expect.prefix.lower() == "none":
            wrapped = [k for k in keys if k.startswith(WRAPPER_PREFIXES)]
            if wrapped:
                problems.append(
                    f"{len(wrapped)} keys start with a wrapper prefix, e.g. {wrapped[0]!r}; "
                    f"fix: ckptfix strip-module IN OUT --prefix {wrapped[0].split('.', 1)[0]}."
                )
        else:
            prefix = normalize_prefix(expect.prefix)
            bare = [k for k in keys if not k.startswith(prefix)]
            if bare:
                problems.append(
                    f"{len(bare)} keys lack the prefix {prefix!r}, e.g. {bare[0]!r}; "
                    f"fix: ckptfix add-module IN OUT --prefix {prefix}"
                )
    if expect.device is not None:
        device = normalize_device(expect.device)
        locations = {s.location for s in iter_storages(root)}
        if any(is_meta_tensor(value) for _, value in walk(root, leaves=True)):
            locations.add("meta")  # data-less tensors have no storage, but a device all the same
        others = sorted(locations - {device})
        if "meta" in others:  # no data to move: no remap makes them real (the problem above says so)
            problems.append(f"tensors on meta (no data), expected all on {device}")
        elif others:
            problems.append(
                f"storages on {', '.join(others)}, expected all on {device}; "
                f"fix: ckptfix remap IN OUT --map-location {device}"
            )
    if expect.dtype is not None:
        dtype = CAST_ALIASES.get(expect.dtype, expect.dtype)
        found: dict[str, int] = {}
        for _, sd in state_dicts:
            for value in sd.values():
                if isinstance(value, TensorRef) and value.dtype in CASTABLE and value.dtype != dtype:
                    found[value.dtype] = found.get(value.dtype, 0) + 1
        if found:
            listed = ", ".join(f"{n} {d}" for d, n in sorted(found.items()))
            problems.append(
                f"floating-point tensors not {dtype}: {listed}; fix: ckptfix convert IN OUT --dtype {dtype}"
            )
    if expect.format is not None:
        wanted = FORMAT_NAME_ALIASES.get(expect.format, expect.format)
        if ckpt.format != wanted:
            how = {v: f"--format {k}" for k, v in [*FORMAT_NAME_ALIASES.items(), ("safetensors", "safetensors")]}
            fix = how.get(wanted, "--format dcp" if wanted == "dcp" else "(OUT a folder ending in /)")
            problems.append(f"format {ckpt.format}, expected {wanted}; fix: ckptfix convert IN OUT {fix}")
    if expect.keys is not None and len(keys) != expect.keys:
        problems.append(f"{len(keys)} state-dict keys, expected {expect.keys}")
    for pair in expect.metadata:
        key, _, value = pair.partition("=")
        have = ckpt.metadata.get(key)
        if have != value:
            what = "no such entry" if have is None else f"it is {have!r}"
            where = (
                "__metadata__"
                if ckpt.format in (FORMAT_SAFETENSORS, FORMAT_SHARDED)
                else "metadata (not a safetensors file)"
            )
            problems.append(f"{where} {key}={value!r} expected, {what}")
