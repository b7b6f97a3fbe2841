"""Hypothesis strategies for tensors and state dicts with every layout a checkpoint can hold."""

from __future__ import annotations

import torch
from conftest import FIXTURES
from hypothesis import strategies as st

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]
#: what both torch and safetensors can hold
SAFETENSORS_DTYPES = [d for d in ALL_DTYPES if d is not torch.complex128]
FLOATING = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64}


def random_tensor(data: st.DataObject, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns (NaN, inf, subnormals, -0.0 all occur) of the given dtype."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    raw = data.draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype is torch.bool:
        raw = bytes(b & 1 for b in raw)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def draw_laid_out_tensor(draw: st.DrawFn, data: st.DataObject, dtype: torch.dtype, previous: dict) -> torch.Tensor:
    """A tensor in one of the layouts checkpoints hold: contiguous, transposed, a slice of a
    bigger storage, the very same object as an earlier tensor, or a view of an earlier one."""
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    layout = draw(st.sampled_from(["plain", "transposed", "slice", "tie", "view_of_previous"]))
    if layout == "transposed" and len(shape) >= 2:
        return random_tensor(data, dtype, shape[::-1]).transpose(0, -1)
    if layout == "slice":
        big = random_tensor(data, dtype, (shape[0] + 2, *shape[1:]) if shape else (3,))
        return big[1 : 1 + shape[0]] if shape else big[1]
    if layout in ("tie", "view_of_previous") and previous:
        earlier = previous[draw(st.sampled_from(list(previous)))]
        return earlier if layout == "tie" else earlier.detach().reshape(-1)[: earlier.numel() // 2]
    return random_tensor(data, dtype, shape)


@st.composite
def flat_state_dicts(draw: st.DrawFn, dtypes: list[torch.dtype] = SAFETENSORS_DTYPES, max_size: int = 7) -> dict:
    """``{name: tensor}`` with contiguous, transposed, sliced, tied and view-of-other tensors."""
    data = draw(st.data())
    sd: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, max_size))):
        name = f"layer{i}." + draw(st.sampled_from(["weight", "bias", "running_mean", "w.x"]))
        tensor = draw_laid_out_tensor(draw, data, draw(st.sampled_from(dtypes)), sd)
        sd[name] = tensor
    return sd


# --------------------------------------------------------------------------- fuzzing seeds

FUZZ_SOURCES = [
    FIXTURES / name
    for name in (
        "dataparallel_tinynet.pth",
        "lightning_tinynet.ckpt",
        "legacy_dataparallel_tinynet.pth",
        "compile_ddp_tinynet.pth",
    )
]


def _safetensors_bytes() -> bytes:
    from safetensors.torch import save

    return save({"a.weight": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.int64)})


#: real files of every format, for the fuzzers to mutate
SEEDS = [p.read_bytes() for p in FUZZ_SOURCES] + [_safetensors_bytes()]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A seed with 1-4 flips, truncations, splices, insertions, deletions or overwrites."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "splice", "insert", "delete", "overwrite"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[at:]
        elif op == "splice":
            other = draw(st.sampled_from(SEEDS))
            start = draw(st.integers(0, len(other) - 1))
            data[at:] = other[start : start + draw(st.integers(1, 4096))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 256))]
        else:
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at : at + len(chunk)] = chunk
    return bytes(data)
