"""Everything torch can save, differentially against ``torch.load`` (issue 15).

Each case saves a small tree with torch (or makes a file as an older or big-endian torch did),
then runs ckptfix's transforms -- strip-module, add-module back, convert to .pth, convert to
safetensors, inspect -- and compares each output with torch's own ``torch.load`` -> the same
edit: per tensor the type, dtype, shape, stride (in .pth outputs), device, requires_grad and the
bits of every element (dtypes without arithmetic too), quantized, sparse, nested and meta
tensors by their parts, which tensors share storage, and the non-tensor values. Every .pth output
is loaded with ``weights_only=True`` and ``mmap=True``, every safetensors output with
``safetensors.torch.load_file``. What safetensors cannot hold is refused naming the feature.

The dtypes are enumerated from torch itself, so a dtype a new torch adds is checked (or fails
here) without anyone listing it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import struct
import tarfile
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same_tree, sharing_groups
from safetensors import safe_open
from safetensors.torch import load_file

import ckptfix
from ckptfix import BadInputError, UnsafeInputError

#: every dtype this torch has
TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
#: dtypes torch has but ``torch.save`` refuses ("dtype torch.int4 is not recognized"): nothing
#: torch writes holds them. A torch that learns to save one fails the test below: move it over.
UNSAVABLE = {f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)}
#: dtypes whose tensors are quantized (checked with the other tensor kinds below)
QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
#: dtypes safetensors has no code for: converting them is refused, naming the dtype
NOT_IN_SAFETENSORS = {"complex32", "complex128", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"}
#: dtypes torch 2.13 saves in the legacy format but cannot load back from it (its legacy loader
#: asks their UntypedStorage for a dtype): ckptfix reads those files, so it can repair them
LEGACY_UNREADABLE_BY_TORCH = {
    *("uint16", "uint32", "uint64", "complex32", "float4_e2m1fn_x2"),
    *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
    *("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch warns about complex32 ("experimental") and quantized tensors being saved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are an arbitrary fixed pattern (NaNs, infinities and
    subnormals included for the float types); made through uint8, so dtypes without arithmetic work."""
    numel = 1
    for size in shape:
        numel *= size
    raw = (torch.arange(numel * dtype.itemsize, dtype=torch.int64) * 37 + 11 + seed) % 251
    raw = raw.to(torch.uint8)
    if dtype is torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _tree(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A training-style checkpoint around ``state_dict``: non-tensor values beside it."""
    return {"state_dict": state_dict, "epoch": 3, "name": "run-é", "lr": 0.5, "shape": (3, 4), "flags": [True, None]}


def _dtype_state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every layout a checkpoint holds, in one dtype: contiguous, 0-dim, 0-element, transposed,
    a slice at an offset and a row of one storage, stride 0, and one tensor under two names."""
    full = _bits(dtype, (3, 4))
    return {
        "module.full": full,
        "module.transposed": full.t(),
        "module.slice": full[1:, 1:],
        "module.row": full[2],
        "module.scalar": _bits(dtype, (), seed=5),
        "module.empty": _bits(dtype, (0, 3)),
        "module.empty_last": torch.empty((2, 0), dtype=dtype),
        "module.expanded": _bits(dtype, (1, 4), seed=9).expand(3, 4),
        "module.tied": full,
    }


# =========================================================================== the checks


def _stripped(tree: dict[str, Any]) -> dict[str, Any]:
    """torch's edit for strip-module: ``consume_prefix_in_state_dict_if_present`` on a copy."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    sd = copy.copy(tree["state_dict"])
    if hasattr(sd, "_metadata"):  # edited in place by torch: a copy of its own
        sd._metadata = copy.deepcopy(sd._metadata)
    consume_prefix_in_state_dict_if_present(sd, "module.")
    return {**tree, "state_dict": sd}


def _loads(path: Path) -> Iterator[Any]:
    """What the real consumers of a .pth output get: torch.load with weights_only, and mmap'ed."""
    yield torch.load(path, weights_only=True)
    yield torch.load(path, weights_only=True, mmap=True)


def _assert_pth(path: Path, expected: Any) -> None:
    for loaded in _loads(path):
        assert_same_tree(loaded, expected)
        assert sharing_groups(loaded) == sharing_groups(expected)


def _safetensors_content(path: Path) -> dict[str, torch.Tensor]:
    """``load_file``'s tensors, plus the names save_model's metadata records as ties."""
    stored = load_file(path)
    with safe_open(path, "pt") as f:
        aliases = {k: v for k, v in (f.metadata() or {}).items() if v in stored and k not in stored}
    return {**stored, **{alias: stored[kept] for alias, kept in aliases.items()}}


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a test tree (dicts, lists, tuples), in the order torch.save meets them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (dict, list, tuple)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from _tensors_in(v)


def _dense_dtypes(tree: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The dense tensors' dtypes with their counts, and all tensors' (as inspect reports them)."""
    dense: dict[str, int] = {}
    everything: dict[str, int] = {}
    for value in _tensors_in(tree):
        name = _name(value.dtype)
        everything[name] = everything.get(name, 0) + 1
        if value.layout is torch.strided and not value.is_quantized and not value.is_nested and not value.is_meta:
            dense[name] = dense.get(name, 0) + 1
    return dense, everything


def check_everything(
    src: Path,
    expected: Any,
    tmp_path: Path,
    *,
    refusal: str | None = None,
    st_drop: tuple[str, ...] = (),
    st_expected: Any = None,
) -> None:
    """Run every ckptfix transform on ``src`` and compare each output with ``expected`` (what
    ``torch.load(src)`` gives, or would give) after torch's own edit. ``refusal``: words the
    refusal to write safetensors must contain (None: safetensors must hold the state dict);
    ``st_drop``: state-dict keys left out of the safetensors output (it cannot hold them);
    ``st_expected``: what the safetensors output must hold, where it differs from ``expected``."""
    # inspect: the tensors torch sees, by dtype (dense ones: the others are counted by their parts)
    summary = ckptfix.inspect_checkpoint(src)
    dense, everything = _dense_dtypes(expected)
    if dense == everything:
        assert summary["dtypes"] == dense
    else:  # the other kinds are counted by their dense parts (a sparse tensor's indices and values)
        assert all(summary["dtypes"].get(k, 0) >= n for k, n in dense.items())

    stripped, back, converted = tmp_path / "stripped.pth", tmp_path / "back.pth", tmp_path / "converted.pth"
    report = ckptfix.fix_prefix(src, stripped)
    assert report.written and report.renamed == len(expected["state_dict"])
    _assert_pth(stripped, _stripped(expected))
    ckptfix.fix_prefix(stripped, back, mode="add")
    _assert_pth(back, expected)
    ckptfix.convert(src, converted)
    _assert_pth(converted, expected)

    out = tmp_path / "weights.safetensors"
    opts = ckptfix.ConvertOptions(select="state_dict", strip_prefixes=("module.",))
    if refusal is not None:
        with pytest.raises(BadInputError, match=refusal):
            ckptfix.convert(src, out, opts)
        assert not out.exists()
        return
    if st_drop:
        opts = ckptfix.ConvertOptions(select="state_dict", strip_prefixes=("module.",), drop=st_drop)
    ckptfix.convert(src, out, opts)
    # safetensors holds plain tensors: a Parameter comes back as its data
    st_source = _stripped(expected if st_expected is None else st_expected)["state_dict"]
    want = {k: v.detach() for k, v in st_source.items() if f"module.{k}" not in st_drop}
    assert_same_tree(_safetensors_content(out), want, check_stride=False)
    from_st = tmp_path / "from_safetensors.pth"
    ckptfix.convert(out, from_st)
    for loaded in _loads(from_st):  # contiguous now: strides as safetensors' own loader gives them
        assert_same_tree(loaded, _safetensors_content(out))


# =========================================================================== every dtype


def test_the_dtype_list_comes_from_torch() -> None:
    """The matrix below runs over what torch has: the dtypes issue 15 names must be among them."""
    names = {_name(d) for d in TORCH_DTYPES}
    named = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
    named |= {"float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "uint16", "uint32"}
    named |= {"uint64", "complex32", "complex64", "complex128", "bool", "int8", "int16", "int32", "int64"}
    assert named <= names


@pytest.mark.parametrize("dtype", [d for d in TORCH_DTYPES if _name(d) in UNSAVABLE], ids=_name)
def test_dtypes_torch_cannot_save(dtype: torch.dtype, tmp_path: Path) -> None:
    """No torch file holds these: torch.save refuses them. When a torch saves one, this fails
    and the dtype belongs in the matrix (drop it from UNSAVABLE)."""
    with pytest.raises(KeyError, match="not recognized"):
        torch.save({"t": torch.empty(2, dtype=dtype)}, tmp_path / "x.pth")


SAVABLE = [d for d in TORCH_DTYPES if _name(d) not in UNSAVABLE | QUANTIZED]


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("dtype", SAVABLE, ids=_name)
def test_every_dtype_and_layout(dtype: torch.dtype, legacy: bool, tmp_path: Path) -> None:
    name = _name(dtype)
    tree = _tree(_dtype_state_dict(dtype))
    src = tmp_path / "in.pth"
    with _quiet():
        torch.save(tree, src, _use_new_zipfile_serialization=not legacy)
    if legacy and name in LEGACY_UNREADABLE_BY_TORCH:
        with pytest.raises(AttributeError, match="UntypedStorage"):
            torch.load(src, weights_only=False)
        expected = tree  # what torch saved: ckptfix's outputs (zip) must give it back
    else:
        expected = torch.load(src, weights_only=True)
        assert_same_tree(expected, tree)  # torch itself round-trips it
    _check_dtype_case(src, expected, name, tmp_path)


def _check_dtype_case(src: Path, expected: Any, name: str, tmp_path: Path, st_expected: Any = None) -> None:
    if name in NOT_IN_SAFETENSORS:
        check_everything(src, expected, tmp_path, refusal=f"'full' has dtype {name}, which safetensors cannot")
    elif name == "float4_e2m1fn_x2":  # safetensors' F4 shapes count 4-bit values: no 0-dim tensor
        with pytest.raises(BadInputError, match=r"'module\.scalar' is a 0-dim float4_e2m1fn_x2, which safetensors"):
            ckptfix.convert(src, tmp_path / "x.safetensors", ckptfix.ConvertOptions(select="state_dict"))
        check_everything(src, expected, tmp_path, st_drop=("module.scalar",), st_expected=st_expected)
    else:
        check_everything(src, expected, tmp_path, st_expected=st_expected)


def _header(path: Path) -> dict[str, Any]:
    import json

    data = path.read_bytes()
    return dict(json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]]))


@pytest.mark.parametrize("shape", [(2, 3), (1,), (0,), (3, 0)], ids=str)
def test_float4_safetensors_shapes_count_values(shape: tuple[int, ...], tmp_path: Path) -> None:
    """safetensors' F4 header gives the last dimension in 4-bit values (twice torch's): files
    written by the safetensors library read as torch has them, and ckptfix writes the same header."""
    from safetensors.torch import save_file

    t = _bits(torch.float4_e2m1fn_x2, shape)
    save_file({"t": t}, tmp_path / "library.safetensors")
    ckpt = ckptfix.read_checkpoint(tmp_path / "library.safetensors")
    assert ckpt.root["t"].shape == shape and ckpt.root["t"].dtype == "float4_e2m1fn_x2"
    ckptfix.write_checkpoint(ckpt, ckpt.root, tmp_path / "ours.safetensors")
    assert _header(tmp_path / "ours.safetensors")["t"] == _header(tmp_path / "library.safetensors")["t"]
    assert load_file(tmp_path / "ours.safetensors")["t"].shape == shape
    ckptfix.convert(tmp_path / "library.safetensors", tmp_path / "t.pth")
    assert_same_tree(torch.load(tmp_path / "t.pth", weights_only=True), {"t": t})


# =========================================================================== pickle protocols


def _protocol_tree() -> dict[str, Any]:
    """Python and torch values whose pickling differs between protocols (bytes, big ints, sets,
    tuples of each length, memoized repeats), around a state dict of several dtypes and layouts."""
    weight = torch.nn.Parameter(_bits(torch.float32, (2, 3)).nan_to_num(), requires_grad=True)
    sd: OrderedDict[str, Any] = OrderedDict()
    sd["module.weight"] = weight
    sd["module.half"] = _bits(torch.float16, (4,))
    sd["module.bf16_t"] = _bits(torch.bfloat16, (2, 3)).t()
    sd["module.long"] = torch.arange(5)
    sd["module.mask"] = _bits(torch.bool, (3,))
    sd["module.c64"] = _bits(torch.complex64, (2,))
    sd["module.view"] = weight.detach()[1]
    # as DataParallel saves it: the wrapper and the model at the same version, a submodule
    sd._metadata = OrderedDict({"": {"version": 1}, "module": {"version": 1}, "module.bn": {"version": 2}})  # type: ignore[attr-defined]
    tree = _tree(sd)
    tree.update(
        raw=b"\x00\xffbytes",
        empty=b"",
        big=2**80,
        negative=-(2**40),
        numbers=(1, 2.5, complex(1, -2)),
        pair=("a", "a"),
        nested=[{"k": (1,)}, {"k": (1, 2, 3, 4)}],
        tags={"x", "y"},
        counts=bytearray(b"ab"),
    )
    return tree


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_pickle_protocol(protocol: int, legacy: bool, tmp_path: Path) -> None:
    """torch's weights-only loader reads protocol 2 only (protocol 3 bytes and protocol 4's
    frames are "Unsupported operand"); ckptfix reads them all, and what it writes loads with
    ``weights_only=True`` -- compared with torch's full loader on this file we made."""
    tree = _protocol_tree()
    src = tmp_path / "in.pth"
    torch.save(tree, src, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    if protocol == 2:
        # pickle spells b"" as builtins.bytes() at protocol 2; torch's weights-only loader refuses
        # it, and so does ckptfix, naming it -- and keeps it, uncalled, when it is allowed
        with pytest.raises(pickle.UnpicklingError, match="GLOBAL bytes"):
            torch.load(src, weights_only=True)
        with pytest.raises(UnsafeInputError, match=r"builtins\.bytes"):
            ckptfix.read_checkpoint(src)
        kept = tmp_path / "kept.pth"
        ckptfix.convert(src, kept, ckptfix.ConvertOptions(allow_globals=["builtins.bytes"]))
        assert_same_tree(torch.load(kept, weights_only=False), tree)
        del tree["empty"]
        torch.save(tree, src, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
    else:
        with pytest.raises(pickle.UnpicklingError, match="Unsupported operand"), _quiet():
            torch.load(src, weights_only=True)
    with _quiet():
        expected = torch.load(src, weights_only=False)
    assert_same_tree(expected, tree)
    check_everything(src, expected, tmp_path)


# =========================================================================== other tensor kinds


def _per_channel(dtype: torch.dtype) -> torch.Tensor:
    scales, zero_points = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2])
    return torch.quantize_per_channel(torch.linspace(-1, 1, 12).reshape(3, 4), scales, zero_points, 0, dtype)


KINDS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    **{
        f"quantized-per-tensor-{_name(d)}": (
            (lambda d=d: torch.quantize_per_tensor(torch.linspace(-1, 1, 8).reshape(2, 4), 0.1, 3, d)),
            "quantized tensor",
        )
        for d in TORCH_DTYPES
        if _name(d) in QUANTIZED
    },
    "quantized-per-channel-qint8": (lambda: _per_channel(torch.qint8), "quantized tensor"),
    "quantized-per-channel-quint8": (lambda: _per_channel(torch.quint8), "quantized tensor"),
    "quantized-transposed": (
        lambda: torch.quantize_per_tensor(torch.linspace(-1, 1, 8).reshape(2, 4), 0.1, 3, torch.qint8).t(),
        "quantized tensor",
    ),
    "sparse-coo": (lambda: torch.eye(3).to_sparse(), "sparse tensor"),
    "sparse-coo-uncoalesced": (
        lambda: torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (2, 2)),
        "sparse tensor",
    ),
    "sparse-csr": (lambda: torch.eye(3).to_sparse_csr(), "sparse tensor"),
    "sparse-csc": (lambda: torch.eye(3).to_sparse_csc(), "sparse tensor"),
    "sparse-bsr": (lambda: torch.eye(4).to_sparse_bsr((2, 2)), "sparse tensor"),
    "sparse-bsc": (lambda: torch.eye(4).to_sparse_bsc((2, 2)), "sparse tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]), "nested tensor"),
    "meta": (lambda: torch.empty(3, 4, device="meta"), "meta tensor"),
    "meta-transposed": (lambda: torch.empty(3, 4, device="meta").t(), "meta tensor"),
}


@pytest.mark.parametrize(
    ("kind", "legacy"),
    # torch's legacy loader cannot read the nested tensor it saved: test_legacy_nested_tensor_is_repaired
    [(k, legacy) for k in KINDS for legacy in (False, True) if not (legacy and k == "nested")],
    ids=lambda v: v if isinstance(v, str) else ("legacy" if v else "zip"),
)
def test_quantized_sparse_nested_meta(kind: str, legacy: bool, tmp_path: Path) -> None:
    """Carried through .pth by every transform; refused for safetensors, naming the kind."""
    make, words = KINDS[kind]
    with _quiet():
        tree = _tree({"module.x": make(), "module.dense": torch.arange(4.0)})
        src = tmp_path / "in.pth"
        torch.save(tree, src, _use_new_zipfile_serialization=not legacy)
        expected = torch.load(src, weights_only=True)
        assert_same_tree(expected, tree)
        check_everything(src, expected, tmp_path, refusal=f"tensor 'x' is a {words}.*, which safetensors cannot hold")


def test_legacy_nested_tensor_is_repaired(tmp_path: Path) -> None:
    """torch saves a nested tensor in the legacy format, then cannot load it (its loader reads the
    sizes from garbage); ckptfix reads it, and its .pth gives back what was saved."""
    with _quiet():
        tree = _tree({"module.x": KINDS["nested"][0](), "module.dense": torch.arange(4.0)})
        src = tmp_path / "in.pth"
        torch.save(tree, src, _use_new_zipfile_serialization=False)
        # torch's own loader reads the sizes from uninitialised memory here: it usually raises, but
        # not always (so that is not asserted); ckptfix's result is checked against what was saved
        check_everything(src, tree, tmp_path, refusal="tensor 'x' is a nested tensor, which safetensors cannot hold")


# =========================================================================== numpy values


def _numpy_tree() -> dict[str, Any]:
    return {
        "state_dict": {"module.w": torch.arange(6.0).reshape(2, 3)},
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "transposed": np.arange(6, dtype=np.int16).reshape(2, 3).T,
        "big_endian": np.arange(3, dtype=">f4"),
        "complex": np.array([1 + 2j], dtype=np.complex64),
        "zero_dim": np.array(5, dtype=np.uint8),
        "flags": np.array([True, False]),
        "huge": np.array([2**63], dtype=np.uint64),
        "f64": np.float64(1.5),
        "i64": np.int64(-7),
        "b": np.bool_(True),
        "f32": np.float32(0.1),
        "c128": np.complex128(1j),
    }


def test_numpy_arrays_and_scalars(tmp_path: Path) -> None:
    """Refused by default (torch's weights-only loader refuses them too); ``allow_globals``
    keeps them as they are (torch.load(weights_only=False) gives equal arrays and scalars);
    ``sanitize`` makes arrays tensors and scalars Python numbers, loadable with weights_only."""
    tree = _numpy_tree()
    src = tmp_path / "in.pth"
    torch.save(tree, src)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)
    with pytest.raises(UnsafeInputError, match="numpy"):
        ckptfix.read_checkpoint(src)
    expected = torch.load(src, weights_only=False)  # our own file: torch may run it

    kept = tmp_path / "kept.pth"
    ckptfix.fix_prefix(src, kept, options=ckptfix.ConvertOptions(allow_globals=["numpy.*"]))
    assert_same_tree(torch.load(kept, weights_only=False), _stripped(expected))
    weights = tmp_path / "weights.safetensors"
    ckptfix.convert(src, weights, ckptfix.ConvertOptions(allow_globals=["numpy.*"], select="state_dict"))
    assert_same_tree(load_file(weights), expected["state_dict"])

    plain = tmp_path / "plain.pth"
    ckptfix.fix_prefix(src, plain, options=ckptfix.ConvertOptions(sanitize=True))
    sanitized = torch.load(plain, weights_only=True)
    as_data = {
        k: (torch.from_numpy(v.astype(v.dtype.newbyteorder("="))) if isinstance(v, np.ndarray) else v.item())
        for k, v in expected.items()
        if k != "state_dict"
    }
    assert_same_tree(sanitized, {**_stripped(expected), **as_data}, check_stride=False)
    for key in ("f64", "i64", "b", "f32", "c128"):
        assert type(sanitized[key]) is type(expected[key].item()), key


def test_empty_numpy_array_needs_builtins_bytes(tmp_path: Path) -> None:
    """An empty array pickles its data as builtins.bytes() (protocol 2): refused by name, like
    torch does, even with numpy allowed; allowing that name too keeps it."""
    tree = {"w": torch.ones(2), "empty": np.zeros((0, 3), dtype=np.float32)}
    torch.save(tree, tmp_path / "in.pth")
    with pytest.raises(UnsafeInputError, match=r"builtins\.bytes"):
        ckptfix.read_checkpoint(tmp_path / "in.pth", allow_globals=["numpy.*"])
    out = tmp_path / "out.pth"
    ckptfix.convert(tmp_path / "in.pth", out, ckptfix.ConvertOptions(allow_globals=["numpy.*", "builtins.bytes"]))
    assert_same_tree(torch.load(out, weights_only=False), tree)


# =========================================================================== big-endian files


def _storage_units(tree: Any) -> list[int]:
    """Per storage record of ``torch.save(tree)``, in key order ("0", "1" ...: the order the
    pickler meets them), the bytes a big-endian machine swaps as one: the element size, half of
    it for complex numbers (torch's ``_byteswap``)."""
    units: dict[int, int] = {}
    for value in _tensors_in(tree):
        size = value.element_size()
        units.setdefault(value.untyped_storage()._cdata, size // 2 if value.is_complex() else size)
    return list(units.values())


def _as_big_endian(tree: Any, src: Path, dst: Path) -> None:
    """``src`` (``torch.save(tree)``) as torch on a big-endian machine writes it: the byteorder
    record says "big" and every storage holds its elements byte-swapped; all else unchanged."""
    units = _storage_units(tree)
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            data = z.read(info)
            name = info.filename.partition("/")[2]
            if name == "byteorder":
                data = b"big"
            elif name.startswith("data/"):
                unit = units[int(name[5:])]
                data = b"".join(data[i : i + unit][::-1] for i in range(0, len(data), unit))
            out.writestr(info, data)


#: dtypes torch.save keeps in an untyped (byte) storage whose elements are wider than a byte:
#: torch 2.13's loader swaps a big-endian storage by its storage dtype, uint8 for these, so it
#: hands their big-endian bytes back unswapped (wrong values). A torch that fixes this fails below.
UNSWAPPED_BY_TORCH = {"uint16", "uint32", "uint64", "bits16", "complex32"}


@pytest.mark.parametrize("dtype", SAVABLE, ids=_name)
def test_big_endian_files(dtype: torch.dtype, tmp_path: Path) -> None:
    """torch reads a big-endian file by swapping its storages to native order; ckptfix's .pth
    outputs keep the file's byte order, so torch.load agrees on them after every transform; its
    safetensors outputs (little-endian by spec) hold torch's values -- also where torch does not
    swap (UNSWAPPED_BY_TORCH: untyped storages, swapped as bytes, that is not at all): ckptfix
    reads what torch reads (issue 22), so a gate and the loader never disagree."""
    name = _name(dtype)
    tree = _tree(_dtype_state_dict(dtype))
    with _quiet():
        torch.save(tree, tmp_path / "little.pth")
    src = tmp_path / "big.pth"
    _as_big_endian(tree, tmp_path / "little.pth", src)
    expected = torch.load(src, weights_only=True)
    if name in UNSWAPPED_BY_TORCH:
        with pytest.raises(AssertionError, match="values differ"):
            assert_same_tree(expected, tree)
    else:
        assert_same_tree(expected, tree)  # the file is what a big-endian torch writes
    assert ckptfix.read_checkpoint(src).archive.byteorder == b"big"
    _check_dtype_case(src, expected, name, tmp_path)


# =========================================================================== files of older torch versions


def _as_torch_1x(src: Path, dst: Path) -> None:
    """``src`` as torch 1.6-1.x wrote the zip format: records in a folder named after the file
    (not ``archive/``), no ``byteorder``, ``.format_version``, ``.storage_alignment`` or
    ``.data/serialization_id`` records (later additions), ``version`` 3, data.pkl at protocol 2."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            name = info.filename.partition("/")[2]
            if name in ("byteorder", ".format_version", ".storage_alignment", ".data/serialization_id"):
                continue
            out.writestr(f"{dst.stem}/{name}", z.read(info))


def test_torch_1x_zip_files(tmp_path: Path) -> None:
    tree = _tree(_dtype_state_dict(torch.float32) | {"module.param": torch.nn.Parameter(torch.ones(2))})
    torch.save(tree, tmp_path / "new.pth")
    src = tmp_path / "resnet_v1.pth"
    _as_torch_1x(tmp_path / "new.pth", src)
    with zipfile.ZipFile(src) as z:
        assert sorted(z.namelist())[0].startswith("resnet_v1/") and "resnet_v1/byteorder" not in z.namelist()
    expected = torch.load(src, weights_only=True)
    assert_same_tree(expected, tree)
    check_everything(src, expected, tmp_path)


class _Storage:
    """A storage of a hand-written legacy file: its persistent id, as torch 0.3-1.x pickled it."""

    def __init__(self, key: str, cls: Any, numel: int, view: tuple[str, int, int] | None = None) -> None:
        self.key, self.cls, self.numel, self.view = key, cls, numel, view


class _OldTensor:
    """``torch._utils._rebuild_tensor(storage, offset, size, stride)``: torch < 0.4's tensor record."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor, self.args)


def _write_old_legacy(path: Path, tree: Any, data: dict[str, bytes]) -> None:
    """The legacy layout torch 0.3-1.x wrote: magic, protocol 1001, sys_info, the tree (storages
    as persistent ids, views of a storage as ``(view_key, offset, size)``), the sorted root keys,
    then per key its element count and bytes."""
    from ckptfix.formats.legacy_pickle import MAGIC_NUMBER, PROTOCOL_VERSION

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                return ("storage", obj.cls, obj.key, "cpu", obj.numel, obj.view)
            return None

    with open(path, "wb") as f:
        for header in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(header, f, protocol=2)
        Pickler(f, protocol=2).dump(tree)
        pickle.dump(sorted(data), f, protocol=2)
        for key in sorted(data):
            f.write(struct.pack("<q", len(data[key]) // 4) + data[key])


def test_torch_0x_legacy_files_with_storage_views(tmp_path: Path) -> None:
    """Before storages lost their views (torch 2.0), a legacy file could name a storage as a view
    into another: ``('storage', FloatStorage, root, 'cpu', numel, (view_key, offset, size))``;
    tensors were ``_rebuild_tensor`` records. torch still loads them; so must ckptfix."""
    root = _Storage("94000", torch.FloatStorage, 6)
    view = _Storage("94000", torch.FloatStorage, 6, ("94001", 2, 3))  # elements 2..4 of the root
    sd = OrderedDict(
        [
            ("module.weight", _OldTensor(root, 0, (2, 3), (3, 1))),
            ("module.weight_t", _OldTensor(root, 0, (3, 2), (1, 3))),
            ("module.bias", _OldTensor(view, 1, (2,), (1,))),
        ]
    )
    src = tmp_path / "old.pth"
    _write_old_legacy(src, {"state_dict": sd, "epoch": 90}, {"94000": struct.pack("<6f", 0, 1, 2, 3, 4, 5)})
    expected = torch.load(src, weights_only=False)  # our own file
    assert expected["state_dict"]["module.bias"].tolist() == [3.0, 4.0]
    assert ckptfix.read_checkpoint(src).format == "torch-legacy"
    check_everything(src, expected, tmp_path)


def _write_tar_era(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """torch < 0.4's tar format (what torch.serialization's ``legacy_load`` reads): members
    ``sys_info``, ``storages`` (pickled count, then per storage ``(key, location, type)``, its
    element count and bytes, then the storage views), ``tensors`` (per tensor ``(key, storage,
    type)``, then ndim, sizes, strides and offset as packed integers) and ``pickle`` (the tree,
    tensors as persistent ids)."""

    def pickles(*values: Any) -> bytes:
        return b"".join(pickle.dumps(v, protocol=2) for v in values)

    storages = pickles(len(tensors))
    records = pickles(len(tensors))
    for i, t in enumerate(tensors.values()):
        data = t.contiguous().numpy().tobytes()
        storages += pickles((i, "cpu", torch.FloatStorage)) + struct.pack("<q", t.numel()) + data
        records += pickles((100 + i, i, torch.FloatTensor)) + struct.pack("<ii", t.dim(), 0)
        records += struct.pack(f"<{t.dim()}q", *t.shape) + struct.pack(f"<{t.dim()}q", *t.stride())
        records += struct.pack("<q", 0)
    storages += pickles([])

    class Marker:
        def __init__(self, key: int) -> None:
            self.key = key

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return str(obj.key) if isinstance(obj, Marker) else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(OrderedDict((k, Marker(100 + i)) for i, k in enumerate(tensors)))
    members = {"sys_info": pickles({"protocol_version": 1001, "little_endian": True}), "storages": storages}
    members |= {"tensors": records, "pickle": buffer.getvalue()}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def test_tar_era_files(tmp_path: Path) -> None:
    """torch reads the tar format only with weights_only=False: ckptfix refuses it without
    unsafe_load, naming what it is and the way out; with it, ckptfix's outputs equal torch's."""
    tensors = {"module.weight": torch.arange(6.0).reshape(2, 3), "module.bias": torch.ones(2)}
    src = tmp_path / "alexnet.pth"
    _write_tar_era(src, tensors)
    expected = torch.load(src, weights_only=False)  # our own file
    assert_same_tree(expected, OrderedDict(tensors))
    with pytest.raises(BadInputError, match="tar") as refused:
        ckptfix.read_checkpoint(src)
    assert "unsafe" in str(refused.value)
    out = tmp_path / "out.pth"
    ckptfix.fix_prefix(src, out, options=ckptfix.ConvertOptions(unsafe_load=True))
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    consume_prefix_in_state_dict_if_present(expected, "module.")
    _assert_pth(out, expected)
    st = tmp_path / "out.safetensors"
    ckptfix.convert(src, st, ckptfix.ConvertOptions(unsafe_load=True))
    assert_same_tree(load_file(st), dict(OrderedDict(tensors)), check_stride=False)
