"""The torch zip format (``torch.save`` since 1.6): read into a lazy tree, write by streaming.

Layout of such a file: a zip whose members all sit in one folder (``archive/``)::

    archive/data.pkl            the pickled object tree; tensors refer to storages by key
    archive/.format_version     "1": storages are numbered in the order they are pickled
    archive/.storage_alignment  "64": every record's data starts on a 64-byte boundary
    archive/byteorder           "little" or "big" (absent in old files: native order)
    archive/data/0 ...          raw storage bytes, one record per storage
    archive/version             the serialization version ("3")
    archive/.data/serialization_id

Reading parses ``data.pkl`` with the restricted unpickler and notes each storage's byte
range; writing re-pickles the (transformed) tree and copies storage records byte for byte.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..compaction import compact_storages
from ..errors import BadInputError, UnsafeInputError
from ..pickle_writer import dumps
from ..sources import OpenFiles
from ..tree import Global, StorageRef, check_extents, make_storage
from ..unpickle import restricted_load
from ..ziparchive import ZipRecord, ZipWriter, read_directory, read_record_bytes

#: data.pkl holds only structure (no tensor data); anything larger is hostile or not ours
MAX_PICKLE_BYTES = 1 << 30
#: records written from our own knowledge rather than copied
_REGENERATED = {"data.pkl", ".format_version", ".storage_alignment", "byteorder", ".data/serialization_id"}


@dataclass
class TorchZipArchive:
    """What the writer needs from the input beyond the tree: its other records."""

    path: str
    archive_name: str
    records: dict[str, ZipRecord] = field(repr=False)
    byteorder: bytes | None

    def extra_records(self) -> list[str]:
        """Records other than the pickle, storages and regenerated ones, in file order."""
        return [
            name for name in self.records
            if name not in _REGENERATED and not name.startswith("data/")
        ]


def _refuse_wrapped(records: dict[str, ZipRecord], path: str) -> None:
    """A zip that carries a checkpoint file (a download bundle) rather than being one."""
    inside = [n for n in records if n.lower().endswith((".pth", ".pt", ".bin", ".ckpt", ".safetensors"))]
    if inside:
        raise BadInputError(f"{path}: a zip archive containing {inside[0]}: extract the checkpoint from it first")


def split_archive_names(records: dict[str, ZipRecord], path: str) -> dict[str, ZipRecord]:
    """Strip the single top folder torch puts every record in; refuse other layouts."""
    tops = {name.split("/", 1)[0] for name in records}
    if len(tops) != 1 or any("/" not in name for name in records):
        _refuse_wrapped(records, path)
        raise BadInputError(f"{path}: a zip archive, but not a torch checkpoint (no single top folder)")
    return {name.split("/", 1)[1]: record for name, record in records.items()}


def read_torch_zip(
    path: str, f: BinaryIO, file_size: int, globals_seen: set[str], allow: Sequence[str] = ()
) -> tuple[Any, TorchZipArchive]:
    """Parse a torch zip checkpoint into a tree of lazy references (no tensor data is read)."""
    raw = read_directory(f, file_size, path)
    if not raw:
        raise BadInputError(f"{path}: an empty zip archive, not a checkpoint")
    archive_name = next(iter(raw)).split("/", 1)[0]
    records = split_archive_names(raw, path)
    if "constants.pkl" in records or any(n.startswith("code/") for n in records):
        raise BadInputError(
            f"{path}: this is a TorchScript archive (a scripted/traced module), not a "
            "checkpoint; load it with torch.jit.load(), and use module.state_dict() to get weights"
        )
    if "data.pkl" not in records:
        _refuse_wrapped(raw, path)
        raise BadInputError(f"{path}: a zip archive without data.pkl: not a torch checkpoint")
    pickle_bytes = read_record_bytes(f, records["data.pkl"], MAX_PICKLE_BYTES)
    byteorder = None
    if "byteorder" in records:
        byteorder = read_record_bytes(f, records["byteorder"], 16)
        if byteorder not in (b"little", b"big"):
            raise BadInputError(f"{path}: unknown byte order {byteorder[:16]!r}")
    order = (byteorder or b"little").decode()

    storages: dict[str, StorageRef] = {}

    def load_storage(storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef:
        if key in storages:
            return storages[key]
        record = records.get(f"data/{key}")
        if view is not None:
            raise BadInputError(f"{path}: corrupt pickle: a storage view in a zip checkpoint")
        if record is None:
            raise BadInputError(f"{path}: storage {key!r} is referenced but its record data/{key} is missing")
        storage = make_storage(storage_type, key, location, numel, record.source(path), order)
        if record.size < storage.nbytes:
            raise BadInputError(
                f"{path}: storage data/{key} holds {record.size} bytes but the checkpoint "
                f"declares {storage.nbytes}: the file is truncated or corrupt"
            )
        storages[key] = storage
        return storage

    try:
        root, _ = restricted_load(pickle_bytes, load_storage, globals_seen, allow, check_depth=False)
    except UnsafeInputError as exc:
        raise UnsafeInputError(exc.global_name, path) from None
    check_extents(root, path)
    return root, TorchZipArchive(path, archive_name, records, byteorder)


def _serialization_id(crcs: list[int], total: int) -> bytes:
    """A 40-digit id like torch's: derived from the records written, so equal files match."""
    combined = 0
    for crc in crcs:
        combined = zlib.crc32(crc.to_bytes(4, "little"), combined)
    return f"{total % 10**20:020d}{combined:020d}".encode()


def write_torch_zip(
    root: Any,
    out: BinaryIO,
    *,
    archive_name: str = "archive",
    source: TorchZipArchive | None = None,
    progress: Callable[[int], None] | None = None,
    zip64_threshold: int | None = None,
) -> list[StorageRef]:
    """Write ``root`` as a torch zip checkpoint into the open file ``out``.

    Storage bytes are copied from wherever the tree's :class:`StorageRef` s point (a zip
    record, a safetensors range, a legacy storage), cut down to the span tensors still use.
    ``source`` supplies extra records of the input to carry over. All storages must share one
    byte order, which is recorded.
    Returns the storages written, in key order; ``progress`` gets each storage's byte count.
    """
    root, _ = compact_storages(root)
    pickled = dumps(root)
    orders = {s.byteorder for s in pickled.storages}
    if len(orders) > 1:
        raise BadInputError("cannot write storages of both byte orders into one checkpoint")
    byteorder = orders.pop() if orders else "little"
    writer = ZipWriter(out, archive_name, **({"zip64_threshold": zip64_threshold} if zip64_threshold else {}))
    crcs = [writer.add_bytes("data.pkl", pickled.data)]
    crcs.append(writer.add_bytes(".format_version", b"1"))
    crcs.append(writer.add_bytes(".storage_alignment", b"64"))
    if source is None or source.byteorder is not None or byteorder != "little":
        crcs.append(writer.add_bytes("byteorder", byteorder.encode()))
    total = 0
    with OpenFiles() as files:
        for key, storage in enumerate(pickled.storages):
            if storage.source is None:
                raise BadInputError(f"storage {storage.key!r} has no source bytes to copy")
            crcs.append(writer.add_copy(f"data/{key}", storage.source, files))
            total += storage.source.size
            if progress:
                progress(storage.source.size)
        extras = source.extra_records() if source else []
        if "version" not in extras:
            crcs.append(writer.add_bytes("version", b"3\n"))
        for name in extras:
            crcs.append(writer.add_copy(name, source.records[name].source(source.path), files))
        writer.add_bytes(".data/serialization_id", _serialization_id(crcs, total))
        writer.close()
    return pickled.storages
