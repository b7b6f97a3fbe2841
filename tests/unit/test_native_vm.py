"""The native pickle VM against the Python one: the same tree, or the same error, on every input.

The native VM (native/src/vm.rs) reads what checkpoints are made of and leaves everything else
to the Python VM (pickling/vm.py, the reference), so on any input ``restricted_load`` must give
exactly what the Python engine gives: the same tree -- types, values, records, memo sharing --
the same globals seen and end offset, or an error of the same class. A differential fuzzer feeds
both engines real fixtures' ``data.pkl`` mutated, the hostile builders, seeded pickle programs,
plain trees pickled at every protocol and torch.save'd state dicts (over 10 000 inputs in all:
each test asserts its share), and checks that the native engine really read a good share of them
(an engine that always declines would pass the comparison and test nothing).
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import random
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hostile
import pytest
import torch
from conftest import needs_native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pickle_programs import programs

from ckptfix import native
from ckptfix.errors import BadInputError, UnsafeInputError, UsageError
from ckptfix.model.refs import ABSENT, EMPTY_HOOKS, Global, OpaqueObject, ParamInfo, Reduce, StorageRef, TensorRef
from ckptfix.native import vm as native_vm
from ckptfix.pickling import native_tree, reader
from ckptfix.pickling.vm import Budgets

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

pytestmark = needs_native


@pytest.fixture(autouse=True, scope="module")
def native_engine() -> Iterator[None]:
    """This module compares the engines whatever CKPTFIX_ENGINE says: load the library here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTFIX_ENGINE", "native")
        native.library.cache_clear()
        native_vm._load_function.cache_clear()
        yield
    native.library.cache_clear()
    native_vm._load_function.cache_clear()


class Loader:
    """torchzip's ``load_storage``: records with sizes, storages cached by key when not empty."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.sizes = sizes
        self.storages: dict[str, StorageRef] = {}

    def __call__(self, storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef:
        from ckptfix.model.refs import make_storage

        if key in self.storages:
            return self.storages[key]
        if view is not None:
            raise BadInputError("a storage view")
        storage = make_storage(storage_type, key, location, numel, None)
        if self.sizes is not None and self.sizes.get(key) != storage.nbytes:
            raise BadInputError(f"storage {key!r} is missing or of another size")
        if storage.nbytes:
            self.storages[key] = storage
        return storage


def canon(root: Any) -> list[Any]:
    """The tree as a flat list of tokens: types, values, records' fields and which objects are
    shared (a container or record reached again is a back-reference to its first visit)."""
    out: list[Any] = []
    ids: dict[int, int] = {}
    keep: list[Any] = []
    todo = [root]
    while todo:
        x = todo.pop()
        kind = type(x)
        if kind in (str, bytes, int, bool, type(None)):
            out.append((kind.__name__, x))
            continue
        if kind is float:
            out.append(("float", "nan" if math.isnan(x) else x.hex()))
            continue
        if kind is complex:
            out.append(("complex", repr(x)))
            continue
        if x is ABSENT or x is EMPTY_HOOKS:
            out.append(repr(x) + "!")
            continue
        if id(x) in ids:
            out.append(("ref", ids[id(x)]))
            continue
        ids[id(x)] = len(ids)
        keep.append(x)
        if kind in (list, tuple, set, frozenset, bytearray):
            out.append((kind.__name__, len(x)))
            todo.extend(reversed(list(x)) if kind not in (set, frozenset) else sorted(x, key=repr))
        elif kind in (dict, OrderedDict):
            attrs = sorted(vars(x).items()) if kind is OrderedDict else []
            out.append((kind.__name__, len(x), [k for k, _ in attrs]))
            for k, v in reversed(list(x.items()) + attrs):
                todo += [v, k]
        elif kind is TensorRef:
            out.append(("tensor", x.storage_offset, x.shape, x.stride, x.dtype, x.requires_grad, x.rebuild))
            todo += [x.param, x.metadata, x.dtype_global, x.hooks, x.storage]
        elif kind is StorageRef:
            out.append(("storage", x.key, x.location, x.numel, x.itemsize, x.dtype, x.byteorder))
            todo.append(x.storage_type)
        elif kind is Global:
            out.append(("global", x.module, x.name, x.allowed))
        elif kind is Reduce:
            out.append(("reduce",))
            todo += [x.state, x.args, x.func]
        elif kind is ParamInfo:
            out.append(("param",))
            todo += [x.state, x.hooks, x.requires_grad]
        elif kind is OpaqueObject:
            out.append(("opaque", x.kind))
            todo += [x.state, x.dictitems, x.items, x.kwargs, x.args, x.global_]
        else:
            out.append(("other", kind.__name__, repr(x)))
    return out


class Engines:
    """Runs ``restricted_load`` on both engines and counts what the native one read itself."""

    def __init__(self) -> None:
        self.inputs = 0
        self.native_read = 0
        self._real_load = native_vm.load

    def read(self, data: bytes, native_engine: bool, loader: Callable[[], Any], budgets: Budgets | None) -> Any:
        """``restricted_load``'s result as tokens; on the native engine, also whether it read the pickle."""
        seen: set[str] = set()
        answered: list[bool] = []

        def counted(*args: Any) -> bytes | None:
            result = self._real_load(*args)
            answered.append(result is not None)
            return result

        native_vm.load = counted if native_engine else (lambda *args: None)  # type: ignore[assignment]
        try:
            tree, end = reader.restricted_load(data, loader(), seen, budgets=budgets)
            result: Any = ("ok", canon(tree), end, sorted(seen))
        except UnsafeInputError:
            result = ("unsafe",)
        except BadInputError as exc:
            result = ("bad", type(exc).__name__)
        finally:
            native_vm.load = self._real_load  # type: ignore[method-assign]
        return result, bool(answered and answered[0])

    def check(self, data: bytes, loader: Callable[[], Any] = Loader, budgets: Budgets | None = None) -> None:
        """Both engines on ``data``. Where the native VM declines, the Python VM has just read it
        as the fallback: the same code, so only what the native VM read itself is compared."""
        self.inputs += 1
        got, native_read = self.read(data, True, loader, budgets)
        if native_read:
            self.native_read += 1
            expected, _ = self.read(data, False, loader, budgets)
            assert got == expected, f"engines differ on {data[:200]!r}"


def mutants(rng: random.Random, seed: bytes, count: int) -> Iterator[bytes]:
    interesting = b"\x00\x01\x7f\x80\xff()t.\x95hqjrRQbuse02\x94\x85]}"
    for _ in range(count):
        m = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(m) + 1)
            op = rng.randrange(6)
            if op == 0 and m:
                m[min(at, len(m) - 1)] = rng.randrange(256)
            elif op == 1 and m:
                del m[min(at, len(m) - 1)]
            elif op == 2:
                m[at:at] = bytes([rng.choice(interesting)])
            elif op == 3 and len(m) > 1:
                a = rng.randrange(len(m))
                m[at:at] = m[a : a + rng.randrange(1, 40)]
            elif op == 4 and len(m) > 4:
                i = rng.randrange(len(m) - 4)
                m[i : i + 4] = rng.choice([0, 1, 255, 2**31 - 1, 2**32 - 1]).to_bytes(4, "little")
            else:
                m[at:] = b""
        yield bytes(m)


def fixture_pickles() -> list[tuple[str, bytes, dict[str, int]]]:
    """Each zip fixture's data.pkl with its storage record sizes."""
    found = []
    for path in sorted(FIXTURES.glob("*")):
        if not zipfile.is_zipfile(path):
            continue
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl")]
            if not pkl:
                continue
            folder = pkl[0][: -len("data.pkl")]
            sizes = {n[len(folder) + 5 :]: z.getinfo(n).file_size for n in names if n.startswith(folder + "data/")}
            found.append((path.name, z.read(pkl[0]), sizes))
    return found


def plain_tree(rng: random.Random, depth: int = 0) -> Any:
    """A random tree of what checkpoints hold besides tensors, with shared sub-trees."""
    atoms: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.random() < 0.5,
        lambda: rng.randrange(-(2**70), 2**70) if rng.random() < 0.1 else rng.randrange(-300, 70000),
        lambda: rng.choice([0.5, -0.0, float("inf"), 1e300, float("nan")]),
        lambda: rng.choice(["", "a", "module.w", "é\u20ac", "x" * 300]),
        lambda: rng.choice([b"", b"\x00", b"xy" * 200]),
    ]
    if depth > 2 or rng.random() < 0.4:
        return rng.choice(atoms)()
    width = rng.randrange(0, 5)
    kind = rng.randrange(6)
    if kind == 0:
        return [plain_tree(rng, depth + 1) for _ in range(width)]
    if kind == 1:
        return tuple(plain_tree(rng, depth + 1) for _ in range(width))
    keys: list[Any] = [rng.choice(["a", "b", "c", 1, 2, True, None, b"k", 2**40, 1.5, ("t", 1)]) for _ in range(width)]
    if kind == 2:
        return {k: plain_tree(rng, depth + 1) for k in keys}
    if kind == 3:
        od: OrderedDict[Any, Any] = OrderedDict((k, plain_tree(rng, depth + 1)) for k in keys)
        if rng.random() < 0.5:
            od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
        return od
    shared = plain_tree(rng, depth + 1)
    return [shared, {"s": shared}, shared]


@pytest.fixture
def engines() -> Engines:
    return Engines()


def test_real_fixtures_and_their_mutants(engines: Engines) -> None:
    rng = random.Random(26)
    pickles = fixture_pickles()
    assert len(pickles) >= 8
    for _name, data, sizes in pickles:
        loader = functools.partial(Loader, sizes)
        engines.check(data, loader)
        engines.check(data, lambda: Loader({}))  # every storage record missing: the loader's error
        for mutant in mutants(rng, data, 80):
            engines.check(mutant, loader)
    assert engines.inputs >= 800 and engines.native_read >= len(pickles), (engines.inputs, engines.native_read)


def test_plain_trees_at_every_protocol(engines: Engines) -> None:
    rng = random.Random(7)
    for _ in range(1500):
        data = pickle.dumps(plain_tree(rng), protocol=rng.randrange(0, 6))
        engines.check(data)
        for mutant in mutants(rng, data, 2):
            engines.check(mutant)
    assert engines.inputs == 4_500 and engines.native_read > 800, engines.native_read


def test_hostile_builders_and_pickle_programs(engines: Engines) -> None:
    rng = random.Random(12)
    builders = [
        hostile.ckpt(),
        hostile.ckpt(hostile.tensor(size=(2, 3), stride=(3, 1))),
        hostile.ckpt(weight=hostile.tensor(metadata=hostile.items(("a", hostile.n(1))))),
        hostile.ckpt(
            weight=hostile.tensor_v3(
                hostile.pid(cls=hostile.g("torch.storage", "UntypedStorage")), hostile.g("torch", "float16")
            )
        ),
        hostile.ckpt(hostile.g("torch", "Size") + hostile.tup((2, 3)) + b"\x85R"),
        hostile.ckpt(
            hostile.g("torch._utils", "_rebuild_parameter") + b"(" + hostile.tensor() + b"\x88" + hostile.HOOKS + b"tR"
        ),
        hostile.ckpt(b"]" * 1100 + b"a" * 1099),
        hostile.ckpt(hostile.u("x") + b"\x85" * 1100),
        hostile.ckpt(hostile.u("s") + hostile.pid()),
        hostile.ckpt(weight=hostile.tensor(size=b"(\x88t", stride=b"(K\x01t")),
        hostile.key_of(hostile.u("x") + b"\x85" * 200),
        hostile.system_call(Path("/nonexistent/marker")),
        # a size list appended to after the tensor was built (the tensor keeps the old shape)
        hostile.ckpt(
            hostile.get(210) + hostile.n(7) + b"a",
            weight=hostile.tensor(size=b"](" + hostile.n(2) + hostile.n(2) + b"e" + hostile.put(210), stride=(2, 1)),
        ),
        # an empty hooks OrderedDict filled after the tensor was built, and one BUILT empty before
        hostile.ckpt(
            hostile.get(211) + hostile.u("k") + hostile.n(1) + b"s",
            weight=hostile.tensor().replace(hostile.HOOKS, hostile.HOOKS + hostile.put(211)),
        ),
        hostile.ckpt(weight=hostile.tensor().replace(hostile.HOOKS, hostile.HOOKS + b"}b")),
    ]
    for data in builders:
        engines.check(data)
        for mutant in mutants(rng, data, 100 if len(data) < 1000 else 20):  # the deep ones cost 10x
            engines.check(mutant)
    for program in programs(5, 3700):
        engines.check(program)
    assert engines.inputs >= 4_650 and engines.native_read >= 30, (engines.inputs, engines.native_read)


def test_budgets_are_the_python_vms(engines: Engines) -> None:
    """Tight budgets: where the Python VM runs out, the native one declines (and Python refuses)."""
    data = hostile.ckpt(hostile.ckpt())
    for objects in range(1, 40, 3):
        engines.check(data, budgets=Budgets(max_objects=objects, max_alloc=1 << 30, max_memo=4))
        engines.check(data, budgets=Budgets(max_objects=1 << 20, max_alloc=64 * objects, max_memo=1 << 20))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_saved_state_dicts(engines: Engines, data: st.DataObject) -> None:
    from strategies import flat_state_dicts

    sd = data.draw(flat_state_dicts())
    if data.draw(st.booleans()):
        sd = {"model": OrderedDict(sd), "epoch": 3, "tied": next(iter(sd.values()), None)}
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    with zipfile.ZipFile(buffer) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        engines.check(z.read(name))


def test_the_native_tree_is_built_without_python_engine_objects() -> None:
    """A torch.save'd state dict is read natively (not handed back to the Python VM)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2), "m": torch.nn.Linear(2, 2).state_dict()}, buffer)
    with zipfile.ZipFile(buffer) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    hooks = reader.ReaderHooks(Loader(), set())
    fast = native_tree.load(data, 0, Budgets.for_length(len(data)), reader.native_table(), hooks.find_global, Loader())
    assert fast is not None
    tree, end = fast
    assert end == len(data) and type(tree["m"]) is OrderedDict and type(tree["w"]) is TensorRef
    assert tree["w"].hooks is EMPTY_HOOKS and tree["m"]._metadata[""] == {"version": 1}


def test_an_encoding_name_with_a_nul_is_bad_input() -> None:
    """Found by this fuzzer: ``_codecs.encode("x", "l\\x00")`` made codecs.lookup raise ValueError (exit 5)."""
    data = hostile.ckpt(hostile.g("_codecs", "encode") + b"(" + hostile.u("x") + hostile.u("l\x00") + b"tR")
    with pytest.raises(BadInputError, match=r"_codecs\.encode"):
        reader.restricted_load(data, Loader())


def test_a_library_without_the_vm_is_python_or_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale build (same ABI, no ckptfix_vm_load): the Python VM reads, except where the native
    engine was asked for, which never falls back in silence."""

    def stale(name: str, *argtypes: Any) -> Any:
        raise AttributeError(name)

    monkeypatch.setattr(native_vm, "function", stale)
    try:
        for engine in ("auto", "native"):
            monkeypatch.setenv("CKPTFIX_ENGINE", engine)
            native_vm._load_function.cache_clear()
            if engine == "auto":
                assert native_vm.load(b"N.", 0, 2, reader.native_table(), (9, 9, 9), False) is None
            else:
                with pytest.raises(UsageError, match="stale build"):
                    native_vm.load(b"N.", 0, 2, reader.native_table(), (9, 9, 9), False)
    finally:
        native_vm._load_function.cache_clear()
