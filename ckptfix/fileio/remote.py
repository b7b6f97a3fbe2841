"""Checkpoints where they live: inputs and outputs named by URL (``s3://``, ``gs://``, ``az://``,
``hf://``, ``https://``, ``file://``, ``memory://``), through ``fsspec``, as planned byte ranges.

Why not mount the bucket, or ``fs.open()`` it and hand that to the readers: a remote file
read like a local one moves bytes nobody asked for (a memory map over a remote mount took ~2 h
where explicit reads took 35 s, pytorch#175762), and the readers here never need most of the
file: ``inspect`` needs a zip's end records, directory and ``data.pkl``, or a safetensors
length and header -- a few requests, whatever the checkpoint's size. So a :class:`RemoteFile`
answers each read with one ranged GET of a window around it (the head and the tail of the
object come in one request each, which is where every format keeps its metadata) and keeps
what it fetched; a reader can name what it is about to read (:meth:`RemoteFile.prefetch`:
coalesced, concurrent), and a writer the ranges it will copy, in its order
(:meth:`RemoteFile.plan`): those are fetched ahead, at most ``--max-concurrency`` requests
of at most :data:`PART` bytes, and written as they arrive. A failed ranged GET is retried.

The object must not change while it is read: its identity (size, ETag, version) is taken
when it is first opened within one command (:func:`consistent_reads`) -- from a HEAD, or from
the folder listing or the "is it a file?" question that found it a moment before -- and checked
again (a HEAD) at every later open and when a reader is done with it; a change is bad input
(exit 3), and an output being written from it is then never committed.

Outputs (:func:`upload_output`) are uploaded as they are written, each a multipart upload
completed after its last part or aborted; a folder's index goes last. An output that must be
read back before it is committed (``--verify``) is written locally first
(:func:`staged_output`), then uploaded the same way.

``fsspec`` and the backends of the common schemes are the optional ``ckptfix[remote]`` extra
(``[gcs]`` and ``[azure]`` add gcsfs and adlfs): the core install stays small, and a URL given
without them is one line naming what to install (exit 2).
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from ..errors import BadInputError, CannotWriteError, CkptfixError, UsageError
from .deferred import VIRTUAL, DeferredRecords
from .held import holding
from .positional import PositionalFile
from .urls import is_url

__all__ = [
    "RemoteFile",
    "RemotePath",
    "as_path",
    "configure",
    "consistent_reads",
    "is_url",
    "metadata_only",
    "open_url",
]

if TYPE_CHECKING:
    from concurrent.futures import Future

#: what to install, by scheme: (the fsspec backend, the ckptfix extra that brings it)
_BACKENDS = {
    "s3": ("s3fs", "remote"),
    "s3a": ("s3fs", "remote"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "hf": ("huggingface_hub", "remote"),
    "http": ("aiohttp", "remote"),
    "https": ("aiohttp", "remote"),
}
EXTRA = "pip install 'ckptfix[remote]'"
#: one request's window for a metadata read: a zip's end records and (usually) its whole
#: directory come in the tail window, ``data.pkl`` and the small records torch writes first in
#: the head window; two windows stay well inside the 1 MB a remote ``inspect`` may move
WINDOW = 1 << 18
#: one part of a streamed tensor range: big enough that a request's latency is amortised,
#: small enough that ``max_concurrency`` of them in memory is modest
PART = 1 << 23
#: planned small reads (zip local headers) closer than this are fetched as one request: the
#: bytes between them (tensor data the conversion fetches again) cost less than a request
SMALL_GAP = 1 << 13
#: what is fetched past a local header's fixed part and name when the header is read on its
#: own: torch's padding extra field is at most 68 bytes (a zip64 one adds 28)
_HEADER_SLACK = 256
#: a failed ranged read is tried again this many times, after BACKOFF, 2x, 4x ... seconds
RETRIES = 3
BACKOFF = 0.1
#: what the RemoteFiles of one command keep of the bytes they fetched for small reads and
#: fetched ahead, at most (all objects together: when full, all of it is let go)
_CACHE_LIMIT = 1 << 26


class _Blocks:
    """Bytes fetched from objects, kept for later reads: ``start -> bytes`` per object (by URL
    and identity). Within one command (:func:`consistent_reads`) every open of an object shares
    its blocks, so what a reader fetched ahead serves the writer that opens the object again
    (a small DCP item comes whole with its head, and its tensor bytes are not fetched twice);
    the whole store holds at most :data:`_CACHE_LIMIT` bytes."""

    def __init__(self) -> None:
        self._objects: dict[tuple[str, tuple[Any, ...]], tuple[dict[int, bytes], list[int]]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def read(self, key: tuple[str, tuple[Any, ...]], size: int, offset: int) -> bytes | None:
        import bisect

        with self._lock:
            found = self._objects.get(key)
            if found is None:
                return None
            blocks, starts = found
            i = bisect.bisect_right(starts, offset) - 1
            if i >= 0:
                block = blocks[starts[i]]
                at = offset - starts[i]
                if at + size <= len(block):
                    return block[at : at + size]
        return None

    def keep(self, key: tuple[str, tuple[Any, ...]], start: int, data: bytes) -> None:
        import bisect

        with self._lock:
            if self._held + len(data) > _CACHE_LIMIT:
                self._objects.clear()
                self._held = 0
            blocks, starts = self._objects.setdefault(key, ({}, []))
            if start not in blocks:
                bisect.insort(starts, start)
            else:
                self._held -= len(blocks[start])
            blocks[start] = data
            self._held += len(data)


_shared_blocks: ContextVar[_Blocks | None] = ContextVar("ckptfix_remote_blocks", default=None)


@dataclass
class RemoteSettings:
    """What ``--storage-option KEY=VALUE`` and ``--max-concurrency`` set (process-wide; fsspec's
    own environment configuration, e.g. ``FSSPEC_S3_ENDPOINT_URL`` or AWS_* variables, applies
    as well)."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int = 8


SETTINGS = RemoteSettings()


def configure(storage_options: dict[str, Any] | None = None, max_concurrency: int | None = None) -> None:
    """Set the storage options and the concurrency every later URL is opened with."""
    if storage_options is not None:
        SETTINGS.storage_options = dict(storage_options)
    if max_concurrency is not None:
        if max_concurrency < 1:
            raise UsageError("--max-concurrency must be at least 1")
        SETTINGS.max_concurrency = max_concurrency


def parse_storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value); ``true``/``false``/integers become JSON-like values, and a
    dotted key (``client_kwargs.endpoint_url``) a nested dict entry in :func:`merge_option`."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--storage-option {text!r}: expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
    lowered = value.lower()
    parsed: Any = value
    if lowered in ("true", "false"):
        parsed = lowered == "true"
    elif re.fullmatch(r"-?\d+", value):
        parsed = int(value)
    return key.strip(), parsed


def merge_option(options: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` (dots make nested dicts: ``client_kwargs.region_name``) in ``options``."""
    *parents, last = key.split(".")
    target = options
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise UsageError(f"--storage-option {key}: {part} is given both as a value and as a group")
    target[last] = value


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path within it; a missing fsspec or backend is
    a one-line usage error naming what to install."""
    scheme = scheme_of(url)
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{url}: reading or writing URLs needs fsspec: {EXTRA}") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **SETTINGS.storage_options)
    except ImportError:
        package, extra = _BACKENDS.get(scheme, ("its fsspec backend", "remote"))
        raise UsageError(f"{url}: {scheme}:// needs {package}: pip install 'ckptfix[{extra}]'") from None
    except ValueError as exc:
        if "Protocol not known" in str(exc) or "not known" in str(exc):
            raise UsageError(f"{url}: fsspec knows no {scheme}:// storage") from None
        raise UsageError(f"{url}: {exc}") from None
    except TypeError as exc:  # a storage option the backend does not take
        raise UsageError(f"{url}: a --storage-option this storage does not take ({exc})") from None
    return fs, cast(str, path)


def _remote_error(url: str, exc: BaseException) -> BadInputError:
    if isinstance(exc, FileNotFoundError):
        return BadInputError(f"{url}: no such object")
    if isinstance(exc, PermissionError):
        return BadInputError(f"{url}: permission denied (check the credentials or --storage-option)")
    return BadInputError(f"{url}: cannot read: {type(exc).__name__}: {exc}")


#: the fields of an fsspec ``info()`` that change when an object is replaced
_IDENTITY_KEYS = ("size", "ETag", "etag", "VersionId", "version_id", "generation", "LastModified", "mtime", "sha")


def _identity(info: dict[str, Any]) -> tuple[Any, ...]:
    """What says an object is the one first opened: its size and ETag (and version) where the
    store gives an ETag -- which changes with the content -- else its size and times. Where an
    ETag is given the time is left out: a listing states it to the millisecond and a HEAD to the
    second, and the same object may be described by either."""
    keys: tuple[str, ...] = _IDENTITY_KEYS
    if info.get("ETag") is not None or info.get("etag") is not None:
        keys = tuple(k for k in keys if k not in ("LastModified", "mtime"))
    return tuple((k, str(info[k])) for k in keys if info.get(k) is not None)


_seen: ContextVar[dict[str, tuple[Any, ...]] | None] = ContextVar("ckptfix_remote_seen", default=None)
_metadata_only: ContextVar[bool] = ContextVar("ckptfix_remote_metadata_only", default=False)
#: within one command, the deferred zip records of each object (by URL: its identity, the
#: records, their data offsets once checked), for every RemoteFile opened on it: the reader
#: that found them and the writer that reads their data are two opens of one object
_deferrals: ContextVar[dict[str, tuple[tuple[Any, ...], DeferredRecords, dict[int, int]]] | None] = ContextVar(
    "ckptfix_remote_deferrals", default=None
)

F = TypeVar("F", bound=Callable[..., Any])


def consistent_reads(func: F) -> F:
    """Run ``func`` as one command: every object opened during it must keep the identity it had
    when first opened (see the module docstring)."""

    @wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        seen: dict[str, tuple[Any, ...]] = {}
        token = _seen.set(seen)
        deferrals = _deferrals.set({})
        blocks = _shared_blocks.set(_Blocks())
        listed = _listed.set({})
        try:
            return func(*args, **kwargs)
        except BadInputError:
            # bytes that make no sense may be bytes of another object: say so if it was replaced
            _refuse_changed(seen)
            raise
        finally:
            _listed.reset(listed)
            _shared_blocks.reset(blocks)
            _deferrals.reset(deferrals)
            _seen.reset(token)

    return cast(F, run)


def _refuse_changed(seen: dict[str, tuple[Any, ...]]) -> None:
    for url, first in seen.items():
        fs, path = filesystem(url)
        try:
            now = _identity(_info(fs, path, url))
        except BadInputError:
            continue  # gone or unreachable now: the error in hand says more
        if not _same(first, now):
            raise BadInputError(
                f"{url}: the object changed while it was being read ({_change(first, now)}); nothing written"
            ) from None


@contextmanager
def metadata_only() -> Iterator[None]:
    """Within this, readers read only metadata (no tensor bytes): a remote zip's per-record local
    headers are not fetched (one request each), since nothing here reads a record's data."""
    token = _metadata_only.set(True)
    try:
        yield
    finally:
        _metadata_only.reset(token)


def reading_metadata_only() -> bool:
    """Whether the caller is within :func:`metadata_only` (a reader may then plan no tensor bytes)."""
    return _metadata_only.get()


def _info(fs: Any, path: str, url: str) -> dict[str, Any]:
    try:
        invalidate = getattr(fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(path)
        return cast(dict[str, Any], fs.info(path))
    except Exception as exc:  # any backend's failure is this input's failure
        raise _remote_error(url, exc) from None


def _check_identity(url: str, info: dict[str, Any]) -> None:
    seen = _seen.get()
    if seen is None:
        return
    now = _identity(info)
    first = seen.setdefault(url, now)
    if not _same(first, now):
        raise BadInputError(
            f"{url}: the object changed while it was being read ({_change(first, now)}); nothing written"
        )


def _same(first: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """Whether two identities describe one object: equal in every field both state (a listing
    states no version where a HEAD does), the size at least."""
    before, after = dict(first), dict(now)
    common = before.keys() & after.keys()
    return "size" in common and all(before[k] == after[k] for k in common)


def _change(first: tuple[Any, ...], now: tuple[Any, ...]) -> str:
    before, after = dict(first), dict(now)
    keys = [k for k in _IDENTITY_KEYS if before.get(k) != after.get(k)]
    return ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in keys[:2]) or "identity differs"


#: the info :func:`stat_url` (or a :class:`RemotePath` question) just fetched, for the
#: :class:`RemoteFile` opened right after it (``read_checkpoint`` stats an input, then opens it;
#: a DCP or DeepSpeed folder's reader asks whether ``.metadata`` or ``latest`` is a file, then
#: opens it: one HEAD request, not two). Only the latest is kept, and only an open of that URL
#: takes it.
_just_statted = threading.local()


#: within one command, what a folder's listing said of each object in it (by URL), for the
#: first open of that object: a folder's reader lists it, then opens its files (the listing
#: states each one's size and ETag as a HEAD would; a later open asks again)
_listed: ContextVar[dict[str, dict[str, Any]] | None] = ContextVar("ckptfix_remote_listed", default=None)


def _note_listing(scheme: str, entries: list[Any]) -> None:
    """Keep what a listing said of its objects for their first open (:data:`_listed`): only
    entries naming a size and a content identity (ETag, generation or version)."""
    listed = _listed.get()
    if listed is None:
        return
    for entry in entries:
        if not isinstance(entry, dict) or entry.get("type") == "directory" or not isinstance(entry.get("size"), int):
            continue
        name = str(entry.get("name", ""))
        if "://" in name or not any(entry.get(k) is not None for k in ("ETag", "etag", "generation", "VersionId")):
            continue
        listed[f"{scheme}://{name}"] = entry


def _fresh_info(fs: Any, path: str, url: str) -> dict[str, Any]:
    kept = getattr(_just_statted, "info", None)
    _just_statted.info = None
    if kept is not None and kept[0] == url:
        return cast(dict[str, Any], kept[1])
    listed = _listed.get()
    if listed is not None and url in listed:
        return listed.pop(url)
    return _info(fs, path, url)


def stat_url(url: str) -> os.stat_result:
    """What ``os.stat`` says of a local input, for a URL: a regular file with its size, or a
    folder (a prefix holding objects)."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise BadInputError(f"{url}: no such object") from None
    except Exception as exc:
        raise _remote_error(url, exc) from None
    if info.get("type") == "directory":
        return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    _check_identity(url, info)
    size = info.get("size")
    if not isinstance(size, int):
        raise BadInputError(f"{url}: the server does not say the object's size; ranged reads need it")
    _just_statted.info = (url, info)
    return os.stat_result((stat.S_IFREG | 0o644, 0, 0, 0, 0, 0, size, 0, 0, 0))


class RemoteFile(PositionalFile):
    """One remote object, read by ranges (see the module docstring). Satisfies
    :class:`~ckptfix.fileio.ranges.RangeSource`; has no ``fileno`` (never mapped)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.fs, self._path = filesystem(url)
        info = _fresh_info(self.fs, self._path, url)
        if info.get("type") == "directory":
            raise BadInputError(f"{url}: is a folder, expected a file")
        size = info.get("size")
        if not isinstance(size, int):
            raise BadInputError(f"{url}: the server does not say the object's size; ranged reads need it")
        self.size = size
        self.identity = _identity(info)
        _check_identity(url, info)
        self.metadata_only = _metadata_only.get()
        self.max_concurrency = SETTINGS.max_concurrency
        self.requests = 0
        self.bytes_fetched = 0
        self._pos = 0
        self._blocks = _shared_blocks.get() or _Blocks()  # this command's, or this file's own
        self._key = (url, self.identity)
        self._lock = threading.Lock()
        self._ahead: _Readahead | None = None
        self._deferred: DeferredRecords | None = None
        self._resolved: dict[int, int] = {}  # deferred record -> its data offset, once checked
        shared = _deferrals.get()
        #: whether a zip reader may defer its tensor records' headers (:meth:`defer`): only
        #: within a command (:func:`consistent_reads`), where a later open finds them again
        self.defers = shared is not None
        if shared is not None and url in shared and shared[url][0] == self.identity:
            _, self._deferred, self._resolved = shared[url]

    # -- ranges
    def fetch(self, start: int, end: int) -> bytes:
        """``[start, end)`` in one ranged request.

        A ranged GET changes nothing, so a failed or short one is safe to repeat: a server
        error, a dropped connection or a short body is retried after 0.1, 0.2, 0.4 s
        (:data:`RETRIES`), then the read fails (exit 3). A missing object or a refusal is not
        retried. A short answer that persists means the object changed or was truncated.
        """
        if start >= end:
            return b""
        import time

        data: bytes = b""
        wrong: str | None = None
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(BACKOFF * 2 ** (attempt - 1))
            try:
                data, answered = self._get(start, end)
            except (FileNotFoundError, PermissionError) as exc:
                raise _remote_error(self.url, exc) from None
            except Exception as exc:
                if attempt == RETRIES:
                    raise _remote_error(self.url, exc) from None
                continue
            finally:
                with self._lock:
                    self.requests += 1
            with self._lock:
                self.bytes_fetched += len(data)
            if answered is not None and not _is_range(answered, start, end, self.size):
                wrong = answered  # another range (or another object's), whatever its length: try again
                continue
            if len(data) == end - start:
                return data
        if wrong is not None:
            raise BadInputError(
                f"{self.url}: asked for bytes {start}-{end - 1} and the server answered {wrong!r}, {RETRIES + 1} "
                "times: a server or proxy that serves the wrong range; nothing written"
            )
        raise BadInputError(
            f"{self.url}: asked for bytes {start}-{end} and got {len(data)}, {RETRIES + 1} times: the object changed "
            "or was truncated while being read; nothing written"
        )

    def _get(self, start: int, end: int) -> tuple[bytes, str | None]:
        """``[start, end)`` and the range the server says it sent (its ``Content-Range``), where the
        backend lets that be seen (s3fs, fsspec's http); else None (fsspec's ``cat_file`` drops
        it): then a wrong range of the right length is caught only by the CRC32 each copied zip
        record is checked against."""
        getter = _RANGE_GETTERS.get(type(self.fs).__name__)
        if getter is None:
            return cast(bytes, self.fs.cat_file(self._path, start=start, end=end)), None
        from fsspec.asyn import sync

        return cast(tuple[bytes, "str | None"], sync(self.fs.loop, getter, self.fs, self._path, start, end))

    def _cached_read(self, size: int, offset: int) -> bytes | None:
        return self._blocks.read(self._key, size, offset)

    def _keep(self, start: int, data: bytes) -> None:
        self._blocks.keep(self._key, start, data)

    def pread(self, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` (short at the end of the object), from what was fetched
        or with one request for a window around them."""
        offset = self._real(offset)
        size = max(0, min(size, self.size - offset))
        if size == 0:
            return b""
        if self._ahead is not None:
            planned = self._ahead.take(offset, size)
            if planned is not None and len(planned) == size:
                return planned
        hit = self._cached_read(size, offset)
        if hit is not None:
            return hit
        if size >= WINDOW:
            return self.fetch(offset, offset + size)
        start, end = offset, min(self.size, offset + WINDOW)
        if end - start < WINDOW:  # near the end: take the whole tail (end records and directory)
            start = max(0, end - WINDOW)
        data = self.fetch(start, end)
        self._keep(start, data)
        return data[offset - start : offset - start + size]

    def prefetch(self, ranges: list[tuple[int, int]], gap: int = SMALL_GAP) -> None:
        """Fetch these ``(offset, size)`` ranges ahead of the reads that will ask for them:
        neighbours less than ``gap`` bytes apart in one request, up to ``max_concurrency``
        requests at once."""
        spans: list[list[int]] = []
        for offset, size in sorted(ranges):
            end = min(self.size, offset + size)
            if offset >= end or self._cached_read(end - offset, offset) is not None:
                continue
            if spans and offset - spans[-1][1] <= gap and end - spans[-1][0] <= PART:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([offset, end])
        for (start, _), data in zip(spans, self._map(lambda s: self.fetch(s[0], s[1]), spans)):
            self._keep(start, data)

    def _map(self, fetch: Callable[[list[int]], bytes], spans: list[list[int]]) -> Iterator[bytes]:
        """``fetch`` of each span, in order, with at most ``max_concurrency`` in flight."""
        if len(spans) <= 1 or self.max_concurrency == 1:
            yield from (fetch(s) for s in spans)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="ckptfix-fetch") as pool:
            pending: list[Future[bytes]] = []
            queued = iter(spans)
            try:
                for span in queued:
                    pending.append(pool.submit(fetch, span))
                    if len(pending) >= self.max_concurrency:
                        yield pending.pop(0).result()
                while pending:
                    yield pending.pop(0).result()
            finally:
                for future in pending:
                    future.cancel()

    def plan(self, ranges: list[tuple[int, int]]) -> None:
        """The ``(offset, size)`` ranges a writer is about to read, in its order: from now on they
        are fetched ahead, coalesced (neighbours in that order less than :data:`SMALL_GAP`
        apart, up to :data:`PART` bytes a request) and at most ``max_concurrency`` requests at
        once, and reads are served from them as the writer gets there (:class:`_Readahead`).

        A range of a deferred zip record (see :meth:`defer`) is fetched from the record's local
        header on, to where the next record starts: header, data and descriptor in the same
        requests, neighbours coalesced, however many records there are. Only a range that starts
        far into its record (a slice of a storage) has its header fetched first, on its own."""
        real = self._real_ranges(ranges)
        spans: list[tuple[int, int]] = []
        for offset, end in real:
            end = min(self.size, end)
            if offset < 0 or offset >= end:
                continue
            last = spans[-1] if spans else None
            if last is not None and last[1] <= offset <= last[1] + SMALL_GAP and end - last[0] <= PART:
                spans[-1] = (last[0], end)
                continue
            spans.extend((at, min(end, at + PART)) for at in range(offset, end, PART))
        self._ahead = _Readahead(self, spans) if spans else None

    def _real_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` as ``[start, end)`` of the object (see :meth:`plan`)."""
        deferred = self._deferred
        if deferred is None or all(offset < VIRTUAL for offset, _ in ranges):
            return [(offset, offset + size) for offset, size in ranges]
        late = []  # deferred records read from far into their data: their headers first
        for offset, _ in ranges:
            if offset >= VIRTUAL:
                index, within = deferred.find(offset)
                if within > SMALL_GAP and index not in self._resolved:
                    late.append(index)
        if late:
            self.prefetch([(deferred.span(i)[0], deferred.span(i)[1] + _HEADER_SLACK) for i in late])
            for index in late:
                self._resolve(index)
        real = []
        for offset, size in ranges:
            if offset < VIRTUAL:
                real.append((offset, offset + size))
                continue
            index, within = deferred.find(offset)
            data_offset = self._resolved.get(index)
            if data_offset is not None:
                real.append((data_offset + within, data_offset + within + size))
                continue
            header, head, following = deferred.span(index)
            # the data starts after the header and its extra field (at most 64 KiB): the range
            # ends before the next record in any archive that passes the check
            real.append((header, min(following, header + head + 0xFFFF + within + size)))
        return real

    def defer(self, records: DeferredRecords) -> None:
        """Take ``records`` (a zip's tensor records: their data is addressed from
        :data:`~ckptfix.fileio.ranges.VIRTUAL` until their local headers are read). A read of
        such an address first reads the record's header -- from the planned request that
        holds it, else with one request -- and has the archive check it; no byte of the data
        is handed out before that check passed."""
        self._deferred = records
        self._resolved = {}
        shared = _deferrals.get()
        if shared is not None:
            shared[self.url] = (self.identity, records, self._resolved)

    def _real(self, offset: int) -> int:
        """Where the address ``offset`` is in the object (see :meth:`defer`)."""
        if offset < VIRTUAL:
            return offset
        if self._deferred is None:
            raise RuntimeError(f"{self.url}: a read at an address no zip record was given")
        index, within = self._deferred.find(offset)
        data_offset = self._resolved.get(index)
        if data_offset is None:
            data_offset = self._resolve(index)
        return data_offset + within

    def _resolve(self, index: int) -> int:
        """Read and check a deferred record's local header: its data offset."""
        deferred = self._deferred
        assert deferred is not None
        if self.metadata_only:  # nothing in a metadata-only command reads tensor bytes
            raise RuntimeError(f"{self.url}: a read of tensor bytes in a metadata-only read")
        header, _, _ = deferred.span(index)
        held = self._ahead.peek(header) if self._ahead is not None else None

        def read(offset: int, size: int) -> bytes:
            if held is not None and held[0] <= offset and offset + size <= held[0] + len(held[1]):
                return held[1][offset - held[0] : offset - held[0] + size]
            return self.pread(size, offset)

        data_offset = deferred.resolve(index, read)
        self._resolved[index] = data_offset
        return data_offset

    def read(self, size: int | None = -1) -> bytes:
        """As a file's ``read`` (from :meth:`seek`'s position, which may be a deferred record's
        address: compressed records are inflated through this)."""
        if self._pos < VIRTUAL:
            return super().read(size)
        at = self._real(self._pos)
        left = max(0, self.size - at)
        data = self.pread(left if size is None or size < 0 else min(size, left), at)
        self._pos += len(data)
        return data

    def iter_range(self, offset: int, size: int) -> Iterator[bytes]:
        """``size`` bytes at ``offset`` as parts of at most :data:`PART` bytes, in order, fetched
        concurrently; the caller writes each as it arrives."""
        offset = self._real(offset)
        if offset + size > self.size:
            raise BadInputError(f"{self.url}: the object ended inside tensor data (truncated?)")
        ahead = self._ahead
        while ahead is not None and size > 0:
            piece = ahead.take(offset, size)
            if piece is None:
                break
            yield piece
            offset, size = offset + len(piece), size - len(piece)
        if size == 0:
            return
        if size < WINDOW:
            yield self.pread(size, offset)
            return
        spans = [[at, min(offset + size, at + PART)] for at in range(offset, offset + size, PART)]
        yield from self._map(lambda s: self.fetch(s[0], s[1]), spans)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        super().close()

    def check_unchanged(self) -> None:
        """The object must still be the one first opened (size, ETag, version)."""
        info = _info(self.fs, self._path, self.url)
        now = _identity(info)
        if not _same(self.identity, now):
            raise BadInputError(
                f"{self.url}: the object changed while it was being read ({_change(self.identity, now)}); "
                "nothing written"
            )


def _is_range(answered: str, start: int, end: int, size: int) -> bool:
    """Whether a ``Content-Range`` answer is ``bytes start-(end-1)/size`` (or ``/*``)."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", answered.strip())
    if match is None:
        return False
    first, last, total = match.groups()
    return (int(first), int(last)) == (start, end - 1) and total in ("*", str(size))


async def _s3_range(fs: Any, path: str, start: int, end: int) -> tuple[bytes, str | None]:
    """A ranged GetObject through s3fs (its retries, its error translation), keeping the
    ``ContentRange`` that ``cat_file`` drops."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
    body = response["Body"]
    try:
        data = await body.read()
    finally:
        body.close()
    return data, response.get("ContentRange") or "(none)"


async def _http_range(fs: Any, url: str, start: int, end: int) -> tuple[bytes, str | None]:
    """A ranged GET through fsspec's http session, keeping the ``Content-Range`` (a server that
    ignores the range answers 200 and the whole object: that is said as its range)."""
    options = dict(fs.kwargs)
    headers = {**options.pop("headers", {}), "Range": f"bytes={start}-{end - 1}"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **options) as response:
        data = await response.read()
        fs._raise_not_found_for_status(response, url)
        if response.status != 206:
            return data, f"the whole object ({response.status}, {len(data)} bytes)"
        return data, response.headers.get("Content-Range", "(none)")


#: ranged GETs that show which range the server sent, by fsspec file system class
_RANGE_GETTERS = {"S3FileSystem": _s3_range, "HTTPFileSystem": _http_range}


class _Readahead:
    """Planned spans of one object fetched ahead of a writer that reads them in order.

    At most ``max_concurrency`` spans are in flight or waiting to be read, so memory stays at
    that many :data:`PART` s whatever the checkpoint's size. A read is served from the span
    that holds it; spans before that one are done with (the writer went past them) and make
    room for the next. A read the plan does not hold gets None: the caller fetches it itself.
    """

    def __init__(self, source: RemoteFile, spans: list[tuple[int, int]]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._source = source
        self._spans = iter(spans)
        self._pool = ThreadPoolExecutor(source.max_concurrency, thread_name_prefix="ckptfix-ahead")
        self._window: list[tuple[int, int, Future[bytes]]] = []
        self._fill()

    def _fill(self) -> None:
        while len(self._window) < self._source.max_concurrency:
            span = next(self._spans, None)
            if span is None:
                return
            start, end = span
            self._window.append((start, end, self._pool.submit(self._source.fetch, start, end)))

    def peek(self, offset: int) -> tuple[int, bytes] | None:
        """(start, bytes) of the planned span holding ``offset``, if it is in the window, leaving
        it there (a deferred record's header, checked before its data is taken)."""
        for start, end, future in self._window:
            if start <= offset < end:
                return start, future.result()
        return None

    def take(self, offset: int, size: int) -> bytes | None:
        """Up to ``size`` bytes at ``offset`` from the span holding ``offset``, if planned."""
        for i, (start, end, future) in enumerate(self._window):
            if start <= offset < end:
                data = future.result()
                piece = data[offset - start : min(end, offset + size) - start]
                # spans before this one are passed; this one too once its last byte is read
                done = i + 1 if offset + len(piece) >= end else i
                for _, _, passed in self._window[:done]:
                    passed.cancel()
                del self._window[:done]
                self._fill()
                return piece
        return None

    def close(self) -> None:
        for _, _, future in self._window:
            future.cancel()
        self._window.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def open_url(url: str) -> tuple[RemoteFile, int]:
    """Open a remote object for ranged reads: (the file, its size); what ``open_input`` is for
    a local path."""
    f = RemoteFile(url)
    return f, f.size


class RemotePath:
    """The part of :class:`pathlib.Path` the folder and shard-index readers use, for a URL
    (``s3://bucket/model/`` and the objects below it). Paths join with ``/``; nothing is a
    symlink."""

    def __init__(self, url: str) -> None:
        scheme, _, rest = url.partition("://")
        self._scheme = scheme
        self._rest = rest.rstrip("/") or rest

    def __str__(self) -> str:
        return f"{self._scheme}://{self._rest}"

    __fspath__ = __str__

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:  # sorted() listings, as of Paths
        return str(self) < str(other)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self}/{name}")

    @property
    def name(self) -> str:
        return posixpath.basename(self._rest)

    @property
    def parent(self) -> RemotePath:
        parent = posixpath.dirname(self._rest)
        return RemotePath(f"{self._scheme}://{parent}") if parent else self

    def _info(self) -> dict[str, Any] | None:
        fs, path = filesystem(str(self))
        try:
            info = cast(dict[str, Any], fs.info(path))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _remote_error(str(self), exc) from None
        if info.get("type") != "directory":  # a folder's reader asks whether a file is there, then opens it
            _just_statted.info = (str(self), info)
        return info

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") != "directory"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def exists(self) -> bool:
        return self._info() is not None

    def is_symlink(self) -> bool:
        return False

    def unlink(self, missing_ok: bool = False) -> None:
        """Remove the object (a folder write that failed removes the shards it committed)."""
        fs, path = filesystem(str(self))
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        except Exception as exc:
            raise CannotWriteError(f"{self}: cannot remove: {type(exc).__name__}: {exc}") from None

    def stat(self) -> os.stat_result:
        return stat_url(str(self))

    def _listing(self) -> list[Any]:
        """The folder's entries from one ``ls`` (each noted for later opens: size and ETag)."""
        fs, path = filesystem(str(self))
        try:
            entries = fs.ls(path, detail=True)
        except Exception as exc:
            raise _remote_error(str(self), exc) from None
        _note_listing(self._scheme, entries)
        return list(entries)

    def iterdir(self) -> Iterator[RemotePath]:
        entries = self._listing()
        names = [str(e.get("name", "")) if isinstance(e, dict) else str(e) for e in entries]
        for name in sorted(names):
            yield self / posixpath.basename(name.rstrip("/"))

    def file_sizes(self) -> dict[str, int]:
        """The folder's objects (name -> size), from one listing (a DCP folder's items are
        checked against it, and its size summed, without a request per object)."""
        entries = self._listing()
        sizes: dict[str, int] = {}
        for entry in entries:
            if isinstance(entry, dict) and entry.get("type") != "directory" and isinstance(entry.get("size"), int):
                sizes[posixpath.basename(str(entry.get("name", "")).rstrip("/"))] = entry["size"]
        return sizes

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        """The objects at any depth below the folder whose names match ``pattern``, from one
        recursive listing (``scan`` of a DeepSpeed run folder visits every tag's files)."""
        import fnmatch

        fs, path = filesystem(str(self))
        try:
            names = fs.find(path)
        except Exception as exc:
            raise _remote_error(str(self), exc) from None
        base = path.rstrip("/") + "/"
        for name in sorted(str(n) for n in names):
            if name.startswith(base) and fnmatch.fnmatchcase(posixpath.basename(name), pattern):
                yield self / name[len(base) :]

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        import fnmatch

        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))


def as_path(path: str | os.PathLike[str]) -> Path:
    """A local path as a :class:`Path`; a URL as a :class:`RemotePath` (typed as a Path: it
    answers the few questions the folder, shard-index and batch code ask of one)."""
    if isinstance(path, RemotePath):
        return cast(Path, path)
    text = os.fspath(path)
    return cast(Path, RemotePath(text)) if is_url(text) else Path(text)


def local_or_remote(path: str | os.PathLike[str]) -> Path:
    """Where ``path``'s bytes live: a local path, and a ``file://`` (or ``local://``) URL's local
    path, as a :class:`Path` (so two spellings of one file compare by device and inode); any
    other URL as a :class:`RemotePath` (an object has one name: URLs compare as text)."""
    text = os.fspath(path)
    if not is_url(text):
        return Path(text)
    if scheme_of(text) in ("file", "local"):
        return Path(filesystem(text)[1])
    return cast(Path, RemotePath(text))


# ---------------------------------------------------------------------------- outputs
#: part size of a multipart upload (S3's minimum part is 5 MiB)
UPLOAD_PART = 1 << 23


def _exists(fs: Any, path: str, url: str) -> bool:
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise CannotWriteError(f"{url}: cannot check the destination: {type(exc).__name__}: {exc}") from None


def refuse_existing(url: str) -> None:
    """An existing object (or folder) at ``url`` is refused, as an existing local OUT is."""
    fs, path = filesystem(url)
    if _exists(fs, path.rstrip("/"), url):
        raise CannotWriteError(f"{url}: already exists", hint="pass --force to overwrite it")


def _staged_files(local: Path) -> list[Path]:
    """What was written under ``local`` (a file, or a folder's files), an index file last: a
    folder is complete once its index is there, so the index is uploaded after every shard."""
    if local.is_file():
        return [local]
    if not local.is_dir():
        return []
    files = sorted(p for p in local.rglob("*") if p.is_file())
    return sorted(files, key=lambda p: p.name.endswith(".index.json"))


def _open_upload(fs: Any, path: str, url: str) -> Any:
    """``path`` opened for an upload that commits nothing until :meth:`commit` (an S3 multipart
    upload; a temporary file for ``file://``); storage that cannot hold a write back is refused."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols:  # a local folder must exist (object stores have none to make)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
    if "memory" in protocols:  # its files exist from the moment they are opened: held until commit
        return _HeldUntilCommit(fs, path)
    try:
        return fs.open(path, "wb", autocommit=False, block_size=UPLOAD_PART)
    except (TypeError, NotImplementedError):
        raise UsageError(
            f"{url}: this storage cannot commit a write atomically; write to s3:// or local disk"
        ) from None
    except Exception as exc:
        raise CannotWriteError(f"{url}: cannot write: {type(exc).__name__}: {exc}") from None


def upload_file(local: Path, fs: Any, path: str, url: str) -> None:
    """Copy ``local`` to ``path`` so that the object is either complete or absent: the bytes go
    up as a multipart upload (parts sent as they are read), completed only after the last part
    and aborted on any failure, Ctrl-C included -- never a partial object, never an orphaned
    upload. Filesystems without uncommitted writes (no ``autocommit=False``) are refused."""
    out = _open_upload(fs, path, url)
    try:
        with open(local, "rb") as f:
            while chunk := f.read(UPLOAD_PART):
                out.write(chunk)
        out.close()  # sends the last part; with autocommit off the object does not exist yet
        out.commit()
    except BaseException as exc:
        with suppress(Exception):
            out.discard()  # aborts the multipart upload: its parts are deleted
        if isinstance(exc, Exception) and not isinstance(exc, CkptfixError):
            raise CannotWriteError(f"{url}: upload failed: {type(exc).__name__}: {exc}; nothing written") from None
        raise


#: whether an upload may replace an existing object (``--force``), within :func:`remote_outputs`
_overwrite: ContextVar[bool] = ContextVar("ckptfix_remote_overwrite", default=False)


@contextmanager
def remote_outputs(*, force: bool) -> Iterator[None]:
    """Within this, outputs named by URL (:func:`upload_output`) may replace existing objects
    when ``force``; otherwise an object that appeared while the output was written is refused
    before the upload is committed (the command refused an existing one before reading)."""
    token = _overwrite.set(force)
    try:
        yield
    finally:
        _overwrite.reset(token)


class _HeldUntilCommit(io.BytesIO):
    """An upload to ``memory://``, whose files appear when opened (fsspec's memory file system
    ignores ``autocommit``): the bytes are held here and stored at :meth:`commit` (they are in
    memory either way)."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        pass  # the bytes are kept for commit

    def commit(self) -> None:
        self._fs.pipe_file(self._path, self.getvalue())
        super().close()

    def discard(self) -> None:
        super().close()


class _UploadStream(io.RawIOBase):
    """What a writer writes an upload through: bytes go into the upload's current part, sent as
    soon as it holds :data:`UPLOAD_PART` bytes (memory stays at about one part); no ``seek``,
    no ``fileno`` (so tensor bytes of a local input are streamed through it, not copied by the
    kernel). A failure to send is :class:`CannotWriteError` (exit 4)."""

    def __init__(self, out: Any, url: str) -> None:
        super().__init__()
        self._out, self._url = out, url
        self._offset = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            self._out.write(data)
        except Exception as exc:
            raise _upload_failed(self._url, exc) from None
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._offset += size
        return size

    def tell(self) -> int:
        return self._offset


def _upload_failed(url: str, exc: BaseException) -> CannotWriteError:
    return CannotWriteError(f"{url}: upload failed: {type(exc).__name__}: {exc}; nothing written")


@contextmanager
def upload_output(url: str) -> Iterator[BinaryIO]:
    """A stream to write the object ``url`` through, uploaded as it is written: each part of
    :data:`UPLOAD_PART` bytes is sent once written, so memory stays at about one part whatever
    the output's size and no local copy is made; the upload is completed only after the last
    part, when the writer is done, and aborted on any failure or interrupt (Ctrl-C, SIGTERM):
    the object is complete or absent, and no upload is left in progress.

    Every writer here writes front to back -- a zip's sizes and CRCs follow each record in a
    data descriptor, as torch's own writer does (and torch.load reads), a safetensors header is
    planned before the first tensor byte -- so nothing needs to seek back."""
    fs, path = filesystem(url)
    path = path.rstrip("/")
    if not _overwrite.get() and _exists(fs, path, url):  # (an existing OUT was refused before reading)
        raise CannotWriteError(f"{url}: already exists", hint="pass --force to overwrite it")
    out = _open_upload(fs, path, url)
    held = holding()
    try:
        yield cast(BinaryIO, _UploadStream(out, url))
        try:
            out.close()  # sends the last part; with autocommit off the object does not exist yet
            if held is None:
                out.commit()
        except Exception as exc:
            raise _upload_failed(url, exc) from None
    except BaseException:
        with suppress(Exception):
            out.discard()  # aborts the multipart upload: its parts are deleted
        raise
    if held is not None:  # every part is sent; completed when the hold commits (a shard folder's way)
        held.hold(partial(_complete, out, url), out.discard, partial(_delete, fs, path))


def _complete(out: Any, url: str) -> None:
    try:
        out.commit()
    except Exception as exc:
        raise _upload_failed(url, exc) from None


def _delete(fs: Any, path: str) -> None:
    fs.rm_file(path)


@contextmanager
def staged_output(url: str, *, force: bool) -> Iterator[Path]:
    """A local path to write an output for ``url`` to; on a clean exit its file (or its
    folder's files, the index last) are uploaded, each atomically (:func:`upload_file`).

    Without ``force`` an existing object is refused before anything is written or uploaded
    (as for a local OUT). The output is staged in a temporary folder: the writers copy ranges
    by the kernel and seek, which an upload stream cannot take; the upload then streams it.
    If a folder's upload fails part way, the shards already uploaded are removed again, and
    the index (the folder's completion marker) was never written.
    """
    import tempfile

    fs, path = filesystem(url)
    path = path.rstrip("/")
    if not force:
        refuse_existing(url)
    with tempfile.TemporaryDirectory(prefix="ckptfix-upload-") as tmp:
        local = Path(tmp) / (posixpath.basename(path) or "out")
        yield local
        staged = _staged_files(local)
        targets = [(p, path if p == local else f"{path}/{p.relative_to(local).as_posix()}") for p in staged]
        if not force:
            for _, target in targets:
                if _exists(fs, target, url):
                    raise CannotWriteError(f"{url}: {target} already exists", hint="pass --force to overwrite it")
        uploaded: list[str] = []
        try:
            for (p, target), shown in zip(targets, output_urls(url, local, [str(p) for p, _ in targets])):
                upload_file(p, fs, target, shown)
                uploaded.append(target)
        except BaseException:
            for target in uploaded:
                with suppress(Exception):
                    fs.rm_file(target)
            raise


def output_urls(url: str, local: Path, outputs: list[str]) -> list[str]:
    """The URLs of the files a staged write reported (local paths under ``local``)."""
    base = url.rstrip("/")
    found = []
    for out in outputs:
        p = Path(out)
        found.append(base if p == local else f"{base}/{p.relative_to(local).as_posix()}")
    return found
