"""Where torch's pre-2018 tar reader finds the pickles it runs -- found with Python's own ``tarfile``,
the module torch itself reads them with.

``torch.load`` of any file that is not a zip (``PK\\x03\\x04`` first) and not named ``.safetensors``
first tries ``tarfile.open(fileobj=f, mode="r:", format=PAX_FORMAT)``; if that accepts the first
header (its checksum, its fields: tarfile's rules, not a magic string), torch extracts the members
``storages``, ``tensors`` and ``pickle`` and unpickles them, whatever the file "really" is: a legacy
checkpoint, a safetensors file named ``.bin`` or a plain pickle whose first 512 bytes also form a
tar header. A :class:`tarfile.TarError` raised later (a bad later header, a member cut short)
is caught by torch, which then reads the file from its start as legacy pickles. The layout
returned here says all of that, so a scan can follow torch step by step.
"""

from __future__ import annotations

import mmap
import tarfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import BadInputError
from ..model.dtypes import DTYPE_ITEMSIZE, STORAGE_DTYPE
from ..pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS
from ..pickling.recording import Finding, RecordingHooks, Symbol, record_globals
from ..pickling.vm import PickleVM

#: the members torch reads, in its order
TAR_MEMBERS = ("storages", "tensors", "pickle")


@dataclass(frozen=True)
class TarMember:
    name: str
    start: int
    end: int


@dataclass
class TarLayout:
    """What torch's tar reader would read: ``members`` in order (as far as torch gets);
    ``fallback``: torch then catches a TarError and reads the file from offset 0 as legacy
    pickles; ``stop``: why torch stops before the last member ("" when it reads them all);
    ``problem``: a step ckptfix cannot follow (a link member: torch would read another file)."""

    members: list[TarMember] = field(default_factory=list)
    fallback: bool = False
    stop: str = ""
    problem: str = ""


def open_tar(f: BinaryIO) -> tarfile.TarFile | None:
    """torch's own first step: the tar reader on the file from offset 0, or None where tarfile
    refuses it (a TarError: torch goes on to the legacy reader). Anything else tarfile raises,
    torch.load raises too (it reads nothing): a clear error here."""
    f.seek(0)
    try:
        return tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT)
    except tarfile.TarError:
        return None
    except (ValueError, OverflowError, UnicodeError, EOFError) as exc:
        raise BadInputError(f"torch's tar reader fails on it ({type(exc).__name__}: {exc}); not a checkpoint") from exc


def tar_layout(tar: tarfile.TarFile, file_size: int) -> TarLayout:
    """The members torch extracts and unpickles, as byte ranges of the file (see the module doc)."""
    layout = TarLayout()
    try:
        tar.getmembers()  # torch's first extract() reads every header: a bad one is a TarError
    except tarfile.TarError:
        layout.fallback = True
        return layout
    except (ValueError, OverflowError, UnicodeError, EOFError) as exc:
        raise BadInputError(f"torch's tar reader fails on it ({type(exc).__name__}: {exc})") from exc
    for name in TAR_MEMBERS:
        try:
            member = tar.getmember(name)  # the last of that name, as tarfile and torch take it
        except KeyError:
            layout.stop = f"it has no {name!r} member (torch.load stops there with a KeyError)"
            return layout
        if not member.isreg() or member.issparse():
            kind = "sparse file" if member.issparse() else "link or special file"
            layout.problem = f"its {name!r} member is a {kind}: torch would read other bytes through it"
            return layout
        if member.offset_data + member.size > file_size:
            layout.fallback = True  # extracting it hits the end: a TarError torch catches
            return layout
        layout.members.append(TarMember(name, member.offset_data, member.offset_data + member.size))
    return layout


# --------------------------------------------------------------------- following torch's reads


def _plain(name: str) -> bool:
    """Globals whose results the reader builds itself: BUILD or items on them is laundering."""
    return name in TORCH_GLOBALS or name in PYTHON_GLOBALS


class _CannotFollow(Exception):
    """torch's next read depends on a value ckptfix cannot know without running the pickle."""


def _one_pickle(data: bytes | mmap.mmap, pos: int, end: int, where: str, found: list[Finding]) -> tuple[Any, int]:
    """Run one pickle of a tar member as torch's ``pickle_module.load(f)`` would; returns its value
    (symbols for globals and calls) and where the next read starts."""
    vm = PickleVM(data, RecordingHooks(where, found, _plain), start=pos, end=end)
    value = vm.run()
    return value, _after_frames(data, pos, vm.pos, end)


def _after_frames(data: bytes | mmap.mmap, start: int, stop: int, end: int) -> int:
    """Where torch's next raw read starts after a pickle that ran from ``start`` to ``stop``:
    the tar members are read from an unbuffered file (no ``peek()``), from which CPython's C
    unpickler reads each FRAME whole, so a STOP inside a frame leaves the file at the frame's
    end, not after the STOP. Frames follow one another from the PROTO on."""
    pos = start + 2 if data[start : start + 1] == b"\x80" else start
    while pos + 9 <= end and data[pos] == _FRAME_OPCODE:
        frame_end = pos + 9 + int.from_bytes(data[pos + 1 : pos + 9], "little")
        if stop <= frame_end:
            return max(stop, frame_end)
        pos = frame_end
    return stop


_FRAME_OPCODE = 0x95


def _storage_itemsize(args: Any) -> int:
    """torch reads ``key, location, storage_type = args`` and takes the element size from the
    storage class's *name* (any module): ``torch.serialization.StorageType``."""
    if type(args) is tuple and len(args) == 3 and type(args[2]) is Symbol and args[2].kind == "global":
        dtype = STORAGE_DTYPE.get(args[2].name.rsplit(".", 1)[-1])
        if dtype is not None and dtype in DTYPE_ITEMSIZE and args[2].name.rsplit(".", 1)[-1] != "UntypedStorage":
            return DTYPE_ITEMSIZE[dtype]
    raise _CannotFollow("a storage record that does not name a storage class")


def _raw(data: bytes | mmap.mmap, pos: int, size: int, end: int) -> int:
    if pos + size > end:
        raise EOFError
    return pos + size


def _scan_tar_member(data: bytes | mmap.mmap, member: TarMember, found: list[Finding]) -> None:
    """Every pickle torch's ``legacy_load`` unpickles from one member, following the raw records
    between them exactly as torch reads them (storage sizes, tensor shapes)."""
    where = f"tar member {member.name}"
    pos, end = member.start, member.end
    count, pos = _one_pickle(data, pos, end, where, found)
    if member.name == "pickle":
        return
    if type(count) is not int:
        raise _CannotFollow(f"its {member.name} count is {type(count).__name__}, not an int")
    for _ in range(count):
        if pos >= end:
            raise EOFError  # torch's next pickle.load ends in EOFError: nothing more is unpickled
        args, pos = _one_pickle(data, pos, end, where, found)
        if member.name == "storages":
            itemsize = _storage_itemsize(args)
            numel = int.from_bytes(data[pos : _raw(data, pos, 8, end)], "little", signed=True)
            pos = _raw(data, pos + 8, numel * itemsize, end) if numel >= 0 else end + 1
            if pos > end:
                raise EOFError
        else:  # tensors: int32 ndim, 4 bytes, ndim sizes, ndim strides, the offset (int64s)
            ndim = int.from_bytes(data[pos : _raw(data, pos, 4, end)], "little", signed=True)
            if ndim < 0:
                raise EOFError  # struct.unpack of a negative count fails: torch stops
            pos = _raw(data, pos, 8 + 16 * ndim + 8, end)
    if member.name == "storages":
        _one_pickle(data, pos, end, where, found)  # the storage views


def record_tar(f: BinaryIO, data: bytes | mmap.mmap, size: int) -> tuple[list[Finding], str]:
    """Every global (and laundering attempt) in the pickles torch's tar reader unpickles, as the
    recording VM names them, and the error that keeps the file from being called clean (a
    tar-era file is never read safely): scan's verdicts, and ``--unsafe-load``'s refusal to hand
    a hostile one to torch, come from here."""
    found: list[Finding] = []
    return found, _record_tar(f, data, size, found)


def _record_tar(f: BinaryIO, data: bytes | mmap.mmap, size: int, found: list[Finding]) -> str:
    tar = open_tar(f)
    if tar is None:  # sniffed as tar a moment ago: the file changed
        return "the file changed while being scanned"
    layout = tar_layout(tar, size)
    error = "tar-era torch file: torch reads it only with weights_only=False (its members were scanned)"
    for member in layout.members:
        try:
            _scan_tar_member(data, member, found)
        except EOFError:
            return error  # torch stops with an error there: nothing further is unpickled
        except _CannotFollow as exc:
            return f"tar member {member.name}: cannot follow torch's reading ({exc}); treat it as unsafe"
        except BadInputError as exc:
            return f"tar member {member.name}: {exc}"
    if layout.problem:
        return f"{layout.problem}; treat it as unsafe"
    if layout.fallback:
        # torch catches the TarError and reads the file from its start as legacy pickles
        more, bad = record_globals(data, "pickles (torch's fallback after a tar error)", _plain, headerless=True)
        found += more
        return error + (f"; {bad}" if bad else "")
    return error + (f" ({layout.stop})" if layout.stop else "")
