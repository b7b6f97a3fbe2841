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
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CkptfixError
from ..fileio.ranges import OpenFiles, crc_of, iter_chunks
from ..formats.checkpoint import read_checkpoint
from ..model.statedicts import WRAPPER_PREFIXES, find_state_dicts
from ..model.walk import iter_storages, iter_tensors
from ..transforms.devices import normalize_device
from ..transforms.prefix import normalize_prefix


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


def verify_path(
    path: str | os.PathLike[str], *, expect_prefix: str | None = None, expect_device: str | None = None
) -> VerifyResult:
    """Every check on one checkpoint; problems are collected, never raised."""
    result = VerifyResult(str(path))
    try:
        ckpt = read_checkpoint(path)
    except CkptfixError as exc:
        result.ok, result.problems = False, [str(exc)]
        return result
    result.format = ckpt.format
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
    _check_expectations(ckpt.root, result, expect_prefix, expect_device)
    result.ok = not result.problems
    return result


def _check_expectations(root: Any, result: VerifyResult, expect_prefix: str | None, expect_device: str | None) -> None:
    keys = [k for _, sd in find_state_dicts(root) for k in sd if isinstance(k, str)]
    if expect_prefix is not None:
        if expect_prefix.lower() == "none":
            wrapped = [k for k in keys if k.startswith(WRAPPER_PREFIXES)]
            if wrapped:
                result.problems.append(f"{len(wrapped)} keys start with a wrapper prefix, e.g. {wrapped[0]!r}")
        else:
            prefix = normalize_prefix(expect_prefix)
            bare = [k for k in keys if not k.startswith(prefix)]
            if bare:
                result.problems.append(f"{len(bare)} keys lack the prefix {prefix!r}, e.g. {bare[0]!r}")
    if expect_device is not None:
        device = normalize_device(expect_device)
        others = sorted({s.location for s in iter_storages(root)} - {device})
        if others:
            result.problems.append(f"storages on {', '.join(others)}, expected all on {device}")
