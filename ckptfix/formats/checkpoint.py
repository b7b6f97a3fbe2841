"""Opening a checkpoint of any supported kind: diagnose, then read with the right reader."""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BadInputError, UnsafeInputError, UsageError
from ..fileio.remote import RemotePath, as_path, reading_metadata_only
from ..fileio.urls import is_url
from ..model.needs import need_torch
from ..model.refs import Tree
from ..pickling.globals import danger
from ..pickling.reader import display_name
from .dcp import METADATA_NAME, dcp_file_sizes, is_dcp_folder, read_dcp, read_dcp_safely
from .deepspeed import DeepSpeedInfo, is_deepspeed_folder, read_deepspeed
from .detect import (
    MEGATRON_HINT,
    MEGATRON_METADATA,
    MEGATRON_NOT_READ,
    NOT_READ_BY_GLOBAL,
    check_input,
    megatron_backend,
    open_input,
    sniff_file,
)
from .legacy import load_with_torch, save_with_torch
from .legacy_pickle import read_legacy
from .safetensors import read_safetensors
from .sharded import find_index, merge_shards, read_index
from .tarera import record_tar
from .torchzip import TorchZipArchive, read_torch_zip, write_torch_zip

FORMAT_TORCH_ZIP = "torch-zip"
FORMAT_TORCH_LEGACY = "torch-legacy"
FORMAT_TORCH_TAR = "torch-tar"
FORMAT_SAFETENSORS = "safetensors"
FORMAT_SHARDED = "sharded"
FORMAT_DCP = "dcp"
FORMAT_DEEPSPEED = "deepspeed"


@dataclass
class Checkpoint:
    """A checkpoint as read: its tree plus what is needed to write a transformed copy.

    ``root`` is what ``torch.load`` would return, with lazy :class:`~ckptfix.tree.TensorRef`
    leaves when ``archive`` is set (the torch zip fast path) and real tensors otherwise
    (formats read through torch itself).
    """

    path: str
    format: str
    root: Tree
    file_size: int
    globals: set[str] = field(default_factory=set)
    archive: TorchZipArchive | None = None
    notes: list[str] = field(default_factory=list)
    #: safetensors ``__metadata__`` (or a shard index's metadata), if any
    metadata: dict[str, Any] = field(default_factory=dict)
    #: False when the tree holds real tensors (formats read through torch itself)
    lazy: bool = True
    #: a DeepSpeed folder: its stage, world size, tags and the weights read
    deepspeed: DeepSpeedInfo | None = None

    def write(self, root: Tree, out: BinaryIO, progress: Callable[[int], None] | None = None) -> None:
        """Write ``root`` (this checkpoint's tree, transformed) as a torch zip file."""
        if not self.lazy:
            save_with_torch(root, out)
            return
        name = self.archive.archive_name if self.archive else "archive"
        write_torch_zip(root, out, archive_name=name, source=self.archive, progress=progress)


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    unsafe_load: bool = False,
    allow_globals: Sequence[str] = (),
    inert_unknown: bool = False,
    tag: str | None = None,
    weights: str | None = None,
) -> Checkpoint:
    """Open ``path`` safely: diagnose the file, then read it without running any of its code.

    Zip-format torch checkpoints (whatever their extension: .pth, .pt, .bin, .ckpt, .tar),
    legacy (non-zip) torch files, safetensors files and HF shard folders (or their
    ``*.index.json``) are read lazily by ckptfix's own readers. The pre-2018 tar format has no
    safe reader: it is read through ``torch.load(weights_only=False)`` with ``unsafe_load`` only.
    ``unsafe_load=True`` allows a fallback to ``torch.load(weights_only=False)`` for pickles
    the allow-list refuses -- only for trusted files. ``allow_globals`` (names or globs such as
    ``argparse.Namespace`` or ``numpy.*``) lets those globals through as opaque records that are
    written back unchanged and never imported or called. ``inert_unknown=True`` reads every other
    global that is not dangerous as an inert record too, marked not allowed (no writer writes
    one): for callers that then write only part of the tree and check what they write
    (:func:`~ckptfix.pickling.reader.foreign_globals`). ``tag`` and ``weights`` choose what a
    DeepSpeed folder gives (:func:`~ckptfix.formats.deepspeed.read_deepspeed`); other inputs refuse them.
    """
    path = str(path)
    st = check_input(path)  # never opens: a FIFO, a device or a socket is refused from its mode
    # a DCP folder first: one question of a remote folder, where a DeepSpeed one lists it
    if stat.S_ISDIR(st.st_mode) and not is_dcp_folder(as_path(path)) and is_deepspeed_folder(as_path(path)):
        return _read_deepspeed(as_path(path), allow_globals, tag, weights)
    if tag is not None or weights is not None:
        raise UsageError(f"{path}: --tag and --weights choose what a DeepSpeed checkpoint folder gives; not one")
    if stat.S_ISDIR(st.st_mode):
        return _read_folder(as_path(path), unsafe_load, allow_globals, inert_unknown)
    if path.endswith(".index.json"):
        return _read_sharded(as_path(path), allow_globals)
    f, file_size = open_input(path)
    with f:
        what = sniff_file(f, file_size, path)
        if what.kind == "zip":
            globals_seen: set[str] = set()
            try:
                root, archive = read_torch_zip(
                    path, f, file_size, globals_seen, allow_globals, inert_unknown=inert_unknown
                )
            except UnsafeInputError as exc:
                refuse_not_read(path, globals_seen, exc)
                if not unsafe_load:
                    raise
                _refuse_hostile(
                    path, exc, lambda: read_torch_zip(path, f, file_size, set(), allow_globals, inert_unknown=True)
                )
                return _read_with_torch(path, FORMAT_TORCH_ZIP, file_size, unsafe=True)
            refuse_not_read(path, globals_seen)
            return Checkpoint(path, FORMAT_TORCH_ZIP, root, file_size, globals_seen, archive, archive.notes())
        if what.kind == "safetensors":
            tensors, metadata = read_safetensors(path, f, file_size)
            return Checkpoint(path, FORMAT_SAFETENSORS, tensors, file_size, metadata=metadata)
        if what.kind == "legacy":
            if is_url(path):
                raise UsageError(
                    f"{path}: a legacy torch checkpoint (saved with _use_new_zipfile_serialization=False); "
                    "ckptfix reads this format from local files only",
                    hint="download it first, e.g. fsspec's `fs.get`, then run ckptfix on the copy",
                )
            globals_seen = set()
            try:
                root = read_legacy(path, f, file_size, globals_seen, allow_globals, inert_unknown=inert_unknown)
            except UnsafeInputError as exc:
                refuse_not_read(path, globals_seen, exc)
                if not unsafe_load:
                    raise
                _refuse_hostile(
                    path, exc, lambda: read_legacy(path, f, file_size, set(), allow_globals, inert_unknown=True)
                )
                return _read_with_torch(path, FORMAT_TORCH_LEGACY, file_size, unsafe=True)
            refuse_not_read(path, globals_seen)
            return Checkpoint(path, FORMAT_TORCH_LEGACY, root, file_size, globals_seen)
    if what.kind == "tar":
        # torch reads the tar format only by running its pickles (it refuses weights_only=True
        # for it), and ckptfix has no restricted reader for it: only --unsafe-load reads one
        need_torch()
        if not unsafe_load:
            raise BadInputError(
                f"{path}: a torch checkpoint in the tar format of torch before 0.4, which torch reads only "
                "with weights_only=False (running code from the file); ckptfix has no safe reader for it",
                hint="only if you trust this file: --unsafe-load (unsafe_load=True), then save it in today's format",
            )
        if is_url(path):
            raise UsageError(
                f"{path}: a tar-era torch checkpoint; ckptfix reads this format from local files only",
                hint="download it first, e.g. fsspec's `fs.get`, then run ckptfix on the copy",
            )
        _refuse_hostile_tar(path)
        return _read_with_torch(path, FORMAT_TORCH_TAR, file_size, unsafe=True)
    raise BadInputError(f"{path}: {what.description}")


#: the one dangerous global a genuine FSDP1 file names: ``getattr(ShardedTensor, "ProcessGroupState")``,
#: how protocol 2 pickles a nested class
_NESTED_CLASS_GETTER = "builtins.getattr"


def refuse_not_read(path: str, names: set[str], refused: UnsafeInputError | None = None) -> None:
    """Refuse by name a file of a kind ckptfix recognises but does not read
    (:data:`~ckptfix.formats.detect.NOT_READ_BY_GLOBAL`), from the globals its pickle named so
    far. A refusal that found code-running globals beyond the one such files hold stays the
    hostile refusal it is."""
    seen = names | set(refused.global_names if refused else ())
    known = next((NOT_READ_BY_GLOBAL[n] for n in sorted(seen) if n in NOT_READ_BY_GLOBAL), None)
    if known is None:
        return
    if refused is not None and set(refused.hostile) - {_NESTED_CLASS_GETTER}:
        return
    what, hint = known
    raise BadInputError(f"{path}: {what}", hint=hint)


def _refuse_hostile_tar(path: str) -> None:
    """:func:`_refuse_hostile` for the tar format, which has no safe reader: every pickle torch's
    tar reader would run is followed by the recording VM first (as ``scan`` does), and a file
    naming a code-running global -- or one whose reads cannot be followed without running it --
    is refused before torch is called."""
    f, size = open_input(path)
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        found, error = record_tar(f, data, size)
    reasons = {}
    for name, _ in found:
        reason = "it changes or calls something the reader built" if name.startswith("<") else danger(name)
        if reason is not None:
            reasons[name] = reason
    if reasons:
        shown = [display_name(*name.rsplit(".", 1)) if "." in name else name for name in reasons]
        raise UnsafeInputError(list(reasons), path, shown=shown, hostile=list(reasons), reasons=reasons)
    if "treat it as unsafe" in error:
        raise BadInputError(
            f"{path}: {error}", hint="--unsafe-load hands torch only files whose pickles ckptfix can follow"
        )


def _refuse_hostile(path: str, refused: UnsafeInputError, read_inert: Callable[[], object]) -> None:
    """Refuse, before torch is called, a file ``--unsafe-load`` would hand to
    ``torch.load(weights_only=False)`` when it is more than merely unusual.

    The fallback is for files that hold a class outside the allow-list (a config), never for
    hostile ones: a file that calls ``os.system`` is an attack whoever trusts it. The reader
    stops at the first name it refuses, so unless that one already runs code, the file is read
    again with every harmless unknown global as an inert record (``read_inert``): that read goes
    through every pickle torch would run, stops at a dangerous global, and checks every storage
    and extent against the file -- a file whose storage claims a terabyte the file does not hold
    would have torch allocate it before reading a byte (``UntypedStorage(2**40)``), so it is
    refused here as it is without ``--unsafe-load``.
    """
    if not refused.hostile:
        try:
            read_inert()
        except UnsafeInputError as again:
            refused = again
    if refused.hostile:
        raise refused.at(path) from None


#: said of a remote DCP folder read for its metadata alone (``inspect``): what it did not read
REMOTE_DCP_NOTE = (
    "a remote DCP folder described from its .metadata alone: its items (and the globals their "
    "pickles name) are not read here; scan and convert read them"
)


def _read_folder(folder: Path, unsafe_load: bool, allow_globals: Sequence[str], inert_unknown: bool) -> Checkpoint:
    # a remote folder is listed once, and asked no question its listing answers
    listing = folder.file_sizes() if isinstance(folder, RemotePath) else None
    backend = megatron_backend(folder) if listing is None or MEGATRON_METADATA in listing else None
    if backend is not None:
        raise BadInputError(f"{folder}: {MEGATRON_NOT_READ.format(backend=backend)}", hint=MEGATRON_HINT)
    if METADATA_NAME in listing if listing is not None else is_dcp_folder(folder):
        listing = dcp_file_sizes(folder) if listing is None else listing
        size = sum(listing.values())
        globals_seen: set[str] = set()
        try:
            root = read_dcp_safely(folder, globals_seen, allow_globals, inert_unknown=inert_unknown, listing=listing)
        except UnsafeInputError as exc:
            if not unsafe_load:
                raise
            if isinstance(folder, RemotePath):
                raise UsageError(
                    f"{folder}: --unsafe-load reads a DCP folder through torch from local disk only",
                    hint="copy it locally first",
                ) from None
            _refuse_hostile(str(folder), exc, lambda: read_dcp_safely(folder, set(), allow_globals, inert_unknown=True))
            note = "DCP folder read through torch.distributed.checkpoint (--unsafe-load); tensors are in memory"
            return Checkpoint(str(folder), FORMAT_DCP, read_dcp(folder), size, notes=[note], lazy=False)
        notes = [REMOTE_DCP_NOTE] if listing is not None and reading_metadata_only() else []
        return Checkpoint(str(folder), FORMAT_DCP, root, size, globals_seen, notes=notes)
    found = find_index(folder)
    if found is None:
        raise BadInputError(
            f"{folder}: a folder without a checkpoint ckptfix knows (model.safetensors, pytorch_model.bin "
            "or a *.index.json)"
        )
    if found.name.endswith(".index.json"):
        return _read_sharded(found, allow_globals)
    return read_checkpoint(found, unsafe_load=unsafe_load, allow_globals=allow_globals, inert_unknown=inert_unknown)


def _read_deepspeed(folder: Path, allow_globals: Sequence[str], tag: str | None, weights: str | None) -> Checkpoint:
    globals_seen: set[str] = set()
    root, info = read_deepspeed(folder, globals_seen, allow_globals, tag=tag, weights=weights)
    size = info.input_bytes
    return Checkpoint(
        str(folder), FORMAT_DEEPSPEED, root, size, globals_seen, notes=[info.describe(), *info.notes], deepspeed=info
    )


def _read_sharded(index_path: Path, allow_globals: Sequence[str] = ()) -> Checkpoint:
    weight_map, metadata = read_index(index_path)

    def read_shard(shard: Path) -> Mapping[str, Any]:
        ckpt = read_checkpoint(shard, allow_globals=allow_globals)
        if not ckpt.lazy or not isinstance(ckpt.root, dict):
            raise BadInputError(f"{shard}: a shard must hold one flat state dict")
        return ckpt.root

    root = merge_shards(index_path, weight_map, metadata, read_shard)
    size = sum((index_path.parent / s).stat().st_size for s in set(weight_map.values()))
    return Checkpoint(str(index_path), FORMAT_SHARDED, root, size, metadata=dict(metadata))


def _read_with_torch(path: str, fmt: str, file_size: int, *, unsafe: bool) -> Checkpoint:
    root = load_with_torch(path, weights_only=not unsafe)
    notes = [
        f"{fmt} file read through torch.load"
        + (" (weights_only=False: --unsafe-load)" if unsafe else " (weights_only=True)")
        + "; tensors were loaded to the CPU and are written as CPU tensors"
    ]
    return Checkpoint(path, fmt, root, file_size, notes=notes, lazy=False)
