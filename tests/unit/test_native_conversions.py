"""Many-tensor conversions with the native engine's batches: ``--dtype`` casts of small storages
(transforms/cast.py ``_CastBatch``) and the small tensors of safetensors files and shards
(formats/safetensors.py ``_write_data``), each a gathered read and one call per batch.

Differential: the same tree written with the batches and with the Python paths (the library
hidden from this piece) gives byte-identical files, and those read back through torch
(``torch.load(weights_only=True)``), ``safetensors.torch.load_file`` and huggingface_hub as the
tensors torch's own ``.to(dtype)`` gives.
"""

from __future__ import annotations

import io
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from conftest import needs_native
from safetensors.torch import load_file

import ckptfix
from ckptfix.errors import BadInputError
from ckptfix.fileio.ranges import FileRange, OpenFiles
from ckptfix.formats import safetensors as st
from ckptfix.formats.sharded import write_sharded
from ckptfix.model.refs import Global, TensorRef, make_storage
from ckptfix.native import cast as native_cast
from ckptfix.transforms import cast as cast_mod

pytestmark = needs_native

#: float32 bits torch treats specially: NaN payloads, infinities, subnormals, -0.0, a value
#: that rounds up to infinity in float16 and in bfloat16, halfway cases
SPECIAL_BITS = [0x7FA12345, 0xFFC00001, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF, 0x80000000]
SPECIAL_BITS += [0x477FF000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x33000000, 0x387FF000]


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small training checkpoint: 120 small tensors of the four float dtypes, specials, a tie,
    two views of one storage, a big tensor (not batched), an integer, optimizer state."""
    torch.manual_seed(26)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    sd: dict[str, Any] = {f"module.l{i}.weight": torch.randn(3 + i % 5).to(dtypes[i % 4]) for i in range(120)}
    sd["module.specials"] = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    sd["module.tied"] = sd["module.l0.weight"]
    base = torch.randn(10, dtype=torch.float64)
    sd["module.v1"], sd["module.v2"] = base[2:5], base[5:]
    sd["module.big"] = torch.randn(20_000)  # 80 KB: above SMALL_COPY, cast and copied on its own
    sd["module.steps"] = torch.tensor(7)
    path = tmp_path_factory.mktemp("many") / "many.pth"
    torch.save({"state_dict": sd, "opt": {"state": {0: {"exp_avg": torch.randn(4)}}}}, path)
    return path


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of a few tensors, so the fixture's ~120 make many of them."""
    monkeypatch.setattr(cast_mod, "BATCH_COUNT", 7)
    monkeypatch.setattr(st, "GATHER_COUNT", 5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _cast_file(src: Path, dtype: str) -> bytes:
    ckpt = ckptfix.read_checkpoint(src)
    root, report = cast_mod.cast_floats(ckpt.root, dtype)
    assert report.tensors >= 90  # the tensors of the other three float dtypes at least
    out = io.BytesIO()
    ckpt.write(root, out)
    return out.getvalue()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cast_batches_write_the_python_paths_bytes_and_torchs_values(
    many: Path, dtype: str, small_batches: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert native_cast.available()
    batched = _cast_file(many, dtype)
    monkeypatch.setattr(native_cast, "library", lambda: None)
    assert _cast_file(many, dtype) == batched
    (tmp_path / "out.pth").write_bytes(batched)
    got = torch.load(tmp_path / "out.pth", weights_only=True)["state_dict"]
    original = torch.load(many, weights_only=True)["state_dict"]
    target = getattr(torch, dtype)
    for name, t in original.items():
        want = t.to(target) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype, name
        assert _bits(got[name]).equal(_bits(want)), name
    assert got["module.tied"].data_ptr() == got["module.l0.weight"].data_ptr()
    assert got["module.v1"].untyped_storage().data_ptr() == got["module.v2"].untyped_storage().data_ptr()


def test_a_batch_member_past_the_end_of_its_file_raises_the_python_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library declines a range the file does not hold; the reference's read then raises
    (the batch is not read again for each member)."""
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(100))
    root = {
        "state_dict": {
            f"w{i}": TensorRef(
                make_storage(Global("torch", "FloatStorage"), str(i), "cpu", 8, FileRange(str(path), off, 32)),
                0,
                (8,),
                (1,),
                "float32",
            )
            for i, off in enumerate([0, 40, 80])  # the last ends 12 bytes past the file
        }
    }
    errors = []
    calls = []
    real_gather = native_cast.gather
    monkeypatch.setattr(native_cast, "gather", lambda *a: calls.append(1) or real_gather(*a))
    for hide in (False, True):
        if hide:
            monkeypatch.setattr(native_cast, "library", lambda: None)
        cast_root, _ = cast_mod.cast_floats(root, "bfloat16")
        storages = [t.storage for t in cast_root["state_dict"].values()]
        with OpenFiles() as files:
            assert storages[0].source.produce(files) == bytes(16)
            with pytest.raises(BadInputError) as caught:
                storages[2].source.produce(files)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "ended inside tensor data" in errors[0]
    assert calls == [1]


def test_retyped_passes_every_tensor_field() -> None:
    assert tuple(f.name for f in fields(TensorRef)) == cast_mod.RETYPED_FIELDS


def _safetensors_bytes(src: Path) -> bytes:
    sd = ckptfix.read_checkpoint(src).root["state_dict"]
    out = io.BytesIO()
    st.write_safetensors(sd, out)
    return out.getvalue()


def test_safetensors_batches_write_the_python_paths_bytes(
    many: Path, small_batches: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    batched = _safetensors_bytes(many)
    monkeypatch.setattr(native_cast, "library", lambda: None)
    assert _safetensors_bytes(many) == batched
    (tmp_path / "out.safetensors").write_bytes(batched)
    got = load_file(tmp_path / "out.safetensors")
    original = torch.load(many, weights_only=True)["state_dict"]
    assert set(got) == set(original) - {"module.tied"}  # the tie is written once, named in metadata
    for name, t in got.items():
        assert _bits(t).equal(_bits(original[name])), name


def _shards(src: Path, out: Path) -> dict[str, bytes]:
    sd = ckptfix.read_checkpoint(src).root["state_dict"]
    out.mkdir()
    write_sharded(sd, out, 20_000)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_shards_batches_write_the_python_paths_bytes_and_the_hub_reads_them(
    many: Path, small_batches: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    batched = _shards(many, tmp_path / "native")
    monkeypatch.setattr(native_cast, "library", lambda: None)
    assert _shards(many, tmp_path / "python") == batched
    assert len(batched) > 3  # several shards and the index
    index = json.loads(batched["model.safetensors.index.json"])
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(huggingface_hub.load_state_dict_from_file(tmp_path / "native" / shard))
    original = torch.load(many, weights_only=True)["state_dict"]
    assert set(got) == set(original) - {"module.tied"}
    for name, t in got.items():
        assert _bits(t).equal(_bits(original[name])), name


class _OlderLibrary:
    """The loaded library as one built before the cast and gather exports (the same ABI version,
    so the loader takes it): every other export is the real one's."""

    MISSING = ("ckptfix_cast_floats", "ckptfix_gather_ranges")

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        if name in self.MISSING:
            raise AttributeError(f"undefined symbol: {name}")
        return getattr(self._lib, name)


def test_a_library_without_the_batch_exports_runs_the_python_paths(
    many: Path, small_batches: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As crc.py's copy_range and records.py do: a library built before these exports is not an
    internal error (exit 5) but the Python paths, with their bytes."""
    from ckptfix import native

    older = _OlderLibrary(native.library())
    with monkeypatch.context() as patch:
        patch.setattr(native_cast, "library", lambda: None)
        want = (_cast_file(many, "bfloat16"), _safetensors_bytes(many))
    monkeypatch.setattr(native, "library", lambda: older)
    monkeypatch.setattr(native_cast, "library", lambda: older)
    assert not native_cast.available()
    assert native_cast.cast_floats(b"\0\0\0\0", "float32", "bfloat16") is None
    assert (_cast_file(many, "bfloat16"), _safetensors_bytes(many)) == want


def test_a_storage_of_several_views_is_cast_once_per_batch(
    tmp_path: Path, small_batches: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A safetensors output writes each view of a storage in full, so a storage split into views
    (a fused qkv weight) is asked for once per view: the batch must count members, not asks,
    or it frees its blob before every member had it and casts the batch again (three times
    the reads and casts here), and a batch asked once more than it has members keeps its blob
    to the end of the write (memory growing with the checkpoint)."""
    torch.manual_seed(3)
    sd = {}
    for i in range(20):
        w = torch.randn(12)
        sd[f"l{i}.q"], sd[f"l{i}.k"], sd[f"l{i}.v"] = w[:4], w[4:8], w[8:]
    torch.save(sd, tmp_path / "qkv.pth")
    casts: list[int] = []
    real = cast_mod._CastBatch._cast_all
    monkeypatch.setattr(cast_mod._CastBatch, "_cast_all", lambda self, files: casts.append(1) or real(self, files))

    def written() -> bytes:
        root, _ = cast_mod.cast_floats(ckptfix.read_checkpoint(tmp_path / "qkv.pth").root, "bfloat16")
        out = io.BytesIO()
        st.write_safetensors(root, out)
        return out.getvalue()

    batched = written()
    assert len(casts) == 3  # 20 storages in batches of 7
    monkeypatch.setattr(native_cast, "library", lambda: None)
    assert written() == batched
