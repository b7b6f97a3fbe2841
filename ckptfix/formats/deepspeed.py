"""DeepSpeed checkpoint folders (ZeRO stages 0-3): one model, read without torch or deepspeed.

A DeepSpeed save is a folder: ``latest`` names a tag, and ``TAG/`` holds

* ``mp_rank_00_model_states.pt``: the module's weights as trained (fp32, or fp16/bf16 for mixed
  precision), its buffers, ``param_shapes`` (per optimizer group, in the flat buffer's order),
  ``frozen_param_shapes``/``frozen_param_fragments`` and ``shared_params`` (tied names);
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` for ZeRO >= 1: rank R's slice of every
  parameter group's flat fp32 master weights (``single_partition_of_fp32_groups``; ZeRO-3:
  ``fp32_flat_groups``, where every parameter is partitioned on its own);
* ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank, with the frozen parameters'
  partitions.

The fp32 master weights are rebuilt as DeepSpeed's ``zero_to_fp32.py`` rebuilds them (the same
rules, checked against its output bitwise in the tests), but no partition is loaded: each output
tensor is the list of byte ranges of the partition files it is made of (a
:class:`~ckptfix.fileio.ranges.JoinedSource`; one plain range when it lies in one partition),
copied when it is written. Every file is read by the restricted reader; DeepSpeed's own objects
(``ZeroStageEnum``, ``LossScaler``, ``fragment_address``) are inert records, never built.

Every size and name in the folder is checked before anything is written: the partitions must
hold exactly the parameters' elements (up to DeepSpeed's alignment padding), every rank must be
there once with the same world size, and a tag must be a folder inside the checkpoint folder.
Tensor-parallel saves (``mp_rank_01``...) are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..errors import BadInputError
from ..fileio.ranges import ComputedSource, FileRange, JoinedSource, OpenFiles, is_plain_range
from ..model.data import is_c_contiguous, tensor_c_bytes
from ..model.dtypes import DTYPE_ITEMSIZE
from ..model.refs import OpaqueObject, Reduce, StorageRef, TensorRef, Tree, tensor_from_range
from .detect import check_input, open_input
from .torchzip import read_torch_zip

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
#: the two weight sources a ZeRO checkpoint holds (``--weights``)
WEIGHTS = ("fp32", "module")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MP_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
#: a tag is one folder name (``global_step100``, or whatever ``save_checkpoint(tag=...)`` got)
_TAG = re.compile(r"[^/\\\x00]{1,255}")
#: a ``latest`` file holds a tag name: anything longer is not one
_MAX_LATEST = 4096
#: ranks a folder may claim (each is a file to open)
MAX_RANKS = 65536


@dataclass(frozen=True)
class DeepSpeedInfo:
    """What ``inspect`` says about a DeepSpeed folder (and what a read used)."""

    tag: str
    tags: tuple[str, ...]
    stage: int
    world_size: int
    #: the module's weights' dtype as trained (float32, float16, bfloat16)
    dtype: str
    parameters: int
    frozen_parameters: int
    weights_available: tuple[str, ...]
    weights: str
    ds_version: str | None = None
    notes: list[str] = field(default_factory=list)
    #: bytes of the tag's files (what is read from)
    input_bytes: int = 0

    def describe(self) -> str:
        other = [w for w in self.weights_available if w != self.weights]
        return (
            f"DeepSpeed ZeRO-{self.stage} checkpoint, tag {self.tag} (tags: {', '.join(self.tags) or self.tag}), "
            f"world size {self.world_size}, trained in {self.dtype}, {self.parameters} parameter elements "
            f"({self.frozen_parameters} frozen); weights read: {_WEIGHT_WORDS[self.weights]}"
            + (f" (also available: --weights {other[0]})" if other else "")
        )


_WEIGHT_WORDS = {"fp32": "fp32 master weights (as zero_to_fp32.py)", "module": "the module's weights as trained"}


def is_deepspeed_folder(folder: Path) -> bool:
    """A run folder (``latest`` or ``global_step*/`` holding model states) or a tag folder."""
    if (folder / LATEST).is_file() or any(_MP_MODEL.fullmatch(p.name) for p in _files(folder)):
        return True
    if any(_ZERO3_MODEL.fullmatch(p.name) for p in _files(folder)):
        return True
    return any(p.is_dir() and p.name.startswith("global_step") and _holds_states(p) for p in _entries(folder))


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _files(folder: Path) -> list[Path]:
    return [p for p in _entries(folder) if p.name.endswith("_model_states.pt")]


def _holds_states(folder: Path) -> bool:
    return any(_MP_MODEL.fullmatch(p.name) or _ZERO3_MODEL.fullmatch(p.name) for p in _files(folder))


def _tags(folder: Path) -> tuple[str, ...]:
    return tuple(sorted((p.name for p in _entries(folder) if p.is_dir() and _holds_states(p)), key=_natural))


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def find_tag(folder: Path, tag: str | None) -> tuple[Path, str, tuple[str, ...]]:
    """(tag folder, tag, all tags): ``tag``, else what ``latest`` names, else the one
    ``global_step*`` folder; ``folder`` itself when it holds the model states."""
    if _holds_states(folder) and tag is None:
        return folder, folder.name, (folder.name,)
    tags = _tags(folder)
    if tag is None and (folder / LATEST).is_file():
        f, size = open_input(folder / LATEST)
        with f:
            raw = f.read(min(size, _MAX_LATEST + 1))
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise BadInputError(f"{folder / LATEST}: not a tag name (not UTF-8 text)") from None
        where = f"{folder / LATEST} names"
    elif tag is None:
        if len(tags) != 1:
            found = ", ".join(tags[:8]) or "none"
            raise BadInputError(
                f"{folder}: a DeepSpeed folder without a 'latest' file and {len(tags)} tag folders ({found})",
                hint="pass --tag TAG (e.g. --tag global_step100) or the tag folder itself",
            )
        tag = tags[0]
        where = "tag"
    else:
        where = "--tag"
    if not _TAG.fullmatch(tag) or tag in (".", "..") or len(tag) > 255:
        raise BadInputError(f"{folder}: {where} {tag[:80]!r}, which is not a folder name inside {folder}")
    path = folder / tag
    st = check_input(path) if path.exists() else None
    if st is None or not path.is_dir():
        raise BadInputError(
            f"{folder}: {where} {tag!r}, but {path} is not a folder",
            hint=f"tags here: {', '.join(tags[:8]) or 'none'}",
        )
    return path, tag, tags or (tag,)


# ---------------------------------------------------------------------------------------------
# the files of one tag


@dataclass
class _Files:
    """The tag folder's files by role, checked: one per rank, ranks 0..W-1, no tensor parallelism."""

    model: Path | None
    zero3_models: dict[int, Path]
    optim: dict[int, Path]


def _list_files(tag_dir: Path) -> _Files:
    model: Path | None = None
    zero3: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    prefixes: set[str] = set()
    for p in sorted(_entries(tag_dir)):
        name = p.name
        m = _OPTIM.fullmatch(name) or _ZERO3_MODEL.fullmatch(name) or _MP_MODEL.fullmatch(name)
        if m is None:
            continue
        mp = m.group(m.lastindex or 1)
        if int(mp) != 0:
            raise BadInputError(
                f"{p}: a tensor-parallel DeepSpeed checkpoint (model-parallel rank {int(mp)}); ckptfix reads "
                "data-parallel (ZeRO) saves with one model-parallel rank (mp_rank_00) only",
                hint="merge the tensor-parallel ranks with the training framework's tool first (Megatron-DeepSpeed)",
            )
        if _OPTIM.fullmatch(name):
            rank = int(m.group(2))
            prefixes.add(m.group(1) or "")
            if rank in optim:
                raise BadInputError(f"{tag_dir}: two optimizer partitions for rank {rank} ({optim[rank].name}, {name})")
            optim[rank] = p
        elif _ZERO3_MODEL.fullmatch(name):
            zero3[int(m.group(1))] = p
        else:
            model = p
    for what, ranks in (("optimizer partition", optim), ("ZeRO-3 model state", zero3)):
        if ranks and sorted(ranks) != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise BadInputError(
                f"{tag_dir}: {what} files for ranks {sorted(ranks)[:16]}: rank(s) {missing[:16]} missing",
                hint="a rank did not save, or files of two runs were mixed: copy the whole tag folder again",
            )
        if len(ranks) > MAX_RANKS:
            raise BadInputError(f"{tag_dir}: {len(ranks)} ranks, more than ckptfix reads ({MAX_RANKS})")
    if len(prefixes) > 1:
        raise BadInputError(f"{tag_dir}: both bf16_ and plain optimizer partitions: files of two runs mixed")
    if model is None and not zero3:
        raise BadInputError(f"{tag_dir}: no {MODEL_STATES} (nor ZeRO-3 model states): not a complete DeepSpeed save")
    return _Files(model, zero3, optim)


def _read(path: Path, globals_seen: set[str], allow: Sequence[str]) -> dict[Any, Any]:
    """One ``.pt`` of the save as a lazy tree: DeepSpeed's classes are inert records (never
    built, never written); dangerous globals are refused as in any checkpoint."""
    f, size = open_input(path)
    with f:
        root, _ = read_torch_zip(str(path), f, size, globals_seen, allow, inert_unknown=True)
    if not isinstance(root, dict):
        raise BadInputError(f"{path}: not a DeepSpeed state file (a {type(root).__name__} at the top, not a dict)")
    return root


def _size(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, Reduce) and value.func.full == "torch.Size" and len(value.args) == 1:
        value = value.args[0]
    if isinstance(value, (tuple, list)) and all(type(v) is int and 0 <= v < 1 << 48 for v in value):
        return tuple(value)
    raise BadInputError(f"{where}: a parameter shape that is not a tuple of sizes")


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _stage_of(optim: dict[Any, Any], where: str) -> int:
    value = optim.get("zero_stage")
    if isinstance(value, OpaqueObject) and value.args and type(value.args[0]) is int:
        value = value.args[0]
    if type(value) is not int or value not in (1, 2, 3):
        raise BadInputError(f"{where}: no ZeRO stage 1, 2 or 3 recorded (zero_stage)")
    return value


def _world(optim: dict[Any, Any], where: str) -> int:
    count = optim.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    checked = [c for c in counts if type(c) is int and 0 < c <= MAX_RANKS]
    if not counts or len(checked) != len(counts):
        raise BadInputError(f"{where}: no world size recorded (partition_count)")
    return max(checked)  # zero_to_fp32: expert groups may be partitioned over fewer ranks


def _plain_tensor(value: object, where: str) -> object:
    """ZeRO-3 saves its flat partitions with a Python attribute (``ds_id``): torch pickles such
    a tensor through ``_rebuild_from_type_v2(_rebuild_tensor_v2, torch.Tensor, args, state)``.
    The tensor inside is taken as it is (its extent checked here: the reader checks those of
    plain tensors only); the attribute is dropped."""
    if not (isinstance(value, Reduce) and value.func.full == "torch._tensor._rebuild_from_type_v2"):
        return value
    args = value.args
    if not (
        len(args) == 4
        and getattr(args[0], "full", None) == "torch._utils._rebuild_tensor_v2"
        and getattr(args[1], "full", None) in ("torch.Tensor", "torch.nn.parameter.Parameter")
        and isinstance(args[2], tuple)
        and len(args[2]) >= 4
    ):
        return value
    storage, offset, shape, stride = args[2][:4]
    shape, stride = _size(shape, where), _size(stride, where)
    if not (isinstance(storage, StorageRef) and type(offset) is int and offset >= 0 and len(shape) == len(stride)):
        raise BadInputError(f"{where}: a corrupt tensor record")
    if len(shape) != 1 or stride != (1,) or offset + shape[0] > storage.numel:
        raise BadInputError(f"{where}: a flat partition that reaches outside its storage or is not 1-D")
    return TensorRef(storage, offset, shape, stride, storage.dtype)


def _flat(t: object, where: str) -> tuple[FileRange, int]:
    """A 1-D fp32 partition as (its bytes' range, its elements)."""
    t = _plain_tensor(t, where)
    if not (
        isinstance(t, TensorRef)
        and t.dtype == "float32"
        and len(t.shape) == 1
        and is_c_contiguous(t.shape, t.stride)
        and t.storage.byteorder == "little"
    ):
        raise BadInputError(f"{where}: a flat partition that is not a 1-D little-endian float32 tensor")
    source = t.storage.source
    if not is_plain_range(source) or (t.storage_offset + t.shape[0]) * 4 > source.size:
        raise BadInputError(f"{where}: a flat partition whose bytes are not stored as they are")
    return source.sub(t.storage_offset * 4, t.shape[0] * 4), t.shape[0]


def _check_disjoint(ranges: list[FileRange], where: str) -> None:
    """No two partitions share bytes: each element of the model comes from one place (a file
    whose second group is a view of its first would otherwise give two parameters one value)."""
    spans = sorted((r.path, r.offset, r.offset + r.size) for r in ranges if r.size)
    for (path_a, _, end_a), (path_b, start_b, _) in pairwise(spans):
        if path_a == path_b and start_b < end_a:
            raise BadInputError(f"{where}: two flat partitions overlap in {path_a}: the fragments are not disjoint")


class _Stream:
    """Elements of consecutive 1-D partitions, addressed as one run: ranges -> file pieces."""

    def __init__(self, parts: list[tuple[FileRange, int]], itemsize: int = 4) -> None:
        self.parts, self.itemsize = parts, itemsize
        self.size = sum(n for _, n in parts)

    def pieces(self, start: int, count: int) -> list[FileRange]:
        out: list[FileRange] = []
        base = 0
        for source, n in self.parts:
            lo, hi = max(start, base), min(start + count, base + n)
            if lo < hi:
                out.append(source.sub((lo - base) * self.itemsize, (hi - lo) * self.itemsize))
            base += n
        return out


def _tensor(dtype: str, shape: tuple[int, ...], pieces: list[FileRange]) -> TensorRef:
    """A tensor whose bytes are ``pieces`` end to end: one range as it is, several joined."""
    merged: list[FileRange] = []
    for p in pieces:
        last = merged[-1] if merged else None
        if last is not None and last.path == p.path and last.offset + last.size == p.offset:
            merged[-1] = FileRange(last.path, last.offset, last.size + p.size)
        elif p.size:
            merged.append(p)
    expected = _numel(shape) * DTYPE_ITEMSIZE[dtype]
    if sum(p.size for p in merged) != expected:  # the pieces must tile the tensor exactly
        raise BadInputError(f"internal: pieces of {sum(p.size for p in merged)} bytes for a {expected}-byte tensor")
    if not merged:
        return tensor_from_range(dtype, shape, ComputedSource(0, lambda files: b""))
    source = merged[0] if len(merged) == 1 else JoinedSource.of(tuple(merged))
    return tensor_from_range(dtype, shape, source)


def _as_float32(t: TensorRef) -> TensorRef:
    """A floating buffer in fp32 (what ``zero_to_fp32`` gives for buffers saved in 16 bits;
    integer buffers, ``num_batches_tracked``, stay integers, where it makes them float32)."""
    return _cast(t, "float32") if t.dtype.startswith(("float", "bfloat")) else t


def _cast(t: TensorRef, dtype: str) -> TensorRef:
    """``t`` in ``dtype``, computed when written, rounded as torch's ``Tensor.to`` rounds."""
    if t.dtype == dtype:
        return t
    from ..model.numeric import cast_float_bytes

    def produce(files: OpenFiles) -> bytes:
        return cast_float_bytes(tensor_c_bytes(t, files), t.dtype, dtype) if t.numel else b""

    return tensor_from_range(dtype, t.shape, ComputedSource(t.numel * DTYPE_ITEMSIZE[dtype], produce))


def _names_dict(value: object, where: str, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadInputError(f"{where}: {what} is not a table of names")
    return value


# ---------------------------------------------------------------------------------------------
# reading


def read_deepspeed(
    folder: Path,
    globals_seen: set[str],
    allow: Sequence[str] = (),
    *,
    tag: str | None = None,
    weights: str | None = None,
) -> tuple[Tree, DeepSpeedInfo]:
    """The model of a DeepSpeed folder as a lazy state dict, and what the folder is.

    ``weights``: ``"fp32"`` (the master weights from the optimizer partitions, the default
    for ZeRO >= 1, what ``zero_to_fp32.py`` gives) or ``"module"`` (the module's weights as
    trained, the only ones ZeRO-0 has). Keys come in the model's ``state_dict()`` order.
    """
    if weights is not None and weights not in WEIGHTS:
        raise BadInputError(f"--weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    tag_dir, tag, tags = find_tag(folder, tag)
    files = _list_files(tag_dir)
    input_bytes = sum(p.stat().st_size for p in (files.model, *files.zero3_models.values(), *files.optim.values()) if p)
    first = files.model if files.model is not None else files.zero3_models[0]
    states = _read(first, globals_seen, allow)
    where = str(first)
    module = states.get("module")
    if not isinstance(module, dict):
        raise BadInputError(f"{where}: no module state dict ('module')")
    ds_version = states.get("ds_version") if isinstance(states.get("ds_version"), str) else None
    dtype = _trained_dtype(module)
    if not files.optim:
        if files.zero3_models:
            raise BadInputError(f"{tag_dir}: ZeRO-3 model states without optimizer partitions: the save is incomplete")
        if weights == "fp32":
            raise BadInputError(
                f"{tag_dir}: a ZeRO-0 save (no optimizer partitions) keeps no named fp32 master weights",
                hint="read its module weights (the default for ZeRO-0)",
            )
        saved_world = states.get("dp_world_size")
        zero0 = DeepSpeedInfo(
            tag,
            tags,
            0,
            saved_world if type(saved_world) is int else 1,
            dtype,
            _count(module, states.get("buffer_names")),
            0,
            ("module",),
            "module",
            ds_version,
            input_bytes=input_bytes,
        )
        return module, zero0
    optims = [_read(files.optim[r], globals_seen, allow) for r in range(len(files.optim))]
    inner = []
    for r, o in enumerate(optims):
        osd = o.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise BadInputError(f"{files.optim[r]}: no optimizer_state_dict: not a ZeRO optimizer partition")
        inner.append(osd)
    stage = _stage_of(inner[0], str(files.optim[0]))
    world = _world(inner[0], str(files.optim[0]))
    for r, osd in enumerate(inner):
        if _stage_of(osd, str(files.optim[r])) != stage or _world(osd, str(files.optim[r])) != world:
            raise BadInputError(f"{files.optim[r]}: a different ZeRO stage or world size than rank 0's: runs mixed")
    if world != len(optims):
        raise BadInputError(
            f"{tag_dir}: the partitions say world size {world}, but {len(optims)} optimizer partition files are here",
            hint="a rank did not save, or an older save's files are mixed in: copy the whole tag folder again",
        )
    chosen = weights or "fp32"
    if stage == 3:
        if sorted(files.zero3_models) != list(range(world)):
            raise BadInputError(
                f"{tag_dir}: ZeRO-3 model states for {len(files.zero3_models)} ranks, world size {world}",
                hint="a rank did not save: copy the whole tag folder again",
            )
        rank_states = [states] + [_read(files.zero3_models[r], globals_seen, allow) for r in range(1, world)]
    else:
        rank_states = [states]
    param_shapes = states.get("param_shapes")
    if not (isinstance(param_shapes, list) and all(isinstance(g, dict) for g in param_shapes)):
        raise BadInputError(f"{where}: no param_shapes table (per parameter group)")
    groups = [{k: _size(v, where) for k, v in _names_dict(g, where, "param_shapes").items()} for g in param_shapes]
    frozen_shapes = {
        k: _size(v, where) for k, v in _names_dict(states.get("frozen_param_shapes"), where, "frozen shapes").items()
    }
    buffer_names = states.get("buffer_names")
    if not (isinstance(buffer_names, list) and all(isinstance(n, str) for n in buffer_names)):
        raise BadInputError(f"{where}: no buffer_names list")
    shared = _names_dict(states.get("shared_params"), where, "shared_params")
    result: dict[str, Any] = {}
    frozen_numel = sum(map(_numel, frozen_shapes.values())) + _unrecorded(module, groups, frozen_shapes, stage, states)

    def info(notes: Sequence[str]) -> DeepSpeedInfo:
        count = _count_groups(groups, frozen_shapes) - sum(map(_numel, frozen_shapes.values())) + frozen_numel
        return DeepSpeedInfo(
            tag, tags, stage, world, dtype, count, frozen_numel, WEIGHTS, chosen, ds_version, [*notes], input_bytes
        )

    if chosen == "module" and stage < 3:
        return module, info(())
    for name in buffer_names:
        t = module.get(name)
        if isinstance(t, TensorRef):
            result[name] = _as_float32(t) if chosen == "fp32" else t
    frozen = _frozen(rank_states, frozen_shapes, world, stage, files)
    result.update(frozen)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flats = []
    for r, osd in enumerate(inner):
        group_list = osd.get(key)
        if not isinstance(group_list, list) or (stage < 3 and len(group_list) != len(groups)):
            raise BadInputError(
                f"{files.optim[r]}: {key} holds {len(group_list) if isinstance(group_list, list) else 'no'} "
                f"partitions for {len(groups)} parameter groups"
            )
        flats.append([_flat(t, f"{files.optim[r]}: {key}[{g}]") for g, t in enumerate(group_list)])
    _check_disjoint([source for rank in flats for source, _ in rank], str(tag_dir))
    if stage < 3:
        result.update(_zero12(groups, flats, world, files))
    else:
        trainable = _zero3(groups, flats, world, files)
        if chosen == "module":
            # ZeRO-3 keeps no whole 16-bit weights: after each step the engine rounds the fp32
            # master partitions to the trained dtype (torch's round-to-nearest-even), which is
            # what its consolidated 16-bit state dict gathers; so is this
            trainable = {k: _cast(t, dtype) for k, t in trainable.items()}
        result.update(trainable)
    for alias, owner in shared.items():
        if isinstance(owner, str) and owner in result:
            result[alias] = result[owner]  # the tie restored: one tensor, two names (#1896)
    # a tie shared_params does not name: the module pickles tied names with one storage
    owners = {id(t.storage): k for k, t in module.items() if isinstance(t, TensorRef) and k in result}
    for k, t in module.items():
        if k not in result and isinstance(t, TensorRef) and id(t.storage) in owners:
            result[k] = result[owners[id(t.storage)]]
    notes = []
    if stage < 3:
        # ZeRO-1 records no frozen parameters (frozen_param_shapes is None): zero_to_fp32 drops
        # them and the result fails load_state_dict(strict=True). They are in the module
        # weights, as trained (frozen: never updated), where ZeRO-2 would have recorded them too
        missing = [k for k, v in module.items() if k not in result and isinstance(v, TensorRef)]
        result.update((k, module[k]) for k in missing)
        if missing:
            notes.append(
                f"{len(missing)} module entries without fp32 master weights (frozen parameters this ZeRO-{stage} save "
                f"did not record, e.g. {missing[0]}) were taken from the module weights as trained"
            )
    ordered = {k: result[k] for k in module if k in result}
    ordered.update((k, v) for k, v in result.items() if k not in ordered)
    return ordered, info(notes)


def _unrecorded(
    module: dict[Any, Any],
    groups: list[dict[str, tuple[int, ...]]],
    frozen: dict[str, tuple[int, ...]],
    stage: int,
    states: dict[Any, Any],
) -> int:
    """Elements of the module's parameters the save records nowhere else (ZeRO-1's frozen
    ones): not trained, not frozen-recorded, not buffers, not a tie of any of those."""
    if stage >= 3:
        return 0
    buffers, shared = states.get("buffer_names"), states.get("shared_params")
    known = {n for g in groups for n in g} | set(frozen)
    known |= {b for b in buffers if isinstance(b, str)} if isinstance(buffers, list) else set()
    known |= {k for k in shared if isinstance(k, str)} if isinstance(shared, dict) else set()
    storages = {id(t.storage) for n, t in module.items() if n in known and isinstance(t, TensorRef)}
    extra = [t for n, t in module.items() if isinstance(t, TensorRef) and n not in known]
    return sum(t.numel for t in extra if id(t.storage) not in storages)


def _trained_dtype(module: dict[Any, Any]) -> str:
    kinds = [t.dtype for t in module.values() if isinstance(t, TensorRef) and t.dtype.startswith(("float", "bfloat"))]
    return max(set(kinds), key=kinds.count) if kinds else "float32"


def _count(module: dict[Any, Any], buffers: object) -> int:
    """Parameter elements in a module state dict (buffers and ties not counted)."""
    seen: set[int] = set()
    total = 0
    skip = {b for b in buffers if isinstance(b, str)} if isinstance(buffers, list) else set()
    for k, t in module.items():
        if isinstance(t, TensorRef) and id(t.storage) not in seen and k not in skip:
            seen.add(id(t.storage))
            total += t.numel
    return total


def _count_groups(groups: list[dict[str, tuple[int, ...]]], frozen: dict[str, tuple[int, ...]]) -> int:
    return sum(_numel(s) for g in groups for s in g.values()) + sum(map(_numel, frozen.values()))


def _frozen(
    rank_states: list[dict[Any, Any]], shapes: dict[str, tuple[int, ...]], world: int, stage: int, files: _Files
) -> dict[str, TensorRef]:
    """Frozen parameters: whole in the model states (ZeRO 1/2), one partition per rank (ZeRO-3)."""
    out: dict[str, TensorRef] = {}
    if not shapes:
        return out
    where = [str(files.model or files.zero3_models[0])] + [str(files.zero3_models.get(r)) for r in range(1, world)]
    fragments = [
        _names_dict(s.get("frozen_param_fragments"), where[r], "frozen_param_fragments")
        for r, s in enumerate(rank_states)
    ]
    for name, shape in shapes.items():
        numel = _numel(shape)
        if stage < 3:
            t = fragments[0].get(name)
            if not (isinstance(t, TensorRef) and t.numel == numel):
                raise BadInputError(f"{where[0]}: frozen parameter {name!r:.80} has no fragment of {numel} elements")
            out[name] = t if t.shape == shape else _reshaped(t, shape, where[0], name)
            continue
        part = -(-numel // world)
        pieces: list[FileRange] = []
        dtype = None
        for r in range(world):
            t = fragments[r].get(name)
            if not (isinstance(t, TensorRef) and t.numel == part and is_c_contiguous(t.shape, t.stride)):
                raise BadInputError(
                    f"{where[r]}: frozen parameter {name!r:.80}: rank {r}'s partition is not {part} elements"
                )
            if dtype not in (None, t.dtype) or not is_plain_range(t.storage.source) or t.storage.byteorder != "little":
                raise BadInputError(f"{where[r]}: frozen parameter {name!r:.80}: partitions of different kinds")
            dtype = t.dtype
            item = DTYPE_ITEMSIZE[t.dtype]
            pieces.append(t.storage.source.sub(t.storage_offset * item, part * item))
        assert dtype is not None
        out[name] = _tensor(dtype, shape, _truncate(pieces, numel * DTYPE_ITEMSIZE[dtype]))
    return out


def _reshaped(t: TensorRef, shape: tuple[int, ...], where: str, name: str) -> TensorRef:
    if not (is_c_contiguous(t.shape, t.stride) and is_plain_range(t.storage.source)):
        raise BadInputError(f"{where}: frozen parameter {name!r:.80} is stored as a view")
    item = DTYPE_ITEMSIZE[t.dtype]
    return _tensor(t.dtype, shape, [t.storage.source.sub(t.storage_offset * item, t.numel * item)])


def _truncate(pieces: list[FileRange], size: int) -> list[FileRange]:
    """The first ``size`` bytes of ``pieces`` (the partitions' padding is cut off the end)."""
    out: list[FileRange] = []
    left = size
    for p in pieces:
        if left <= 0:
            break
        take = min(left, p.size)
        out.append(p.sub(0, take))
        left -= take
    return out


def _zero12(
    groups: list[dict[str, tuple[int, ...]]], flats: list[list[tuple[FileRange, int]]], world: int, files: _Files
) -> dict[str, TensorRef]:
    """ZeRO 1/2: group g's parameters, in order, tile the ranks' partitions of g end to end."""
    out: dict[str, TensorRef] = {}
    align = 2 * world
    for g, shapes in enumerate(groups):
        stream = _Stream([flats[r][g] for r in range(world)])
        need = sum(_numel(s) for s in shapes.values())
        # zero_to_fp32's own check: the parameters fill the partitions up to the alignment padding
        if need > stream.size or -(-need // align) != -(-stream.size // align):
            raise BadInputError(
                f"{files.optim[0].parent}: parameter group {g}'s {len(shapes)} parameters hold {need} elements, "
                f"its partitions {stream.size} (sizes {[n for _, n in stream.parts][:8]}): the partition sizes lie"
            )
        offset = 0
        for name, shape in shapes.items():
            numel = _numel(shape)
            if name in out:
                raise BadInputError(f"{files.optim[0].parent}: parameter {name!r:.80} listed in two places")
            out[name] = _tensor("float32", shape, stream.pieces(offset, numel))
            offset += numel
    return out


def _zero3(
    groups: list[dict[str, tuple[int, ...]]], flats: list[list[tuple[FileRange, int]]], world: int, files: _Files
) -> dict[str, TensorRef]:
    """ZeRO-3: every parameter is split on its own into ``ceil(n / world)`` elements per rank
    (padded at the end); each rank's partitions follow each other through its flat groups."""
    streams = [_Stream(flats[r]) for r in range(world)]
    if len({s.size for s in streams}) != 1:
        raise BadInputError(
            f"{files.optim[0].parent}: the ranks' flat partitions differ in size ({[s.size for s in streams][:8]}): "
            "the partition sizes lie"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for g in groups:
        for name, shape in g.items():
            if name in shapes:
                raise BadInputError(f"{files.optim[0].parent}: parameter {name!r:.80} listed in two places")
            shapes[name] = shape
    need = sum(-(-_numel(s) // world) for s in shapes.values())
    if need != streams[0].size:
        raise BadInputError(
            f"{files.optim[0].parent}: the parameters need {need} elements on each rank, its partitions hold "
            f"{streams[0].size}: the partition sizes lie"
        )
    out: dict[str, TensorRef] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = _numel(shape)
        part = -(-numel // world)
        pieces = [p for s in streams for p in s.pieces(offset, part)]
        out[name] = _tensor("float32", shape, _truncate(pieces, numel * 4))
        offset += part
    return out
