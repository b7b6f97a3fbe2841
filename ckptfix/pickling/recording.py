"""The pickle VM in recording mode: every global a pickle names, nothing built, nothing refused.

``scan`` reports what these hooks record, and the reader uses them on pickles carried as bytes
inside allowed-by-name objects, so both see exactly what the VM resolves (memo, DUP and POP
juggling included). Besides globals, they record what the reader would refuse as an attempt to
launder an allowed global -- BUILD, APPENDS or SETITEMS on a global, on a torch record or twice
on the same object, a call of something that is not a global -- as a finding named
``<BUILD on torch.FloatStorage>``: ``scan`` calls those dangerous.

Bytes met anywhere in a pickle (call arguments, BUILD state, list or dict items) that are
pickles themselves are recorded too, up to :data:`MAX_NESTED` levels: with a protocol 2-5
header, or without one (protocol 0/1) when what they name are real dotted names.
"""

from __future__ import annotations

import codecs
import mmap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import BadInputError
from ..model.walk import walk
from .globals import danger, resolved_name
from .names import is_dotted_identifier
from .vm import Budgets, Hooks, OverBudget, PickleVM, Unhashed

#: how many pickles-inside-bytes deep the recording goes
MAX_NESTED = 8

Finding = tuple[str, str]  # (global name or "<what the reader refuses>", where)


class Symbol:
    """What a global, a call or a persistent id "is" while recording: a name and a kind."""

    __slots__ = ("built", "kind", "name")

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind, self.built = name, kind, False

    def __repr__(self) -> str:
        return self.name


def protocol2_bytes(args: tuple[Any, ...]) -> bytes | None:
    """``_codecs.encode(text, "latin1"[, errors])``: how protocol 2 spells ``bytes`` (any text
    encoding, as torch's weights-only unpickler calls it); None if it is not that. The reader's
    builder and the recording hooks both use it."""
    if not (1 <= len(args) <= 3 and all(type(a) is str for a in args)):
        return None
    try:
        if not codecs.lookup(args[1] if len(args) > 1 else "utf-8")._is_text_encoding:
            return None  # bytes-to-bytes codecs (zlib, base64...) are not read
        data: bytes = codecs.encode(*args)
        return data
    except (LookupError, ValueError):  # ValueError: an encoding name with a NUL in it (UnicodeError too)
        return None


def looks_like_pickle(data: bytes | bytearray) -> bool:
    """A protocol 2-5 header: how a pickle carried inside another one usually starts."""
    return len(data) > 2 and data[0] == 0x80 and 2 <= data[1] <= 5


class RecordingHooks(Hooks):
    """See the module docstring. ``plain(name)`` says whether a global is one whose results the
    reader builds itself (torch records, Python builtins): those never take BUILD or items."""

    python2_names_always = False  # as CPython: protocols 0-2 only
    max_protocol = 5  # as CPython
    list_arguments = True  # CPython stops there; reading on names more, never fewer

    def __init__(
        self, where: str, found: list[Finding], plain: Callable[[str], bool], depth: int = 0, headerless: bool = False
    ) -> None:
        self.where, self.found, self.plain, self.depth, self.headerless = where, found, plain, depth, headerless
        #: a read ran past a FRAME's end: the other stream semantics must be read too
        self.crossed = False
        # containers and blobs already searched for payloads, by id, with the objects kept alive
        # so an id is never reused: a memoised list passed to 20 000 calls is searched once
        # (searching it per call made the pass quadratic: 61 s for a 180 KB pickle)
        self._searched: dict[int, Any] = {}

    def find_global(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if self.headerless and not is_dotted_identifier(full):
            return Symbol(full, "junk")  # bytes that happen to parse, not a pickle someone wrote
        reached = resolved_name(module, name)  # a dotted name through a module is that module's
        self.found.append((reached if danger(reached) is not None else full, self.where))
        return Symbol(full, "global")

    def _flag(self, what: str) -> None:
        self.found.append((f"<{what}>", self.where))

    def _objectlike(self, target: Any) -> bool:
        """What the reader lets BUILD/APPENDS/SETITEMS touch: an object of an allowed-by-name class."""
        return type(target) is Symbol and target.kind == "call" and not self.plain(target.name)

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        if type(func) is not Symbol or func.kind != "global":
            self._flag(f"a call of {_describe(func)}")
        name = func.name if type(func) is Symbol else "?"
        if name == "collections.OrderedDict" and not args and func.kind == "global":
            return OrderedDict()  # a real one, so BUILD and SETITEMS meet the VM's own checks, as when reading
        if name == "_codecs.encode":
            data = protocol2_bytes(args)
            if data is not None:
                self._payloads(data)
                return data
        self._payloads(args)
        return Symbol(name, "call")

    def new_object(self, cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
        self._payloads(kwargs)
        return self.call(cls, args)

    def build(self, inst: Any, state: Any) -> None:
        if not self._objectlike(inst):
            self._flag(f"BUILD on {_describe(inst)}")
        elif inst.built:
            self._flag(f"a second BUILD on {_describe(inst)}")
        else:
            inst.built = True
        self._payloads(state)

    def extend(self, target: Any, items: list[Any]) -> None:
        if not self._objectlike(target):
            self._flag(f"APPENDS on {_describe(target)}")
        self._payloads(items)

    def set_items(self, target: Any, pairs: list[tuple[Any, Any]]) -> None:
        if not self._objectlike(target):
            self._flag(f"SETITEMS on {_describe(target)}")
        self._payloads(pairs)

    def persistent_load(self, pid: Any) -> Any:
        return Symbol("persistent id", "pid")

    def check_key(self, key: Any) -> None:
        pass  # symbols are hashable; the VM itself refuses unhashable keys

    def costly_key(self, key: Any, why: str) -> Any:
        return Unhashed(key)  # nothing reads a key's identity here: store it unhashed, read on

    def frame_crossed(self, at: int) -> None:
        if not self.crossed:
            self.crossed = True
            self._flag(f"a read at byte {at} across a FRAME end")

    def _payloads(self, value: Any) -> None:
        """Record the pickles hidden in bytes anywhere in ``value``."""
        if self.depth >= MAX_NESTED or value is None:
            return
        searched = self._searched

        def enter(path: Any, node: Any) -> bool:
            if id(node) in searched:
                return False
            searched[id(node)] = node
            return True

        if type(value) in (bytes, bytearray):
            blobs = [value]
        elif id(value) in searched:
            return
        else:
            blobs = [v for _, v in walk(value, enter, leaves=True) if type(v) in (bytes, bytearray)]
        for blob in blobs:
            if id(blob) in searched:
                continue
            searched[id(blob)] = blob
            if len(blob) > 2:
                found, _ = record_globals(
                    bytes(blob),
                    f"{self.where} (nested pickle)",
                    self.plain,
                    self.depth + 1,
                    headerless=not looks_like_pickle(blob),
                )
                self.found.extend(found)


def _describe(value: Any) -> str:
    if type(value) is Symbol:
        return value.name if value.kind != "call" else f"the result of {value.name}"
    return f"a {type(value).__name__}"


def record_globals(
    data: bytes | mmap.mmap,
    where: str,
    plain: Callable[[str], bool],
    depth: int = 0,
    *,
    count: int | None = None,
    headerless: bool = False,
    start: int = 0,
) -> tuple[list[Finding], str]:
    """Findings in ``count`` consecutive pickles (all, if None) from ``data[start:]`` (bytes or
    an mmap); returns them and an error ("" if every pickle read cleanly).

    Without ``count``, stops quietly where the data stops being pickles after at least one
    complete pickle, if the failed attempt named nothing (trailing non-pickle bytes). What a
    pickle named before it turned to garbage is kept: ``pickle.load`` would have run it.

    The pickles are read as CPython reads a ``BytesIO`` (``data.pkl``, nested pickles); if a
    read runs past a FRAME's end -- where a stream with ``peek()`` (a legacy file) or
    ``pickle.loads`` reads on linearly -- they are read linearly too and both findings kept,
    with the crossing itself as a finding. A stop at one of ckptfix's own budgets (CPython
    would read on) is a finding too (``<not read to the end: ...>``): never a clean result.
    """
    found, error, crossed = _record(data, where, plain, depth, count, headerless, start, framed=True)
    if crossed:
        linear, _, _ = _record(data, where, plain, depth, count, headerless, start, framed=False)
        found += [f for f in linear if f not in found]
    return found, error


def _record(
    data: bytes | mmap.mmap,
    where: str,
    plain: Callable[[str], bool],
    depth: int,
    count: int | None,
    headerless: bool,
    start: int,
    *,
    framed: bool,
) -> tuple[list[Finding], str, bool]:
    found: list[Finding] = []
    pos, complete, crossed = start, 0, False
    while pos < len(data) and (count is None or complete < count):
        before = len(found)
        hooks = RecordingHooks(where, found, plain, depth, headerless)
        # nothing here is built for keeps: integers as long as the pickle (CPython has no limit)
        budgets = replace(Budgets.for_length(len(data) - pos), max_long_bytes=len(data))
        vm = PickleVM(data, hooks, budgets, start=pos, framed=framed)
        try:
            vm.run()
        except OverBudget as exc:
            found.append((f"<not read to the end: {str(exc).removeprefix('corrupt or hostile pickle: ')}>", where))
            return found, str(exc), crossed or hooks.crossed
        except BadInputError as exc:
            crossed = crossed or hooks.crossed
            if count is None and (complete or headerless) and len(found) == before:
                return found, "", crossed
            return found, str(exc), crossed
        crossed = crossed or hooks.crossed
        pos = vm.pos
        complete += 1
    if count is not None and complete < count:
        return found, f"only {complete} of the {count} pickles are there (truncated)", crossed
    return found, "", crossed
