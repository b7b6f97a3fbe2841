"""The storage records the library builds (native/src/vm_records.rs) against the Python resolver.

``_ZipStorages.many`` asks the library first: in torch.save's layout it builds every
``StorageRef`` and ``FileRange`` through the C API. Those objects must be exactly what the
Python comprehension builds (same types, same field values and field types, the same shared
objects), every reference the library takes must be released with the records, and anything
outside the layout it models must come back None so the Python resolver decides.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import tempfile
import zipfile
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_native

from ckptfix import native
from ckptfix.fileio.ranges import FileRange
from ckptfix.formats import torchzip
from ckptfix.model.refs import Global, StorageRef
from ckptfix.native import records as native_records
from ckptfix.native import vm as native_vm

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
ZIP_FIXTURES = sorted(p for p in FIXTURES.glob("*.p*") if zipfile.is_zipfile(p) and "torchscript" not in p.name)

pytestmark = needs_native


@pytest.fixture(autouse=True, scope="module")
def native_engine() -> Iterator[None]:
    """Compare the engines whatever CKPTFIX_ENGINE says: load the library here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTFIX_ENGINE", "native")
        native.library.cache_clear()
        native_vm._load_function.cache_clear()
        yield
    native.library.cache_clear()
    native_vm._load_function.cache_clear()


def _fields(storage: StorageRef) -> list[tuple[type, Any]]:
    """Every field of a storage and of its byte range, with its exact type."""
    values = [getattr(storage, f.name) for f in dataclasses.fields(storage) if f.name != "source"]
    assert type(storage.source) is FileRange
    values += [getattr(storage.source, f.name) for f in dataclasses.fields(storage.source)]
    return [(type(v), v) for v in values]


def _same(built: Any, reference: Any) -> None:
    assert reference is not None and built is not None
    (made, sizes), (ref_made, ref_sizes) = built, reference
    assert type(made) is list and type(sizes) is array and sizes.typecode == "q"
    assert sizes == ref_sizes and len(made) == len(ref_made)
    for a, b in zip(made, ref_made, strict=True):
        assert type(a) is StorageRef and _fields(a) == _fields(b)
        assert a.storage_type is b.storage_type and a.dtype is b.dtype and a.key is b.key


class _Spy:
    """``_ZipStorages.many`` asked both ways on every read: the library's records against the
    Python comprehension's (the library switched off for the second)."""

    def __init__(self) -> None:
        self.built = 0
        self.calls = 0

    def bound(self) -> Any:
        """A replacement for ``_ZipStorages.many`` that goes through this spy."""
        return lambda loader, *columns: self.many(loader, *columns)

    def many(self, loader: Any, *columns: Any) -> Any:
        self.calls += 1
        built = loader._many_native(*columns)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torchzip._ZipStorages, "_many_native", lambda *_: None)
            reference = _PYTHON_MANY(loader, *columns)
        if built is not None:
            self.built += 1
            _same(built, reference)
        return reference


_PYTHON_MANY = torchzip._ZipStorages.many


def _read(path: Path) -> Any:
    with path.open("rb") as f:
        return torchzip.read_torch_zip(str(path), f, path.stat().st_size, set())


def test_fixtures_build_the_python_records(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy()
    monkeypatch.setattr(torchzip._ZipStorages, "many", lambda self, *c: spy.many(self, *c))
    for path in ZIP_FIXTURES:
        _read(path)
    assert ZIP_FIXTURES and spy.built == spy.calls >= len(ZIP_FIXTURES) - 2  # the library built them


def _saved(tree: Any, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    if not compress:
        return buffer.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), zipfile.ZIP_DEFLATED if "/data/1" in info.filename else 0)
    return out.getvalue()


def _loader(data: bytes, base: int = 0) -> torchzip._ZipStorages:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.pth"
        path.write_bytes(data)
        with path.open("rb") as f:
            raw = torchzip.read_checked_directory(f, len(data), "t.pth")
    return torchzip._ZipStorages(torchzip.split_archive_names(raw, "t.pth"), "t.pth", base, "little")


FLOAT = Global("torch", "FloatStorage")
HALF = Global("torch", "HalfStorage")


def test_trees_and_shared_storages(tmp_path: Path) -> None:
    weight = torch.arange(12.0)
    tree = {"a": weight, "c": torch.zeros(3, dtype=torch.float16), "e": torch.zeros(0)}
    for shared, expected in ((False, 1), (True, 0)):  # a storage two tensors use: left to Python
        spy = _Spy()
        data = _saved({**tree, "b": weight[2:5]} if shared else tree)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torchzip._ZipStorages, "many", spy.bound())
            (tmp_path / "t.pth").write_bytes(data)
            _read(tmp_path / "t.pth")
        assert (spy.built, spy.calls) == (expected, 1)
    data = _saved(tree)
    # base offset, and the objects passed in are the ones the records hold
    loader = _loader(data, base=1000)
    columns = ([0, 1, 0], ["0", "1", "2"], ["cpu", "cuda:0", "cpu"], [12, 3, 0])
    built = loader._many_native([FLOAT, HALF], *columns)
    _same(built, torchzip._ZipStorages(loader.records, "t.pth", 1000, "little").many([FLOAT, HALF], *columns))
    assert built is not None and built[0][0].source.offset >= 1000 and built[0][1].location == "cuda:0"


@pytest.mark.parametrize(
    "globals_, columns",
    [
        ([FLOAT, HALF], ([0, 1], ["0", "1"], ["cpu", "cpu"], [12, 4])),  # a record of another size
        ([FLOAT, HALF], ([0, 1], ["1", "0"], ["cpu", "cpu"], [3, 12])),  # another order
        ([FLOAT, HALF], ([0, 0], ["0", "0"], ["cpu", "cpu"], [12, 12])),  # a key used twice
        ([FLOAT, HALF], ([0, 1], ["0", "9"], ["cpu", "cpu"], [12, 3])),  # a missing record
        ([Global("torch", "NoSuchStorage"), HALF], ([0, 1], ["0", "1"], ["cpu", "cpu"], [12, 3])),  # no dtype
        ([FLOAT, HALF], ([0, 2], ["0", "1"], ["cpu", "cpu"], [12, 3])),  # a kind out of range
        ([FLOAT, HALF], ([0, 1], ["0", "1"], ["cpu", "cpu"], [12, 1 << 70])),  # a numel beyond 64 bits
        ([FLOAT, HALF], ([0, 1], ["0", "\udc80"], ["cpu", "cpu"], [12, 3])),  # a lone surrogate
    ],
)
def test_outside_the_layout_is_left_to_python(globals_: list[Global], columns: Any) -> None:
    data = _saved({"a": torch.arange(12.0), "c": torch.zeros(3, dtype=torch.float16)})
    loader = _loader(data)
    assert loader._many_native(globals_, *columns) is None


def test_a_deflated_record_is_left_to_python() -> None:
    loader = _loader(_saved({"a": torch.zeros(2), "b": torch.ones(3)}, compress=True))
    columns = ([0, 0], ["0", "1"], ["cpu", "cpu"], [2, 3])
    assert loader._many_native([FLOAT], *columns) is None
    assert native_records.storages(StorageRef, FileRange, columns, ([FLOAT], [4], ["float32"]), *_rest(loader)) is None
    loader = _loader(_saved({"a": torch.zeros(2), "b": torch.ones(3)}))
    assert native_records.storages(StorageRef, FileRange, columns, ([FLOAT], [4], ["float32"]), *_rest(loader))


def _rest(loader: torchzip._ZipStorages) -> tuple[Any, ...]:
    c = loader.records.columns()
    return c.names, loader.records.rows(["data/0"])[0], (c.size, c.data_offset, c.crc, c.method), "p", 0, "little"


def test_references_are_released() -> None:
    data = _saved({"a": torch.arange(12.0), "c": torch.zeros(3, dtype=torch.float16)})
    loader = _loader(data)
    path, order = "t-unique-path.pth", "little-unique"
    loader.path, loader.order = path, order
    keys, locations, numels = ["0", "1"], ["cpu-unique", "cpu-unique"], [12, 3]
    watched = (path, order, FLOAT, HALF, keys[0], locations[0])
    before = [sys.getrefcount(o) for o in watched]
    built = loader._many_native([FLOAT, HALF], [0, 1], keys, locations, numels)
    assert built is not None
    during = [sys.getrefcount(o) for o in watched]
    assert [d - b for d, b in zip(during, before, strict=True)] == [2, 2, 1, 1, 1, 2]
    del built
    assert [sys.getrefcount(o) for o in watched] == before


def test_directory_lookups_without_a_dict_until_many() -> None:
    """The native directory answers a few lookups by scanning its names, then builds the dict:
    the same answers either way (rows, membership, records, KeyError, unhashable keys)."""
    data = _saved({str(i): torch.zeros(1) for i in range(20)})
    records = _loader(data).records
    names = list(records)
    assert records._index is None  # split_archive_names made no dict
    assert "data.pkl" in records and "nope" not in records and records.rows(["data/3"]) == [names.index("data/3")]
    assert records["data/3"].name == "data/3" and records.get("nope") is None
    with pytest.raises(TypeError):
        [] in records  # noqa: B015 -- as a dict lookup fails
    assert records._index is None
    scanned = [records.rows([n])[0] for n in names]  # past _SCANS lookups: the dict is built
    assert records._index is not None and scanned == list(range(len(names)))
    assert records.rows([*names, "nope"]) == [*range(len(names)), None]
    with pytest.raises(KeyError):
        records["nope"]
    with pytest.raises(ValueError, match="share a name"):
        records.with_names(["a"] * len(names))
