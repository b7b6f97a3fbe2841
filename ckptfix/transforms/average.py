"""Many checkpoints of one model -> their (weighted) mean, one tensor at a time.

What the result holds, key by key (the rules of timm's ``avg_checkpoints.py``, with the
dtype kept):

* floating-point tensors (float16, bfloat16, float32, float64): each input's values widened to
  float64 (what ``tensor.to(torch.float64)`` gives), summed in input order, each times its
  coefficient, divided by the coefficients' sum, then cast back to the tensor's own dtype
  bitwise as ``Tensor.to`` does (:mod:`ckptfix.model.numeric`). With no coefficients every one
  is 1.0, so the arithmetic is timm's ``sum / N``, bit for bit. timm writes every tensor as
  float32; here a bfloat16 model stays bfloat16 (its float32 inputs agree with timm bitwise).
* integer and bool tensors (``num_batches_tracked``, masks, index buffers): the last input's,
  unchanged -- a mean of counters or masks is not one, and the last checkpoint is the latest.
  (timm averages them too and writes them as float32; ``load_state_dict`` casts them back.)
* anything else (complex, float8, quantized tensors, non-tensor entries) is refused by name.

Nothing is read when the plan is made: every output tensor is a :class:`ComputedSource` that
reads that one tensor from each input while the writer asks for it, so memory holds one
tensor's float64 sum, one input's copy of it and the cast result -- whatever the number of
inputs and the size of the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from ..errors import BadInputError, UsageError
from ..fileio.ranges import ComputedSource, OpenFiles
from ..model.data import tensor_c_bytes
from ..model.dtypes import CASTABLE, DTYPE_ITEMSIZE, DTYPE_STORAGE
from ..model.refs import Global, StorageRef, TensorRef

#: dtypes whose last input's tensor is taken as it is (no mean of counters or masks)
FROM_LAST = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
#: how many names an error lists before "and N more"
_NAMED = 5


@dataclass
class AverageStats:
    """What an average holds: counted while planning (``averaged``, ``from_last``) and while
    writing (``reads``: input tensors read, ``tensor_bytes``: output tensor bytes produced)."""

    inputs: int
    coefficients: list[float]
    averaged: int = 0
    from_last: list[str] = field(default_factory=list)
    #: output keys that name a tensor another key names too (a tie kept in the output)
    tied: list[str] = field(default_factory=list)
    reads: int = 0
    tensor_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_coefficients(text: str | Sequence[float] | None, count: int) -> list[float]:
    """``--coefficients 1,2,1`` (or a sequence) as ``count`` floats; None: all 1.0.

    They must be finite, non-negative and not all zero: the result is then a convex combination,
    inside the inputs' range, so casting it back to a 16-bit dtype cannot overflow."""
    if text is None:
        return [1.0] * count
    try:
        values = [float(v) for v in text.split(",")] if isinstance(text, str) else [float(v) for v in text]
    except ValueError:
        raise UsageError(f"--coefficients {text!r}: give numbers separated by commas, e.g. 1,1,2") from None
    if len(values) != count:
        raise UsageError(f"--coefficients has {len(values)} numbers for {count} inputs: give one per input")
    if any(not math.isfinite(v) or v < 0 for v in values) or not sum(values) > 0:
        raise UsageError(
            f"--coefficients {','.join(map(repr, values))}: each must be a finite number >= 0, and not all 0"
        )
    return values


def _listing(names: Sequence[str]) -> str:
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(repr(n) for n in names[:_NAMED]) + more


def check_same_model(state_dicts: Sequence[Mapping[str, Any]], names: Sequence[str]) -> None:
    """Refuse (exit 3) inputs that are not the same model: keys, then shapes and dtypes, each
    input against the first, naming the keys and the files."""
    first = state_dicts[0]
    for name, sd in zip(names[1:], state_dicts[1:], strict=True):
        missing = [k for k in first if k not in sd]
        extra = [k for k in sd if k not in first]
        if missing or extra:
            parts = ([f"lacks {_listing(missing)}"] if missing else []) + (
                [f"has {_listing(extra)} beyond it"] if extra else []
            )
            raise BadInputError(
                f"{name}: not the same model as {names[0]}: it {' and '.join(parts)}",
                hint="average checkpoints of one model (choose the state dict with --select/--ema)",
            )
        for key, a in first.items():
            b = sd[key]
            if isinstance(a, TensorRef) and isinstance(b, TensorRef) and (a.shape, a.dtype) != (b.shape, b.dtype):
                raise BadInputError(
                    f"{name}: {key!r} is {b.dtype}{list(b.shape)} where {names[0]} has {a.dtype}{list(a.shape)}",
                    hint="average checkpoints of one model, saved in the same dtype",
                )


def _mean_bytes(
    tensors: Sequence[TensorRef], coefficients: Sequence[float], stats: AverageStats, files: OpenFiles
) -> bytes:
    """The weighted mean of one tensor across the inputs, in its dtype (see the module doc)."""
    from ..model.numeric import cast_float_bytes, decode_wide

    dtype = tensors[0].dtype
    total: Any = None
    for tensor, weight in zip(tensors, coefficients, strict=True):
        values = decode_wide(tensor_c_bytes(tensor, files), dtype)  # a fresh float64 array
        stats.reads += 1
        assert values is not None  # CASTABLE dtypes all decode
        if weight != 1.0:
            values *= weight
        if total is None:
            total = values
        else:
            total += values
        del values
    total /= math.fsum(coefficients)  # N for a plain mean: timm's div_(count)
    out = cast_float_bytes(total.tobytes(), "float64", dtype)
    stats.tensor_bytes += len(out)
    return out


def _last_bytes(tensor: TensorRef, stats: AverageStats, files: OpenFiles) -> bytes:
    data = tensor_c_bytes(tensor, files)
    stats.reads += 1
    stats.tensor_bytes += len(data)
    return data


def _fresh(like: TensorRef, source: ComputedSource) -> TensorRef:
    """A contiguous cpu tensor shaped like ``like`` whose bytes ``source`` makes when written."""
    shape = like.shape
    stride: list[int] = []
    step = 1
    for size in reversed(shape):
        stride.insert(0, step)
        step *= max(size, 1)
    storage = StorageRef(
        key="0",  # writers number storages themselves
        storage_type=Global("torch", DTYPE_STORAGE[like.dtype]),
        location="cpu",
        numel=like.numel,
        itemsize=DTYPE_ITEMSIZE[like.dtype],
        dtype=like.dtype,
        source=source,
    )
    return TensorRef(storage, 0, shape, tuple(stride), like.dtype)


def _view_key(t: TensorRef) -> tuple[int, int, tuple[int, ...], tuple[int, ...], str]:
    return id(t.storage), t.storage_offset, t.shape, t.stride, t.dtype


def plan_average(
    state_dicts: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    coefficients: str | Sequence[float] | None = None,
) -> tuple[dict[str, TensorRef], AverageStats]:
    """The averaged state dict of ``state_dicts`` (one per input, ``names`` for messages), in the
    first input's key order, with tensors computed when written; and its statistics (``reads``
    and ``tensor_bytes`` fill in as the writer produces the tensors).

    Keys naming the same view of one storage in every input (tied weights) name one output
    tensor, so the writer keeps the tie. Raises :class:`BadInputError` for inputs that are not
    the same model or hold what cannot be averaged."""
    if len(state_dicts) < 2:
        raise UsageError("average needs at least two inputs (then OUT)")
    weights = parse_coefficients(coefficients, len(state_dicts))
    check_same_model(state_dicts, names)
    stats = AverageStats(len(state_dicts), weights)
    out: dict[str, TensorRef] = {}
    made: dict[tuple[Any, ...], TensorRef] = {}
    for key, first in state_dicts[0].items():
        tensors = [sd[key] for sd in state_dicts]
        odd = next((i for i, t in enumerate(tensors) if not isinstance(t, TensorRef)), None)
        if odd is not None:
            raise BadInputError(
                f"{names[odd]}: {key!r} is a {type(tensors[odd]).__name__}, not a tensor: only tensors can be averaged",
                hint="choose the state dict with --select, or leave the entry out first (ckptfix convert --drop)",
            )
        views = tuple(_view_key(t) for t in tensors)
        if views in made:
            out[key] = made[views]
            stats.tied.append(key)
            continue
        dtype = first.dtype
        last = tensors[-1]
        if dtype in CASTABLE:
            size = first.numel * DTYPE_ITEMSIZE[dtype]
            source = ComputedSource(size, partial(_mean_bytes, tensors, weights, stats))
            stats.averaged += 1
        elif dtype in FROM_LAST:
            source = ComputedSource(last.nbytes, partial(_last_bytes, last, stats))
            stats.from_last.append(key)
        else:
            raise BadInputError(
                f"{names[0]}: {key!r} is {dtype}, which average cannot take the mean of "
                "(it averages float16/bfloat16/float32/float64 and keeps integers and bools from the last input)"
            )
        made[views] = out[key] = _fresh(first if dtype in CASTABLE else last, source)
    return out, stats
