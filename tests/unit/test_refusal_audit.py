"""The refusal audit (issue 22): every refusal the pickle VM and the reader's builders raise, one
input each, against torch's weights-only unpickler (``torch.load(weights_only=True)`` reads
``data.pkl`` with it). Each row is one of

* ``torch`` -- torch refuses it too (checked here);
* ``budget: <name>`` -- a named limit of ckptfix's own; torch would read on (slowly, or by
  allocating what the file asks). ``scan`` never stops at these (it reads on, or reports
  ``<not read to the end>`` as dangerous);
* ``deviation: <why>`` -- torch accepts it and ckptfix refuses on purpose (checked: torch does
  accept it, so the row cannot go stale silently).
"""

from __future__ import annotations

import io
import struct
import warnings
from typing import Any

import pytest
from hostile import g, n, u

from ckptfix.errors import CkptfixError
from ckptfix.pickling.reader import restricted_load
from ckptfix.pickling.vm import Budgets

P2, P4, P5 = b"\x80\x02", b"\x80\x04", b"\x80\x05"
OD = g("collections", "OrderedDict")
COLLIDING = b"}(" + b"".join(n(i * ((1 << 61) - 1) + 5) + b"N" for i in range(40)) + b"u"

#: (label, pickle, what, budgets for the reader or None)
AUDIT: list[tuple[str, bytes, str, Budgets | None]] = [
    ("truncated", P2 + b"}", "torch", None),
    ("TUPLE without a MARK", P2 + b"t.", "torch", None),
    ("stack underflow", P2 + b"\x85.", "torch", None),
    ("a text opcode without its newline", P2 + b"I1", "torch", None),
    ("a malformed INT", P2 + b"Ix\n.", "torch", None),
    ("an INT of 5000 decimal digits", P2 + b"I" + b"1" * 5000 + b"\n.", "torch", None),
    ("a malformed FLOAT", P2 + b"F1_0\n.", "torch", None),
    ("a negative PUT index", P2 + b"Np-1\n.", "torch", None),
    ("a FRAME longer than the data", P4 + b"\x95" + struct.pack("<Q", 1000) + b"}.", "torch", None),
    ("a read across a FRAME end", P4 + b"\x95" + struct.pack("<Q", 4) + b"}\x8c\x05a" + b"bcdef0.", "torch", None),
    ("STOP with an empty stack", P2 + b".", "torch", None),
    ("a negative LONG4 length", P2 + b"\x8b\xff\xff\xff\xff.", "torch", None),
    (
        "a LONG4 over max_long_bytes",
        P2 + b"\x8b" + struct.pack("<i", 9) + b"\x01" * 9 + b".",
        "torch",
        Budgets(max_long_bytes=8),
    ),
    ("a string that is not UTF-8", P2 + b"X\x01\x00\x00\x00\xff.", "torch", None),
    ("a malformed UNICODE", P2 + b"V\\u12\n.", "torch", None),
    ("a STRING without quotes", P2 + b"Sabc\n.", "torch", None),
    ("a negative BINSTRING length", P2 + b"T\xff\xff\xff\xff.", "torch", None),
    ("READONLY_BUFFER on a str", P5 + u("a") + b"\x98.", "torch", None),
    ("DICT with an odd number of items", P2 + b"(Nd.", "torch", None),
    ("an unhashable dict key", P2 + b"}]Ns.", "torch", None),
    ("an unhashable set element", P4 + b"\x8f(]\x90.", "torch", None),
    ("SETITEMS with an odd number of items", P2 + b"}(Nu.", "torch", None),
    ("a memo entry used before it is set", P2 + b"h\x05.", "torch", None),
    ("STACK_GLOBAL with names that are not strings", P4 + b"NN\x93.", "torch", None),
    ("a GLOBAL that is not UTF-8", P2 + b"c\xff\nx\n.", "torch", None),
    ("REDUCE with arguments that are not a tuple or list", P2 + OD + b"NR.", "torch", None),
    ("NEWOBJ_EX with arguments of the wrong types", P4 + OD + b"N}\x92.", "torch", None),
    ("OBJ without a class", P2 + b"(o.", "torch", None),
    ("BUILD on an OrderedDict with state None", P2 + OD + b")RNb.", "torch", None),
    ("an unsupported opcode (EXT1)", P2 + b"\x82\x01.", "torch", None),
    ("NEXT_BUFFER (no out-of-band buffers)", P5 + b"\x97.", "torch", None),
    ("APPENDS on something that is not a list", P2 + b"N(Ne.", "torch", None),
    ("SETITEMS on something that is not a dict", P2 + b"N(NNu.", "torch", None),
    ("ADDITEMS on something that is not a set", P4 + b"N(N\x90.", "torch", None),
    ("a tensor rebuild with the wrong arguments", P2 + g("torch._utils", "_rebuild_tensor_v2") + b")R.", "torch", None),
    ("OrderedDict with two arguments", P2 + OD + b"NN\x86R.", "torch", None),
    ("OrderedDict of something that is not pairs", P2 + OD + b"](" + n(1) + b"e\x85R.", "torch", None),
    ("Counter of a number", P2 + g("collections", "Counter") + n(5) + b"\x85R.", "torch", None),
    ("set of a number", P2 + g("builtins", "set") + n(5) + b"\x85R.", "torch", None),
    ("complex of malformed text", P2 + g("builtins", "complex") + u("x") + b"\x85R.", "torch", None),
    ("a call of something that is not a global", P2 + u("x") + b")R.", "torch", None),
    ("BUILD on a list", P2 + b"]}b.", "torch", None),
    ("a persistent id that is not a storage", P2 + b"NQ.", "torch", None),
    ("a global off the allow-list", P2 + g("argparse", "Namespace") + b".", "torch", None),
    ("a dangerous global", P2 + g("posix", "system") + b".", "torch", None),
    # ckptfix's own limits: torch reads on
    ("more objects than the pickle's size allows", P2 + b"]0]0]0]0}.", "budget: max_objects", Budgets(max_objects=3)),
    ("more memo entries than allowed", P2 + b"Nq\x00q\x01q\x02.", "budget: max_memo", Budgets(max_memo=2)),
    (
        "a dict key nested more than 100 deep",
        P2 + b"}" + u("x") + b"\x85" * 150 + b"Ns.",
        "budget: MAX_KEY_NESTING",
        None,
    ),
    ("40 dict keys sharing one hash", P2 + COLLIDING + b".", "budget: MAX_SHARED_HASH (hash flooding)", None),
    (
        "bytearray of 2**24 + 1 bytes",
        P2 + g("builtins", "bytearray") + n(2**24 + 1) + b"\x85R.",
        "budget: MAX_BYTEARRAY",
        None,
    ),
    # refused on purpose although torch accepts
    (
        "BUILD giving an OrderedDict an attribute named 'items'",
        P2 + OD + b")R}" + u("items") + n(1) + b"sb.",
        "deviation: an attribute shadowing a dict method breaks every reader of the state dict",
        None,
    ),
    (
        "BUILD on an OrderedDict with a non-string attribute name",
        P2 + OD + b")R}" + n(1) + n(1) + b"sb.",
        "deviation: attributes are names (CPython's own BUILD accepts it too; torch's writers never make it)",
        None,
    ),
    (
        "BUILD on an OrderedDict with a list of pairs",
        P2 + OD + b")R](" + u("a") + n(1) + b"\x86eb.",
        "deviation: CPython refuses it (state is not a dictionary); only the weights-only unpickler updates from pairs",
        None,
    ),
    (
        "_codecs.encode with a text-to-text codec (rot13)",
        P2 + g("_codecs", "encode") + u("x") + u("rot13") + b"\x86R.",
        "deviation: only text encodings make protocol-2 bytes; rot13 makes a str no pickler writes so",
        None,
    ),
    (
        "NEWOBJ of torch.Size",
        P2 + g("torch", "Size") + b"(" + n(1) + b"t\x85\x81.",
        "deviation: torch pickles Size by REDUCE; NEWOBJ of torch classes is not read",
        None,
    ),
    (
        "NEWOBJ of builtins.set",
        P2 + g("builtins", "set") + b")\x81.",
        "deviation: set.__new__ makes an empty set whatever its arguments; never pickled so",
        None,
    ),
]


def weights_only(data: bytes) -> Any:
    from torch._weights_only_unpickler import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(io.BytesIO(data), encoding="utf-8")


@pytest.mark.parametrize(("label", "data", "what", "budgets"), AUDIT, ids=[row[0] for row in AUDIT])
def test_every_refusal_is_torchs_own_or_named(label: str, data: bytes, what: str, budgets: Budgets | None) -> None:
    with pytest.raises(CkptfixError):
        restricted_load(data, None, budgets=budgets)
    if what == "torch":
        with pytest.raises(Exception):  # noqa: B017 -- torch's errors are of many types
            weights_only(data)
    elif what.startswith("deviation"):
        weights_only(data)  # torch accepts it: the row says why ckptfix does not


#: (shape, stride): negative strides torch reads (empty tensors, one-element dimensions) and refuses
NEGATIVE_STRIDES = [
    ((0,), (-1,)),
    ((0, 2), (-5, 1)),
    ((2, 0), (9, -1)),
    ((3, 0, 2), (-1, -2, -3)),
    ((1,), (-1,)),
    ((1, 2), (-1, 1)),
    ((2, 1), (1, -5)),
    ((1, 1), (-2, -3)),
    ((4,), (-1,)),
    ((2, 2), (2, -1)),
]


@pytest.mark.parametrize(("shape", "stride"), NEGATIVE_STRIDES, ids=[f"{a}-{b}" for a, b in NEGATIVE_STRIDES])
def test_negative_strides_are_read_as_torch_reads_them(tmp_path: Any, shape: Any, stride: Any) -> None:
    """torch refuses a negative stride over more than one element (its storage size overflows)
    and reads the rest, replacing each negative stride (c10's ``set_sizes_and_strides``): the
    fixed file must hold what torch loads -- shape, stride, offset and values."""
    import torch
    from hostile import ckpt, make_base_zip, tensor, with_data_pkl

    import ckptfix

    src = with_data_pkl(make_base_zip(tmp_path), ckpt(weight=tensor(size=shape, stride=stride)), tmp_path / "in.pth")
    try:
        expected = torch.load(src, weights_only=True)["sd"]["module.w"]
    except RuntimeError:
        with pytest.raises(CkptfixError, match="negative stride"):
            ckptfix.fix_prefix(src, tmp_path / "out.pth")
        return
    ckptfix.fix_prefix(src, tmp_path / "out.pth")
    got = torch.load(tmp_path / "out.pth", weights_only=True)["sd"]["w"]
    assert (got.shape, got.stride(), got.storage_offset()) == (
        expected.shape,
        expected.stride(),
        expected.storage_offset(),
    )
    assert torch.equal(got, expected)
