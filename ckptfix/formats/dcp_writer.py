"""Writing a ``torch.distributed.checkpoint`` (DCP) folder without torch.

A DCP folder is what ``torch.distributed.checkpoint.load`` reads on any number of ranks, each
rank reading only the items that overlap its part. torch 2.13's ``FileSystemWriter`` writes:

* ``__R_N.distcp`` files, each a run of items: a tensor item is ``torch.save(tensor)`` of one
  chunk (a contiguous tensor holding just its elements), a non-tensor value is
  ``torch.save(value)``; ``FileSystemReader`` reads an item with ``torch.load`` over a view of
  its byte range (``weights_only=True`` for tensors, ``False`` for values);
* ``.metadata``, a pickle of ``Metadata`` (``state_dict_metadata``: per key, the dtype, size and
  chunks of a tensor or "bytes"; ``planner_data``: where each key was in the nested state dict;
  ``storage_data``: per item, its file, offset and length), read with plain ``pickle.load``.

Here the items are torch zips written by :func:`~ckptfix.formats.torchzip.write_torch_zip`
(tensor bytes copied from the source by the kernel where they lie as they are, else one chunk
gathered at a time) and the ``.metadata`` by ckptfix's own emitter, which may name only
:data:`~ckptfix.pickling.globals.DCP_METADATA_WRITES`. Keys are flattened exactly as torch's
``flatten_state_dict`` does (:func:`dcp_entries`), so ``dcp.load`` into the same state dict, and
``dcp_to_torch_save``, find every key.

``files=N`` splits the folder for N readers: each tensor is cut along its first dimension the
way ``torch.chunk`` (and FSDP2's ``fully_shard``, DTensor's ``Shard(0)``) cuts it for N ranks,
piece ``i`` in file ``__i_0.distcp``; a job loading it FSDP2-sharded on N ranks then reads one
file per rank. Tensors with fewer rows than that stay whole, in the file with the fewest bytes.

The folder is staged beside ``dest`` (``.metadata`` written last) and renamed into place:
``dest`` is complete or as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BadInputError, CannotWriteError
from ..fileio.atomic import describe_os_error
from ..fileio.ranges import ComputedSource, JoinedSource, OpenFiles, is_plain_range
from ..model.data import is_c_contiguous, storage_swap_unit, tensor_c_bytes
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.refs import (
    ABSENT,
    Global,
    OpaqueObject,
    Reduce,
    Source,
    TensorRef,
    Tree,
    is_tensor_like,
    is_torch_tensor,
    tensor_from_range,
)
from ..pickling.globals import DCP_METADATA_WRITES
from ..pickling.writer import dumps
from .dcp import MAX_CHUNKS, METADATA_NAME
from .legacy import save_with_torch
from .torchzip import write_torch_zip

#: what torch 2.13 writes as ``Metadata.version`` (``filesystem.CURRENT_DCP_VERSION``)
DCP_VERSION = "1.0.0"
#: the most files ``files=N`` may split a folder into (a tensor's chunks: the reader's limit)
MAX_FILES = MAX_CHUNKS
#: items start on this boundary (a shared copy keeps a record 64-aligned within its item too)
_ITEM_ALIGNMENT = 64
_MODULE = "torch.distributed.checkpoint.metadata"
_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS_FORMAT = Reduce(Global(_MODULE, "_MEM_FORMAT_ENCODING"), (0,))

#: a key's place in the nested state dict: dict keys as str, list indices as int (torch's OBJ_PATH)
ObjPath = tuple[str | int, ...]


@dataclass(frozen=True)
class DcpChunk:
    """One stored piece of a tensor: where it sits in the whole, and the item's tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    #: what the item holds: a contiguous tensor of just these elements
    tensor: TensorRef
    file: int


@dataclass
class DcpEntry:
    """One key of the flattened state dict: a tensor (``chunks``) or a value stored whole."""

    fqn: str
    path: ObjPath
    value: Tree = None
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    requires_grad: bool = False
    chunks: list[DcpChunk] = field(default_factory=list)

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class _Stored:
    """Where an item landed: ``storage_data``'s ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int


# -- flattening, as torch's traverse_state_dict / flatten_state_dict -----------------------


def _is_tensor(value: Any) -> bool:
    return isinstance(value, TensorRef) or is_tensor_like(value)


def _is_terminal(value: list[Any]) -> bool:
    """torch's ``_is_terminal`` for a list: stored whole unless it (or a list inside it, at any
    depth) holds a tensor or a mapping. Iterative: a hostile tree nests lists 1000 deep."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for entry in node:
            if isinstance(entry, dict) or _is_tensor(entry):
                return False
            if isinstance(entry, list):
                pending.append(entry)
    return True


def _key(key: Any, where: ObjPath) -> str:
    """A mapping key as torch's traversal spells it (``str(key)``) -- for the keys whose ``str``
    is the same in torch and here."""
    if key is None or type(key) in (str, int, float, bool):
        return str(key)
    raise BadInputError(
        f"cannot write a DCP folder: the key {key!r:.80} under {'.'.join(map(str, where)) or 'the top level'} "
        "is not a string or a number"
    )


def dcp_entries(root: Tree) -> Iterator[tuple[ObjPath, Tree]]:
    """``(path, value)`` for every key torch's ``flatten_state_dict`` makes of ``root``, in its
    order: mappings are entered (keys spelled ``str(key)``), lists only when they hold a tensor
    or a mapping (at any depth; their indices stay ints), everything else (tuples too) is one
    value. Iterative, and a container inside itself is refused (torch would recurse forever)."""
    if not isinstance(root, dict):
        raise CannotWriteError(f"a DCP folder holds a dict at the top level, not a {type(root).__name__}")
    stack: list[tuple[Iterator[tuple[Any, Any]], ObjPath, int, bool]] = [(iter(root.items()), (), id(root), True)]
    open_ids = {id(root)}
    while stack:
        items, prefix, ident, mapping = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            open_ids.discard(ident)
            continue
        key, value = item
        path = (*prefix, _key(key, prefix) if mapping else key)
        is_dict = isinstance(value, dict)
        if is_dict or (isinstance(value, list) and not _is_terminal(value)):
            if id(value) in open_ids:
                raise BadInputError(f"cannot write a DCP folder: {'.'.join(map(str, path))} contains itself")
            open_ids.add(id(value))
            stack.append((iter(value.items() if is_dict else enumerate(value)), path, id(value), is_dict))
        else:
            yield path, value


# -- planning ---------------------------------------------------------------------------------


def _row_ranges(rows: int, files: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s cut of ``rows`` into ``files`` pieces: ceil(rows / files) each."""
    step = -(-rows // files)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _gathered(view: TensorRef) -> Callable[[OpenFiles], bytes]:
    return lambda files: tensor_c_bytes(view, files)


def _ref_chunk(t: TensorRef, start: int, stop: int, whole: bool) -> TensorRef:
    """Rows ``start:stop`` of ``t`` as a tensor of just those elements, its bytes a range of
    the source where they lie there as they are, else gathered when written."""
    view = (
        t
        if whole
        else replace(t, storage_offset=t.storage_offset + start * t.stride[0], shape=(stop - start, *t.shape[1:]))
    )
    itemsize = DTYPE_ITEMSIZE[t.dtype]
    nbytes = view.numel * itemsize
    source = t.storage.source
    plain = not storage_swap_unit(t.storage) and is_c_contiguous(view.shape, view.stride)
    chunk: Source
    if nbytes == 0:
        chunk = ComputedSource(0, lambda files: b"")
    elif plain and is_plain_range(source):
        chunk = source.sub(view.storage_offset * itemsize, nbytes)
    elif plain and isinstance(source, JoinedSource):
        # a ZeRO parameter straddling partitions: the pieces of the rows, copied by the kernel
        chunk = _joined_part(source, view.storage_offset * itemsize, nbytes)
    else:
        chunk = ComputedSource(nbytes, _gathered(view))
    return _contiguous(t.dtype, view.shape, chunk)


def _joined_part(source: JoinedSource, start: int, size: int) -> Source:
    """Bytes ``start:start+size`` of ``source``, as the parts of its pieces that hold them."""
    if start == 0 and size == source.size:
        return source
    parts, at = [], 0
    for piece in source.pieces:
        low, high = max(start, at), min(start + size, at + piece.size)
        if low < high:
            parts.append(piece.sub(low - at, high - low))
        at += piece.size
    return parts[0] if len(parts) == 1 else JoinedSource.of(tuple(parts))


def _torch_chunk(t: Any, start: int, stop: int, whole: bool) -> TensorRef:
    view = t if whole else t[start:stop]
    return _contiguous(
        _torch_dtype(t), tuple(view.shape), ComputedSource(view.numel() * view.element_size(), _gathered(view))
    )


def _contiguous(dtype: str, shape: tuple[int, ...], source: Source) -> TensorRef:
    return tensor_from_range(dtype, shape, source)


def _torch_dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensor_facts(value: Any, fqn: str) -> tuple[str, tuple[int, ...], bool]:
    """dtype, shape and requires_grad of a tensor DCP can store (dense, with data), or refused."""
    if isinstance(value, TensorRef):
        param = value.param
        grad = param.requires_grad if param is not None else value.requires_grad
        if value.dtype not in DTYPE_ITEMSIZE:
            raise BadInputError(f"cannot write a DCP folder: {fqn} has dtype {value.dtype}")
        return value.dtype, value.shape, grad is True
    if is_torch_tensor(value):  # torch is imported already: it made the tensor
        if (
            str(value.layout) != "torch.strided"
            or value.is_quantized
            or value.is_meta
            or _torch_dtype(value) not in DTYPE_ITEMSIZE
        ):
            raise BadInputError(
                f"cannot write a DCP folder: {fqn} is a {value.layout} / {value.dtype} tensor without dense data"
            )
        return _torch_dtype(value), tuple(value.shape), bool(value.requires_grad)
    what = value.func.full if isinstance(value, Reduce) else type(value).__name__
    raise BadInputError(
        f"cannot write a DCP folder: {fqn} is a tensor kind DCP stores only through torch ({what}: sparse, quantized, "
        "meta or a tensor subclass)",
        hint="drop it (--drop) or write .pth / .safetensors",
    )


def plan_dcp(root: Tree, files: int = 1) -> list[DcpEntry]:
    """Every key's entry and every tensor's chunks, checked before anything is written."""
    if not 1 <= files <= MAX_FILES:
        raise ValueError(f"files must be 1..{MAX_FILES}")
    entries: list[DcpEntry] = []
    seen: set[str] = set()
    load = [0] * files  # bytes planned per file
    for path, value in dcp_entries(root):
        fqn = ".".join(map(str, path))
        if fqn in seen:  # torch's flatten_state_dict: "duplicated flatten key"
            raise BadInputError(f"cannot write a DCP folder: two entries flatten to the key {fqn!r:.120}")
        seen.add(fqn)
        if not _is_tensor(value):
            entries.append(DcpEntry(fqn, path, value))
            continue
        dtype, shape, grad = _tensor_facts(value, fqn)
        entry = DcpEntry(fqn, path, None, dtype, shape, grad)
        cut = _ref_chunk if isinstance(value, TensorRef) else _torch_chunk
        rows = shape[0] if shape else 0
        if files > 1 and rows >= 2:
            for i, (start, stop) in enumerate(_row_ranges(rows, files)):
                piece = cut(value, start, stop, False)
                offsets = (start, *(0 for _ in shape[1:]))
                entry.chunks.append(DcpChunk(offsets, piece.shape, piece, i))
                load[i] += piece.nbytes
        else:
            target = load.index(min(load))
            piece = cut(value, 0, rows, True)
            entry.chunks.append(DcpChunk(tuple(0 for _ in shape), shape, piece, target))
            load[target] += piece.nbytes
        entries.append(entry)
    return entries


# -- writing ----------------------------------------------------------------------------------


def file_name(index: int) -> str:
    """``__R_0.distcp``: the name torch gives rank R's one file."""
    return f"__{index}_0.distcp"


def _write_items(
    entries: list[DcpEntry],
    folder: Path,
    files: int,
    lazy: bool,
    progress: Callable[[int], None] | None,
) -> dict[tuple[str, int | None], _Stored]:
    """Write every item; where each landed, by (fqn, chunk index or None for a value)."""
    stored: dict[tuple[str, int | None], _Stored] = {}
    per_file: list[list[tuple[DcpEntry, int | None]]] = [[] for _ in range(files)]
    for entry in entries:  # values first, as torch writes them, into file 0
        if not entry.is_tensor:
            per_file[0].append((entry, None))
    for entry in entries:
        for number, chunk in enumerate(entry.chunks):
            per_file[chunk.file].append((entry, number))
    with OpenFiles() as open_files:
        open_files.plan(c.tensor.storage.source for e in entries for c in e.chunks)
        for file_number, items in enumerate(per_file):
            if not items:
                continue
            name = file_name(file_number)
            with open(folder / name, "wb") as out:
                for entry, index in items:
                    out.write(b"\0" * (-out.tell() % _ITEM_ALIGNMENT))
                    start = out.tell()
                    if index is None:
                        _write_value(entry.value, out, lazy, open_files)
                    else:
                        write_torch_zip(entry.chunks[index].tensor, out, embedded=True, files=open_files)
                        if progress:
                            progress(entry.chunks[index].tensor.nbytes)
                    stored[entry.fqn, index] = _Stored(name, start, out.tell() - start)
    return stored


def _write_value(value: Tree, out: BinaryIO, lazy: bool, files: OpenFiles) -> None:
    """A non-tensor value as ``torch.save(value)`` writes it (torch's own, for a tree of real
    tensors read through torch)."""
    if lazy:
        write_torch_zip(value, out, embedded=True, files=files)
    else:
        save_with_torch(value, out)


def _record(name: str, state: Any = ABSENT, module: str = _MODULE) -> OpaqueObject:
    """A DCP dataclass as pickle writes it: ``NEWOBJ`` of the class, then ``BUILD`` ``state``."""
    record = OpaqueObject(Global(module, name), (), kind="newobj")
    record.state = state
    return record


def _size(values: tuple[int, ...]) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(values),))


def metadata_tree(entries: list[DcpEntry], stored: dict[tuple[str, int | None], _Stored]) -> OpaqueObject:
    """The ``Metadata`` record torch's planner and ``FileSystemWriter`` would have made."""
    described: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for entry in entries:
        planner[entry.fqn] = entry.path
        if not entry.is_tensor:
            described[entry.fqn] = _record("BytesStorageMetadata")
            continue
        assert entry.dtype is not None
        properties = _record(
            "TensorProperties", (Global("torch", entry.dtype), _STRIDED, entry.requires_grad, _CONTIGUOUS_FORMAT, False)
        )
        chunks = [
            _record("ChunkStorageMetadata", {"offsets": _size(c.offsets), "sizes": _size(c.sizes)})
            for c in entry.chunks
        ]
        described[entry.fqn] = _record(
            "TensorStorageMetadata", {"properties": properties, "size": _size(entry.shape), "chunks": chunks}
        )
    items = sorted(stored.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    by_fqn = {entry.fqn: entry for entry in entries}
    for (fqn, index), where in items:
        if index is None:
            key = _record("MetadataIndex", {"fqn": fqn, "index": None})
        else:
            key = _record(
                "MetadataIndex", {"fqn": fqn, "offset": _size(by_fqn[fqn].chunks[index].offsets), "index": index}
            )
        info = {"relative_path": where.relative_path, "offset": where.offset, "length": where.length}
        storage[key] = _record("_StorageInfo", info, "torch.distributed.checkpoint.filesystem")
    meta: dict[str, Any] = {"checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None, "modules": []}
    return _record(
        "Metadata",
        {
            "state_dict_metadata": described,
            "planner_data": planner,
            "storage_data": storage,
            "storage_meta": _record("StorageMeta", meta),
            "version": DCP_VERSION,
        },
    )


def write_dcp(
    root: Tree,
    dest: Path,
    *,
    overwrite: bool,
    files: int = 1,
    lazy: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write ``root`` (a dict) as a DCP folder at ``dest``; returns the files written.

    ``files``: split into that many ``.distcp`` files, tensors cut by rows for as many readers
    (see the module docstring). ``lazy``: ``root``'s tensors are ckptfix's references (False:
    real tensors read through torch, whose non-tensor values torch then saves). Nothing is
    written unless every key can be (checked first); the folder is staged beside ``dest`` and
    renamed into place after its ``.metadata``: ``dest`` is complete or untouched.
    """
    entries = plan_dcp(root, files)
    if dest.exists() and not overwrite:
        raise CannotWriteError(f"{dest}: already exists", hint="pass --force to overwrite it")
    if not dest.parent.is_dir():
        raise CannotWriteError(f"{dest}: the folder {dest.parent} does not exist")
    try:
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".ckptfix-tmp", dir=dest.parent))
    except OSError as exc:
        raise CannotWriteError(describe_os_error(exc, dest)) from exc
    try:
        staged = work / "dcp"
        staged.mkdir()  # the umask's mode, not mkdtemp's 0700
        stored = _write_items(entries, staged, files, lazy, progress)
        pickled = dumps(metadata_tree(entries, stored), only=DCP_METADATA_WRITES)
        with open(staged / METADATA_NAME, "wb") as f:  # last: a folder with .metadata is complete
            f.write(pickled.data)
        if dest.exists():
            os.replace(dest, work / "previous")
        os.replace(staged, dest)
    except OSError as exc:
        raise CannotWriteError(describe_os_error(exc, dest)) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(dest.iterdir())
