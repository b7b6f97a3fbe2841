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

import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO

from ..errors import BadInputError

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
