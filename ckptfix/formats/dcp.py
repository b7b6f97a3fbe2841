"""``torch.distributed.checkpoint`` (DCP) folders, the format FSDP and multi-node training write.

Reading needs no torch and runs nothing from the folder. torch reads a folder's ``.metadata``
with plain ``pickle.load`` (torch 2.13, ``FileSystemReader.read_metadata``); ckptfix reads it with
its restricted reader, where the metadata dataclasses (``Metadata``, ``TensorStorageMetadata``,
``ChunkStorageMetadata`` ...: :data:`~ckptfix.pickling.globals.DCP_METADATA`) are inert records,
and refuses anything else as for any pickle. Each item the metadata lists is a ``torch.save`` zip
inside a ``.distcp`` file (a tensor chunk, or a non-tensor value): read by the torch zip reader
over that byte range. A tensor saved in one chunk is a lazy reference into its ``.distcp``
file; one saved in several (FSDP with 2+ ranks) is assembled by placing each chunk's bytes when
it is written, one tensor in memory at a time.

Writing is :mod:`ckptfix.formats.dcp_writer` (no torch either); ``--unsafe-load`` still reads a
folder through torch's own code.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO, cast

from ..errors import BadInputError
from ..fileio.positional import PositionalFile
from ..fileio.ranges import ComputedSource, FileSlice, OpenFiles, RangeSource
from ..fileio.remote import RemotePath, reading_metadata_only
from ..model.data import is_c_contiguous, tensor_c_bytes
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.needs import need_torch
from ..model.refs import Global, OpaqueObject, Reduce, TensorRef, Tree, tensor_from_range
from ..pickling.globals import DCP_METADATA
from ..pickling.reader import restricted_load
from .detect import open_input
from .torchzip import read_torch_zip

METADATA_NAME = ".metadata"


def is_dcp_folder(folder: Path) -> bool:
    return (folder / METADATA_NAME).is_file()


#: what a .metadata pickle may name besides the DCP dataclasses: the checkpoint id's path
_METADATA_ALLOW = (
    *DCP_METADATA,
    *(f"pathlib.{n}" for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
)
#: a .metadata is structure only; anything larger is hostile or not DCP
MAX_METADATA_BYTES = 1 << 30
#: chunks one tensor may be saved in (FSDP/DTensor: one per rank and shard)
MAX_CHUNKS = 4096  # the tiling check compares chunks pairwise
#: what of each item of a remote folder is fetched ahead, in coalesced ranged reads, before the
#: item's zip is read: its head (``data.pkl`` and the first records' local headers) and its tail
#: (as much as the zip reader reads to find the end records and the directory); a big item's
#: tail and the next item's head are one request
_ITEM_HEAD = 1 << 12
_ITEM_TAIL = 4096 + 22  # ziparchive's first tail
#: a gap between the ranges fetched ahead that is fetched rather than asked for in two requests
#: (a request costs about what moving this many bytes does): an item smaller than this comes
#: whole, and the tensor data is read again by the writer's own planned reads
_ITEM_GAP = 1 << 16
#: entries whose items are fetched ahead at once (bounds what the remote file keeps cached)
_AHEAD_ENTRIES = 128


def _fields(value: object, name: str, where: str) -> dict[str, object]:
    """The fields of a DCP dataclass record (``NEWOBJ`` + ``BUILD`` with its ``__dict__``)."""
    if not (isinstance(value, OpaqueObject) and value.global_.name == name and isinstance(value.state, dict)):
        if isinstance(value, OpaqueObject) and value.global_.name == name and not value.args:
            return {}  # a dataclass without fields (BytesStorageMetadata)
        raise BadInputError(f"{where}: corrupt DCP metadata: expected a {name}, found {type(value).__name__}")
    return value.state


def _size(value: object, where: str) -> tuple[int, ...]:
    """A ``torch.Size`` record as a tuple of non-negative ints."""
    if isinstance(value, Reduce) and value.func.full == "torch.Size" and len(value.args) == 1:
        value = value.args[0]
    if not (isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)):
        raise BadInputError(f"{where}: corrupt DCP metadata: a size that is not a tuple of non-negative integers")
    return value


def dcp_file_sizes(folder: Path) -> dict[str, int]:
    """The folder's files by name, with their sizes: a remote folder's from one listing."""
    if isinstance(folder, RemotePath):
        return folder.file_sizes()
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}


def prefetch_items(f: BinaryIO, places: Sequence[tuple[int, int]]) -> None:
    """Fetch the head and tail of each ``(offset, length)`` item of a remote file ahead (see
    :data:`_ITEM_HEAD`): then reading the items' zips makes no request of its own. A local
    file is left alone."""
    if not isinstance(f, RangeSource):
        return
    ranges: list[tuple[int, int]] = []
    for offset, length in places:
        tail = min(length, _ITEM_TAIL)
        ranges += [(offset, min(length, _ITEM_HEAD)), (offset + length - tail, tail)]
    f.prefetch(ranges, _ITEM_GAP)


def read_dcp_safely(
    folder: Path,
    globals_seen: set[str],
    allow: Sequence[str] = (),
    *,
    inert_unknown: bool = False,
    listing: dict[str, int] | None = None,
) -> Tree:
    """The folder's state dict as a lazy tree, read without torch and without running anything.

    ``allow`` (``--allow-global``) and ``inert_unknown`` apply to the non-tensor values, as for any
    checkpoint. A remote folder (a :class:`~ckptfix.fileio.remote.RemotePath`) is checked against
    its one listing (``listing``, else made here), and its items are read by planned ranged reads
    of their ``.distcp`` objects; reading only metadata (:func:`~ckptfix.fileio.remote.metadata_only`:
    ``inspect``), its tensors are described from ``.metadata`` alone, and their items are read
    only if their bytes are asked for.
    """
    where = str(folder / METADATA_NAME)
    f, size = open_input(folder / METADATA_NAME)
    with f:
        if size > MAX_METADATA_BYTES:
            raise BadInputError(f"{where}: {size} bytes, too large for DCP metadata")
        data = f.read(size)
    metadata, _ = restricted_load(data, None, globals_seen, _METADATA_ALLOW)
    fields = _fields(metadata, "Metadata", where)
    described, items = fields.get("state_dict_metadata"), fields.get("storage_data")
    planner = fields.get("planner_data") or {}
    if not (isinstance(described, dict) and isinstance(items, dict) and isinstance(planner, dict)):
        raise BadInputError(f"{where}: corrupt DCP metadata: no state_dict_metadata or storage_data table")
    located = _located(items, where)
    for stored_items in located.values():
        for _, stored in stored_items:
            if stored.get("transform_descriptors"):
                raise BadInputError(f"{where}: DCP items saved with transforms (compression) are not supported yet")
    remote = isinstance(folder, RemotePath)
    if isinstance(folder, RemotePath):
        _check_listed(folder, located, folder.file_sizes() if listing is None else listing, where)
    lazy = remote and reading_metadata_only()
    tree: dict[object, object] = {}
    entries = list(described.items())
    with OpenFiles() as files:
        for first in range(0, len(entries), _AHEAD_ENTRIES):
            batch = entries[first : first + _AHEAD_ENTRIES]
            if remote:
                _prefetch_entries(folder, batch, located, files, lazy, where)
            for fqn, meta in batch:
                if not isinstance(fqn, str) or fqn not in located:
                    raise BadInputError(f"{where}: corrupt DCP metadata: no stored item for {fqn!r:.80}")
                chunks = located[fqn]
                value = _read_entry(folder, fqn, meta, chunks, globals_seen, (allow, inert_unknown), files, where, lazy)
                path = planner.get(fqn, tuple(fqn.split(".")))
                _place(tree, path, value, where)
    return tree


def _check_listed(folder: Path, located: Located, sizes: dict[str, int], where: str) -> None:
    """Every item of a remote folder lies within an object its listing has (one line, exit 3,
    before any item is read)."""
    for fqn, stored_items in located.items():
        for _, stored in stored_items:
            name, offset, length = _item_place(stored, where)
            if name not in sizes:
                raise BadInputError(f"{folder / name}: no such object, but {where} stores {fqn!r:.80} there")
            if offset + length > sizes[name]:
                raise BadInputError(
                    f"{folder / name}: an item at {offset}+{length} runs past the end ({sizes[name]} bytes)"
                )


def _is_bytes_entry(meta: object) -> bool:
    return isinstance(meta, OpaqueObject) and meta.global_.name == "BytesStorageMetadata"


def _prefetch_entries(
    folder: Path,
    batch: list[tuple[object, object]],
    located: Located,
    files: OpenFiles,
    lazy: bool,
    where: str,
) -> None:
    """Fetch ahead what reading ``batch``'s items will read, per ``.distcp`` object (reading
    only metadata, only the non-tensor items are read)."""
    places: dict[str, list[tuple[int, int]]] = {}
    for fqn, meta in batch:
        if not isinstance(fqn, str) or fqn not in located or (lazy and not _is_bytes_entry(meta)):
            continue
        for _, stored in located[fqn]:
            name, offset, length = _item_place(stored, where)
            places.setdefault(name, []).append((offset, length))
    for name, items in places.items():
        prefetch_items(files.file(str(folder / name)), items)


Located = dict[str, list[tuple[tuple[int, ...] | None, dict[str, object]]]]


def _located(items: dict[object, object], where: str, problems: list[str] | None = None) -> Located:
    """``storage_data`` by fqn: (chunk offsets or None, the ``_StorageInfo`` fields).

    torch looks items up in this dict by ``MetadataIndex(fqn, offset)`` (equal by those two fields:
    ``index`` is a hint that takes no part); a pickle can hold two keys equal to torch, of which
    torch's dict keeps the last -- refused as ambiguous, never read as the first (with
    ``problems``, noted there and kept, so that a scan still visits both)."""
    located: Located = {}
    keys: set[tuple[str, tuple[int, ...] | None]] = set()
    for key, info in items.items():
        index, stored = _fields(key, "MetadataIndex", where), _fields(info, "_StorageInfo", where)
        fqn, raw = index.get("fqn"), index.get("offset")
        if not isinstance(fqn, str):  # torch looks items up by MetadataIndex(str fqn): 1 is not "1"
            raise BadInputError(f"{where}: corrupt DCP metadata: an item named by a {type(fqn).__name__}, not a str")
        offset = None if raw is None else _size(raw, where)
        identity = (fqn, offset)
        if identity in keys:
            problem = (
                f"{where}: two storage_data entries for one item ({fqn!r:.80}, offset {offset}): torch keeps "
                "the last, another reader the first; refusing as ambiguous"
            )
            if problems is None:
                raise BadInputError(problem)
            problems.append(problem)
        keys.add(identity)
        located.setdefault(fqn, []).append((offset, stored))
    return located


@dataclass(frozen=True)
class DcpItem:
    """One stored item (a ``torch.save`` blob inside a ``.distcp`` file), as ``scan`` visits it."""

    fqn: str
    relative_path: str
    offset: int
    length: int


def dcp_items(folder: Path, problems: list[str]) -> list[DcpItem]:
    """Every item a DCP folder's metadata lists (what torch's loader may ``torch.load``; the
    non-tensor ones with ``weights_only=False``), in file order; the metadata is read by the
    restricted reader (scan the ``.metadata`` pickle itself first: this refuses a hostile one).
    Entries torch would read ambiguously are all listed, and said in ``problems``."""
    where = str(folder / METADATA_NAME)
    f, size = open_input(folder / METADATA_NAME)
    with f:
        if size > MAX_METADATA_BYTES:
            raise BadInputError(f"{where}: {size} bytes, too large for DCP metadata")
        data = f.read(size)
    metadata, _ = restricted_load(data, None, set(), _METADATA_ALLOW)
    items = _fields(metadata, "Metadata", where).get("storage_data")
    if not isinstance(items, dict):
        raise BadInputError(f"{where}: corrupt DCP metadata: no storage_data table")
    found = []
    for fqn, stored_items in _located(items, where, problems).items():
        for _, stored in stored_items:
            name, offset, length = _item_place(stored, where)
            found.append(DcpItem(fqn, name, offset, length))
    return sorted(found, key=lambda item: (item.relative_path, item.offset))


def _item_place(stored: dict[str, object], where: str) -> tuple[str, int, int]:
    name, offset, length = stored.get("relative_path"), stored.get("offset"), stored.get("length")
    if not (isinstance(name, str) and name and "/" not in name and "\\" not in name and name not in (".", "..")):
        raise BadInputError(f"{where}: corrupt DCP metadata: item file {name!r:.80} is not a file in the folder")
    if not (type(offset) is int and type(length) is int and offset >= 0 and length > 0):
        raise BadInputError(f"{where}: corrupt DCP metadata: an item with a bad offset or length")
    return name, offset, length


def _read_item(
    folder: Path,
    stored: dict[str, object],
    globals_seen: set[str],
    allow: tuple[Sequence[str], bool],
    where: str,
    files: OpenFiles,
) -> Tree:
    """One item: the ``torch.save`` zip at (relative_path, offset, length), read in place (a
    remote object's is opened once for all its items, in ``files``)."""
    name, offset, length = _item_place(stored, where)
    if isinstance(folder, RemotePath):
        remote = files.file(str(folder / name))
        size = cast(PositionalFile, remote).size
        return _read_item_in(folder, name, remote, size, (offset, length), globals_seen, allow)
    f, size = open_input(folder / name)
    with f:
        return _read_item_in(folder, name, f, size, (offset, length), globals_seen, allow)


def _read_item_in(
    folder: Path,
    name: str,
    f: BinaryIO,
    size: int,
    place: tuple[int, int],
    globals_seen: set[str],
    allow: tuple[Sequence[str], bool],
) -> Tree:
    offset, length = place
    if offset + length > size:
        raise BadInputError(f"{folder / name}: an item at {offset}+{length} runs past the end ({size} bytes)")
    part = cast(BinaryIO, FileSlice(f, offset, length))  # a binary file (io.RawIOBase) over the item
    root, _ = read_torch_zip(str(folder / name), part, length, globals_seen, allow[0], inert_unknown=allow[1])
    return root


def _read_entry(
    folder: Path,
    fqn: str,
    meta: object,
    stored: list[tuple[tuple[int, ...] | None, dict[str, object]]],
    globals_seen: set[str],
    allow: tuple[Sequence[str], bool],
    files: OpenFiles,
    where: str,
    lazy: bool = False,
) -> Tree:
    """One entry's value; ``lazy``: a tensor described from the metadata alone, its items read
    (and checked against it) only when its bytes are asked for."""
    if _is_bytes_entry(meta):
        # torch reads storage_data[MetadataIndex(fqn)]: the entry without chunk offsets
        plain = [info for offsets, info in stored if offsets is None]
        if not plain:
            raise BadInputError(f"{where}: corrupt DCP metadata: no stored item for {fqn!r:.80} (only tensor chunks)")
        return _read_item(folder, plain[0], globals_seen, allow, where, files)
    fields = _fields(meta, "TensorStorageMetadata", where)
    shape = _size(fields.get("size"), where)
    properties = fields.get("properties")
    # TensorProperties pickles its fields as a tuple (its own __getstate__): dtype comes first
    state = properties.state if isinstance(properties, OpaqueObject) else None
    if isinstance(state, tuple) and state:
        dtype_global = state[0]
    else:
        dtype_global = _fields(properties, "TensorProperties", where).get("dtype")
    if not (
        isinstance(dtype_global, Global) and dtype_global.module == "torch" and dtype_global.name in DTYPE_ITEMSIZE
    ):
        raise BadInputError(f"{where}: {fqn}: not a torch dtype")
    dtype = dtype_global.name
    chunks_meta = fields.get("chunks")
    if not isinstance(chunks_meta, list) or not chunks_meta or len(chunks_meta) > MAX_CHUNKS:
        raise BadInputError(f"{where}: {fqn}: corrupt DCP metadata: no chunks or too many")
    by_offset = {offsets: info for offsets, info in stored}
    used: set[tuple[object, object]] = set()
    planned: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, object]]] = []
    for chunk in chunks_meta:
        c = _fields(chunk, "ChunkStorageMetadata", where)
        offsets, sizes = _size(c.get("offsets"), where), _size(c.get("sizes"), where)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or offsets not in by_offset:
            raise BadInputError(f"{where}: {fqn}: a chunk that does not fit the tensor or has no stored item")
        if any(o + n > s for o, n, s in zip(offsets, sizes, shape)):
            raise BadInputError(f"{where}: {fqn}: a chunk reaches outside the tensor's shape")
        stored_item = by_offset[offsets]
        item_key = (stored_item.get("relative_path"), stored_item.get("offset"))
        if item_key in used:
            raise BadInputError(f"{where}: {fqn}: two chunks claim one stored item")
        used.add(item_key)
        planned.append((offsets, sizes, stored_item))
    if lazy:
        _check_tiling(shape, planned, f"{where}: {fqn}")

        def read_whole(open_files: OpenFiles) -> bytes:
            whole = _read_chunks(folder, fqn, dtype, shape, planned, set(), allow, open_files, where)
            return tensor_c_bytes(cast(TensorRef, whole), open_files)

        return tensor_from_range(dtype, shape, ComputedSource(_numel(shape) * DTYPE_ITEMSIZE[dtype], read_whole))
    return _read_chunks(folder, fqn, dtype, shape, planned, globals_seen, allow, files, where)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


def _read_chunks(
    folder: Path,
    fqn: str,
    dtype: str,
    shape: tuple[int, ...],
    planned: list[tuple[tuple[int, ...], tuple[int, ...], dict[str, object]]],
    globals_seen: set[str],
    allow: tuple[Sequence[str], bool],
    files: OpenFiles,
    where: str,
) -> Tree:
    """A tensor entry's value from its planned chunks: each stored item read and checked, then
    the one item itself (a lazy reference into its .distcp file) or the pieces assembled."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], TensorRef]] = []
    for offsets, sizes, stored_item in planned:
        piece = _read_item(folder, stored_item, globals_seen, allow, where, files)
        if not (isinstance(piece, TensorRef) and piece.dtype == dtype and piece.shape == sizes):
            raise BadInputError(f"{where}: {fqn}: a stored chunk is not a {dtype} tensor of shape {sizes}")
        if not is_c_contiguous(piece.shape, piece.stride):
            # a stride-0 view stores one element for millions: assembling it would make them all
            raise BadInputError(f"{where}: {fqn}: a stored chunk is a view, not its own elements")
        chunks.append((offsets, sizes, piece))
    _check_tiling(shape, chunks, f"{where}: {fqn}")
    if len(chunks) == 1:
        return chunks[0][2]  # saved whole: a lazy reference into its .distcp file

    def assemble(open_files: OpenFiles) -> bytes:
        import numpy as np

        whole = np.zeros((*shape, itemsize), dtype=np.uint8)
        for offsets, sizes, piece in chunks:
            part = np.frombuffer(tensor_c_bytes(piece, open_files), dtype=np.uint8).reshape(*sizes, itemsize)
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = part
        return whole.tobytes()

    return tensor_from_range(dtype, shape, ComputedSource(_numel(shape) * itemsize, assemble))


def _check_tiling(
    shape: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], object]], what: str
) -> None:
    """The chunks cover the tensor exactly: volumes add up and no two overlap."""
    volume = 1
    for n in shape:
        volume *= n
    total = 0
    for _, sizes, _ in chunks:
        part = 1
        for n in sizes:
            part *= n
        total += part
    if total != volume:
        raise BadInputError(f"{what}: its chunks hold {total} elements, the tensor {volume}")
    boxes = sorted((offsets, sizes) for offsets, sizes, _ in chunks if all(sizes))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if b_off[0] >= a_off[0] + a_size[0]:
                break  # sorted by the first offset: nothing later overlaps a
            if all(bo < ao + an and ao < bo + bn for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size)):
                raise BadInputError(f"{what}: two of its chunks overlap")


def _place(tree: dict[object, object], path: object, value: object, where: str) -> None:
    """Put ``value`` at ``path`` (keys; an int makes a list, as torch's unflatten does)."""
    if not (isinstance(path, tuple) and path and all(type(k) in (str, int) for k in path)):
        raise BadInputError(f"{where}: corrupt DCP metadata: a planner path that is not a tuple of names")
    node: Any = tree
    for key, following in pairwise(path):
        fresh: Any = [] if type(following) is int else {}
        if type(key) is int:
            _grow(node, key, where)
            if node[key] is None:
                node[key] = fresh
            node = node[key]
        else:
            if not isinstance(node, dict):
                raise BadInputError(f"{where}: corrupt DCP metadata: two entries claim one place")
            node = node.setdefault(key, fresh)
        if not isinstance(node, (dict, list)):
            raise BadInputError(f"{where}: corrupt DCP metadata: two entries claim one place")
    last = path[-1]
    if type(last) is int:
        _grow(node, last, where)
        taken = node[last] is not None
    elif isinstance(node, dict):
        taken = last in node
    else:
        taken = True
    if taken:
        raise BadInputError(f"{where}: corrupt DCP metadata: two entries claim one place ({path!r:.120})")
    node[last] = value


#: how far past a list's end a DCP path may index (torch's unflatten fills the gap with None)
_MAX_LIST_GAP = 1024


def _grow(node: Any, index: int, where: str) -> None:
    if not isinstance(node, list) or index > len(node) + _MAX_LIST_GAP:
        raise BadInputError(f"{where}: corrupt DCP metadata: a list index where there is no list")
    node.extend([None] * (index + 1 - len(node)))


def read_dcp(folder: Path) -> Tree:
    """The folder's state dict as real tensors, via ``dcp_to_torch_save`` (trusted folders only)."""
    need_torch()
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix=".ckptfix-dcp-") as tmp:
        flat = Path(tmp) / "state.pth"
        try:
            with warnings.catch_warnings():  # "assuming the intent is to ... single process"
                warnings.simplefilter("ignore")
                dcp_to_torch_save(folder, flat)
        except Exception as exc:  # torch raises many kinds on a broken folder
            raise BadInputError(f"{folder}: torch could not read this DCP folder: {exc}"[:300]) from exc
        return torch.load(flat, map_location="cpu", weights_only=False)
