"""The native emitter (native/src/emit*.rs) against the Python one (pickling/writer.py).

The Python emitter is the reference: on every tree the native one either writes the same bytes
and lists the same storage objects in the same order, or declines (None) and the Python one
runs. Trees: the fixtures' trees as each transform leaves them (captured where the zip writer
pickles them), generated trees of records (shared and tied tensors, views of one storage,
parameters, v3 dtypes, metadata, sharing and cycles through lists and dicts), and the records
it must leave to Python.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, needs_native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.errors import BadInputError, CkptfixError, UnsafeInputError
from ckptfix.formats import compact
from ckptfix.model.dtypes import DTYPE_ITEMSIZE
from ckptfix.model.refs import ABSENT, EMPTY_HOOKS, Global, OpaqueObject, ParamInfo, Reduce, StorageRef, TensorRef
from ckptfix.model.walk import walk
from ckptfix.native import emit as native_emit
from ckptfix.pickling import writer

pytestmark = needs_native


def both(root: Any) -> tuple[writer.PickleResult, tuple[bytes, list[Any]] | None]:
    return writer.dumps_python(root), native_emit.torch_pickle(root, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS)


def assert_same(root: Any, *, handled: bool = True) -> None:
    """Native output is the Python output, byte for byte, with the same storage objects."""
    python, native = both(root)
    if native is None:
        assert not handled, "the native emitter declined a tree it handles"
        return
    data, storages = native
    assert data == bytes(python.data)
    assert len(storages) == len(python.storages)
    assert all(a is b for a, b in zip(storages, python.storages))
    assert_whole(root)


def whole_reference(root: Any) -> bool:
    """Whether every storage a tensor uses is spanned whole by one of its tensors, by
    compact.py's own test (``compact_storages`` cuts only storages for which it is not)."""
    used, whole = set(), set()
    for _, leaf in walk(root):
        if type(leaf) is TensorRef:
            used.add(id(leaf.storage))
            itemsize = DTYPE_ITEMSIZE[leaf.dtype]
            if leaf.storage_offset == 0 and compact._extent(leaf) * itemsize >= leaf.storage.nbytes:
                whole.add(id(leaf.storage))
    return used <= whole


def assert_whole(root: Any) -> bool:
    """The ``_whole`` entry point writes what the plain one writes, and its flag is the
    reference's answer (where a tensor's shape and stride differ in length the reference may
    fail to measure it: there the library answers False unless no measure is needed); when it
    says True, compaction indeed leaves the tree as it is."""
    got = writer.dumps_whole(root)
    plain = native_emit.torch_pickle(root, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS)
    assert (got is None) == (plain is None)
    if got is None or plain is None:
        return False
    result, flag = got
    assert result.data == plain[0] and all(a is b for a, b in zip(result.storages, plain[1], strict=True))
    ranks_match = all(len(t.shape) == len(t.stride) for _, t in walk(root) if type(t) is TensorRef)
    if ranks_match:
        assert flag == whole_reference(root)
    if flag:  # (with ranks that differ too: the reference must not meet one it cannot measure)
        assert compact.compact_storages(root)[0] is root
    return flag


# -- the fixtures, after each transform ---------------------------------------------------------

FIXTURES = sorted(
    p for p in (ROOT / "fixtures").iterdir() if p.suffix in (".pth", ".ckpt") and "torchscript" not in p.name
)
OPTIONS = [
    ckptfix.ConvertOptions(),
    ckptfix.ConvertOptions(strip_prefixes=["module.", "_orig_mod."], map_location="cpu"),
    ckptfix.ConvertOptions(dtype="bfloat16", add_prefix="net."),
    ckptfix.ConvertOptions(select="state_dict", drop=["*.bias"], sanitize=True),
]


def test_fixture_trees_after_each_transform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    flags: list[bool] = []
    real_whole = writer.dumps_whole

    def checked(root: Any) -> writer.PickleResult:
        python, native = both(root)
        seen.append(native is not None)
        if native is not None:
            assert native[0] == bytes(python.data)
            assert [id(s) for s in native[1]] == [id(s) for s in python.storages]
        return python

    def checked_whole(root: Any) -> tuple[writer.PickleResult, bool] | None:
        flags.append(assert_whole(root))
        return real_whole(root)

    # the writer pickles through dumps_whole (and dumps again after a compaction that cut)
    monkeypatch.setattr(compact, "dumps", checked)
    monkeypatch.setattr(compact, "dumps_whole", checked_whole)
    for i, fixture in enumerate(FIXTURES):
        for j, options in enumerate(OPTIONS):
            with contextlib.suppress(CkptfixError):  # an option that does not apply to this file
                ckptfix.convert(fixture, tmp_path / f"{i}_{j}.pth", options)
    # every fixture's tree is plain records: the native emitter wrote each one, and most use
    # their storages whole
    assert len(flags) >= 2 * len(FIXTURES) and all(seen), seen
    assert sum(flags) >= len(FIXTURES), flags


# -- generated trees ------------------------------------------------------------------------

_GLOBALS = [Global("torch", "FloatStorage"), Global("torch", "HalfStorage"), Global("torch", "BoolStorage")]
_ints = st.one_of(
    st.integers(-3, 300), st.integers(-(2**40), 2**40), st.sampled_from([65535, 65536, 2**31, -(2**31) - 1])
)
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, math.nan])
_text = st.text(max_size=8) | st.text(min_size=38, max_size=45) | st.sampled_from(["storage", "cpu", "héllo", "a" * 41])
_atoms = st.one_of(st.none(), st.booleans(), _ints, _floats, _text)


@st.composite
def record_trees(draw: st.DrawFn, exotic: bool) -> Any:
    """A tree of records. ``exotic``: also what the native emitter leaves to Python (bytes,
    sets, big ints, lone surrogates, parameters with state, opaque objects)."""
    storages: list[StorageRef] = []
    pool: list[Any] = []

    def storage() -> StorageRef:
        if storages and draw(st.booleans()):
            return draw(st.sampled_from(storages))  # a view of a storage another tensor uses
        numel = draw(st.sampled_from([0, 4, 300, 70000]))
        made = StorageRef(
            str(len(storages)),
            draw(st.sampled_from(_GLOBALS)),
            draw(st.sampled_from(["cpu", "cuda:1"])),
            numel,
            4,
            "float32",
        )
        storages.append(made)
        return made

    def dims() -> tuple[int, ...]:
        return tuple(draw(st.lists(st.sampled_from([0, 1, 3, 255, 256, 70000]), max_size=5)))

    def tensor() -> TensorRef:
        v3 = draw(st.booleans())
        hooks = draw(st.sampled_from([EMPTY_HOOKS, "od", "full"]))
        hooks = EMPTY_HOOKS if hooks is EMPTY_HOOKS else OrderedDict() if hooks == "od" else OrderedDict(h=draw(_atoms))
        param = None
        if draw(st.integers(0, 3)) == 0:
            state: Any = {"x": draw(_atoms)} if exotic and draw(st.booleans()) else ABSENT
            param = ParamInfo(draw(st.booleans()), draw(st.sampled_from([EMPTY_HOOKS, "od"])), state)
            if param.hooks == "od":
                param = ParamInfo(param.requires_grad, OrderedDict(), state)
        return TensorRef(
            storage(),
            draw(st.sampled_from([0, 7, 256, 70000])),
            dims(),
            dims(),
            "bfloat16" if v3 else "float32",
            requires_grad=draw(st.booleans()),
            hooks=hooks,
            rebuild="v3" if v3 else "v2",
            dtype_global=Global("torch", "bfloat16") if v3 else None,
            metadata={"m": draw(_atoms)} if draw(st.integers(0, 4)) == 0 else ABSENT,
            param=param,
        )

    def leaf() -> Any:
        choice = draw(st.integers(0, 9))
        if choice < 4:
            return tensor()
        if choice == 4:
            return Reduce(Global("torch", "Size"), (dims(),))
        if choice == 5:
            return draw(st.sampled_from([Global("collections", "OrderedDict"), EMPTY_HOOKS, storage()]))
        if exotic and choice == 6:
            return draw(
                st.sampled_from([b"raw", {1, 2}, 2**80, "\ud800", complex(1, 2), OpaqueObject(Global("a", "B"), ())])
            )
        return draw(_atoms)

    def node(depth: int) -> Any:
        if pool and draw(st.integers(0, 4)) == 0:
            return draw(st.sampled_from(pool))  # shared: a tied tensor, a shared container
        if depth > 3 or draw(st.integers(0, 2)) == 0:
            value = leaf()
            if isinstance(value, (TensorRef, Reduce)):
                pool.append(value)
            return value
        kind = draw(st.sampled_from(["dict", "odict", "list", "tuple"]))
        if kind == "tuple":
            value = tuple(node(depth + 1) for _ in range(draw(st.integers(0, 5))))
            pool.append(value)
            return value
        container: Any = {"dict": dict, "odict": OrderedDict, "list": list}[kind]()
        pool.append(container)
        for _ in range(draw(st.integers(0, 5))):
            child = container if draw(st.integers(0, 9)) == 0 else node(depth + 1)  # a cycle
            if isinstance(container, list):
                container.append(child)
            else:
                container[draw(st.one_of(_text, st.integers(-2, 2)))] = child
        if kind == "odict" and draw(st.booleans()):
            container._metadata = {"": {"version": 1}}
        if kind == "odict" and len(container) > 1 and draw(st.booleans()):
            container.move_to_end(next(iter(container)))  # its order is not its dict's
        return container

    return {"root": node(0)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(record_trees(exotic=False))
def test_generated_record_trees(tree: Any) -> None:
    assert_same(tree)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(record_trees(exotic=True))
def test_generated_trees_with_rare_records_are_written_or_left_to_python(tree: Any) -> None:
    assert_same(tree, handled=False)


@st.composite
def views(draw: st.DrawFn) -> Any:
    """Tensors viewing a few storages (shape and stride of one rank, typed and untyped
    storages, dtypes of other sizes): the cases compaction decides on."""
    storages = [
        StorageRef("0", Global("torch", "FloatStorage"), "cpu", draw(st.sampled_from([0, 1, 6, 24])), 4, "float32"),
        StorageRef(
            "1", Global("torch.storage", "UntypedStorage"), "cpu", draw(st.sampled_from([0, 8, 48])), 1, "uint8"
        ),
        StorageRef("2", Global("torch", "DoubleStorage"), "cpu", draw(st.sampled_from([3, 12])), 8, "float64"),
    ]
    tensors = []
    for _ in range(draw(st.integers(1, 6))):
        rank = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 6]), min_size=rank, max_size=rank)))
        stride = tuple(draw(st.lists(st.sampled_from([-1, 0, 1, 2, 4, 12]), min_size=rank, max_size=rank)))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float64", "uint8"]))
        tensors.append(
            TensorRef(draw(st.sampled_from(storages)), draw(st.sampled_from([0, 0, 1, 5])), shape, stride, dtype)
        )
    return {"t": tensors}


@settings(max_examples=60, deadline=None)
@given(views())
def test_the_whole_flag_is_compactions_own_test(tree: Any) -> None:
    assert_whole(tree)


def test_the_whole_flag_sees_a_partly_used_storage() -> None:
    """A storage only half used by its one tensor, beside one used whole: not whole (and
    compaction cuts it); a second tensor spanning it whole makes it whole."""
    used = StorageRef("0", _GLOBALS[0], "cpu", 8, 4, "float32")
    half = StorageRef("1", _GLOBALS[0], "cpu", 8, 4, "float32")
    tree: dict[str, Any] = {
        "a": TensorRef(used, 0, (8,), (1,), "float32"),
        "b": TensorRef(half, 0, (4,), (1,), "float32"),
    }
    assert assert_whole(tree) is False
    tree["c"] = TensorRef(half, 0, (2, 4), (4, 1), "float32")
    assert assert_whole(tree) is True
    tree["d"] = TensorRef(half, 0, (8,), (1,), "bfloat16")  # 16 of its 32 bytes: not whole alone
    assert assert_whole({"d": tree["d"]}) is False


# -- what it leaves to Python, and errors ---------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [b"bytes", {1}, frozenset(), 2**64, "\udc80", complex(0, 1), OpaqueObject(Global("a", "B"), ()), None],
    ids=["bytes", "set", "frozenset", "bigint", "surrogate", "complex", "opaque", "none"],
)
def test_rare_values_are_left_to_python(value: Any) -> None:
    tree = {"x": [value, value]}
    assert_same(tree, handled=value is None)
    assert writer.dumps(tree).data == writer.dumps_python(tree).data


def test_an_unallowed_global_is_refused_as_python_refuses_it() -> None:
    tree = {"cfg": Global("omegaconf", "DictConfig", allowed=False)}
    assert native_emit.torch_pickle(tree, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS) is None
    with pytest.raises(UnsafeInputError):
        writer.dumps(tree)


def test_nesting_beyond_the_walk_limit_is_refused_by_both() -> None:
    deep: Any = 1
    for _ in range(1002):  # the innermost list 1001 levels below the root: one too deep
        deep = [deep]
    assert native_emit.torch_pickle(deep, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS) is None
    with pytest.raises(BadInputError, match="nested more than"):
        writer.dumps(deep)
    assert_same(deep[0])  # 1000 levels: written


def test_a_tensor_in_its_own_metadata_is_left_to_python() -> None:
    storage = StorageRef("0", _GLOBALS[0], "cpu", 4, 4, "float32")
    meta: dict[str, Any] = {}
    t = TensorRef(storage, 0, (4,), (1,), "float32", metadata=meta)
    meta["self"] = t
    assert_same({"t": t}, handled=False)


# -- no Python code runs while the library reads (review of issue 26) ---------------------------


def test_an_ordered_dict_whose_items_is_shadowed_in_code_is_left_to_python() -> None:
    """``od.items = ...`` (an instance attribute, set in code) shadowed OrderedDict's C method:
    the library called it -- Python code -- and kept borrowed pointers to what it returned,
    freed when its iterator went: a segfault here (a 4 MiB str is unmapped when freed)."""
    od: Any = OrderedDict()
    od.items = lambda: iter([("k", "x" * (1 << 22))])
    assert native_emit.torch_pickle({"od": od}, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS) is None
    with pytest.raises(BadInputError, match="function"):
        writer.dumps({"od": od})


def test_ordered_dict_keys_with_python_hashing_are_left_to_python() -> None:
    """The OrderedDict items iterator hashes each key: a key whose ``__hash__`` is Python code
    ran inside the library (which could free what it reads). Such keys are Python's."""
    calls = []

    class Key:
        def __hash__(self) -> int:
            calls.append(1)
            return 7

    od = OrderedDict([(Key(), 1)])
    calls.clear()
    assert native_emit.torch_pickle({"od": od}, writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS) is None
    assert calls == []
    # a Global key (a frozen dataclass: its __hash__ is Python) likewise; str and int keys stay native
    assert (
        native_emit.torch_pickle(
            OrderedDict([(Global("torch", "float32"), 1)]), writer._NATIVE_OBJECTS, writer._NATIVE_SLOTS
        )
        is None
    )
    assert_same(OrderedDict([("a", 1), (2, "b")]))
