"""Core v2 by construction: the structure rules a test enforces, and generated trees round-tripped
through emitter -> pickle.loads / torch.load(weights_only=True) -> VM with sharing and cycles."""

from __future__ import annotations

import ast
import io
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from typing import Any

import pytest
import torch
from conftest import ROOT, parsed
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckptfix.formats.checkpoint import read_checkpoint
from ckptfix.formats.torchzip import write_torch_zip
from ckptfix.pickling.reader import restricted_load
from ckptfix.pickling.writer import dumps

PACKAGE = ROOT / "ckptfix"

#: functions allowed to call themselves, and why (none of them walks a checkpoint's tree)
_RECURSION_ALLOWED = {
    ("cli/render.py", "printable"): "escapes ckptfix's own report document (a few levels), never file data",
}


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.engine_independent  # the source, read with ast
def test_no_recursive_traversal_in_the_package() -> None:
    """THE walk (model.walk.walk) is the only traversal: no function in the package calls itself
    (which is how every recursive tree walk is written), nested functions included."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for func in _functions(parsed(path)):
            calls = {n.func.id for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)} | {
                n.func.attr
                for n in ast.walk(func)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id in ("self", "cls")
            }
            if func.name in calls and (path.relative_to(PACKAGE).as_posix(), func.name) not in _RECURSION_ALLOWED:
                offenders.append(f"{path.relative_to(PACKAGE)}:{func.lineno} {func.name}")
    assert not offenders, f"recursive functions (use model.walk.walk): {offenders}"


@pytest.mark.engine_independent  # the source, read with ast
def test_no_python_unpickler_and_one_opcode_table() -> None:
    """Nothing in the package unpickles through :mod:`pickle` or reads opcodes with pickletools:
    the VM (pickle_vm.py) is the only place opcodes are interpreted."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "native_tree.py":
            continue  # CPython's unpickler over the native VM's own output (GLOBAL-free), never a file's bytes
        source = path.read_text()
        tree = parsed(path)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "pickletools" not in imported, path
        assert "_Unpickler" not in source and "Unpickler(" not in source, path
        if "pickle" in imported:
            assert path.name == "legacy.py", f"{path} imports pickle"


# --------------------------------------------------------------------------- generated trees

_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    # not b"": torch.save spells it builtins.bytes(), which torch.load(weights_only=True) refuses too
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(min_size=1, max_size=8),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
)
_keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.tuples(st.text(max_size=3), st.integers(0, 3)))


@st.composite
def trees(draw: st.DrawFn) -> Any:
    """Nested dicts/OrderedDicts/lists/tuples/sets of atoms, with shared sub-trees and cycles
    through lists and dicts (the only cycles pickle can express without a class)."""
    pool: list[Any] = []

    def node(depth: int) -> Any:
        if pool and draw(st.integers(0, 5)) == 0:
            return draw(st.sampled_from(pool))  # a shared reference
        if depth > 3 or draw(st.integers(0, 2)) == 0:
            return draw(_atoms)
        kind = draw(st.sampled_from(["dict", "odict", "list", "tuple", "set"]))
        if kind == "set":
            return set(draw(st.lists(st.one_of(st.integers(-9, 9), st.text(max_size=3)), max_size=4)))
        if kind == "tuple":
            value: Any = tuple(node(depth + 1) for _ in range(draw(st.integers(0, 4))))
            if depth >= 2:
                pool.append(value)
            return value
        container: Any = {"dict": dict, "odict": OrderedDict, "list": list}[kind]()
        if depth >= 2:  # share only small sub-trees: sharing big ones makes printing a failing
            pool.append(container)  # example (repr does not memoize) exponential
        for _ in range(draw(st.integers(0, 4))):
            child = container if draw(st.integers(0, 9)) == 0 else node(depth + 1)  # a cycle
            if isinstance(container, list):
                container.append(child)
            else:
                container[draw(_keys)] = child
        if kind == "odict" and draw(st.booleans()):
            container._metadata = {"": {"version": draw(st.integers(1, 3))}}
        return container

    root = node(0)
    lists = [c for c in pool if type(c) is list] + ([root] if type(root) is list else [])
    if lists and draw(st.booleans()):  # a tuple inside a list that holds it, met first through the
        target = draw(st.sampled_from(lists))  # tuple: pickle's POP + GET case
        cycle = (target, draw(_atoms))
        target.append(cycle)
        return {"cycle": cycle, "root": root}
    return {"root": root}


def assert_isomorphic(a: Any, b: Any) -> None:
    """Same values, same types, and the same sharing: identity in ``a`` <-> identity in ``b``,
    cycles included. Iterative (the trees may contain themselves)."""
    pairs: dict[int, int] = {}
    reverse: dict[int, int] = {}
    stack = [(a, b, "root")]
    while stack:
        x, y, where = stack.pop()
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y) and x.dtype == y.dtype, where
            continue
        assert type(x) is type(y), f"{where}: {type(x).__name__} != {type(y).__name__}"
        if isinstance(x, (dict, list, tuple, set)):
            if id(x) in pairs:
                assert pairs[id(x)] == id(y), f"{where}: sharing differs"
                continue
            assert id(y) not in reverse, f"{where}: two objects became one"
            pairs[id(x)], reverse[id(y)] = id(y), id(x)
            assert len(x) == len(y), where
            if isinstance(x, dict):
                assert list(x) == list(y), f"{where}: keys {list(x)} != {list(y)}"
                stack.extend((x[k], y[k], f"{where}.{k!r}") for k in x)
                assert getattr(x, "__dict__", {}) == getattr(y, "__dict__", {}), f"{where}: attributes differ"
            elif isinstance(x, set):
                assert x == y, where
            else:
                stack.extend((p, q, f"{where}[{i}]") for i, (p, q) in enumerate(zip(x, y)))
        elif isinstance(x, float) and x != x:
            assert y != y, where
        else:
            assert x == y, f"{where}: {x!r} != {y!r}"


def _no_storage(*_: Any) -> Any:
    raise AssertionError("no storages in these trees")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trees())
def test_generated_trees_round_trip_through_emitter_pickle_and_vm(tree: Any) -> None:
    data = dumps(tree).data
    assert_isomorphic(tree, pickle.loads(data))  # Python's own unpickler
    assert_isomorphic(tree, restricted_load(data, _no_storage)[0])  # our VM, same result
    if not _needs_pop(data):  # torch's safe loader has no POP: a tuple on a cycle is beyond it
        assert_isomorphic(tree, torch.load(io.BytesIO(_zip_of(data)), weights_only=True))


def _needs_pop(data: bytes | bytearray) -> bool:
    """Pickle's recursion rule (a tuple reached again through its own contents) writes POP."""
    return any(op.name in ("POP", "POP_MARK") for op, _, _ in pickletools.genops(bytes(data)))


def _zip_of(pickle_bytes: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buffer.getvalue()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trees(), st.integers(1, 4))
def test_trees_with_tensors_round_trip_through_torch(tmp_path_factory: Any, tree: Any, n: int) -> None:
    """torch.save -> ckptfix read (VM) -> ckptfix write (emitter) -> torch.load(weights_only=True):
    the same tree, tensors bit for bit, shared tensors still shared."""
    assume(not _needs_pop(pickle.dumps(tree, protocol=2)))  # torch.load(weights_only=True) has no POP
    tmp = tmp_path_factory.mktemp("rt")
    base = torch.arange(12, dtype=torch.float32)
    tensors = [base[i : i + 3] for i in range(n)] + [base]
    tree["tensors"] = tensors
    tree["tied"] = {"a": tensors[0], "b": tensors[0]}
    src, out = tmp / "in.pth", tmp / "out.pth"
    torch.save(tree, src)
    ckpt = read_checkpoint(src)
    with open(out, "wb") as f:
        write_torch_zip(ckpt.root, f)
    loaded = torch.load(out, weights_only=True)
    assert_isomorphic(torch.load(src, weights_only=True), loaded)
    assert loaded["tied"]["a"] is loaded["tied"]["b"]
