"""The pickle VM: one opcode table, run over a ``memoryview`` of the pickle, with budgets.

Everything ckptfix learns from a pickle -- the tree it reads, the globals ``scan`` reports,
the header pickles of the legacy format -- comes from this one machine. It never imports or
calls anything: the four places where a pickle could reach code (``GLOBAL``/``STACK_GLOBAL``,
``REDUCE``/``NEWOBJ``, ``BUILD``, persistent ids) go through a :class:`Hooks` object, and
the two hook sets are the reader's (:mod:`ckptfix.unpickle`: an allow-list, inert records)
and the scanner's (:mod:`ckptfix.scan`: record every global, build nothing). So what ``scan``
reports is exactly what the reader meets, by construction.

Why not :class:`pickle.Unpickler`: its C version grows its memo as an array (one
``LONG_BINPUT 700000000`` allocates gigabytes), hashes dict keys recursively in C (a tuple
nested 500 000 deep as a key kills the process with SIGSEGV), lets ``BUILD`` mutate any
object, and reads via one ``read()`` call per opcode in its pure-Python form. Here:

* every length is checked against the bytes that are really left before anything is
  allocated, and reads are slices of a ``memoryview`` (no per-opcode ``read()``);
* :class:`Budgets` bound objects created, memo entries, estimated bytes allocated, integer
  digits and the nesting of hashed keys; exceeding one raises :class:`BadInputError`;
* mutation opcodes (``APPEND(S)``, ``SETITEM(S)``, ``ADDITEMS``) act on the plain containers
  the VM made itself; on anything else they go to the hooks, which refuse all but a few
  record types. A record handed out can therefore not be changed by a later opcode.
* malformed input is recognised explicitly (truncation, stack underflow, bad memo index,
  unhashable keys...) and raised as :class:`BadInputError`; any other exception is a bug in
  ckptfix and surfaces as one (exit 5), so the fuzzer can find it.

The semantics (what a port -- the native core -- must do the same; each point is tested against
CPython 3.11's ``_pickle.c`` or torch's ``_weights_only_unpickler`` through the oracle):

Reading the bytes. CPython's C unpickler reads a stream without ``peek()`` -- torch hands it
``data.pkl`` and nested ``_load_from_bytes`` pickles as a ``BytesIO`` -- through a buffer that,
after a FRAME, holds exactly that frame. ``framed=True`` (the default) follows it:

* a fixed-size read (an opcode's argument or length, a string's bytes) that fits in the frame is
  taken there; one that starts inside the frame and runs past its end is taken whole from the
  bytes *after* the frame, and the frame's rest is dropped;
* ``BINBYTES``/``SHORT_BINBYTES``/``BINBYTES8``/``BYTEARRAY8`` data is read through the frame's
  end linearly (C ``ReadInto``: the frame's rest, then the stream);
* a text line (``INT``, ``GLOBAL``...) not ending inside the frame is dropped there and read from
  after the frame; lines have no length limit (a line costs its bytes in the allocation budget);
* a ``FRAME`` inside a frame that fits in the frame's rest changes nothing; one that does not
  is read from after the outer frame (the rest dropped); zero-length frames and frames in any
  protocol are read the same way; a ``STOP`` leaves the next pickle to start after its frame.

``framed=False`` reads linearly (``pickle.loads``, and a buffered file with ``peek()`` -- legacy
files, DCP's ``.metadata`` -- whose reading through a frame's end depends on where its 8 KiB
buffer happens to end). Every point where the two differ is reported to
:meth:`Hooks.frame_crossed`: the reader refuses (torch's weights-only unpickler reads no FRAME at
all, so this refuses nothing it loads); the recorder reads the pickle both ways, keeps both sets
of globals and reports the crossing as a dangerous finding (no pickler writes one).

Text opcodes, as C parses the NUL-terminated line (:func:`int_text` and friends): ``INT`` is
``strtol(text, 0)`` (``010`` is 8, ``0x10`` 16; ``I01``/``I00`` and any other two-character
line reading 0 or 1 are bools) falling back to ``int(text, 0)``; ``LONG`` drops one ``L`` and
is ``int(text, 0)`` (``010L`` is refused); ``PUT``/``GET`` are ``int(text, 10)``; ``FLOAT``
takes no blanks or underscores and refuses overflow; bytes after a NUL are not seen.
Decimal integers of more than 4300 digits are refused, as CPython refuses them.

Stack and names. ``STOP`` returns the top of the stack whatever is under it (open MARKs, extra
items: CPython does not check). ``READONLY_BUFFER`` leaves bytes as they are (a bytearray
becomes its bytes). Python 2 names (``_compat_pickle``) are renamed in protocols 0-2 only for
the recorder (CPython's ``fix_imports``) and always for the reader (torch's weights-only
unpickler); ``torch.tensor`` is ``torch._tensor`` always (torch's own ``find_class``).

Keys. Dict keys and set elements must be hashable. Integers of any size are keys (digits are
bounded where they are parsed, as CPython bounds them). Hashing work is budgeted, not only
allocation: at most :data:`MAX_SHARED_HASH` distinct keys per hash (40 000 colliding ints,
floats, complex numbers or tuples made CPython's dict quadratic: minutes), a total of atoms
hashed proportional to the pickle's length, tuple/frozenset keys at most
:data:`MAX_KEY_NESTING` deep. Past one of those the reader refuses and the recorder keeps the
key unhashed (:class:`Unhashed`) and reads on. Every limit CPython does not have raises
:class:`OverBudget`; the recorder turns it into a ``<not read to the end: ...>`` finding, which
``scan`` calls dangerous: a pickle scan could not finish is never clean.
"""

from __future__ import annotations

import codecs
import gc
import math
import mmap
import re
import struct
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..errors import BadInputError
from ..model.walk import MAX_NESTING


@dataclass(frozen=True)
class Budgets:
    """Limits on what one pickle may make the VM do; each defaults to far above real checkpoints.

    ``max_objects`` counts containers, strings, numbers and records created; ``max_alloc`` is
    a running estimate of the bytes they occupy (a 1-byte ``EMPTY_DICT`` costs 64); ``None``
    means "derive from the pickle's length" (see :meth:`for_length`).
    """

    max_objects: int = 1 << 27
    max_alloc: int = 8 << 30
    max_memo: int = 1 << 27
    max_int_digits: int = 4300
    max_long_bytes: int = 1 << 20
    max_depth: int = MAX_NESTING

    @classmethod
    def for_length(cls, length: int) -> Budgets:
        """Budgets proportional to a pickle of ``length`` bytes: a real ``data.pkl`` spends
        about 8 bytes of pickle per object and makes about 6 bytes of Python objects per byte."""
        return cls(
            max_objects=min(cls.max_objects, (1 << 16) + length),
            max_alloc=min(cls.max_alloc, (64 << 20) + 32 * length),
            max_memo=min(cls.max_memo, (1 << 16) + length),
        )


class Hooks:
    """What the VM asks when a pickle wants code: subclasses decide (allow-list or record)."""

    #: the machine running these hooks (set by :class:`PickleVM`), for its key checks
    vm: PickleVM
    #: map Python 2 names (``__builtin__``, ``commands``...) in every protocol, as torch's weights-only
    #: unpickler does; False: only in protocols 0-2, as CPython's unpickler does
    python2_names_always = True
    #: the highest PROTO accepted: torch's weights-only unpickler takes any (with a warning), CPython 5
    max_protocol = 255
    #: REDUCE / NEWOBJ with a list of arguments: torch's weights-only unpickler calls func(*list)
    list_arguments = True

    def find_global(self, module: str, name: str) -> Any:
        raise NotImplementedError

    def call(self, func: Any, args: tuple[Any, ...]) -> Any:
        """REDUCE: ``func(*args)``."""
        raise NotImplementedError

    def new_object(self, cls: Any, args: tuple[Any, ...], kwargs: dict[Any, Any] | None) -> Any:
        """NEWOBJ / NEWOBJ_EX: ``cls.__new__(cls, *args, **kwargs)``."""
        raise NotImplementedError

    def make_frozenset(self, items: list[Any]) -> Any:
        """FROZENSET (protocol 4): what CPython builds; the reader's hooks say otherwise."""
        try:
            return frozenset(items)
        except TypeError:
            raise BadInputError("corrupt or hostile pickle: an unhashable set element") from None

    def build(self, inst: Any, state: Any) -> None:
        """BUILD on something that is not a plain OrderedDict."""
        raise NotImplementedError

    def persistent_load(self, pid: Any) -> Any:
        raise NotImplementedError

    def extend(self, target: Any, items: list[Any]) -> None:
        """APPEND(S) on something that is not a list."""
        raise BadInputError(f"corrupt or hostile pickle: APPENDS on a {type(target).__name__}")

    def set_items(self, target: Any, pairs: list[tuple[Any, Any]]) -> None:
        """SETITEM(S) on something that is not a dict."""
        raise BadInputError(f"corrupt or hostile pickle: SETITEMS on a {type(target).__name__}")

    def check_key(self, key: Any) -> None:
        """A dict key or set element the VM does not know (a record): hashable records only."""
        raise BadInputError(f"corrupt or hostile pickle: a {type(key).__name__} used as a dict key")

    def frame_crossed(self, at: int) -> None:
        """A read at byte ``at`` runs past the end of its FRAME, or a STOP leaves bytes in it: CPython's
        readings differ by stream (see the module docstring). The reader refuses (torch's weights-only
        unpickler reads no FRAME at all); the recorder notes it and reads on."""
        raise _bad(f"a read at byte {at} runs past the end of its FRAME (CPython reads such a pickle two ways)")

    def costly_key(self, key: Any, why: str) -> Any:
        """A key past a hashing budget (:meth:`PickleVM.check_key`): the reader refuses; the recorder
        stores it unhashed and reads on."""
        raise over_limit(why)


_ATOMS = frozenset({str, int, float, bool, type(None), bytes, complex})
_UNHASHABLE = frozenset({list, dict, set, bytearray, OrderedDict})
#: dict keys and set elements nest far less than values: CPython hashes, compares and repr()s
#: a nested tuple recursively in C, so a 990-deep key inside the 1000 limit still crashes repr
MAX_KEY_NESTING = 100
#: distinct dict keys (or set elements) one hash may stand for: beyond, inserting is quadratic
MAX_SHARED_HASH = 32
_NOTHING = object()


class _SharedHash(list[Any]):
    """The distinct keys seen with one hash (a type of its own: a key may be a list-like record)."""


class OverBudget(BadInputError):
    """A limit of ckptfix's own, which CPython does not have: CPython would read on. The recorder
    therefore never reports a pickle it stopped on for this as clean."""


class Unhashed:
    """A dict key the recorder stores by identity instead of hashing it (too deep, or flooding)."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _bad(what: str) -> BadInputError:
    return BadInputError(f"corrupt or hostile pickle: {what}")


class TruncatedPickleError(BadInputError):
    """A pickle whose data ends before it does: the one refusal a longer read of the same file
    could change (the legacy reader reads a growing head of the file; any other error is final)."""


def _truncated(what: str) -> TruncatedPickleError:
    return TruncatedPickleError(f"corrupt or hostile pickle: {what}")


# --------------------------------------------------------------------------- text opcodes, as C reads them
# CPython's C unpickler hands a text opcode's line (with its newline, NUL-terminated) to C
# functions: whatever follows a NUL byte is not seen, and each opcode has its own parser.

_C_SPACE = frozenset(b" \t\n\v\f\r")
_DIGITS = {8: frozenset(b"01234567"), 10: frozenset(b"0123456789"), 16: frozenset(b"0123456789abcdefABCDEF")}
_FLOAT_TEXT = re.compile(rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity|nan))")


def _c_string(raw: bytes) -> bytes:
    """What C sees of a line: up to its first NUL (the newline, ``raw`` lacks, is whitespace)."""
    cut = raw.find(b"\0")
    return raw if cut < 0 else raw[:cut]


def _strtol(text: bytes) -> int | None:
    """C ``strtol(text, &end, 0)`` for a 64-bit long, when it reads all of ``text`` without
    overflow (None otherwise: the C unpickler then falls back to ``int(text, 0)``)."""
    i, n = 0, len(text)
    while i < n and text[i] in _C_SPACE:
        i += 1
    sign = 1
    if i < n and text[i] in b"+-":
        sign = -1 if text[i] == 45 else 1
        i += 1
    base = 10
    if text[i : i + 2] in (b"0x", b"0X") and i + 2 < n and text[i + 2] in _DIGITS[16]:
        base, i = 16, i + 2
    elif text[i : i + 1] == b"0":
        base = 8
    digits = _DIGITS[base]
    j = i
    while j < n and text[j] in digits:
        j += 1
    if j == i:  # no digits: C's end pointer stays at the start, fine only where the text is empty
        return 0 if not text else None
    if j != n:
        return None
    significant = text[i:j].lstrip(b"0")
    if len(significant) > 24:
        return None  # overflow
    value = sign * int(significant or b"0", base)
    return value if -(1 << 63) <= value < 1 << 63 else None


def _py_int(text: bytes, base: int) -> int:
    """``PyLong_FromString(text, NULL, base)`` (what ``int(bytes, base)`` runs, digit limit included)."""
    try:
        return int(text, base)
    except ValueError:
        raise _bad("a malformed integer (or one of more than 4300 decimal digits)") from None


def int_text(raw: bytes) -> int | bool:
    """INT: ``strtol`` base 0 (``010`` is 8, ``0x10`` is 16), ``int(text, 0)`` where it stops early
    or overflows; a two-character line reading 0 or 1 (``00``, ``01``, `` 1``, ``+1``) is a bool."""
    if not raw:
        raise _truncated("it ends early (truncated)")
    text = _c_string(raw)
    value = _strtol(text)
    if value is None:
        return _py_int(text if len(text) < len(raw) else raw + b"\n", 0)
    return bool(value) if len(raw) == 2 and value in (0, 1) else value


def long_text(raw: bytes) -> int:
    """LONG: one trailing ``L`` dropped, then ``int(text, 0)`` (``010L`` is refused, ``0x10L`` is 16)."""
    if not raw:
        raise _truncated("it ends early (truncated)")
    return _py_int(_c_string(raw[:-1] if raw[-1:] == b"L" else raw + b"\n"), 0)


def index_text(raw: bytes) -> int:
    """PUT / GET: ``int(text, 10)`` (leading zeros, blanks and underscores allowed), not negative."""
    if not raw:
        raise _truncated("it ends early (truncated)")
    text = _c_string(raw)
    value = _py_int(text if len(text) < len(raw) else raw + b"\n", 10)
    if value < 0:
        raise _bad("a negative memo index")
    return value


def float_text(raw: bytes) -> float:
    """FLOAT: ``PyOS_string_to_double`` -- no blanks, no underscores; overflow is an error."""
    if not raw:
        raise _truncated("it ends early (truncated)")
    text = _c_string(raw)
    if _FLOAT_TEXT.fullmatch(text) is None:
        raise _bad("a malformed float")
    value = float(text)
    if math.isinf(value) and text.lstrip(b"+-")[:1] not in (b"i", b"I"):
        raise _bad("a float too large")
    return value


def over_limit(what: str) -> OverBudget:
    return OverBudget(f"corrupt or hostile pickle: {what}")


def over_budget(objects: int, alloc: int) -> BadInputError:
    return over_limit(
        f"it creates {objects} objects ({alloc >> 20} MiB): more than this pickle's size allows "
        "(a pickle bomb, or a checkpoint far larger than any real one)"
    )


class PickleVM:
    """Runs one pickle from ``data[start:]`` to its STOP. See the module docstring."""

    def __init__(
        self,
        data: bytes | mmap.mmap,
        hooks: Hooks,
        budgets: Budgets | None = None,
        start: int = 0,
        end: int | None = None,
        *,
        fast: bool = True,
        framed: bool = True,
    ) -> None:
        # bytes or a read-only mmap: both index to ints, slice to bytes and have find()
        self.data = data
        self.hooks = hooks
        hooks.vm = self
        self.pos = start
        self.end = len(data) if end is None else end
        self.budgets = budgets or Budgets.for_length(self.end - start)
        self.proto = 0
        self._key_weights: dict[int, tuple[int, int, Any]] = {}
        self._hashes: dict[int, Any] = {}  # hash -> the distinct key (or _SharedHash of keys) seen with it
        self._key_work = 0
        self._max_key_work = (1 << 22) + 16 * (self.end - start)
        #: True: read as a BytesIO without peek() (how torch reads data.pkl); False: linearly
        self.framed = framed
        #: False: run every opcode through the table (the reference the fast loop is tested against)
        self.fast = fast

    # ------------------------------------------------------------------ budget helpers
    def check_key(self, key: Any) -> Any:
        """The key to store for ``key`` (a dict key or set element): it must be hashable, hash
        without recursing deeper than :data:`MAX_KEY_NESTING` (CPython hashes, compares and
        prints nested tuples recursively in C) and share its hash with at most
        :data:`MAX_SHARED_HASH` other distinct keys (a dict of colliding keys is quadratic: 40 000
        of them take minutes). Past those budgets the hooks decide (:meth:`Hooks.costly_key`)."""
        kind = type(key)
        if kind is str or kind is bytes:
            return key  # hashes are salted per process: no file can make them collide
        if kind is tuple or kind is frozenset:
            weight = self._key_weight(key)
            if weight < 0:
                return self.hooks.costly_key(key, f"a dict key or set element nested more than {MAX_KEY_NESTING} deep")
        elif kind in _ATOMS:
            weight = 1 + (key.bit_length() >> 6 if kind is int else 0)
        elif kind in _UNHASHABLE:
            raise _bad(f"an unhashable dict key or set element (a {kind.__name__})")
        else:
            self.hooks.check_key(key)
            return key
        self._key_work += weight
        if self._key_work > self._max_key_work:
            return self.hooks.costly_key(key, "its dict keys take more hashing than its size allows")
        return self._count_hash(key)

    def _count_hash(self, key: Any) -> Any:
        h = hash(key)
        seen = self._hashes.get(h, _NOTHING)
        if seen is _NOTHING:
            self._hashes[h] = key
            return key
        if type(seen) is not _SharedHash:
            if seen is key or seen == key:
                return key
            self._hashes[h] = _SharedHash((seen, key))
            return key
        for other in seen:
            if other is key or other == key:
                return key
        if len(seen) >= MAX_SHARED_HASH:
            why = f"more than {MAX_SHARED_HASH} distinct dict keys share one hash (hash flooding)"
            return self.hooks.costly_key(key, why)
        seen.append(key)
        return key

    def _key_weight(self, key: tuple[Any, ...] | frozenset[Any]) -> int:
        """Atoms in ``key`` (its hashing work), or -1 if it nests deeper than allowed. Both are
        cached per tuple/frozenset, so a key built level by level (each level a key itself)
        still has its whole depth counted."""
        known = self._key_weights  # id -> (depth, weight, the key: kept alive so ids stay unique)
        found = known.get(id(key))
        if found is None:
            found = self._weigh_level(key)
            if found is None:
                self._walk_key(key)
                found = known[id(key)]
        return -1 if found[0] > MAX_KEY_NESTING else found[1]

    def _weigh_level(self, key: tuple[Any, ...] | frozenset[Any]) -> tuple[int, int, Any] | None:
        """:meth:`_walk_key`'s last step alone, for a key whose nested keys are all known (a key
        built level by level: each level was a key itself) and whose other items are atoms;
        None for any other key, which the walk then takes. Saves the walk's stack per level."""
        known = self._key_weights
        depth, weight = 1, 1
        for v in key:
            kind = type(v)
            if kind is tuple or kind is frozenset:
                inner = known.get(id(v))
                if inner is None:
                    return None
                if inner[0] >= depth:
                    depth = inner[0] + 1
                weight += inner[1]
            elif kind in _ATOMS:
                weight += 1 + (v.bit_length() >> 6 if kind is int else 0)
            else:
                return None
        found = known[id(key)] = (min(depth, MAX_KEY_NESTING + 1), weight, key)
        return found

    def _walk_key(self, key: tuple[Any, ...] | frozenset[Any]) -> None:
        known = self._key_weights
        too_deep = MAX_KEY_NESTING + 1
        stack: list[tuple[Any, int, bool]] = [(key, 1, False)]  # iterative post-order
        while stack:
            value, level, done = stack.pop()
            if id(value) in known:
                continue
            if done:
                depth, weight = 1, 1
                for v in value:
                    kind = type(v)
                    if kind is tuple or kind is frozenset:
                        inner = known[id(v)]
                        depth, weight = max(depth, 1 + inner[0]), weight + inner[1]
                    else:
                        weight += 1 + (v.bit_length() >> 6 if kind is int else 0)
                known[id(value)] = (min(depth, too_deep), weight, value)
                continue
            if level > MAX_KEY_NESTING:
                known[id(value)] = (too_deep, 1, value)  # not walked further: refused or kept unhashed
                continue
            stack.append((value, level, True))
            for v in value:
                kind = type(v)
                if kind is tuple or kind is frozenset:
                    if id(v) not in known:
                        stack.append((v, level + 1, False))
                elif kind in _UNHASHABLE:
                    raise _bad(f"an unhashable dict key or set element (holding a {kind.__name__})")
                elif kind not in _ATOMS:
                    self.hooks.check_key(v)

    # ------------------------------------------------------------------ the machine
    def run(self) -> Any:
        """Execute opcodes until STOP; return the object STOP pops. ``self.pos`` ends after it."""
        data, end, hooks, budgets = self.data, self.end, self.hooks, self.budgets
        stack: list[Any] = []
        marks: list[int] = [0]  # stack index where each open MARK frame starts; [0] is the base frame
        # the memo: a list while indices come in order (what every pickler writes: 8 bytes per
        # entry instead of ~100 for a dict), a dict for any other index (LONG_BINPUT 700000000
        # costs one entry, not an array of that size)
        memo: list[Any] = []
        memo_sparse: dict[int, Any] = {}
        objects = alloc = 0
        max_objects, max_alloc = budgets.max_objects, budgets.max_alloc
        push = stack.append
        unpack_i = struct.Struct("<i").unpack_from
        unpack_I = struct.Struct("<I").unpack_from
        unpack_H = struct.Struct("<H").unpack_from
        unpack_Q = struct.Struct("<Q").unpack_from
        unpack_d = struct.Struct(">d").unpack_from
        check_key = self.check_key

        def charge(count: int, nbytes: int) -> None:
            nonlocal objects, alloc
            objects += count
            alloc += nbytes
            if objects > max_objects or alloc > max_alloc:
                raise over_budget(objects, alloc)

        max_memo = budgets.max_memo

        # -- the stream: see "Reading the bytes" in the module docstring. ``limit`` is the end
        # of the buffered FRAME while ``pos`` is inside one, else ``end``.
        framed = self.framed
        limit = end

        def take(pos: int, count: int) -> int:
            """Where a fixed-size read of ``count`` bytes at ``pos`` is taken from (``_pickle.c``'s Read)."""
            nonlocal limit
            if pos + count <= limit:
                return pos
            if pos < limit < end:  # the read starts in a frame and runs past its end
                hooks.frame_crossed(pos)
                if framed:
                    pos = limit  # CPython: the frame's rest is dropped, the read comes from after it
            limit = end
            if pos + count > end:
                raise _truncated("it ends early (truncated)")
            return pos

        def take_into(pos: int, count: int) -> int:
            """BINBYTES and friends (``_pickle.c``'s ReadInto): the frame's rest, then the stream: linear."""
            nonlocal limit
            if pos + count > limit:
                limit = end
                if pos + count > end:
                    raise _truncated("it ends early (truncated)")
            return pos

        def pop_mark() -> list[Any]:
            if len(marks) == 1:
                raise _bad("no MARK on the stack")
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            return items

        def top() -> Any:
            if len(stack) <= marks[-1]:
                raise _bad("stack underflow")
            return stack[-1]

        def pop() -> Any:
            if len(stack) <= marks[-1]:
                raise _bad("stack underflow")
            return stack.pop()

        def line(pos: int) -> tuple[bytes, int]:
            """A text opcode's line without its newline (``_pickle.c``'s Readline): a line not
            ending inside the buffered frame is dropped there and read from after the frame."""
            nonlocal limit
            if pos < limit < end:
                stop = data.find(b"\n", pos, limit)
                if stop >= 0:
                    return data[pos:stop], stop + 1
                hooks.frame_crossed(pos)
                if framed:
                    pos = limit
            limit = end
            stop = data.find(b"\n", pos, end)
            if stop < 0:
                raise _truncated("a text opcode without its newline (truncated)")
            charge(0, stop - pos)
            return data[pos:stop], stop + 1

        def push_str(raw: Any, encoding: str = "utf-8") -> None:
            try:
                value = str(raw, encoding, "surrogatepass")
            except UnicodeDecodeError:
                raise _bad("a string that is not valid UTF-8") from None
            charge(1, 49 + len(raw))
            push(value)

        def push_bytes(pos: int, size: int) -> int:
            pos = take_into(pos, size)
            charge(1, 33 + size)
            push(bytes(data[pos : pos + size]))
            return pos + size

        # -- protocol / framing
        def op_proto(pos: int) -> int:
            pos = take(pos, 1)
            self.proto = data[pos]
            if self.proto > hooks.max_protocol:
                raise _bad(f"unsupported pickle protocol {self.proto}")
            return pos + 1

        def op_frame(pos: int) -> int:
            nonlocal limit
            pos = take(pos, 8)
            (size,) = unpack_Q(data, pos)
            pos += 8
            if pos + size <= limit < end:
                return pos  # inside the buffered frame: CPython reads nothing new
            if pos < limit < end:  # runs past the buffered frame: read from after it
                hooks.frame_crossed(pos - 9)
                if framed:
                    pos = limit
            if size > end - pos:
                raise _truncated("a frame longer than the data (truncated)")
            limit = pos + size
            return pos

        def op_stop(pos: int) -> int:
            # CPython returns the top of the stack: an open MARK or items under it do not matter
            if len(stack) <= marks[-1]:
                raise _bad("STOP with an empty stack")
            if pos < limit < end:  # a frame's rest: a BytesIO reader's next pickle starts after it
                hooks.frame_crossed(pos - 1)
                if framed:
                    pos = limit
            return -pos - 1

        # -- constants
        def op_none(pos: int) -> int:
            push(None)
            return pos

        def op_true(pos: int) -> int:
            push(True)
            return pos

        def op_false(pos: int) -> int:
            push(False)
            return pos

        def op_binint(pos: int) -> int:
            pos = take(pos, 4)
            push(unpack_i(data, pos)[0])
            return pos + 4

        def op_binint1(pos: int) -> int:
            pos = take(pos, 1)
            push(data[pos])
            return pos + 1

        def op_binint2(pos: int) -> int:
            pos = take(pos, 2)
            push(unpack_H(data, pos)[0])
            return pos + 2

        def op_int(pos: int) -> int:  # protocol 0: also True/False as "01"/"00"
            raw, pos = line(pos)
            push(int_text(raw))
            return pos

        def op_long(pos: int) -> int:
            raw, pos = line(pos)
            push(long_text(raw))
            return pos

        def op_long1(pos: int) -> int:
            pos = take(pos, 1)
            size = data[pos]
            pos = take(pos + 1, size)
            push(int.from_bytes(data[pos : pos + size], "little", signed=True))
            return pos + size

        def op_long4(pos: int) -> int:
            pos = take(pos, 4)
            size: int
            (size,) = unpack_i(data, pos)
            if size < 0:
                raise _bad("negative LONG4 length")
            if size > budgets.max_long_bytes:
                raise over_limit(f"an integer of more than {budgets.max_long_bytes} bytes")
            pos = take(pos + 4, size)
            charge(1, 28 + size)
            push(int.from_bytes(data[pos : pos + size], "little", signed=True))
            return pos + size

        def op_float(pos: int) -> int:
            raw, pos = line(pos)
            push(float_text(raw))
            return pos

        def op_binfloat(pos: int) -> int:
            pos = take(pos, 8)
            push(unpack_d(data, pos)[0])
            return pos + 8

        # -- strings and bytes
        def op_binunicode(pos: int) -> int:
            pos = take(pos, 4)
            size: int
            (size,) = unpack_I(data, pos)
            pos = take(pos + 4, size)
            push_str(data[pos : pos + size])
            return pos + size

        def op_short_binunicode(pos: int) -> int:
            pos = take(pos, 1)
            size = data[pos]
            pos = take(pos + 1, size)
            push_str(data[pos : pos + size])
            return pos + size

        def op_binunicode8(pos: int) -> int:
            pos = take(pos, 8)
            size: int
            (size,) = unpack_Q(data, pos)
            pos = take(pos + 8, size)
            push_str(data[pos : pos + size])
            return pos + size

        def op_unicode(pos: int) -> int:
            raw, pos = line(pos)
            try:
                value = raw.decode("raw-unicode-escape")
            except UnicodeDecodeError:
                raise _bad("a malformed UNICODE string") from None
            charge(1, 49 + len(raw))
            push(value)
            return pos

        def op_string(pos: int) -> int:  # protocol 0 quoted (Python 2 str), decoded as torch does
            raw, pos = line(pos)
            if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b"'", b'"'):
                raise _bad("a malformed STRING")
            try:
                value = codecs.escape_decode(raw[1:-1])[0]  # as pickle does
            except ValueError:
                raise _bad("a malformed STRING") from None
            push_str(value)
            return pos

        def op_binstring(pos: int) -> int:
            pos = take(pos, 4)
            size: int
            (size,) = unpack_i(data, pos)
            if size < 0:
                raise _bad("negative BINSTRING length")
            pos = take(pos + 4, size)
            push_str(data[pos : pos + size])
            return pos + size

        def op_short_binstring(pos: int) -> int:
            pos = take(pos, 1)
            size = data[pos]
            pos = take(pos + 1, size)
            push_str(data[pos : pos + size])
            return pos + size

        def op_binbytes(pos: int) -> int:
            pos = take(pos, 4)
            return push_bytes(pos + 4, unpack_I(data, pos)[0])

        def op_short_binbytes(pos: int) -> int:
            pos = take(pos, 1)
            return push_bytes(pos + 1, data[pos])

        def op_binbytes8(pos: int) -> int:
            pos = take(pos, 8)
            return push_bytes(pos + 8, unpack_Q(data, pos)[0])

        def op_bytearray8(pos: int) -> int:
            pos = op_binbytes8(pos)
            stack[-1] = bytearray(stack[-1])
            return pos

        # -- containers
        def op_readonly_buffer(pos: int) -> int:
            # CPython: memoryview(top), made read-only: bytes stay bytes, a bytearray becomes a
            # read-only view (read here as bytes), anything else is a TypeError
            value = top()
            if type(value) is bytearray:
                stack[-1] = bytes(value)
            elif type(value) is not bytes:
                raise _bad(f"READONLY_BUFFER on a {type(value).__name__}")
            return pos

        def op_mark(pos: int) -> int:
            marks.append(len(stack))
            return pos

        def op_empty_tuple(pos: int) -> int:
            push(())
            return pos

        def op_tuple(pos: int) -> int:
            items = pop_mark()
            charge(1, 40 + 8 * len(items))
            push(tuple(items))
            return pos

        def op_tuple1(pos: int) -> int:
            value = pop()
            charge(1, 48)
            push((value,))
            return pos

        def op_tuple2(pos: int) -> int:
            b, a = pop(), pop()
            charge(1, 56)
            push((a, b))
            return pos

        def op_tuple3(pos: int) -> int:
            c, b, a = pop(), pop(), pop()
            charge(1, 64)
            push((a, b, c))
            return pos

        def op_empty_list(pos: int) -> int:
            charge(1, 56)
            push([])
            return pos

        def op_list(pos: int) -> int:
            items = pop_mark()
            charge(1, 56 + 8 * len(items))
            push(items)
            return pos

        def op_empty_dict(pos: int) -> int:
            charge(1, 64)
            push({})
            return pos

        def op_dict(pos: int) -> int:
            items = pop_mark()
            if len(items) % 2:
                raise _bad("DICT with an odd number of items")
            charge(1, 64 + 40 * len(items))
            result: dict[Any, Any] = {}
            set_pairs(result, items)
            push(result)
            return pos

        def op_empty_set(pos: int) -> int:
            charge(1, 216)
            push(set())
            return pos

        def op_frozenset(pos: int) -> int:
            items = [check_key(item) for item in pop_mark()]
            charge(1, 216 + 16 * len(items))
            push(hooks.make_frozenset(items))
            return pos

        def op_additems(pos: int) -> int:
            items = pop_mark()
            target = top()
            if type(target) is not set:  # CPython calls the object's add(): the hooks decide
                hooks.extend(target, items)
                return pos
            items = [check_key(item) for item in items]
            charge(0, 16 * len(items))
            try:
                target.update(items)
            except TypeError:
                raise _bad("an unhashable set element") from None
            return pos

        def op_append(pos: int) -> int:
            value = pop()
            target = top()
            charge(0, 8)
            if type(target) is list:
                target.append(value)
            else:
                hooks.extend(target, [value])
            return pos

        def op_appends(pos: int) -> int:
            items = pop_mark()
            target = top()
            charge(0, 8 * len(items))
            if type(target) is list:
                target.extend(items)
            else:
                hooks.extend(target, items)
            return pos

        def set_pairs(target: dict[Any, Any], items: list[Any]) -> None:
            for i in range(0, len(items), 2):
                key = items[i]
                if type(key) is not str:
                    key = check_key(key)
                try:
                    target[key] = items[i + 1]
                except TypeError:
                    raise _bad("an unhashable dict key") from None

        def op_setitem(pos: int) -> int:
            value = pop()
            key = pop()
            target = top()
            charge(0, 40)
            kind = type(target)
            if kind is dict or kind is OrderedDict or kind is Counter:
                set_pairs(target, [key, value])
            else:
                hooks.set_items(target, [(key, value)])
            return pos

        def op_setitems(pos: int) -> int:
            items = pop_mark()
            if len(items) % 2:
                raise _bad("SETITEMS with an odd number of items")
            target = top()
            charge(0, 40 * len(items))
            kind = type(target)
            if kind is dict or kind is OrderedDict or kind is Counter:
                set_pairs(target, items)
            else:
                for i in range(0, len(items), 2):
                    if type(items[i]) is not str:
                        items[i] = check_key(items[i])
                hooks.set_items(target, list(zip(items[::2], items[1::2])))
            return pos

        # -- stack juggling
        def op_pop(pos: int) -> int:
            if len(marks) > 1 and len(stack) == marks[-1]:
                marks.pop()  # POP of a MARK, as pickle does
            else:
                pop()
            return pos

        def op_pop_mark(pos: int) -> int:
            pop_mark()
            return pos

        def op_dup(pos: int) -> int:
            push(top())
            return pos

        # -- memo
        def put(index: int) -> None:
            value = top()
            n = len(memo)
            if index == n:
                if n + len(memo_sparse) >= max_memo:
                    raise over_limit(f"more than {max_memo} memo entries")
                memo.append(value)
                if memo_sparse:
                    memo_sparse.pop(index, None)
            elif 0 <= index < n:
                memo[index] = value
            elif index > n:
                if index not in memo_sparse and n + len(memo_sparse) >= max_memo:
                    raise over_limit(f"more than {max_memo} memo entries")
                memo_sparse[index] = value
            else:
                raise _bad("a negative memo index")

        def get(index: int) -> None:
            if 0 <= index < len(memo):
                push(memo[index])
            elif index in memo_sparse:
                push(memo_sparse[index])
            else:
                raise _bad(f"memo entry {index} is used before it is set")

        def op_binput(pos: int) -> int:
            pos = take(pos, 1)
            put(data[pos])
            return pos + 1

        def op_long_binput(pos: int) -> int:
            pos = take(pos, 4)
            put(unpack_I(data, pos)[0])
            return pos + 4

        def op_put(pos: int) -> int:
            raw, pos = line(pos)
            put(index_text(raw))
            return pos

        def op_memoize(pos: int) -> int:
            put(len(memo) + len(memo_sparse))
            return pos

        def op_binget(pos: int) -> int:
            pos = take(pos, 1)
            get(data[pos])
            return pos + 1

        def op_long_binget(pos: int) -> int:
            pos = take(pos, 4)
            get(unpack_I(data, pos)[0])
            return pos + 4

        def op_get(pos: int) -> int:
            raw, pos = line(pos)
            get(index_text(raw))
            return pos

        # -- the doors to code: all through the hooks
        def call_args(args: Any, what: str) -> tuple[Any, ...]:
            # torch's weights-only unpickler calls func(*args): a list works there (CPython refuses)
            if type(args) is list and hooks.list_arguments:
                return tuple(args)
            raise _bad(f"{what} arguments are not a tuple")

        def global_name(module: Any, name: Any) -> Any:
            if type(module) is not str or type(name) is not str:
                raise _bad("STACK_GLOBAL with a name that is not a string")
            if module == "torch.tensor":  # torch's own find_class, before CPython's
                module = "torch._tensor"
            if self.proto < 3 or hooks.python2_names_always:  # CPython: fix_imports, protocols 0-2 only
                renamed = NAME_MAPPING.get((module, name))
                if renamed is not None:
                    module, name = renamed
                else:
                    module = IMPORT_MAPPING.get(module, module)
            charge(1, 64)
            return hooks.find_global(module, name)

        def op_global(pos: int) -> int:
            module, pos = line(pos)
            name, pos = line(pos)
            try:
                push(global_name(module.decode("utf-8"), name.decode("utf-8")))
            except UnicodeDecodeError:
                raise _bad("a global name that is not UTF-8") from None
            return pos

        def op_stack_global(pos: int) -> int:
            name = pop()
            module = pop()
            push(global_name(module, name))
            return pos

        def op_reduce(pos: int) -> int:
            args = pop()
            func = top()
            if type(args) is not tuple:
                args = call_args(args, "REDUCE")
            charge(1, 64)
            stack[-1] = hooks.call(func, args)
            return pos

        def op_newobj(pos: int) -> int:
            args = pop()
            cls = top()
            if type(args) is not tuple:
                args = call_args(args, "NEWOBJ")
            charge(1, 64)
            stack[-1] = hooks.new_object(cls, args, None)
            return pos

        def op_newobj_ex(pos: int) -> int:
            kwargs = pop()
            args = pop()
            cls = top()
            if type(args) is not tuple or type(kwargs) is not dict:
                raise _bad("NEWOBJ_EX arguments are not a tuple and a dict")
            charge(1, 64)
            stack[-1] = hooks.new_object(cls, args, kwargs)
            return pos

        def op_inst(pos: int) -> int:  # protocol 0: INST module\nname\n after MARK args
            module, pos = line(pos)
            name, pos = line(pos)
            args = tuple(pop_mark())
            try:
                cls = global_name(module.decode("utf-8"), name.decode("utf-8"))
            except UnicodeDecodeError:
                raise _bad("a global name that is not UTF-8") from None
            charge(1, 64)
            push(hooks.call(cls, args))
            return pos

        def op_obj(pos: int) -> int:
            items = pop_mark()
            if not items:
                raise _bad("OBJ without a class")
            charge(1, 64)
            push(hooks.call(items[0], tuple(items[1:])))
            return pos

        def op_build(pos: int) -> int:
            state = pop()
            inst = top()
            if type(inst) is OrderedDict:
                # what Module.state_dict() pickles: its _metadata attribute (torch allows the same)
                if type(state) is not dict or not all(type(k) is str for k in state):
                    raise _bad("BUILD on an OrderedDict with a state that is not a dict of names")
                shadowing = [k for k in state if k.startswith("__") or hasattr(OrderedDict, k)]
                if shadowing:  # an attribute named "items" or "keys" would break every reader of it
                    raise _bad(f"BUILD gives an OrderedDict an attribute named {shadowing[0]!r:.40}")
                inst.__dict__.update(state)
            else:
                hooks.build(inst, state)
            return pos

        def op_binpersid(pos: int) -> int:
            pid = pop()
            push(hooks.persistent_load(pid))
            return pos

        def op_persid(pos: int) -> int:
            raw, pos = line(pos)
            push(hooks.persistent_load(raw.decode("ascii", "replace")))
            return pos

        table: list[Callable[[int], int]] = list(_UNSUPPORTED)
        for code, handler in {
            b"\x80": op_proto,
            b"\x95": op_frame,
            b".": op_stop,
            b"N": op_none,
            b"\x88": op_true,
            b"\x89": op_false,
            b"J": op_binint,
            b"K": op_binint1,
            b"M": op_binint2,
            b"I": op_int,
            b"L": op_long,
            b"\x8a": op_long1,
            b"\x8b": op_long4,
            b"F": op_float,
            b"G": op_binfloat,
            b"X": op_binunicode,
            b"\x8c": op_short_binunicode,
            b"\x8d": op_binunicode8,
            b"V": op_unicode,
            b"S": op_string,
            b"T": op_binstring,
            b"U": op_short_binstring,
            b"B": op_binbytes,
            b"C": op_short_binbytes,
            b"\x8e": op_binbytes8,
            b"\x96": op_bytearray8,
            b"\x98": op_readonly_buffer,
            b"(": op_mark,
            b")": op_empty_tuple,
            b"t": op_tuple,
            b"\x85": op_tuple1,
            b"\x86": op_tuple2,
            b"\x87": op_tuple3,
            b"]": op_empty_list,
            b"l": op_list,
            b"}": op_empty_dict,
            b"d": op_dict,
            b"\x8f": op_empty_set,
            b"\x91": op_frozenset,
            b"\x90": op_additems,
            b"a": op_append,
            b"e": op_appends,
            b"s": op_setitem,
            b"u": op_setitems,
            b"0": op_pop,
            b"1": op_pop_mark,
            b"2": op_dup,
            b"q": op_binput,
            b"r": op_long_binput,
            b"p": op_put,
            b"\x94": op_memoize,
            b"h": op_binget,
            b"j": op_long_binget,
            b"g": op_get,
            b"c": op_global,
            b"\x93": op_stack_global,
            b"R": op_reduce,
            b"\x81": op_newobj,
            b"\x92": op_newobj_ex,
            b"i": op_inst,
            b"o": op_obj,
            b"b": op_build,
            b"Q": op_binpersid,
            b"P": op_persid,
        }.items():
            table[code[0]] = handler

        # The loop: the opcodes a torch.save pickle is made of (95 % of them, by count) are
        # written out inline -- same semantics as their table handlers, which stay the
        # reference (``fast=False`` runs the table alone; a test compares the two) -- the
        # rest go through the table. Saves a Python call per opcode on the hot path.
        pos = self.pos
        if not self.fast:
            while pos < end:
                pos = table[data[pos]](pos + 1)
                if pos < 0:
                    self.pos = -pos - 1
                    return stack[-1]
            raise _truncated("it ends before its STOP opcode (truncated)")
        while pos < end:
            op = data[pos]
            pos += 1
            if op == 114:  # LONG_BINPUT
                if pos + 4 > limit:
                    pos = op_long_binput(pos)
                    continue
                index = unpack_I(data, pos)[0]
                if index == len(memo) and not memo_sparse and index < max_memo and len(stack) > marks[-1]:
                    memo.append(stack[-1])
                else:
                    put(index)
                pos += 4
            elif op == 104:  # BINGET
                if pos >= limit:
                    pos = op_binget(pos)
                    continue
                index = data[pos]
                if index < len(memo):
                    push(memo[index])
                else:
                    get(index)
                pos += 1
            elif op == 75:  # BININT1
                if pos >= limit:
                    pos = op_binint1(pos)
                    continue
                push(data[pos])
                pos += 1
            elif op == 40:  # MARK
                marks.append(len(stack))
            elif op == 116:  # TUPLE
                if len(marks) == 1:
                    raise _bad("no MARK on the stack")
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                objects += 1
                alloc += 40 + 8 * len(items)
                if objects > max_objects or alloc > max_alloc:
                    raise over_budget(objects, alloc)
                push(tuple(items))
            elif op == 82:  # REDUCE
                if len(stack) <= marks[-1] + 1:
                    raise _bad("stack underflow")
                args = stack.pop()
                if type(args) is not tuple:
                    args = call_args(args, "REDUCE")
                objects += 1
                alloc += 64
                if objects > max_objects or alloc > max_alloc:
                    raise over_budget(objects, alloc)
                stack[-1] = hooks.call(stack[-1], args)
            elif op == 133:  # TUPLE1
                if len(stack) <= marks[-1]:
                    raise _bad("stack underflow")
                objects += 1
                alloc += 48
                if objects > max_objects or alloc > max_alloc:
                    raise over_budget(objects, alloc)
                stack[-1] = (stack[-1],)
            elif op == 41:  # EMPTY_TUPLE
                push(())
            elif op == 88:  # BINUNICODE
                if pos + 4 > limit or pos + 4 + unpack_I(data, pos)[0] > limit:
                    pos = op_binunicode(pos)
                    continue
                size = unpack_I(data, pos)[0]
                pos += 4
                try:
                    value = str(data[pos : pos + size], "utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    raise _bad("a string that is not valid UTF-8") from None
                objects += 1
                alloc += 49 + size
                if objects > max_objects or alloc > max_alloc:
                    raise over_budget(objects, alloc)
                push(value)
                pos += size
            elif op == 137:  # NEWFALSE
                push(False)
            elif op == 81:  # BINPERSID
                if len(stack) <= marks[-1]:
                    raise _bad("stack underflow")
                stack[-1] = hooks.persistent_load(stack[-1])
            else:
                pos = table[op](pos)
                if pos < 0:
                    self.pos = -pos - 1
                    return stack[-1]
        raise _truncated("it ends before its STOP opcode (truncated)")


def _unsupported(op: int) -> Callable[[int], int]:
    def handler(pos: int) -> int:
        raise _bad(f"unsupported opcode {op:#04x} at byte {pos - 1}")

    return handler


#: the table's default entry per opcode, made once (a run copies the list: 256 closures per
#: run were a third of the fuzzer's time)
_UNSUPPORTED: tuple[Callable[[int], int], ...] = tuple(_unsupported(i) for i in range(256))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one read-transform-write.

    A checkpoint tree is millions of objects that live until the command ends, and the work
    on it makes no garbage cycles: every automatic collection would only re-scan the tree
    (measured: ~1 s of 6 at 200 000 tensors). Nesting is fine; the previous state returns on exit,
    so cycles made elsewhere (a library user's) are collected as before.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


#: True while the command line's entry point runs its one command: the process ends when it
#: returns (see :func:`keep_until_exit`); False for every library call and in-process test run
_LAST_COMMAND: ContextVar[bool] = ContextVar("last_command", default=False)

#: what :func:`keep_until_exit` keeps: a list holding itself, so that clearing this module at
#: interpreter exit leaves it (and all it holds) alive, and nothing frees it
_KEPT: list[Any] = []
_KEPT.append(_KEPT)


@contextmanager
def last_command() -> Iterator[None]:
    """Mark what runs within as the last thing this process does (the console script's command):
    the trees it reads may be left to the operating system at exit (:func:`keep_until_exit`)."""
    token = _LAST_COMMAND.set(True)
    try:
        yield
    finally:
        _LAST_COMMAND.reset(token)


@contextmanager
def many_commands() -> Iterator[None]:
    """Within this, :func:`keep_until_exit` keeps nothing: a batch reads many files, and the
    first one's tree must not stay alive beside every later one's."""
    token = _LAST_COMMAND.set(False)
    try:
        yield
    finally:
        _LAST_COMMAND.reset(token)


def keep_until_exit(tree: Any) -> None:
    """Within :func:`last_command`: never free ``tree``, nor scan it again -- the process ends soon
    and the kernel takes its pages back at once. Elsewhere (a library call, a test): nothing.

    Freeing a 200 000-tensor tree costs ~75 ms of a ~0.5 s ``inspect`` (1.4 M objects, one
    deallocation each), and had the tree outlived :func:`collector_paused`, the first collection
    after it would have scanned all of it (~0.1 s). ``gc.freeze`` moves every object the collector
    tracks now into its permanent generation, which no collection looks at, not even the ones at
    interpreter exit; ``tree`` stays reachable from :data:`_KEPT`, a frozen cycle, so neither
    reference counting nor the collector ever frees it. Objects made later are collected as usual.
    One tree per command: a later call frees its tree as usual, so a command that reads many
    (a batch) never piles them up.
    """
    if _LAST_COMMAND.get():
        _LAST_COMMAND.set(False)
        _KEPT.append(tree)
        gc.freeze()
