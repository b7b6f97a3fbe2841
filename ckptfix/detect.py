"""Say what a file is from its first bytes, before any parser touches it.

Files named ``model.pth`` are often something else: a git-lfs pointer (the weights were
never pulled), an HTML error page (a failed download), an empty file, a gzip of the real
thing. torch reports these as baffling unpickling errors ("Unsupported operand 118");
we name them and say what to do.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

#: torch's legacy format begins with a pickled magic number (LONG1 0x1950a86a20f9469cfc6c)
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_ARCHIVES = {
    b"\x1f\x8b": "a gzip-compressed file: decompress it first (gunzip)",
    b"7z\xbc\xaf\x27\x1c": "a 7z archive: extract the checkpoint from it first",
    b"BZh": "a bzip2-compressed file: decompress it first (bunzip2)",
    b"\xfd7zXZ\x00": "an xz-compressed file: decompress it first (unxz)",
    b"\x28\xb5\x2f\xfd": "a zstd-compressed file: decompress it first (unzstd)",
    b"Rar!": "a RAR archive: extract the checkpoint from it first",
}


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
        if head[8:9] == b"{" and 2 <= header_len <= file_size - 8:
            return Sniffed("safetensors", "a safetensors file")
    if head.startswith(b"\x80") and len(head) > 1 and 2 <= head[1] <= 5:
        if head.startswith(_LEGACY_MAGIC):
            return Sniffed("legacy", "a legacy torch checkpoint (saved with _use_new_zipfile_serialization=False)")
        return Sniffed(
            "not-checkpoint",
            "a plain Python pickle, not a torch checkpoint (torch.save always starts with its own header)",
        )
    if len(head) >= 262 and head[257:262] == b"ustar":
        return Sniffed("tar", "a tar archive (the format of torch before 0.4)")
    if head.startswith(b"\x1f\x8b"):
        inner = _gunzip_head(head)
        what = {"zip": "torch checkpoint (zip format)", "legacy": "legacy torch checkpoint",
                "safetensors": "safetensors file", "tar": "tar-era torch checkpoint"}.get(inner.kind if inner else "")
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
