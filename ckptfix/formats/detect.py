"""Say what a file is from its first bytes, before any parser touches it -- and, before that,
whether the path is a file at all (:func:`check_input`: FIFOs, devices and sockets are refused
from their mode, without being opened).

Files named ``model.pth`` are often something else: a git-lfs pointer (the weights were
never pulled), an HTML error page (a failed download), an empty file, a gzip of the real
thing. torch reports these as baffling unpickling errors ("Unsupported operand 118");
we name them and say what to do.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from ..errors import BadInputError
from ..fileio.urls import is_url

# The one registry of format names and file suffixes: the CLI's choices, output naming, folder
# scans and the reader's messages all take them from here.

#: names of the torch.save family (torch zip, legacy, tar), by suffix; OUT with one of these is .pth
PTH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".tar", ".pkl", ".model")
#: what a folder scan treats as a checkpoint file
CHECKPOINT_SUFFIXES = (*PTH_SUFFIXES, ".safetensors")
#: single-file output formats (``fit``, ``publish``)
FILE_FORMATS = ("pth", "safetensors")
#: every ``--format`` of the writing commands (dcp: a torch.distributed.checkpoint folder)
OUTPUT_FORMATS = (*FILE_FORMATS, "dcp")
#: what ``inspect`` (and every --json ``format`` field) calls the formats read: checkpoint.py's
#: FORMAT_* values, here so the CLI can offer them without importing the readers
FORMAT_NAMES = ("torch-zip", "torch-legacy", "torch-tar", "safetensors", "sharded", "dcp", "deepspeed")
#: the ``--format`` names that differ from what they write
FORMAT_NAME_ALIASES = {"pth": "torch-zip"}

#: checkpoints ckptfix recognises but does not read, by a pickle global only they name: what
#: they are, and what to do instead (refused by name, exit 3; ``scan`` says it in a note)
NOT_READ_BY_GLOBAL: dict[str, tuple[str, str]] = {
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": (
        "an FSDP1 per-rank state dict (torch.save of one rank's LOCAL_STATE_DICT flat parameter or "
        "SHARDED_STATE_DICT shards, as ShardedTensor); ckptfix does not read these files",
        "save FSDP1 state with torch.distributed.checkpoint (dcp.save of the SHARDED_STATE_DICT) and read that "
        "folder, or gather a FULL_STATE_DICT and torch.save it",
    ),
}
#: folders ckptfix recognises but does not read: Megatron-core's distributed checkpoints, a
#: ``metadata.json`` naming the backend beside the data (``torch_dist``: a DCP folder of stacked
#: layer tensors, with the rest of the state in ``common.pt``)
MEGATRON_METADATA = "metadata.json"
MEGATRON_NOT_READ = (
    "a Megatron-core distributed checkpoint ({backend} backend: layer tensors stacked and resharded as "
    "Megatron's sharded state dict lays them out, the rest in common.pt); ckptfix does not read it"
)
MEGATRON_HINT = (
    "convert it with Megatron's own tools first (its checkpoint converter to the torch or HF format), "
    "then run ckptfix on that"
)


def megatron_backend(folder: Path) -> str | None:
    """The ``sharded_backend`` a Megatron-core checkpoint folder's ``metadata.json`` names, or
    None for any other folder (no such file, or not Megatron's: a small JSON object with that key)."""
    import json

    marker = folder / MEGATRON_METADATA
    try:
        if not marker.is_file() or marker.stat().st_size > 1 << 16:
            return None
        document = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        return None
    backend = document.get("sharded_backend") if isinstance(document, dict) else None
    return backend if isinstance(backend, str) and backend.isprintable() else None


#: torch's legacy format begins with a pickled magic number (LONG1 0x1950a86a20f9469cfc6c), after
#: the PROTO opcode of whatever ``pickle_protocol`` it was saved with (2-5; 4+ adds a FRAME)
_LEGACY_MAGIC = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_FRAME = 0x95


def _is_legacy(head: bytes) -> bool:
    """A pickle header (PROTO 2-5, maybe a FRAME) followed by torch's legacy magic number."""
    body = head[2:]
    if body[:1] == bytes((_FRAME,)):
        body = body[9:]
    return body.startswith(_LEGACY_MAGIC)


#: torch's legacy magic number as protocols 0 and 1 pickle it (LONG, in decimal text)
_LEGACY_MAGIC_TEXT = b"L119547037146038801333356L\n."

_ARCHIVES = {
    b"\x1f\x8b": "a gzip-compressed file: decompress it first (gunzip)",
    b"7z\xbc\xaf\x27\x1c": "a 7z archive: extract the checkpoint from it first",
    b"BZh": "a bzip2-compressed file: decompress it first (bunzip2)",
    b"\xfd7zXZ\x00": "an xz-compressed file: decompress it first (unxz)",
    b"\x28\xb5\x2f\xfd": "a zstd-compressed file: decompress it first (unzstd)",
    b"Rar!": "a RAR archive: extract the checkpoint from it first",
}


#: what a path is when it is neither a regular file nor a folder
_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)
#: JSON whitespace the safetensors library's parser (serde_json) skips before the header's ``{``
_JSON_SPACE = b" \t\r\n"


def check_input(path: str | os.PathLike[str]) -> os.stat_result:
    """``os.stat`` of an input, refusing anything but a regular file or a folder.

    This never opens the path: opening a FIFO blocks until a writer appears (a hang), and a
    device such as ``/dev/zero`` reports size 0 but reads forever, so both must be recognised
    from their mode alone. Symlinks are followed (a link to a checkpoint is fine); a symlink
    loop, a path through a non-folder or an unreadable folder is a clear error.
    """
    if is_url(str(path)):  # a remote object or prefix (fsspec): what its server says of it
        from ..fileio.remote import stat_url

        return stat_url(str(path))
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise BadInputError(f"{path}: no such file") from exc
    except PermissionError as exc:
        raise BadInputError(f"{path}: permission denied") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInputError(f"{path}: a symlink loop (too many levels of symbolic links)") from exc
        raise BadInputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except ValueError as exc:  # an embedded NUL byte, e.g. from a shard index
        raise BadInputError(f"{path!r}: not a valid path ({exc})") from exc
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return st
    kind = next((what for test, what in _SPECIAL if test(st.st_mode)), "not a regular file")
    raise BadInputError(f"{path}: {kind}, not a checkpoint file or folder")


def open_input(path: str | os.PathLike[str]) -> tuple[BinaryIO, int]:
    """Open a regular file for reading and return it with its size.

    The path is checked with :func:`check_input` first; it is then opened non-blocking (so a
    file swapped for a FIFO between the check and the open cannot hang us) and must still be
    the same regular file.
    """
    if is_url(str(path)):  # read by planned ranged requests, never mapped or downloaded whole
        from ..fileio.remote import open_url

        remote, size = open_url(str(path))
        return cast(BinaryIO, remote), size
    st = check_input(path)
    if stat.S_ISDIR(st.st_mode):
        raise BadInputError(f"{path}: is a folder, expected a file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except PermissionError as exc:
        raise BadInputError(f"{path}: permission denied") from exc
    except OSError as exc:
        raise BadInputError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise BadInputError(f"{path}: changed while being opened (no longer the same regular file)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), now.st_size
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class Sniffed:
    """``kind`` is one of: torch-zip-or-zip, legacy, tar, safetensors, not-checkpoint."""

    kind: str
    description: str


def _gunzip_head(head: bytes) -> Sniffed | None:
    """What the first bytes inside a gzip stream look like (zip/legacy/safetensors), if readable."""
    import zlib

    try:
        inner = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 512)
    except zlib.error:
        return None
    return sniff(inner, 1 << 40) if len(inner) >= 16 else None


def sniff(head: bytes, file_size: int) -> Sniffed:
    """Classify a file from its first bytes (give at least 512) and its size."""
    if file_size == 0:
        return Sniffed("not-checkpoint", "an empty file (0 bytes): the save or download did not complete")
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return Sniffed("zip", "a zip archive")
    # before pickles: a header length such as 0x0280 begins with the bytes of a pickle header
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if head[8:].lstrip(_JSON_SPACE).startswith(b"{") and header_len >= 2:
            if header_len <= file_size - 8:
                return Sniffed("safetensors", "a safetensors file")
            return Sniffed(
                "not-checkpoint",
                f"a truncated or corrupt safetensors file: its header length ({header_len} bytes) goes beyond "
                f"the end of the file ({file_size} bytes)",
            )
    if head.startswith(b"\x80") and len(head) > 1 and 2 <= head[1] <= 5:
        if _is_legacy(head):
            return Sniffed("legacy", "a legacy torch checkpoint (saved with _use_new_zipfile_serialization=False)")
        return Sniffed(
            "not-checkpoint",
            "a plain Python pickle, not a torch checkpoint (torch.save always starts with its own header)",
        )
    if head.startswith(_LEGACY_MAGIC_TEXT):  # protocols 0 and 1: no header, the magic number as text
        return Sniffed("legacy", "a legacy torch checkpoint (saved with _use_new_zipfile_serialization=False)")
    if len(head) >= 262 and head[257:262] == b"ustar":
        return Sniffed("tar", "a tar archive (the format of torch before 0.4)")
    if head.startswith(b"\x1f\x8b"):
        inner = _gunzip_head(head)
        what = {
            "zip": "torch checkpoint (zip format)",
            "legacy": "legacy torch checkpoint",
            "safetensors": "safetensors file",
            "tar": "tar-era torch checkpoint",
        }.get(inner.kind if inner else "")
        if what:
            return Sniffed("not-checkpoint", f"a gzip-compressed {what}: decompress it first (gunzip)")
    for magic, what in _ARCHIVES.items():
        if head.startswith(magic):
            return Sniffed("not-checkpoint", what)
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith(b"version https://git-lfs"):
        return Sniffed(
            "not-checkpoint",
            "a git-lfs pointer, not the checkpoint itself: run `git lfs pull` to fetch the real file",
        )
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml", b"<body")):
        return Sniffed(
            "not-checkpoint",
            "an HTML/XML page, not a checkpoint: the download failed (check the URL, a login or a quota)",
        )
    if text.startswith((b"{", b"[")):
        return Sniffed("not-checkpoint", "a JSON/text file, not a checkpoint")
    try:
        head.decode("utf-8")
        is_text = all(c >= 32 or c in (9, 10, 13) for c in head)
    except UnicodeDecodeError:
        is_text = False
    if is_text:
        return Sniffed("not-checkpoint", "a plain text file, not a checkpoint")
    return Sniffed("not-checkpoint", "not a checkpoint format ckptfix recognises (unknown binary data)")


_TAR = Sniffed("tar", "a tar archive (the format of torch before 0.4)")
#: the only start torch.load takes for a zip (``torch.serialization._is_zipfile``)
_ZIP_LOCAL = b"PK\x03\x04"


def sniff_file(f: BinaryIO, file_size: int, path: str | os.PathLike[str]) -> Sniffed:
    """What ``torch.load(path)`` takes the open file ``f`` for, in torch's own order: a path ending
    ``.safetensors`` goes to the safetensors library; a file starting ``PK\\x03\\x04`` is a zip;
    any other file is first offered to Python's tar reader (whatever its first bytes look like:
    a legacy checkpoint, a safetensors file named ``.bin`` or a plain pickle can also be a tar
    header), and only when tarfile refuses it is it sniffed from its first bytes. Leaves ``f``
    just past the first 512 bytes, as :func:`sniff` callers expect."""
    from .tarera import open_tar

    head = f.read(512)
    what = sniff(head, file_size)
    if os.fspath(path).endswith(".safetensors") or head.startswith(_ZIP_LOCAL) or file_size == 0:
        return what
    tar = open_tar(f)
    f.seek(len(head))
    if tar is not None:
        tar.close()
        return _TAR
    if what.kind == "tar":  # "ustar" but a header tarfile refuses: torch reads it as a pickle
        return Sniffed("not-checkpoint", "a tar header torch's tar reader refuses (bad checksum or fields)")
    return what


def checkpoint_like(path: Path) -> bool:
    """Whether a file in a folder is one that torch or ``transformers`` might load: a name from
    the suffix registry (:data:`CHECKPOINT_SUFFIXES`), or first bytes that torch.load takes for
    a checkpoint or a pickle (``training_args.bin`` is one; so is a pickle named ``.txt``).
    Anything that cannot be opened as a regular file counts too: checking it reports why."""
    if path.name.lower().endswith(CHECKPOINT_SUFFIXES):
        return True
    try:
        f, size = open_input(path)
    except BadInputError:
        return not path.is_dir()
    with f:
        what = sniff_file(f, size, path)
    return what.kind != "not-checkpoint" or "pickle" in what.description or "tar header" in what.description
