"""The pickle VM reads what CPython's C unpickler reads (issue 22): FRAME buffers, text opcodes,
where scan stops, keys, Python 2 names and argument forms -- each case compared with CPython
itself through the oracle (tests/oracle.py), several variants each, made here."""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hostile import g, legacy_file, make_legacy_header, n, su, u
from oracle import assert_scan_sees_what_torch_resolves, canonical, dangerous_names, pickle_views
from pickle_programs import frame, programs

from ckptfix.analysis.scan import scan_pickles
from ckptfix.errors import BadInputError, CkptfixError, UnsafeInputError
from ckptfix.pickling import vm as vm_module
from ckptfix.pickling.reader import restricted_load

#: what CPython resolves and would run: posix.system("echo"), its result popped
CALL = g("posix", "system") + su("echo") + b"\x85R"


def assert_scan_agrees(pickles: list[bytes], streams: tuple[str, ...] = ("bytesio", "file")) -> list[Any]:
    """scan names every global CPython resolves in each pickle, read from a BytesIO (data.pkl) and
    from a buffered file (legacy files), and calls it dangerous where CPython resolved a dangerous one."""
    views = []
    for stream in streams:
        for p, view in zip(pickles, pickle_views(pickles, stream=stream), strict=True):
            found, _ = scan_pickles(p, "t")
            names = [f.name for f in found]
            missed = canonical(view.globals) - canonical(names)
            assert not missed, f"{stream}: CPython resolves {missed} scan does not report in {p!r} (scan: {names})"
            if dangerous_names(view.globals):
                assert any(f.verdict == "dangerous" for f in found), (stream, p, names)
            views.append(view)
    return views


# =========================================================================== FRAME boundaries


def _framed(body: bytes, after: bytes, proto: int = 4) -> bytes:
    return b"\x80" + bytes([proto]) + frame(len(body)) + body + after


FRAME_CASES = {
    # a fixed-size read runs past the frame: CPython reads it whole from after the frame
    "SHORT_BINUNICODE": lambda k: _framed(b"}\x8c" + bytes([3 + k]) + b"ab", b"c" * (3 + k) + b"0" + CALL + b"0."),
    "BINUNICODE": lambda k: _framed(b"}X" + struct.pack("<I", 2 + k) + b"a", b"\x00" * (2 + k) + b"0" + CALL + b"0."),
    "BININT": lambda k: _framed(b"}" + b"N0" * k + b"J\x01\x02", b"\x00" * 4 + b"0" + CALL + b"0."),
    "BINFLOAT in protocol 2": lambda k: _framed(b"}G\x01" + b"\x00" * k, b"\x00" * 8 + b"0" + CALL + b"0.", 2),
    # a text line not ending in the frame: the partial line is dropped, a line read after it
    "GLOBAL line": lambda k: _framed(b"}c" + b"junk" * (k + 1), b"posix\nsystem\n" + su("e") + b"\x85R0."),
    "INT line": lambda k: _framed(b"}I" + b"x" * (k + 1), b"7\n0" + CALL + b"0."),
    # a FRAME inside the frame, longer than the frame's rest: read from after the outer frame
    "nested FRAME": lambda k: _framed(b"}" + frame(len(CALL) + 2) + b"." + b"x" * k, CALL + b"0."),
}


@pytest.mark.parametrize("case", sorted(FRAME_CASES))
def test_reads_across_a_frame_end_are_read_as_cpython_reads_them(case: str) -> None:
    """Each crossing in several variants: CPython (BytesIO, as torch reads data.pkl) resolves
    posix.system where a linear reader sees a clean pickle; scan reports it, dangerous."""
    pickles = [FRAME_CASES[case](k) for k in range(3)]
    views = assert_scan_agrees(pickles, streams=("bytesio",))
    assert all("posix.system" in v.globals for v in views), views  # the case is what it claims


def test_frame_cases_also_hold_on_a_buffered_file() -> None:
    """A real file (peek(): legacy files, DCP .metadata) reads those pickles linearly: scan reports
    that reading too."""
    assert_scan_agrees([FRAME_CASES[c](1) for c in sorted(FRAME_CASES)], streams=("file",))


def test_a_stop_inside_a_frame_hides_no_second_pickle() -> None:
    """A STOP with bytes left in its frame: a BytesIO reader's next pickle starts after the frame,
    a file's right after the STOP; scan reads both ways and names the payload either holds."""
    hidden = b"\x80\x02" + CALL + b"."  # what a linear reader takes as the second pickle
    first = b"\x80\x04" + frame(2 + len(hidden)) + b"}." + hidden
    for second in (b"\x80\x02}.", b"\x80\x02N."):
        found, _ = scan_pickles(first + second, "t")
        assert {"os.system", "<a read at byte 12 across a FRAME end>"} <= {f.name for f in found}, found


def test_the_reader_refuses_a_read_across_a_frame_end() -> None:
    """torch's weights-only unpickler reads no FRAME at all: refusing the ambiguous ones refuses
    nothing it loads (the audit below checks it refuses these too)."""
    for case in FRAME_CASES.values():
        with pytest.raises(BadInputError, match="FRAME"):
            restricted_load(case(0), None)


def test_generated_frames_agree_with_cpython() -> None:
    """Seeded programs -- globals, memo juggling, text opcodes, frames short, long, nested, empty,
    in protocols 2-5 -- on both stream kinds; the generator makes the readers disagree often."""
    pickles = programs(2026, 300)
    views = assert_scan_agrees(pickles)
    bytesio, file = views[: len(pickles)], views[len(pickles) :]
    differ = sum(a.globals != b.globals for a, b in zip(bytesio, file, strict=True))
    assert differ > 20 and sum(bool(dangerous_names(v.globals)) for v in bytesio) > 50, differ


# =========================================================================== text opcodes


TEXTS = [
    *(b"I" + t + b"\n." for t in (b"010", b"0x10", b"0X1f", b"01", b"00", b"+1", b" 1", b"-0", b"1\x00x", b"\x00")),
    *(b"I" + t + b"\n." for t in (b"0b11", b"1_0", b"99999999999999999999", b"0o7", b"0x", b"08", b"", b"1 ")),
    *(b"I" + t + b"\n." for t in (b"0x" + b"f" * 5000, b"1" * 5000, b"00000000000000000000000001")),
    *(b"L" + t + b"\n." for t in (b"010L", b"0x10L", b"10", b" 5 L", b"1_0L", b"7\x00zz", b"L")),
    *(b"F" + t + b"\n." for t in (b" 1.5", b"1.5 ", b"1_0", b"1e500", b"1e-500", b"-InFinity", b"nan", b".5", b"5.")),
    *(b"F" + t + b"\n." for t in (b"1e", b"1.5\x00zz", b"0x10", b"+1", b"1" * 400 + b".5", b"infinit")),
    *(b"Np" + t + b"\n0g" + t2 + b"\n." for t, t2 in ((b"010", b"10"), (b" 3", b"3"), (b"1_0", b"10"))),
    *(b"Np" + t + b"\n0g" + t2 + b"\n." for t, t2 in ((b"-1", b"1"), (b"0x1", b"1"), (b"5", b"05"))),
]


def _value(load: Any, data: bytes) -> Any:
    try:
        value = load(data)
        return ("ok", type(value), hex(value) if type(value) is int else repr(value))
    except (CkptfixError, ValueError, OverflowError, pickle.UnpicklingError, EOFError, KeyError) as exc:
        return ("error", type(exc) is not KeyError or "memo")


@pytest.mark.parametrize("data", TEXTS, ids=lambda d: repr(d[:24]))
def test_text_opcodes_are_parsed_as_cpython_parses_them(data: bytes) -> None:
    """INT (strtol base 0: 010 is 8, 0x10 is 16, 01/00 are bools), LONG (int(text, 0)), FLOAT
    (no blanks or underscores, overflow refused), PUT/GET (base 10): the same value or the same
    refusal as CPython's C unpickler (pickle.loads: no global is named, nothing runs)."""
    theirs = _value(pickle.loads, data)
    ours = _value(lambda d: restricted_load(d, None)[0], data)
    if theirs[0] == "error":
        assert ours[0] == "error", (data, ours)
    else:
        assert ours == theirs, data


# =========================================================================== scan reads on


def _legacy_with_dup_magic(tmp_path: Path, variant: int) -> Path:
    header = make_legacy_header()
    magic_end = list(pickletools.genops(header))[-1][2] + 1  # the magic number's pickle ends there
    dup = header[: magic_end - 1] + b"2" * (variant + 1) + b"."
    tree = b"\x80\x02" + CALL + b"0" + b"}."
    return legacy_file(dup + header[magic_end:], tree, [], tmp_path / f"dup{variant}.pt")


READ_ON = {
    "READONLY_BUFFER on bytes": lambda k: b"C" + bytes([k]) + b"a" * k + b"\x98",
    "READONLY_BUFFER on a bytearray": lambda k: b"\x96" + struct.pack("<Q", k) + b"a" * k + b"\x98",
    "a long text line": lambda k: b"V" + b"a" * (70_000 + k) + b"\n",
    "a big LONG4": lambda k: b"\x8b" + struct.pack("<i", (1 << 20) + k + 1) + b"\x01" * ((1 << 20) + k + 1),
    "a deep tuple key": lambda k: b"}" + u("x") + b"\x85" * (150 + 50 * k) + b"Ns",
    "a big int key": lambda k: b"}" + n(-(10**30) - k) + b"Ns",
    "a long float text": lambda k: b"F" + b"1" * (100 + k) + b".5\n",
    "INT text in hex": lambda k: b"I0x1" + b"0" * k + b"\n",
    "a STOP over an open MARK": lambda k: b"(" * (k + 1) + b"N",
    "OrderedDict from pairs": lambda k: g("collections", "OrderedDict") + b"((" + u("k") + n(k) + b"ll\x85R",
}


def _read_on(thing: bytes) -> bytes:
    return b"\x80\x02" + thing + b"0" + CALL + b"0" + b"}."


@pytest.mark.parametrize("case", sorted(READ_ON))
def test_scan_reads_on_where_cpython_reads_on(case: str) -> None:
    """What ckptfix used to stop at (exit 3 "corrupt", no dangerous name) while CPython read on and
    resolved posix.system: scan now names it, in several variants of each."""
    pickles = [_read_on(READ_ON[case](k)) for k in range(3)]
    views = assert_scan_agrees(pickles, streams=("bytesio",))
    assert all("posix.system" in v.globals for v in views), views


@pytest.mark.parametrize("variant", [0, 2])
def test_scan_reads_a_legacy_file_whose_magic_pickle_leaves_extra_items(tmp_path: Path, variant: int) -> None:
    """DUP before STOP in the magic-number pickle: CPython returns the top item, torch reads on."""
    path = _legacy_with_dup_magic(tmp_path, variant)
    view = assert_scan_sees_what_torch_resolves(path)
    assert "posix.system" in view.globals, view


def test_a_spent_budget_is_never_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit of ckptfix's own stops the scanner before the payload: the result is dangerous ("not
    read to the end"), never clean."""
    monkeypatch.setattr(vm_module.Budgets, "for_length", classmethod(lambda cls, length: cls(max_objects=3)))
    for filler in (b"]0" * 5, b"}0" * 5, b"N\x85" * 5 + b"0"):
        found, error = scan_pickles(b"\x80\x02" + filler + CALL + b"0}.", "t")
        assert error and [f.verdict for f in found] == ["dangerous"], found
        assert found[0].name.startswith("<not read to the end"), found


# =========================================================================== keys


def test_integer_keys_beyond_64_bits_are_read_as_cpython_reads_them() -> None:
    for keys in ([-(10**30)], [10**30, 2**64, -(2**63) - 1], [2**61 - 1, 2**61, 2**61 + 1], [10**4000]):
        data = pickle.dumps({k: i for i, k in enumerate(keys)}, protocol=2)
        assert restricted_load(data, None)[0] == pickle.loads(data), keys
        if keys[0] != 10**4000:  # LONG4: torch's weights-only unpickler reads LONG1 only
            assert weights_only(data) == pickle.loads(data)  # torch loads it


def _colliding(count: int) -> tuple[bytes, bytes, bytes]:
    """``count`` distinct dict keys sharing one hash: ints (i * (2**61 - 1) + 5), complex numbers
    (a + b*1000003 equal), 1-tuples of such ints; then the payload."""
    modulus = (1 << 61) - 1
    ints = b"}(" + b"".join(n(i * modulus + 5) + b"N" for i in range(count)) + b"u"
    tuples = b"}(" + b"".join(n(i * modulus + 5) + b"\x85N" for i in range(count)) + b"u"
    cx = g("builtins", "complex") + b"q\x00"
    complexes = b"}(" + cx + b"0"
    complexes += b"".join(
        b"h\x00" + b"G" + struct.pack(">d", 5.0 - 1000003 * b) + n(b) + b"\x86RN" for b in range(count)
    )
    return ints, tuples, complexes + b"u"


def test_hash_flooding_is_budgeted_not_quadratic() -> None:
    """20 000 keys sharing one hash took CPython (and ckptfix) seconds to minutes (40 000: minutes):
    the reader refuses past MAX_SHARED_HASH keys per hash, scan keeps them unhashed and reads on
    to the payload. CPU time asserted with a wide margin (CPython's dict needs ~4 s here)."""
    for flood in _colliding(20_000):
        data = b"\x80\x02" + flood + b"0" + CALL + b"0}."
        start = time.process_time()
        with pytest.raises(BadInputError, match="hash flooding"):
            restricted_load(b"\x80\x02" + flood + b".", None)
        found, _ = scan_pickles(data, "t")
        assert "os.system" in {f.name for f in found}
        assert time.process_time() - start < 2.0


def test_colliding_keys_agree_with_cpython_when_few() -> None:
    """The same shapes, small enough for CPython: scan names what CPython resolves."""
    assert_scan_agrees([b"\x80\x02" + f + b"0" + CALL + b"0}." for f in _colliding(200)], streams=("bytesio",))


def test_deep_keys_within_cpython_are_kept_for_scan_only() -> None:
    """A tuple key 150 deep: the reader refuses (MAX_KEY_NESTING, a budget), scan reads on."""
    data = b"\x80\x02}" + u("x") + b"\x85" * 150 + b"Ns" + b"0" + CALL + b"0}."
    with pytest.raises(BadInputError, match="nested more than"):
        restricted_load(data, None)
    assert "os.system" in {f.name for f in scan_pickles(data, "t")[0]}


# =========================================================================== Python 2 names


@pytest.mark.parametrize("proto", [0, 2, 4])
def test_python2_names_are_renamed_only_where_cpython_renames_them(proto: int) -> None:
    """CPython maps commands.getoutput to subprocess.getoutput in protocols 0-2 only (fix_imports)."""
    header = b"\x80" + bytes([proto]) if proto >= 2 else b""
    pickles = [header + g("commands", "getoutput") + su("id") + b"\x85R.", header + g("__builtin__", "eval") + b"."]
    views = assert_scan_agrees(pickles, streams=("bytesio",))
    if proto < 3:
        assert views[0].globals == ("subprocess.getoutput",) and views[1].globals == ("builtins.eval",), views
    else:  # not renamed (the oracle stubs modules that are not there: a real Python stops at the import)
        assert views[0].globals == ("commands.getoutput",) and views[1].globals == ("__builtin__.eval",), views


# =========================================================================== argument forms


ARGUMENT_FORMS = {
    "OrderedDict([[k, v], ...])": g("collections", "OrderedDict") + b"](](" + u("a") + n(1) + b"ee\x85R",
    "OrderedDict(((k, v), ...))": g("collections", "OrderedDict") + u("a") + n(1) + b"\x86\x85\x85R",
    "OrderedDict(dict)": g("collections", "OrderedDict") + b"}" + u("a") + n(1) + b"s\x85R",
    "OrderedDict(['ab'])": g("collections", "OrderedDict") + b"](" + u("ab") + b"e\x85R",
    "OrderedDict with big int keys": g("collections", "OrderedDict") + b"]((" + n(10**30) + n(1) + b"te\x85R",
    "Counter(list)": g("collections", "Counter") + b"](" + u("a") + u("a") + u("b") + b"e\x85R",
    "set(tuple)": g("builtins", "set") + b"(" + n(1) + n(2) + b"t\x85R",
    "set(str)": g("builtins", "set") + u("abc") + b"\x85R",
    "bytearray(int)": g("builtins", "bytearray") + n(5) + b"\x85R",
    "bytearray(list)": g("builtins", "bytearray") + b"](" + n(1) + n(2) + b"e\x85R",
    "complex(text)": g("builtins", "complex") + u("1+2j") + b"\x85R",
    "complex(complex)": g("builtins", "complex") + g("builtins", "complex") + n(1) + n(2) + b"\x86R\x85R",
    "encode(text, utf-16)": g("_codecs", "encode") + u("\u00e9") + u("utf-16") + b"\x86R",
    "REDUCE with a list": g("collections", "OrderedDict") + b"]R",
    "NEWOBJ OrderedDict": g("collections", "OrderedDict") + b")\x81",
    "SETITEM on a Counter": g("collections", "Counter") + b")R" + u("a") + n(3) + b"s",
}


def weights_only(data: bytes) -> Any:
    """torch.load(weights_only=True)'s unpickler on one raw pickle (it runs nothing off its list)."""
    from torch._weights_only_unpickler import load

    return load(io.BytesIO(data), encoding="utf-8")


@pytest.mark.parametrize("case", sorted(ARGUMENT_FORMS))
def test_every_argument_form_torch_loads_is_read_as_torch_reads_it(case: str) -> None:
    """Python 2-era pickles (``REDUCE(OrderedDict, ([[key, value], ...],))``) and the other
    argument forms torch's weights-only unpickler accepts: read, and equal to torch's value."""
    for proto in (b"\x80\x02", b"\x80\x06"):  # torch takes any PROTO (with a warning)
        data = proto + ARGUMENT_FORMS[case] + b"."
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = weights_only(data)
        ours = restricted_load(data, None)[0]
        assert ours == theirs and type(ours) is type(theirs), (case, ours, theirs)


def test_a_key_built_level_by_level_still_has_its_depth_counted() -> None:
    """FROZENSET checks each level as it is made (where real frozensets are built: hooks that
    build what CPython builds, as the scanner's do): the cache must carry depth, not only hashing
    work. The reader refuses the first one: torch's weights-only unpickler has no frozenset."""
    for depth in (101, 150):
        data = b"\x80\x04}" + b"(" * depth + b"\x91" * depth + b"Ns."
        machine = vm_module.PickleVM(data, vm_module.Hooks(), vm_module.Budgets.for_length(len(data)))
        with pytest.raises(BadInputError, match="nested more than"):
            machine.run()
        with pytest.raises(UnsafeInputError, match=r"builtins\.frozenset"):
            restricted_load(data, None)


@pytest.mark.parametrize(
    "under",
    [
        pickle.dumps({"w": 1}, protocol=2)[:-1],  # a whole dict under the returned one
        b"\x80\x02N(",  # None, then an open MARK: neither is what STOP returns
        b"\x80\x02]q\x00K\x01a",  # a list built with APPEND, left under
    ],
)
def test_stop_returns_the_top_of_the_stack_as_torch_loads_it(tmp_path: Path, under: bytes) -> None:
    """CPython's STOP pops the top item whatever lies under it; torch.load therefore returns the
    last object pushed, and so must the reader (it once returned the bottom one: a pickle of two
    dicts converted to the one torch never sees)."""
    import zipfile

    import torch

    path = tmp_path / "two.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("two/data.pkl", under + pickle.dumps({"v": 2}, protocol=2)[2:])
        z.writestr("two/version", "3\n")
        z.writestr("two/byteorder", "little")
    expected = torch.load(path, weights_only=True)
    assert expected == {"v": 2}
    data = under + pickle.dumps({"v": 2}, protocol=2)[2:]
    assert restricted_load(data, None)[0] == expected
