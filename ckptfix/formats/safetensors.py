"""safetensors files, read and written without torch.

Layout: an 8-byte little-endian header length N, N bytes of JSON
(``{"__metadata__": {str: str}, NAME: {"dtype", "shape", "data_offsets": [begin, end]}, ...}``),
then the raw little-endian data, each tensor contiguous in row-major order.

Writing follows ``safetensors.torch.save_model`` where safetensors cannot hold what a torch
checkpoint can:

* tied tensors (one storage, same view: ``lm_head.weight is embed.weight``) are written once,
  under the alphabetically first name, and every other name is recorded in ``__metadata__``
  as ``{"dropped_name": "kept_name"}`` -- exactly save_model's convention, which ckptfix reads
  back to restore the tie when converting to .pth;
* other views into a shared storage (slices, transposes, a flat DeepSpeed buffer) are written
  as their own contiguous bytes (save_model would refuse those);
* data is ordered by element size (largest first), then name, as the safetensors library does,
  so every tensor is aligned for memory mapping -- unless the tensors' bytes already sit in one
  file (a safetensors input being renamed, its metadata edited, tensors dropped) and keeping
  their order there lets more of them be copied in long runs: then the input's order is kept;
* the header is padded with spaces (the library pads to 8 bytes the same way) so that the data
  section starts at the offset, modulo 4096, where the longest such runs start in their file: a
  copy-on-write file system (XFS, btrfs) then shares those blocks instead of copying them, and
  a file whose header and data are both unchanged is copied whole.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, TypeAlias

from ..errors import BadInputError, InputMismatchError
from ..fileio import strictjson
from ..fileio.ranges import BLOCK, SMALL_COPY, FileRange, JoinedSource, OpenFiles, OutputStream, is_plain_range
from ..fileio.urls import is_url
from ..model.data import is_c_contiguous, storage_swap_unit, tensor_c_chunks
from ..model.dtypes import DTYPE_ITEMSIZE, DTYPE_TO_SAFETENSORS, SAFETENSORS_DTYPES, SAFETENSORS_PACKED
from ..model.needs import need_torch
from ..model.refs import Reduce, TensorRef, is_torch_tensor, tensor_from_range
from ..native import cast as native_cast

if TYPE_CHECKING:
    import torch

#: what identifies a view: storage, offset, shape, stride and dtype
_ViewKey: TypeAlias = tuple[int, int, tuple[int, ...], tuple[int, ...], str]

#: the safetensors library refuses headers above 100 MB; so do we
MAX_HEADER_BYTES = 100_000_000
#: serde_json, which the library parses headers with, refuses nesting deeper than this
MAX_HEADER_DEPTH = 127
_U64 = 1 << 64
_ALIGN = 8
#: --max-expand's default budget: EXPAND_FACTOR x the input's size, at least EXPAND_FLOOR bytes
EXPAND_FACTOR = 16
EXPAND_FLOOR = 1 << 30


def read_safetensors(path: str, f: BinaryIO, file_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse a safetensors file into ``{name: TensorRef}`` (no data read) and its metadata.

    The header is held to what the safetensors library (``safetensors/src/tensor.rs``,
    ``read_metadata`` and ``Metadata::validate``) accepts, so ckptfix never reads a file
    differently from the loader that will use it: a header of at most 100 MB inside the file,
    UTF-8 JSON nested at most 127 deep, ``__metadata__`` absent, null or a map of strings,
    every entry a ``dtype``/``shape``/``data_offsets`` record of the right types whose byte
    length is exactly shape x dtype (no arithmetic overflow), and the entries, in offset order,
    tiling the data section exactly from its first byte to the last byte of the file: no
    overlap, no hole, nothing after the last tensor. One deliberate difference: a key repeated
    in the header is refused (the library keeps the last occurrence; see ``strictjson``).

    Names that ``__metadata__`` maps to a stored tensor (``save_model``'s record of a tied
    weight it dropped) are restored as the same tensor.
    """
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise BadInputError(f"{path}: truncated safetensors file (no header)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES:
        raise BadInputError(
            f"{path}: safetensors header declares {header_len} bytes, more than the {MAX_HEADER_BYTES} the "
            "safetensors library accepts: corrupt"
        )
    if 8 + header_len > file_size:
        raise BadInputError(
            f"{path}: safetensors header declares {header_len} bytes, beyond the end of the file "
            f"({file_size} bytes): truncated or corrupt"
        )
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise BadInputError(f"{path}: the file ended inside the safetensors header (truncated?)")
    try:
        header = strictjson.loads(raw, serde_numbers=True)
    except strictjson.JSONError as exc:
        raise BadInputError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise BadInputError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = _check_metadata(path, header.pop("__metadata__", None))
    data_start, data_size = 8 + header_len, file_size - 8 - header_len
    entries = {name: _check_entry(path, name, info) for name, info in header.items()}
    _check_layout(path, entries, data_size)
    tensors: dict[str, Any] = {
        name: tensor_from_range(dtype, shape, FileRange(path, data_start + begin, end - begin))
        for name, (begin, end, dtype, shape) in entries.items()
    }
    for alias, kept in metadata.items():
        if alias not in tensors and kept in tensors:
            tensors[alias] = tensors[kept]
    return tensors, metadata


def _check_metadata(path: str, metadata: Any) -> dict[str, str]:
    """``__metadata__``: absent or null (no metadata), else a map of strings to strings."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
        strictjson.is_text(k) and strictjson.is_text(v) for k, v in metadata.items()
    ):
        raise BadInputError(f"{path}: corrupt safetensors __metadata__ (it must map strings to strings)")
    return metadata


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64


def _check_entry(path: str, name: str, info: Any) -> tuple[int, int, str, tuple[int, ...]]:
    """One header entry, typed as the library's ``TensorInfo`` (usize shape and offsets)."""
    if not strictjson.is_text(name):
        raise BadInputError(f"{path}: corrupt safetensors header: a tensor name is not valid Unicode ({name!r:.100})")
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: {info!r:.100}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: unsupported dtype {code!r:.40}")
    if not (isinstance(shape, list) and all(_is_u64(s) for s in shape)):
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: shape {shape!r:.100}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: data_offsets {offsets!r:.100}")
    for key, value in info.items():  # the library ignores other fields, but parses them (depth, text)
        if key not in ("dtype", "shape", "data_offsets") and (
            2 + strictjson.depth(value) > MAX_HEADER_DEPTH
            or not all(strictjson.is_text(t) for t in itertools.chain([key], strictjson.strings_in(value)))
        ):
            raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: field {key!r:.40} is invalid")
    begin, end = offsets
    packed = SAFETENSORS_PACKED.get(dtype, 1)
    if packed > 1:  # F4: the header counts 4-bit values, torch (and the data) whole bytes of them
        if not shape or shape[-1] % packed:
            raise BadInputError(
                f"{path}: safetensors tensor {name!r} ({code} {shape}) does not end on a byte boundary: corrupt"
            )
        shape = [*shape[:-1], shape[-1] // packed]
    numel = 1
    for size in shape:  # in order, with the library's checked u64 arithmetic
        numel *= size
        if numel >= _U64:
            break
    nbytes = numel * DTYPE_ITEMSIZE[dtype]
    if numel >= _U64 or nbytes * 8 >= _U64:
        raise BadInputError(f"{path}: safetensors tensor {name!r} has a shape {shape} too large to exist: corrupt")
    if end - begin != nbytes:
        raise BadInputError(
            f"{path}: safetensors tensor {name!r} ({dtype} {shape}) has data range [{begin}, {end}), which does not "
            f"fit its size ({nbytes} bytes): corrupt"
        )
    return begin, end, dtype, tuple(shape)


def _check_layout(path: str, entries: Mapping[str, tuple[int, int, str, tuple[int, ...]]], data_size: int) -> None:
    """In offset order, the tensors must tile the data section exactly, as the library requires."""
    expected = 0
    for begin, end, name in sorted((begin, end, name) for name, (begin, end, _, _) in entries.items()):
        if begin != expected:
            how = "overlaps the tensor before it" if begin < expected else f"leaves {begin - expected} unused bytes"
            raise BadInputError(
                f"{path}: safetensors tensor {name!r} starts at data offset {begin}, but the data before it ends at "
                f"{expected}: it {how}; corrupt file"
            )
        expected = end
    if expected < data_size:
        raise BadInputError(
            f"{path}: {data_size - expected} bytes after the last safetensors tensor's data (the header covers "
            f"{expected} of {data_size} data bytes): corrupt or not a safetensors file"
        )
    if expected > data_size:
        raise BadInputError(
            f"{path}: safetensors tensor data runs to byte {expected} of a {data_size}-byte data section: truncated "
            "or corrupt"
        )


@dataclass
class SafetensorsPlan:
    """What will be written: kept tensors in data order, aliases, and the header bytes."""

    tensors: list[tuple[str, TensorRef]]
    aliases: dict[str, str]
    header: bytes
    data_bytes: int
    #: each tensor's :func:`_plain_span` and byte count, worked out once for the writer
    spans: list[tuple[str, int] | None] | None = None
    sizes: list[int] | None = None


@dataclass
class _Run:
    """Consecutive tensors of the output whose bytes lie back to back, as they are, in one file:
    one stretch the kernel can copy (and a copy-on-write file system share) at once, if the
    header puts it at the right offset. ``start`` is its offset in the output's data section."""

    start: int
    path: str
    offset: int
    size: int


def _nbytes(t: TensorRef) -> int:
    """``t.nbytes`` with the product in C (the property multiplies in a Python loop)."""
    return math.prod(t.shape) * DTYPE_ITEMSIZE.get(t.dtype, 1)


def _plain_span(t: TensorRef) -> tuple[str, int] | None:
    """(file, offset) where ``t``'s bytes already are exactly as safetensors stores them
    (little-endian, C order, uncompressed), or None when they must be gathered."""
    source = t.storage.source
    if (
        type(source) is FileRange  # the common case, decided without the general checks below
        and source.deflated_size is None
        and t.storage.byteorder == "little"
        and len(t.shape) == 1
        and t.shape[0] > 0
        and (t.stride == (1,) or t.shape[0] == 1)
    ):
        return source.path, source.offset + t.storage_offset * DTYPE_ITEMSIZE[t.dtype]
    if t.numel == 0 and is_plain_range(source):
        return source.path, source.offset  # no bytes: its offset may be anything (2**62), never read
    if storage_swap_unit(t.storage) or not is_plain_range(source) or not is_c_contiguous(t.shape, t.stride):
        return None
    return source.path, source.offset + t.storage_offset * DTYPE_ITEMSIZE[t.dtype]


def _joined(t: TensorRef) -> JoinedSource | None:
    """``t``'s bytes as file ranges end to end, when they are stored as safetensors stores them."""
    source = t.storage.source
    whole = t.storage_offset == 0 and t.storage.byteorder == "little" and is_c_contiguous(t.shape, t.stride)
    return source if isinstance(source, JoinedSource) and whole and t.nbytes == source.size else None


def _runs(
    tensors: list[tuple[str, TensorRef]],
    spans: list[tuple[str, int] | None] | None = None,
    sizes: list[int] | None = None,
) -> list[_Run | TensorRef]:
    """The data section as pieces: runs to copy, and tensors to gather one by one (``spans``
    and ``sizes``: each tensor's :func:`_plain_span` and byte count, when already known)."""
    if spans is None:
        spans = [_plain_span(t) for _, t in tensors]
    if sizes is None:
        sizes = [_nbytes(t) for _, t in tensors]
    pieces: list[_Run | TensorRef] = []
    start = 0
    last: _Run | None = None
    for (_, t), span, size in zip(tensors, spans, sizes):
        if span is None:
            pieces.append(t)
            last = None
        elif last is not None and last.path == span[0] and last.offset + last.size == span[1]:
            last.size += size
        else:
            last = _Run(start, span[0], span[1], size)
            pieces.append(last)
        start += size
    return pieces


def _run_sizes(spans: list[tuple[str, int] | None], sizes: list[int]) -> list[int]:
    """For each tensor, the byte count of the run (:func:`_runs`) it is part of; 0 for a
    tensor gathered on its own."""
    out = [0] * len(spans)
    i, n = 0, len(spans)
    while i < n:
        span = spans[i]
        if span is None:
            i += 1
            continue
        j, total = i + 1, sizes[i]
        while j < n and (nxt := spans[j]) is not None and nxt[0] == span[0] and span[1] + total == nxt[1]:
            total += sizes[j]
            j += 1
        out[i:j] = [total] * (j - i)
        i = j
    return out


def _best_placement(pieces: Iterable[_Run | TensorRef]) -> tuple[int | None, int]:
    """(offset modulo :data:`BLOCK` for the data section, bytes that can then be shared).

    A run shares blocks when the data section starts at its file offset minus its offset in
    the section (mod 4096); with the section 8-aligned, as the library writes it, and runs of
    at least 64 KiB (as for zip records: smaller ones are not worth it) of local files (a
    remote object's bytes are streamed, never shared). None: nothing can be.
    """
    shared: dict[int, int] = {}
    for piece in pieces:
        if isinstance(piece, _Run) and piece.size >= SMALL_COPY and not is_url(piece.path):
            residue = (piece.offset - piece.start) % BLOCK
            if residue % _ALIGN == 0:
                shared[residue] = shared.get(residue, 0) + piece.size
    if not shared:
        return None, 0
    residue = max(shared, key=lambda r: (shared[r], -r))
    return residue, shared[residue]


def _all_remote(kept: list[tuple[str, TensorRef]]) -> bool:
    """Whether every tensor's bytes are in remote objects: written in their order, they are read
    in one pass, neighbours coalesced into few ranged requests (in name order, a request or more
    per jump; nothing is shared with a remote object anyway)."""
    return all(isinstance(t.storage.source, FileRange) and is_url(t.storage.source.path) for _, t in kept)


def _in_source_order(
    kept: list[tuple[str, TensorRef]], spans: list[tuple[str, int] | None], sizes: list[int]
) -> list[int] | None:
    """The order of ``kept`` (indices) in which its bytes lie in their files, or None when some
    tensor must be gathered or that order would leave a tensor misaligned for its element size."""
    if None in spans:
        return None
    order = sorted(range(len(kept)), key=lambda i: (spans[i], kept[i][0]))
    start = 0
    for i in order:
        if start % DTYPE_ITEMSIZE[kept[i][1].dtype]:
            return None
        start += sizes[i]
    return order


#: the torch tensor kinds a pickle rebuilds through a call ckptfix keeps as a record, by that call
_TENSOR_KINDS = {
    "torch._utils._rebuild_qtensor": "quantized tensor",
    "torch._utils._rebuild_sparse_tensor": "sparse tensor",
    "torch._utils._rebuild_nested_tensor": "nested tensor",
    "torch._utils._rebuild_meta_tensor_no_storage": "meta tensor (on the meta device, no data)",
    "torch._utils._rebuild_wrapper_subclass": "tensor subclass (wrapper)",
    "torch._utils._rebuild_device_tensor_from_numpy": "device tensor rebuilt from numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "device tensor rebuilt from a CPU tensor",
    "torch._tensor._rebuild_from_type_v2": "tensor subclass",
}


def _view_key(t: TensorRef) -> _ViewKey:
    return (id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype)


def default_expand_budget(input_bytes: int) -> int:
    """``--max-expand``'s default: 16x the input's size, and at least 1 GiB.

    A real conversion writes about what it read (4x at most, casting float16 to float64), so
    only views that expand a small storage (a stride-0 ``expand``, many overlapping slices)
    come near it.
    """
    return max(EXPAND_FACTOR * input_bytes, EXPAND_FLOOR)


def _data_bytes(t: TensorRef | torch.Tensor, cap: int) -> int:
    """The bytes ``t``'s elements fill when written contiguously, or ``cap`` if that is more.

    The product stops growing at ``cap``, so a pickled shape of a million huge dimensions
    costs a million small multiplications, not arithmetic on million-digit integers.
    """
    if not isinstance(t, TensorRef):  # a real torch tensor (files read through torch.load)
        return min(t.numel() * t.element_size(), cap)
    if 0 in t.shape:
        return 0
    size = DTYPE_ITEMSIZE.get(t.dtype, 1)
    for dim in t.shape:
        size *= dim
        if size >= cap:
            return cap
    return size


def _describe_view(t: TensorRef | torch.Tensor) -> str:
    """dtype, shape, stride and stored bytes: what shows that a view expands its storage."""
    if isinstance(t, TensorRef):
        dtype, stride, stored = t.dtype, list(t.stride), t.storage.nbytes
    else:  # a real torch tensor
        dtype, stride, stored = str(t.dtype).removeprefix("torch."), list(t.stride()), t.untyped_storage().nbytes()
    return f"{dtype} {list(t.shape)!s:.80}, stride {stride!s:.80}, over {stored} stored bytes"


def check_expand_budget(tensors: Iterable[tuple[str, TensorRef | torch.Tensor]], budget: int) -> None:
    """Refuse, before anything is written, a write whose tensor data would exceed ``budget`` bytes.

    safetensors stores each tensor as its own contiguous bytes, so views are materialised: a
    stride-0 view (``torch.zeros(1).expand(10**6, 10**6)``: 4 bytes in a .pth) becomes 4 TB,
    and overlapping views of one storage are written once each. ``tensors`` are the (name,
    tensor) pairs to be written, ties already counted once. The error names the largest
    tensor and ``--max-expand``, the option that raises the budget.
    """
    from ..fileio.sizes import format_size

    total, largest, largest_name = 0, -1, ""
    largest_tensor: TensorRef | torch.Tensor | None = None
    for name, t in tensors:
        size = _data_bytes(t, budget + 1)
        total += size
        if size > largest:
            largest, largest_name, largest_tensor = size, name, t
    if total <= budget:
        return
    assert largest_tensor is not None  # total > budget >= 0: some tensor was counted
    if largest > budget and len(largest_tensor.shape) <= 64:  # small enough to say exactly how big
        largest = _data_bytes(largest_tensor, 1 << 256)
    where = f"{largest_name!r} ({_describe_view(largest_tensor)})"
    limit = f"the --max-expand budget of {format_size(budget)} (default: 16x the input size, at least 1 GiB)"
    if largest > budget:
        message = f"tensor {where} would be written out as {format_size(largest)}, more than {limit}"
    else:
        message = f"the tensors would be written out as more than {limit}; the largest is {where}"
    raise BadInputError(
        message,
        hint="safetensors stores every view in full; if this is intended, raise the budget with --max-expand SIZE",
    )


def hub_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``__metadata__`` as every safetensors file ckptfix writes carries it: ``{"format": "pt"}``
    first (``huggingface_hub.load_torch_model`` and transformers refuse metadata without it),
    then the rest."""
    return {"format": "pt", **{k: v for k, v in metadata.items() if k != "format"}}


def plan_safetensors(
    state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *, max_data_bytes: int | None = None
) -> SafetensorsPlan:
    """Check that ``state_dict`` can be stored and lay the file out (no bytes are read).

    With ``max_data_bytes``, the data the file would hold is checked against that budget
    (:func:`check_expand_budget`) before the layout is computed.
    """
    groups: dict[_ViewKey, list[str]] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise InputMismatchError(f"safetensors needs string keys; found key {name!r}")
        if isinstance(value, Reduce):
            kind = _TENSOR_KINDS.get(value.func.full, f"{value.func.full} tensor")
            raise BadInputError(
                f"tensor {name!r} is a {kind}, which safetensors cannot hold (it stores dense tensors only)",
                hint="drop it (--drop), or write a .pth file, which carries it as it is",
            )
        if not isinstance(value, TensorRef):
            raise InputMismatchError(
                f"{name!r} is a {type(value).__name__}, not a tensor; safetensors holds only tensors"
            )
        if value.dtype not in DTYPE_TO_SAFETENSORS:
            raise BadInputError(
                f"tensor {name!r} has dtype {value.dtype}"
                + (" (quantized)" if value.dtype.startswith(("qint", "quint")) else "")
                + ", which safetensors cannot hold",
                hint="drop it (--drop), cast it (--dtype, floating point only), or write a .pth file",
            )
        if value.dtype in SAFETENSORS_PACKED and not value.shape:
            raise BadInputError(
                f"tensor {name!r} is a 0-dim {value.dtype}, which safetensors cannot hold: its shapes count the "
                f"{SAFETENSORS_PACKED[value.dtype]} values packed in each element along the last dimension",
                hint="reshape it to 1 element with a dimension, or write a .pth file",
            )
        if value.device == "meta":
            raise BadInputError(
                f"tensor {name!r} is a meta tensor (on the meta device): it has no data, which safetensors cannot hold",
                hint="drop it (--drop), or write a .pth file, which carries it as it is",
            )
        groups.setdefault(_view_key(value), []).append(name)
    aliases: dict[str, str] = {}
    kept: list[tuple[str, TensorRef]] = []
    for names in groups.values():
        keep = sorted(names)[0]
        kept.append((keep, state_dict[keep]))
        aliases.update({n: keep for n in names if n != keep})
    if max_data_bytes is not None:
        check_expand_budget(kept, max_data_bytes)
    kept.sort(key=lambda item: (-DTYPE_ITEMSIZE[item[1].dtype], item[0]))
    spans = [_plain_span(t) for _, t in kept]
    sizes = [_nbytes(t) for _, t in kept]
    residue, shared = _best_placement(_runs(kept, spans, sizes))
    order = _in_source_order(kept, spans, sizes)
    if order is not None:
        as_stored = [kept[i] for i in order]
        stored_spans, stored_sizes = [spans[i] for i in order], [sizes[i] for i in order]
        stored_residue, stored_shared = _best_placement(_runs(as_stored, stored_spans, stored_sizes))
        if stored_shared > shared or (not shared and _all_remote(kept)):
            kept, residue, spans, sizes = as_stored, stored_residue, stored_spans, stored_sizes
    meta = hub_metadata(metadata or {})
    for alias, keep in aliases.items():
        meta.setdefault(alias, keep)  # save_model's convention; user metadata wins
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    offset = 0
    for (name, t), size in zip(kept, sizes):
        shape = list(t.shape)
        if t.dtype in SAFETENSORS_PACKED:  # F4 counts 4-bit values; 0-dim ones were refused above
            shape[-1] *= SAFETENSORS_PACKED[t.dtype]
        header[name] = {
            "dtype": DTYPE_TO_SAFETENSORS[t.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if residue is None:
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
    else:
        raw += b" " * ((residue - 8 - len(raw)) % BLOCK)
    return SafetensorsPlan(kept, aliases, struct.pack("<Q", len(raw)) + raw, offset, spans, sizes)


def write_safetensors(
    state_dict: Mapping[str, Any],
    out: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    max_data_bytes: int | None = None,
    plan: SafetensorsPlan | None = None,
) -> SafetensorsPlan:
    """Stream ``state_dict`` into ``out`` as safetensors; returns the plan that was written.

    Tensors whose bytes lie back to back in one file are copied file to file by the kernel in
    few calls (so a copy-on-write file system can share the blocks); strided views and
    big-endian sources are gathered one tensor at a time. When header and data come out the
    same as a source file's, that file is copied whole. ``max_data_bytes`` refuses, before the
    first byte, a file whose data would be larger (see :func:`check_expand_budget`). ``plan``:
    what :func:`plan_safetensors` gave for this very ``state_dict``, ``metadata`` and budget
    (a caller that checked before opening its output), so it is not worked out twice.
    """
    if plan is None:
        plan = plan_safetensors(state_dict, metadata, max_data_bytes=max_data_bytes)
    stream = OutputStream(out)
    stream.reserve(len(plan.header) + plan.data_bytes)  # the file's exact size, known from the plan
    with OpenFiles() as files:
        whole = _unchanged_file(plan, files)
        if whole is not None:
            stream.copy(whole, files)
            if progress:
                progress(plan.data_bytes)
        else:
            stream.write(plan.header)
            _write_data(plan, stream, files, progress)
        stream.flush()  # before the input files close: the last copy may still be pending
    return plan


#: the most bytes (and tensors) of small tensors read in one native call (what the writer holds)
GATHER_BYTES = 1 << 22
GATHER_COUNT = 8192


def _write_data(
    plan: SafetensorsPlan, stream: OutputStream, files: OpenFiles, progress: Callable[[int], None] | None
) -> None:
    """The data section, tensor by tensor in the plan's order.

    With the native engine, consecutive small tensors of one local file (each its own run of
    under :data:`SMALL_COPY` bytes: a training checkpoint's every parameter) are read in one
    library call per batch and written as one buffer -- the bytes the loop below would copy,
    without a Python read each; a batch the library declines (a range not all in its file) goes
    through that loop, which raises its own error.
    """
    tensors = plan.tensors
    spans = plan.spans if plan.spans is not None else [_plain_span(t) for _, t in tensors]
    sizes = plan.sizes if plan.sizes is not None else [_nbytes(t) for _, t in tensors]
    paths = {span[0] for span in spans if span is not None}
    remote = {path for path in paths if is_url(path)}
    if remote or None in spans:
        files.plan(_planned_reads(tensors))  # a remote input: fetched ahead, in this order
    small = _run_sizes(spans, sizes) if native_cast.available() else None
    n, i = len(tensors), 0
    while i < n:
        span = spans[i]
        if small is None or span is None or not 0 < small[i] < SMALL_COPY or span[0] in remote:
            _write_one(tensors[i][1], span, sizes[i], stream, files, progress)
            i += 1
            continue
        j, total = i, 0
        while (
            j < n
            and (other := spans[j]) is not None
            and other[0] == span[0]
            and 0 < small[j] < SMALL_COPY
            and total < GATHER_BYTES
            and j - i < GATHER_COUNT
        ):
            total += sizes[j]
            j += 1
        offsets = array("Q", [spans[k][1] for k in range(i, j)])  # type: ignore[index]
        blob = native_cast.gather(files.file(span[0]).fileno(), offsets, array("Q", sizes[i:j]))
        if blob is None:
            for k in range(i, j):
                _write_one(tensors[k][1], spans[k], sizes[k], stream, files, progress)
        else:
            stream.write(blob)
            if progress:
                progress(total)
        i = j


def _write_one(
    t: TensorRef,
    span: tuple[str, int] | None,
    size: int,
    stream: OutputStream,
    files: OpenFiles,
    progress: Callable[[int], None] | None,
) -> None:
    joined = _joined(t) if span is None else None
    if joined is not None:  # ranges of several files (a ZeRO partition's slices): each by the kernel
        stream.copy(joined, files)
    elif span is None:
        for piece in tensor_c_chunks(t, files):
            stream.write(piece)
    elif _whole_remote_record(t):  # streamed from an object: checked against its CRC32
        _check_record_crc(t, stream.copy(FileRange(span[0], span[1], size), files, want_crc=True))
    else:  # file to file, in the kernel; the stream merges tensors that lie back to back
        stream.copy(FileRange(span[0], span[1], size), files)
    if progress:
        progress(size)


def _whole_remote_record(t: TensorRef) -> bool:
    """Whether ``t`` is all of a zip record (one that recorded its CRC32) in a remote object: its
    bytes stream through Python anyway, so they are checked as a .pth output checks them (a
    server answering other bytes than asked is otherwise unseen where the backend hides the
    range it sent)."""
    source = t.storage.source
    return (
        isinstance(source, FileRange)
        and bool(source.crc)
        and is_url(source.path)
        and t.storage_offset == 0
        and t.nbytes == source.size
    )


def _check_record_crc(t: TensorRef, actual: int | None) -> None:
    source = t.storage.source
    assert isinstance(source, FileRange)
    if actual != source.crc:
        raise BadInputError(
            f"{source.path}: the bytes copied for a tensor have CRC32 {actual or 0:08x}, but the input's record "
            f"says {source.crc:08x}: the input is corrupt or was served wrong (run `ckptfix verify` on it); "
            "nothing was written"
        )


def _planned_reads(tensors: Iterable[tuple[str, TensorRef]]) -> Iterator[FileRange | None]:
    """What the loop above reads, in its order: each tensor's bytes, or its whole storage when
    it is gathered (see :func:`~ckptfix.model.data.tensor_c_bytes`)."""
    for _, t in tensors:
        span = _plain_span(t)
        source = t.storage.source
        if span is not None:
            yield FileRange(span[0], span[1], t.nbytes)
        elif isinstance(source, FileRange):
            yield source
        elif isinstance(source, JoinedSource):
            yield from source.pieces


def _unchanged_file(plan: SafetensorsPlan, files: OpenFiles) -> FileRange | None:
    """The whole source file, when the output would be that file byte for byte: one run that
    is the source's entire data section, after a header equal to the source's."""
    pieces = _runs(plan.tensors, plan.spans, plan.sizes)
    if len(pieces) != 1 or not isinstance(pieces[0], _Run):
        return None
    run = pieces[0]
    if is_url(run.path):
        return None  # a remote source is streamed tensor by tensor (the runs merge anyway)
    f = files.file(run.path)
    if run.offset != len(plan.header) or os.fstat(f.fileno()).st_size != run.offset + run.size:
        return None
    if os.pread(f.fileno(), len(plan.header), 0) != plan.header:
        return None
    return FileRange(run.path, 0, run.offset + run.size)


def _torch_kept(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Real tensors to write, each view once: (name -> tensor, alias -> kept name)."""
    if not all(is_torch_tensor(v) for v in state_dict.values()):
        raise InputMismatchError("safetensors holds only tensors; select a state dict with --select")
    seen: dict[tuple[Any, ...], str] = {}
    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name in sorted(state_dict):
        t = state_dict[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen and t.numel():
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t
    return kept, aliases


def check_torch_expand_budget(state_dict: Mapping[str, Any], budget: int) -> None:
    """:func:`check_expand_budget` for a state dict of real tensors (read through torch)."""
    check_expand_budget(_torch_kept(state_dict)[0].items(), budget)


def write_safetensors_from_torch(
    state_dict: Mapping[str, Any],
    out: BinaryIO,
    metadata: Mapping[str, str] | None,
    *,
    max_data_bytes: int | None = None,
) -> None:
    """For trees holding real tensors (``--unsafe-load`` input): the safetensors library itself.

    ``contiguous()`` materialises each view in memory, so ``max_data_bytes`` is checked first.
    """
    need_torch()
    from safetensors.torch import save

    kept, aliases = _torch_kept(state_dict)
    if max_data_bytes is not None:
        check_expand_budget(kept.items(), max_data_bytes)
    meta = hub_metadata(metadata or {})
    for name, target in aliases.items():
        meta.setdefault(name, target)
    tensors = {name: t.detach().cpu().contiguous() for name, t in kept.items()}
    out.write(save(tensors, metadata=meta or None))
