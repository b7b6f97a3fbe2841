"""Values ckptfix reads, compared with what torch itself reads (the oracle, tests/oracle.py):
big-endian files swapped as torch swaps them, one storage key named by two storage classes or
first with no elements (torch's caching rules), in the zip and the legacy format; and what
ckptfix writes from them loads in torch as the same values."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same_tree
from hostile import PROTO, g, items, legacy_file, make_legacy_header, pid, tensor, tensor_v3
from oracle import assert_reads_as_torch, torch_view
from safetensors import safe_open
from safetensors.torch import load_file

import ckptfix
from ckptfix.fileio.ranges import OpenFiles
from ckptfix.formats.checkpoint import read_checkpoint
from ckptfix.model.data import tensor_c_chunks
from ckptfix.model.refs import TensorRef

D, F, U = g("torch", "DoubleStorage"), g("torch", "FloatStorage"), g("torch.storage", "UntypedStorage")
C = g("torch", "ComplexFloatStorage")


def zip_checkpoint(dest: Path, pkl: bytes, records: dict[str, bytes], byteorder: bytes | None = b"big") -> Path:
    """A torch zip as a big-endian machine's torch.save lays it out (records as given)."""
    with zipfile.ZipFile(dest, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        for key, raw in records.items():
            z.writestr(f"archive/data/{key}", raw)
        z.writestr("archive/version", b"3\n")
    return dest


def big(values: list[float], dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).astype(np.dtype(dtype).newbyteorder(">")).tobytes()


def ckptfix_values(path: Path) -> dict[str, torch.Tensor]:
    """Each top-level tensor as ckptfix reads it (its C-order bytes, read in small chunks)."""
    root = read_checkpoint(str(path)).root
    out = {}
    with OpenFiles() as files:
        for name, t in root.items():
            assert isinstance(t, TensorRef)
            raw = bytearray(b"".join(tensor_c_chunks(t, files, chunk=8)))
            flat = (
                torch.frombuffer(raw, dtype=getattr(torch, t.dtype))
                if raw
                else torch.empty(0, dtype=getattr(torch, t.dtype))
            )
            out[name] = flat.reshape(t.shape)
    return out


def assert_values_as_torch(path: Path, tmp_path: Path, *, pth: bool = True) -> None:
    """ckptfix reads ``path`` as torch does, and writes .pth and safetensors files (verified)
    that hold torch's values."""
    view = torch_view(path)
    assert view.loads, view.weights_only_error
    expected = {k: v.contiguous() for k, v in view.tree.items()}
    assert_same_tree(ckptfix_values(path), expected, check_stride=False)
    if pth:
        out = tmp_path / f"{path.stem}.out.pth"
        ckptfix.convert(path, out, ckptfix.ConvertOptions(verify=True, allow_globals=["torch.storage.UntypedStorage"]))
        assert_reads_as_torch(path, out)
    st = tmp_path / f"{path.stem}.safetensors"
    ckptfix.convert(path, st, ckptfix.ConvertOptions(verify=True, allow_globals=["torch.storage.UntypedStorage"]))
    loaded = load_file(st)
    with safe_open(st, "pt") as f:  # tied views are stored once: restore their other names
        aliases = {k: v for k, v in (f.metadata() or {}).items() if v in loaded}
    assert_same_tree({**loaded, **{k: loaded[v] for k, v in aliases.items()}}, expected, check_stride=False)


def one(name: str, value: bytes) -> bytes:
    return PROTO + items((name, value)) + b"."


BIG_ENDIAN: dict[str, tuple[bytes, dict[str, bytes]]] = {
    # a float32 view of a DoubleStorage: torch swaps 8-byte units, the view sees their halves
    "float_over_double": (
        one("w", tensor_v3(pid("0", 2, D), g("torch", "float32"), size=(4,))),
        {"0": big([1.5, 2.5], "f8")},
    ),
    "odd_half_view_of_double": (
        one("w", tensor_v3(pid("0", 2, D), g("torch", "float16"), offset=1, size=(3,), stride=(2,))),
        {"0": big([1.5, 2.5], "f8")},
    ),
    # an untyped storage is bytes: torch swaps nothing, whatever dtype views it
    "untyped_bfloat16": (
        one("w", tensor_v3(pid("0", 8, U), g("torch", "bfloat16"), size=(4,))),
        {"0": bytes(range(1, 9))},
    ),
    # one storage under two dtypes: swapped once, by the class that loaded it first
    "two_dtypes": (
        PROTO
        + items(
            ("a", tensor_v3(pid("0", 2, D), g("torch", "float64"), size=(2,))),
            ("b", tensor_v3(pid("0", 4, F), g("torch", "float32"), size=(2, 2), stride=(1, 2))),
        )
        + b".",
        {"0": big([1.5, 2.5], "f8")},
    ),
    "complex_halves": (one("c", tensor(pid("0", 2, C), size=(2,))), {"0": big([1, 2, 3, 4], "f4")}),
    "transposed_float": (
        one("w", tensor(pid("0", 6, F), size=(3, 2), stride=(1, 3))),
        {"0": big([1, 2, 3, 4, 5, 6], "f4")},
    ),
}


@pytest.mark.parametrize("case", sorted(BIG_ENDIAN))
def test_big_endian_values_are_torchs(case: str, tmp_path: Path) -> None:
    pkl, records = BIG_ENDIAN[case]
    path = zip_checkpoint(tmp_path / f"{case}.pth", pkl, records)
    # torch.save refuses to write two dtypes over one storage: that one is compared by values
    assert_values_as_torch(path, tmp_path, pth=case != "two_dtypes")


CACHING: dict[str, tuple[bytes, dict[str, bytes]]] = {
    # an empty storage is not kept by torch: the second use loads its own, of its own type
    "empty_first": (
        PROTO + items(("a", tensor(pid("0", 0, D), size=(0,))), ("b", tensor(pid("0", 0, F), size=(0,)))) + b".",
        {"0": b""},
    ),
    # the first class decides the dtype of every v2 tensor over that key
    "double_then_float": (
        PROTO
        + items(("a", tensor(pid("0", 2, D), size=(2,))), ("b", tensor(pid("0", 4, F), size=(1,), offset=1)))
        + b".",
        {"0": np.asarray([1.5, 2.5]).tobytes()},
    ),
    "float_then_double": (
        PROTO + items(("b", tensor(pid("0", 4, F), size=(4,))), ("a", tensor(pid("0", 2, D), size=(2,)))) + b".",
        {"0": np.arange(1, 5, dtype="f4").tobytes()},
    ),
}


@pytest.mark.parametrize("case", sorted(CACHING))
def test_zip_storage_caching_is_torchs(case: str, tmp_path: Path) -> None:
    pkl, records = CACHING[case]
    path = zip_checkpoint(tmp_path / f"{case}.pth", pkl, records, byteorder=b"little")
    assert_values_as_torch(path, tmp_path)


def test_a_record_longer_than_its_storage_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    path = zip_checkpoint(tmp_path / "long.pth", one("w", tensor(pid("0", 2), size=(2,))), {"0": bytes(16)}, None)
    assert "does not match" in (torch_view(path).weights_only_error or "")
    with pytest.raises(ckptfix.BadInputError, match="holds 16 bytes but the checkpoint declares 8"):
        read_checkpoint(str(path))


P2 = b"\x80\x02"


def legacy_tree(*pairs: tuple[str, bytes]) -> bytes:
    return P2 + items(*pairs) + b"."


LEGACY: dict[str, tuple[bytes, list[tuple[str, int, bytes]]]] = {
    "empty_first": (
        legacy_tree(
            ("a", tensor(pid("0", 0, D, legacy=True), size=(0,))), ("b", tensor(pid("0", 0, F, legacy=True), size=(0,)))
        ),
        [("0", 0, b"")],
    ),
    "double_then_float": (
        legacy_tree(
            ("a", tensor(pid("0", 2, D, legacy=True), size=(2,))), ("b", tensor(pid("0", 4, F, legacy=True), size=(2,)))
        ),
        [("0", 2, np.asarray([1.5, 2.5]).tobytes())],
    ),
    "view_under_another_class": (
        legacy_tree(
            ("a", tensor(pid("0", 2, D, legacy=True), size=(2,))),
            ("b", tensor(pid("0", 4, F, legacy=True, view=("v", 1, 2)), size=(2,))),
        ),
        [("0", 2, np.asarray([1.5, 2.5]).tobytes())],
    ),
}


@pytest.fixture(scope="module")
def legacy_header() -> bytes:
    return make_legacy_header()


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_legacy_storage_caching_is_torchs(case: str, legacy_header: bytes, tmp_path: Path) -> None:
    tree, storages = LEGACY[case]
    path = legacy_file(legacy_header, tree, storages, tmp_path / f"{case}.pt")
    assert_values_as_torch(path, tmp_path, pth=case != "view_under_another_class")


F32, F16 = g("torch", "float32"), g("torch", "float16")
#: a view using part of one element of a wider storage type: compaction keeps that element whole
PARTIAL: dict[str, bytes] = {
    "float_in_second_double": one("w", tensor_v3(pid("0", 4, D), F32, offset=2, size=(1,))),
    "floats_across_doubles": one("w", tensor_v3(pid("0", 4, D), F32, offset=3, size=(2,), stride=(2,))),
    "half_in_last_double": one("w", tensor_v3(pid("0", 4, D), F16, offset=13, size=(1,))),
    "float_in_double_beside_dropped": PROTO
    + items(("w", tensor_v3(pid("0", 4, D), F32, offset=5, size=(1,))), ("drop", tensor(pid("0", 4, D), size=(4,))))
    + b".",
}


@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_compaction_keeps_the_wider_element_a_view_uses(case: str, tmp_path: Path) -> None:
    source = zip_checkpoint(tmp_path / "in.pth", PARTIAL[case], {"0": np.arange(1, 5, dtype="f8").tobytes()}, b"little")
    out = tmp_path / "out.pth"
    ckptfix.convert(source, out, ckptfix.ConvertOptions(drop=["drop"], verify=True))
    expected = {k: v for k, v in torch_view(source).tree.items() if k != "drop"}
    assert_same_tree(torch_view(out).tree, expected)
    assert read_checkpoint(str(out)).root["w"].storage.numel == 1 + (case == "floats_across_doubles")


@pytest.mark.parametrize("order", ["little", "big"])
def test_wide_views_are_gathered_in_pieces_as_torch_reads_them(order: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A view wider than SPAN_LIMIT is read in pieces: runs of rows when the first dimension has
    the widest stride (a big-endian matrix to swap, a slice of columns), else along its widest
    stride (a permuted 3-d tensor, a column, a stride-0 expansion); a limit of 10 floats here."""
    import ckptfix.model.data as data

    monkeypatch.setattr(data, "SPAN_LIMIT", 40)
    values = np.arange(60, dtype="f4")
    raw = values.astype(">f4").tobytes() if order == "big" else values.tobytes()
    views = {
        "permuted": tensor(pid("0", 60), size=(3, 4, 5), stride=(1, 15, 3)),
        "column": tensor(pid("0", 60), offset=2, size=(12,), stride=(5,)),
        "expanded": tensor(pid("0", 60), offset=7, size=(3, 9, 2), stride=(0, 6, 0)),
        "rows": tensor(pid("0", 60), size=(6, 10), stride=(10, 1)),
        "columns_slice": tensor(pid("0", 60), offset=2, size=(6, 3), stride=(10, 1)),
        "rows_of_two": tensor(pid("0", 60), offset=1, size=(30, 1), stride=(2, 1)),
    }
    path = zip_checkpoint(tmp_path / "wide.pth", PROTO + items(*views.items()) + b".", {"0": raw}, order.encode())
    expected = {k: v.contiguous() for k, v in torch_view(path).tree.items()}
    assert_same_tree(ckptfix_values(path), expected, check_stride=False)
