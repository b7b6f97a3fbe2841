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
  so every tensor is aligned for memory mapping.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..dtypes import DTYPE_ITEMSIZE, DTYPE_TO_SAFETENSORS, SAFETENSORS_DTYPES
from ..errors import BadInputError, UsageError
from ..sources import FileRange, OpenFiles, OutputStream, is_c_contiguous, is_plain_range, tensor_c_bytes
from ..tree import Reduce, TensorRef, is_torch_tensor, tensor_from_range

#: the safetensors library refuses headers above 100 MB; so do we
MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8


def read_safetensors(path: str, f: BinaryIO, file_size: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse a safetensors file into ``{name: TensorRef}`` (no data read) and its metadata.

    Names that ``__metadata__`` maps to a stored tensor (``save_model``'s record of a tied
    weight it dropped) are restored as the same tensor.
    """
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise BadInputError(f"{path}: truncated safetensors file (no header)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise BadInputError(f"{path}: safetensors header declares {header_len} bytes: truncated or corrupt")
    try:
        header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path}: corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise BadInputError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadInputError(f"{path}: corrupt safetensors __metadata__ (values must be strings)")
    data_start, data_size = 8 + header_len, file_size - 8 - header_len
    tensors: dict[str, Any] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        begin, end, dtype, shape = _check_entry(path, name, info, data_size)
        spans.append((begin, end, name))
        tensors[name] = tensor_from_range(dtype, shape, FileRange(path, data_start + begin, end - begin))
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise BadInputError(f"{path}: safetensors tensors {first!r} and {second!r} overlap: corrupt file")
    for alias, kept in metadata.items():
        if alias not in tensors and kept in tensors:
            tensors[alias] = tensors[kept]
    return tensors, metadata


def _check_entry(path: str, name: str, info: Any, data_size: int) -> tuple[int, int, str, tuple[int, ...]]:
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}: {info!r:.100}") from exc
    if not all(type(s) is int and s >= 0 for s in shape) or not (type(begin) is int and type(end) is int):
        raise BadInputError(f"{path}: corrupt safetensors entry for {name!r}")
    numel = 1
    for s in shape:
        numel *= s
    if not 0 <= begin <= end <= data_size or end - begin != numel * DTYPE_ITEMSIZE[dtype]:
        raise BadInputError(
            f"{path}: safetensors tensor {name!r} ({dtype} {list(shape)}) has data range [{begin}, {end}) "
            f"that does not fit its size or the file: truncated or corrupt"
        )
    return begin, end, dtype, shape


@dataclass
class SafetensorsPlan:
    """What will be written: kept tensors in data order, aliases, and the header bytes."""

    tensors: list[tuple[str, TensorRef]]
    aliases: dict[str, str]
    header: bytes
    data_bytes: int


def _view_key(t: TensorRef) -> tuple:
    return (id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype)


def plan_safetensors(state_dict: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> SafetensorsPlan:
    """Check that ``state_dict`` can be stored and lay the file out (no bytes are read)."""
    groups: dict[tuple, list[str]] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise UsageError(f"safetensors needs string keys; found key {name!r}")
        if isinstance(value, Reduce):
            raise UsageError(
                f"tensor {name!r} is a {value.func.name.lstrip('_').replace('_', ' ')} (sparse, quantized, "
                "nested or meta), which safetensors cannot hold; drop it or write a .pth file"
            )
        if not isinstance(value, TensorRef):
            raise UsageError(f"{name!r} is a {type(value).__name__}, not a tensor; safetensors holds only tensors")
        if value.dtype not in DTYPE_TO_SAFETENSORS:
            raise UsageError(f"tensor {name!r} has dtype {value.dtype}, which safetensors cannot hold")
        if value.device == "meta":
            raise UsageError(f"tensor {name!r} is on the meta device: it has no data to write")
        groups.setdefault(_view_key(value), []).append(name)
    aliases: dict[str, str] = {}
    kept: list[tuple[str, TensorRef]] = []
    for names in groups.values():
        keep = sorted(names)[0]
        kept.append((keep, state_dict[keep]))
        aliases.update({n: keep for n in names if n != keep})
    kept.sort(key=lambda item: (-DTYPE_ITEMSIZE[item[1].dtype], item[0]))
    meta = dict(metadata or {})
    for alias, keep in aliases.items():
        meta.setdefault(alias, keep)  # save_model's convention; user metadata wins
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    offset = 0
    for name, t in kept:
        size = t.nbytes
        header[name] = {
            "dtype": DTYPE_TO_SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-(len(raw) + 8) % _ALIGN)
    return SafetensorsPlan(kept, aliases, struct.pack("<Q", len(raw)) + raw, offset)


def write_safetensors(
    state_dict: Mapping[str, Any],
    out: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> SafetensorsPlan:
    """Stream ``state_dict`` into ``out`` as safetensors; returns the plan that was written.

    Contiguous little-endian tensors are copied file to file by the kernel; strided views
    and big-endian sources are gathered one tensor at a time.
    """
    plan = plan_safetensors(state_dict, metadata)
    stream = OutputStream(out)
    stream.write(plan.header)
    with OpenFiles() as files:
        for _, t in plan.tensors:
            _write_tensor(stream, t, files)
            if progress:
                progress(t.nbytes)
    stream.flush()
    return plan


def _write_tensor(stream: OutputStream, t: TensorRef, files: OpenFiles) -> None:
    source = t.storage.source
    if t.storage.byteorder != "big" and is_plain_range(source) and is_c_contiguous(t.shape, t.stride):
        start = t.storage_offset * DTYPE_ITEMSIZE[t.dtype]
        stream.copy(source.sub(start, t.nbytes), files)  # file to file, in the kernel
        return
    stream.write(tensor_c_bytes(t, files))


def write_safetensors_from_torch(
    state_dict: Mapping[str, Any], out: BinaryIO, metadata: Mapping[str, str] | None
) -> None:
    """For trees holding real tensors (``--unsafe-load`` input): the safetensors library itself."""
    from safetensors.torch import save

    if not all(is_torch_tensor(v) for v in state_dict.values()):
        raise UsageError("safetensors holds only tensors; select a state dict with --select")
    seen: dict[tuple, str] = {}
    tensors, meta = {}, dict(metadata or {})
    for name in sorted(state_dict):
        t = state_dict[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen and t.numel():
            meta.setdefault(name, seen[key])
            continue
        seen[key] = name
        tensors[name] = t.detach().cpu().contiguous()
    out.write(save(tensors, metadata=meta or None))
