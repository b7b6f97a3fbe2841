"""Whole operations -- read, transform, write -- as the CLI runs them, callable from Python.

Every writing command is one pipeline::

    read (any format) -> --select -> --drop/--keep/prune -> --strip-prefix ... -> --add-prefix
        -> --rename ... -> --map-location -> --dtype
        -> write (format from OUT or --format: .pth, .safetensors, a shard folder, dcp)

``strip-module`` and ``add-module`` are this pipeline with one prefix step, and they write
nothing when no key changes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .analysis.inspect import describe_tree, holding, not_a_mapping_fix
from .analysis.inspect import inspect_checkpoint as inspect_checkpoint  # the library's entry points, all here
from .errors import (
    BadInputError,
    CannotWriteError,
    CheckFailedError,
    InputMismatchError,
    UnsafeInputError,
    UsageError,
    about_input,
    names_input,
)
from .fileio.atomic import atomic_output, check_destination
from .fileio.extents import shared_bytes, shared_bytes_of
from .fileio.ranges import FileRange, OpenFiles, OutputStream
from .fileio.remote import (
    RemotePath,
    as_path,
    consistent_reads,
    local_or_remote,
    metadata_only,
    output_urls,
    refuse_existing,
    remote_outputs,
    staged_output,
)
from .fileio.sizes import parse_size
from .fileio.urls import is_url
from .formats.checkpoint import (
    FORMAT_DCP,
    FORMAT_SAFETENSORS,
    FORMAT_SHARDED,
    FORMAT_TORCH_ZIP,
    Checkpoint,
    read_checkpoint,
)
from .formats.detect import CHECKPOINT_SUFFIXES, FILE_FORMATS, OUTPUT_FORMATS, PTH_SUFFIXES, check_input
from .formats.safetensors import (
    SafetensorsPlan,
    check_expand_budget,
    check_torch_expand_budget,
    default_expand_budget,
    plan_safetensors,
    write_safetensors,
    write_safetensors_from_torch,
)
from .formats.sharded import Split, together, write_sharded
from .model.needs import need_torch
from .model.paths import format_path
from .model.paths import select as select_path
from .model.refs import StorageRef, TensorRef, is_meta_tensor, is_tensor_like
from .model.statedicts import (
    EMA_ENTRIES,
    PURE_WRAPPER_PREFIXES,
    ema_prefix,
    find_state_dicts,
    holds_tensors_by_name,
    looks_like_state_dict,
    split_ema,
    wrapper_chain,
)
from .model.walk import census, substitute, walk
from .pickling.names import check_global_patterns
from .pickling.vm import collector_paused, keep_until_exit
from .transforms.devices import parse_map_location, remap_devices
from .transforms.foreign import check_output, has_foreign
from .transforms.prefix import AUTO, add_prefix, normalize_prefix, parse_rule, rename_keys, strip_prefix, wrapper_fix
from .transforms.select import filter_tree, literal_glob, prune_patterns, shell_word

if TYPE_CHECKING:
    from .analysis.diff import DiffReport
    from .transforms.fit import FitPlan

DEFAULT_SHARD_SIZE = "5GB"
#: what a write target is called in reports: the words ``inspect`` prints for a format
_FORMAT_WORDS = {
    "pth": FORMAT_TORCH_ZIP,
    "safetensors": FORMAT_SAFETENSORS,
    "sharded": FORMAT_SHARDED,
    "dcp": FORMAT_DCP,
}
#: --keep-metadata keeps values whose JSON form is at most this long
_MAX_METADATA_VALUE = 1024


@dataclass(frozen=True)
class ConvertOptions:
    """Everything a writing command can be asked to do; the defaults change nothing.

    Frozen: a command's preset makes a new one with :func:`dataclasses.replace`, so what a
    worker process runs is exactly what the command built."""

    select: str | None = None
    #: with --select (or alone): the EMA copy of the weights instead of the model's own
    ema: bool = False
    drop: Sequence[str] = ()
    keep: Sequence[str] = ()
    prune: bool = False
    strip_prefixes: Sequence[str] = ()
    add_prefix: str | None = None
    rename: Sequence[str] = ()
    keys: Sequence[str] = ()
    map_location: str | None = None
    dtype: str | None = None
    dtype_keep: Sequence[str] = ()
    out_format: str | None = None
    max_shard_size: str | int | None = None
    #: a DCP output (``out_format="dcp"``): split it into this many ``.distcp`` files, every
    #: tensor cut by rows for as many readers (see :mod:`ckptfix.formats.dcp_writer`); None: one
    dcp_files: int | None = None
    #: the most tensor bytes a safetensors write may produce by writing views out in full
    #: (``2GB``, ``5GiB`` or bytes); None: 16x the input's size, at least 1 GiB
    max_expand: str | int | None = None
    keep_metadata: bool = False
    #: a checkpoint that is one tensor (or, with --sanitize, one numpy array): store it under this name
    tensor_name: str | None = None
    dry_run: bool = False
    force: bool = False
    in_place: bool = False
    strict: bool = False
    unsafe_load: bool = False
    allow_globals: Sequence[str] = ()
    sanitize: bool = False
    #: re-read the output and check it against the plan before it replaces anything
    verify: bool = False
    #: strip-module/add-module: write only when a key was renamed
    require_change: bool = False
    #: split a sharded write by output shard over the processes ``torchrun`` started (see
    #: :func:`torchrun_split`); every process runs the same command
    distributed: bool = False
    #: DeepSpeed folders: the tag to read (default: what ``latest`` names) and the weights
    #: (``fp32`` master weights, the default for ZeRO >= 1, or ``module``)
    tag: str | None = None
    weights: str | None = None


@dataclass(frozen=True)
class Step:
    """One step the command asked for, and what it did.

    ``done`` holds a phrase per change ("stripped 'module.' on 9/9 keys in state_dict"); empty
    when the step changed nothing, and then ``unchanged`` says why. A command that must change
    something ("strip-module") writes nothing when no step did, and names every step's reason.
    """

    requested: str
    done: tuple[str, ...]
    unchanged: str

    @property
    def changed(self) -> bool:
        return bool(self.done)


@dataclass
class Report:
    """What a writing command did; ``to_dict()`` is the ``--json`` document."""

    command: str
    input: str
    output: str | None
    #: the words ``inspect`` prints: torch-zip, torch-legacy, torch-tar, safetensors, sharded, dcp
    input_format: str
    #: torch-zip, safetensors, sharded or dcp (``--format pth`` writes torch-zip)
    output_format: str
    dry_run: bool
    #: for a sharded output, the shards' format (torch-zip or safetensors); None otherwise
    shard_format: str | None = None
    #: the input's size on disk (a folder's files together)
    input_bytes: int = 0
    written: bool = False
    #: nothing needed changing: OUT (if written) holds the input's content as it was
    unchanged: bool = False
    renamed: int = 0
    state_dicts: list[dict[str, Any]] = field(default_factory=list)
    selected: str | None = None
    sanitized: list[dict[str, str]] = field(default_factory=list)
    #: classes outside the allow-list that the output leaves out ({"path", "global"})
    ignored: list[dict[str, str]] = field(default_factory=list)
    #: globals outside torch's allow-list that the output carries, allowed by --allow-global
    kept_globals: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    dropped_bytes: int = 0
    #: storages moved by --map-location, per move (``{"cuda:1->cpu": 9}``)
    device_moves: dict[str, int] = field(default_factory=dict)
    cast: dict[str, Any] = field(default_factory=dict)
    verify_seconds: float | None = None
    tensors: int = 0
    aliases: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    #: bytes of the output in blocks shared with another file (the input: a copy-on-write
    #: copy), as the file system reports them; None where it cannot tell
    shared_bytes: int | None = None
    seconds: float = 0.0
    message: str = ""
    notes: list[str] = field(default_factory=list)
    #: the requested steps in pipeline order (in --json as {"step", "changed"})
    steps: list[Step] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(step.changed for step in self.steps)

    @property
    def devices(self) -> dict[str, int]:
        """The name before schema 2; use :attr:`device_moves`."""
        return self.device_moves

    @property
    def bytes_dropped(self) -> int:
        """The name before schema 2; use :attr:`dropped_bytes`."""
        return self.dropped_bytes

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data, each container copied with its dicts and lists one level
        down. Not ``dataclasses.asdict``: that deep-copies every (old, new) pair of every
        rename, ~150 000 Python calls for a 50 000-key state dict; the pairs are tuples of
        strings, shared as they are. Every field holds plain data (the steps are spelled out)."""
        document = {f.name: _copied(getattr(self, f.name)) for f in fields(self)}
        document["steps"] = [{"step": s.requested, "changed": s.changed} for s in self.steps]
        return document


def _copied(value: Any) -> Any:
    """A report field's value with its dicts and lists copied two levels down (a list of dicts
    of lists: ``state_dicts``); tuples, strings and numbers are shared, being immutable."""
    if isinstance(value, dict):
        return {k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v for k, v in value.items()}
    if isinstance(value, list):
        return [
            {k: list(v) if isinstance(v, list) else v for k, v in item.items()} if isinstance(item, dict) else item
            for item in value
        ]
    return value


def read_input(path: str | os.PathLike[str], opts: ConvertOptions, *, inert_unknown: bool) -> Checkpoint:
    """One input as the options read it: --unsafe-load, --allow-global, DeepSpeed's --tag and
    --weights; ``inert_unknown``: classes off the allow-list as inert records (judged later on
    what the output carries)."""
    return read_checkpoint(
        path,
        unsafe_load=opts.unsafe_load,
        allow_globals=opts.allow_globals,
        inert_unknown=inert_unknown,
        tag=opts.tag,
        weights=opts.weights,
    )


def check_dcp_files(dcp_files: int | None, kind: str) -> None:
    """``--dcp-files N`` splits a DCP output; anywhere else it would be ignored: refused."""
    from .formats.dcp_writer import MAX_FILES

    if dcp_files is None:
        return
    if kind != "dcp":
        raise UsageError("--dcp-files splits a DCP folder: add --format dcp")
    if not 1 <= dcp_files <= MAX_FILES:
        raise UsageError(f"--dcp-files takes 1 to {MAX_FILES}, not {dcp_files}")


def output_target(out_path: str, out_format: str | None, max_shard_size: Any) -> tuple[str, str]:
    """(kind, file format): kind is "file" or "sharded"; the format is "pth" or "safetensors"."""
    if out_format is not None and out_format not in OUTPUT_FORMATS:
        raise UsageError(f"unknown --format {out_format!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
    if out_format == "dcp":
        return "dcp", "dcp"
    is_folder = out_path.endswith(("/", os.sep)) or Path(out_path).is_dir()
    suffix = Path(out_path).suffix.lower()
    if max_shard_size is not None and not is_folder and suffix in (*PTH_SUFFIXES, ".safetensors"):
        folder = str(Path(out_path).with_suffix("")) + "/"
        raise UsageError(
            f"--max-shard-size writes a folder of shards, but {out_path} is named like a file: "
            f"name the folder, e.g. {folder}"
        )
    if is_folder or max_shard_size is not None:
        return "sharded", out_format or "safetensors"
    if out_format:
        return "file", out_format
    if suffix == ".safetensors":
        return "file", "safetensors"
    if suffix in PTH_SUFFIXES:
        return "file", "pth"
    raise UsageError(
        f"{out_path}: cannot tell the output format from the name; use a .pth/.safetensors name, "
        "a folder ending in / for shards, or --format"
    )


def _metadata_value(value: Any) -> str | None:
    """How --keep-metadata stores a value: str as is, other plain JSON values as JSON text."""
    if isinstance(value, str):
        return value
    try:  # what fits in 1 KiB of JSON is small and shallow: look before encoding (json recurses)
        for count, _ in enumerate(walk(value, limit=100, leaves=True)):
            if count > _MAX_METADATA_VALUE:
                return None
        text = json.dumps(value)
    except (TypeError, ValueError, BadInputError):
        return None
    return text if len(text) <= _MAX_METADATA_VALUE else None


def flat_state_dict(root: Any, original: Any, keep_metadata: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``{name: tensor}`` mapping safetensors needs, plus metadata kept by --keep-metadata.

    Anything that is neither a tensor nor (with --keep-metadata) a small plain value is an
    error that names every such entry and the options that leave it out (``--drop PATH``),
    or, where the tensors are further down, the ``--select`` that takes them: data is never
    dropped silently.
    """
    if not isinstance(root, Mapping):
        raise InputMismatchError(
            f"safetensors holds named tensors, but this holds {holding(root)}", hint=not_a_mapping_fix(root)
        )
    tensors = {k: v for k, v in root.items() if is_tensor_like(v)}
    others = {k: v for k, v in root.items() if k not in tensors}
    metadata: dict[str, str] = {}
    if keep_metadata:
        sources = [others] + ([original] if isinstance(original, Mapping) and original is not root else [])
        for mapping in sources:
            for key, value in mapping.items():
                text = _metadata_value(value)
                if text is not None and isinstance(key, str):
                    metadata.setdefault(key, text)
        others = {k: v for k, v in others.items() if k not in metadata}
    candidates = [format_path(p) for p, _ in find_state_dicts(root) if p]
    if candidates and not tensors:
        layout = "; ".join(
            f"{e['path']}: {e['kind']}" + (f" ({e['tensors']} tensors)" if "tensors" in e else "")
            for e in describe_tree(root, 10)
        )
        raise InputMismatchError(
            f"safetensors holds one flat mapping of names to tensors, but this holds: {layout}",
            hint=f"choose the weights with --select, e.g. --select {candidates[0]}",
        )
    if others or not tensors:
        names = [format_path((k,)) for k in others]
        listed = ", ".join(f"{n} ({holding(others[k])})" for n, k in zip(names[:20], others))
        more = f" and {len(names) - 20} more" if len(names) > 20 else ""
        drops = " ".join(f"--drop {shell_word(literal_glob(n))}" for n in names[:20])
        if not tensors:
            raise InputMismatchError(
                f"safetensors holds named tensors, but there are none here; this holds {listed}{more}",
                hint="write a .pth file, or --select the part that holds the weights",
            )
        raise InputMismatchError(
            f"safetensors holds only tensors, but {len(names)} entries beside the {len(tensors)} tensors are not: "
            f"{listed}{more}",
            hint=f"leave them out with {drops}, keep small values as metadata with --keep-metadata, "
            "or write a .pth file",
        )
    return tensors, metadata


def verify_output(temp: Path, planned: Any, file_format: str, report: Report) -> None:
    """Re-open a written file and require it to hold exactly the planned tree: keys, dtypes,
    shapes and every tensor's bytes (and, for .pth, device tags and which tensors share storage)."""
    from .analysis.diff import diff_trees
    from .analysis.diff import render as render_diff

    started = time.perf_counter()
    written = read_checkpoint(temp)
    result = diff_trees(planned, written.root)
    problems = []
    if not result.equal:
        problems.append(render_diff(result).splitlines()[0])
    if file_format == "pth":
        planned_tags, planned_sharing = _storage_layout(planned)
        written_tags, written_sharing = _storage_layout(written.root)
        if planned_tags != written_tags:
            problems.append(f"device tags {sorted(set(written_tags))} instead of {sorted(set(planned_tags))}")
        if planned_sharing != written_sharing:
            problems.append("tensors that should share a storage do not (or the reverse)")
    report.verify_seconds = round(time.perf_counter() - started, 4)
    if problems:
        raise CannotWriteError(
            f"{report.output}: the written file failed verification: {'; '.join(problems)}",
            hint="nothing was replaced; this is a bug or a failing disk",
        )


def _storage_layout(root: Any) -> tuple[list[str], set[frozenset[tuple[Any, ...]]]]:
    """In one walk: the device tags of the distinct storages the tree uses (through tensors or
    directly), and the groups of tensor paths that share a storage. Paths stay tuples of keys
    (formatting a million paths of one memoized tensor cost more than the rest of --verify)."""
    storages: dict[int, StorageRef] = {}
    groups: dict[int, set[tuple[Any, ...]]] = {}
    for path, value in walk(root):
        if isinstance(value, TensorRef):
            storages[id(value.storage)] = value.storage
            groups.setdefault(id(value.storage), set()).add(path)
        elif isinstance(value, StorageRef):
            storages[id(value)] = value
    tags = sorted(s.location for s in storages.values())
    return tags, {frozenset(g) for g in groups.values() if len(g) > 1}


def model_or_ema(root: Any, ema: bool) -> tuple[Any, tuple[Any, ...], list[str]]:
    """The model's weights in ``root``, or with ``ema`` its EMA copy: a top-level EMA entry
    (timm's ``state_dict_ema``, ``model_ema``, ``ema``), or the EMA submodule of a state dict
    that holds both (a Lightning module with ``model`` and ``model_ema``).

    Returns the tree to use, the path of the top-level entry taken (``()`` if none) and notes
    saying what was left out."""
    if ema and isinstance(root, Mapping):
        entry = next((e for e in EMA_ENTRIES if e in root), None)
        if entry is not None:
            return root[entry], (entry,), [f"took the EMA weights at {entry!r}"]
    replacements: dict[int, Any] = {}
    notes: list[str] = []
    for _, state_dict in find_state_dicts(root) if not looks_like_state_dict(root) else [((), root)]:
        part, note = split_ema(state_dict, ema)
        if note:
            replacements[id(state_dict)] = part
            notes.append(note)
    if ema and not replacements:
        raise InputMismatchError(
            "--ema: no EMA copy here (no state_dict_ema/model_ema/ema entry, no model_ema./ema. keys "
            "beside the model's)"
        )
    if id(root) in replacements:
        return replacements[id(root)], (), notes
    return (substitute(root, replacements) if replacements else root), (), notes


def _strip_words(prefix: str) -> tuple[str, str, str]:
    """How a strip step is reported: its label, the verb of a change, why it changed nothing."""
    if prefix == AUTO:
        wrappers = ", ".join(PURE_WRAPPER_PREFIXES)
        return (
            "strip wrapper prefixes",
            "stripped wrapper prefixes on",
            f"no wrapper prefix ({wrappers}) is on every key",
        )
    return f"strip {prefix!r}", f"stripped {prefix!r} on", f"no key starts with {prefix!r}"


def apply_transforms(ckpt: Checkpoint, opts: ConvertOptions, report: Report, out_format: str | None = None) -> Any:
    """Run the transform steps of the pipeline on ``ckpt``'s tree; record them in ``report``.
    ``out_format``: what will be written, where it changes what a step can do."""
    root = select_path(ckpt.root, opts.select)[1] if opts.select else ckpt.root
    if opts.select or opts.ema:
        root, _, notes = model_or_ema(root, opts.ema)
        report.notes += notes
    steps = report.steps
    done: tuple[str, ...]
    if opts.sanitize:
        from .transforms.sanitize import sanitize

        root, cleaned = sanitize(root)
        report.sanitized = cleaned.replaced
        kinds = ", ".join(sorted({s["global"] for s in cleaned.replaced}))
        done = (f"sanitized {len(cleaned.replaced)} objects ({kinds})",) if cleaned.replaced else ()
        steps.append(Step("--sanitize", done, "nothing to sanitize"))
    if opts.tensor_name is not None:
        if not is_tensor_like(root):
            raise InputMismatchError(f"--tensor-name {opts.tensor_name}: this holds {holding(root)}, not one tensor")
        root = {opts.tensor_name: root}
        steps.append(Step(f"--tensor-name {opts.tensor_name}", (f"named the tensor {opts.tensor_name!r}",), ""))
    keys = opts.keys
    if opts.select and not keys and holds_tensors_by_name(root) and not find_state_dicts(root):
        keys = ("",)  # what --select names is the state dict, whatever else it holds beside the tensors
    drop = list(opts.drop) + (prune_patterns(root) if opts.prune else [])
    if drop or opts.keep:
        root, selection = filter_tree(root, drop, opts.keep)
        report.dropped = selection.dropped
        report.dropped_bytes = selection.bytes_before - selection.bytes_after
    if opts.drop or opts.keep or opts.prune:
        done = (
            (f"dropped {len(report.dropped)} entries ({report.dropped_bytes} bytes of tensors)",)
            if report.dropped
            else ()
        )
        why = "nothing to prune: no optimizer, scheduler, loop or callback state" if opts.prune else "nothing matched"
        steps.append(Step("prune" if opts.prune else "--drop/--keep", done, why))
    prefix_steps: list[tuple[str, str, str, Callable[[Any], Any]]] = [
        (
            *_strip_words(normalize_prefix(p)),
            partial(strip_prefix, prefix=p, keys=keys),
        )
        for p in opts.strip_prefixes
    ]
    if opts.add_prefix:
        added = normalize_prefix(opts.add_prefix)
        prefix_steps.append(
            (
                f"add {added!r}",
                f"added {added!r} on",
                f"every key already starts with {added!r}",
                partial(add_prefix, prefix=added, keys=keys),
            )
        )
    if opts.rename:
        prefix_steps.append(
            (
                "rename by rules",
                "renamed",
                "no key matches the rename rules",
                lambda r: rename_keys(r, opts.rename, keys),
            )
        )
    for label, verb, why, step in prefix_steps:
        result = step(root)
        root = result.root
        report.state_dicts += [c.to_dict() | {"change": label} for c in result.changes]
        report.renamed += result.renamed
        done = tuple(
            f"{verb} {len(c.renamed)}/{c.keys} keys in {c.path or '(top level)'}" for c in result.changes if c.renamed
        )
        steps.append(Step(label, done, why))
    if opts.map_location and out_format == "safetensors":
        # safetensors stores no device tags: a move would be claimed and then not written
        why = "a safetensors output has no device tags (its loader's device argument decides)"
        steps.append(Step(f"--map-location {opts.map_location}", (), why))
    elif opts.map_location:
        if not ckpt.lazy:
            raise InputMismatchError(f"--map-location cannot be applied to a {ckpt.format} file read through torch")
        meta = sum(1 for value in census(root).records if is_meta_tensor(value))
        if meta:
            raise InputMismatchError(
                f"--map-location {opts.map_location}: {meta} tensors are on the meta device, with no data to move",
                hint="a meta tensor has only a shape: save the model again after its weights are materialised",
            )
        root, report.device_moves = remap_devices(root, opts.map_location)
        done = tuple(f"moved {n} storages {move}" for move, n in report.device_moves.items())
        why = f"no device tag changes under --map-location {opts.map_location}"
        steps.append(Step(f"--map-location {opts.map_location}", done, why))
    if opts.dtype:
        if not ckpt.lazy:
            raise InputMismatchError(f"--dtype cannot be applied to a {ckpt.format} file read through torch")
        from .transforms.cast import cast_floats

        root, cast = cast_floats(root, opts.dtype, opts.dtype_keep, keys)
        report.cast = asdict(cast)
        done = ()
        if cast.tensors:
            kept = f", kept {len(cast.kept)} as they were" if cast.kept else ""
            done = (
                f"cast {cast.tensors} tensors to {cast.dtype} ({cast.bytes_before} -> {cast.bytes_after} bytes){kept}",
            )
            if cast.shared_with_uncast:
                done += (f"left {len(cast.shared_with_uncast)} tensors uncast: they share storage with kept ones",)
        steps.append(
            Step(f"--dtype {opts.dtype}", done, f"no floating-point state-dict tensor to cast to {cast.dtype}")
        )
    return root


@names_input
@collector_paused()
@consistent_reads
def convert(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    options: ConvertOptions | None = None,
    *,
    command: str = "convert",
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Run the pipeline: read ``in_path`` (any format), transform, write ``out_path``.

    Example::

        ckptfix.convert("train.ckpt", "model.safetensors",
                        ckptfix.ConvertOptions(select="state_dict", strip_prefixes=["model."]))
    """
    opts = options or ConvertOptions()
    in_path = str(in_path)
    if opts.in_place:
        if out_path is not None and Path(out_path).resolve() != Path(in_path).resolve():
            raise UsageError("give either OUT or --in-place, not both")
        out_path = in_path
    if out_path is None:
        raise UsageError("missing OUT: give an output path, or --in-place to replace the input")
    out_path = str(out_path)
    max_bytes = _size_option(opts.max_shard_size)
    kind, file_format = output_target(out_path, opts.out_format, max_bytes)
    check_dcp_files(opts.dcp_files, kind)
    _size_option(opts.max_expand)  # a bad SIZE is a usage error before any reading
    if opts.map_location:
        parse_map_location(opts.map_location)  # a bad SPEC is a usage error before any reading
    for rule in opts.rename:
        parse_rule(rule)
    check_global_patterns(opts.allow_globals)  # the API gets the CLI's check too
    if opts.distributed and (kind != "sharded" or opts.in_place):
        raise UsageError("--distributed splits a folder of shards by shard: name a folder OUT/ (or a URL ending in /)")
    if opts.distributed and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise UsageError(_UNDER_TORCHRUN)
    if is_url(out_path) and (opts.in_place or kind == "dcp"):
        raise UsageError(f"{out_path}: a URL output takes a .pth/.safetensors name or a folder of shards")
    check_input(in_path)  # a missing input is reported as such, before anything about OUT
    if not opts.dry_run and kind == "file" and not is_url(out_path):
        check_destination(in_path, out_path, overwrite=opts.force, in_place=opts.in_place)
    # split over torchrun's processes: each step before the write is agreed on by all (one
    # process failing to read must not leave the others waiting for it at the write)
    split = torchrun_split() if opts.distributed and not opts.dry_run else None
    if not opts.dry_run and not opts.force and is_url(out_path):
        # before any reading, as for a local OUT; asked once (rank 0) for every process
        together(split, lambda: refuse_existing(out_path) if split is None or split.rank == 0 else None, out_path)
    if not opts.dry_run and not (opts.in_place and kind == "file"):
        check_no_overlap(local_or_remote(in_path), local_or_remote(out_path), kind)
    started = time.perf_counter()
    # unknown classes are read as inert records and judged on what the output carries
    # (check_output); --unsafe-load keeps the old way: the file through torch if it holds any
    read: list[Checkpoint] = []
    together(split, lambda: read.append(read_input(in_path, opts, inert_unknown=not opts.unsafe_load)), in_path)
    ckpt = read[0]
    keep_until_exit(ckpt)  # the command line's one command: the tree is left to the OS, never freed
    report = Report(
        command=command,
        input=in_path,
        output=out_path,
        input_format=ckpt.format,
        output_format=_FORMAT_WORDS[kind if kind != "file" else file_format],
        shard_format=_FORMAT_WORDS[file_format] if kind == "sharded" else None,
        input_bytes=ckpt.file_size,
        dry_run=opts.dry_run,
        notes=list(ckpt.notes),
        selected=opts.select,
    )
    root = apply_transforms(ckpt, opts, report, file_format)
    if has_foreign(ckpt):
        try:
            found = check_output(
                ckpt.root,
                None if file_format == "safetensors" else root,
                converted=[s["path"] for s in report.sanitized],
                sanitize_requested=opts.sanitize,
                select_given=bool(opts.select),
            )
        except UnsafeInputError as exc:
            raise exc.at(in_path) from None
        report.kept_globals, report.ignored = found.kept, found.ignored
        report.notes += found.notes()
    write = partial(
        _write,
        ckpt,
        root,
        kind=kind,
        file_format=file_format,
        max_bytes=max_bytes,
        opts=opts,
        report=report,
        progress=progress,
    )
    if opts.require_change and not report.changed:
        why = _nothing_to_do(ckpt, report)
        fix = wrapper_fix(root, opts.keys) if opts.strip_prefixes and not opts.add_prefix else None
        if fix is not None:  # e.g. torch.compile's _orig_mod. where module. was asked for
            target = "--in-place" if opts.in_place else out_path
            report.notes.append(
                f"{in_path}: the keys carry {fix.wrappers}; strip with: "
                f"ckptfix {command} {in_path} {target} {fix.options}"
            )
        report.unchanged = True
        if opts.strict:
            raise CheckFailedError(f"{why}; nothing written")
        if opts.in_place or opts.dry_run:  # the file stays as it is
            report.message = f"{why}; nothing written"
            report.seconds = time.perf_counter() - started
            return report
        # OUT was named: it exists afterwards, so `a && b` chains and batch folders never miss a
        # file -- a byte-for-byte copy when the format stays (reflinked where the file system can)
        if _same_format(ckpt, kind, file_format) and not is_url(out_path):
            _copy_whole(ckpt, Path(out_path), report)
        else:
            _write_to(out_path, opts, report, write)
        if report.output_format != report.input_format:  # a conversion is written, not "unchanged"
            report.unchanged = False
            report.message = f"{why}; wrote {out_path} as {report.output_format} (a format conversion)"
            report.notes.append(f"{why}: {out_path} holds the input's content as {report.output_format}")
        else:
            report.message = f"{why}; wrote {out_path} unchanged"
            report.notes.append(f"{why}: {out_path} is the input unchanged")
        report.seconds = time.perf_counter() - started
        return report
    _write_to(out_path, opts, report, write)
    report.seconds = time.perf_counter() - started
    return report


_UNDER_TORCHRUN = (
    "--distributed runs under torchrun, e.g. torchrun --standalone --nproc-per-node 4 -m ckptfix convert IN OUT/ "
    "--distributed"
)


def torchrun_split() -> Split:
    """This process's part of a write split over ``torchrun``'s processes (torch.distributed
    with gloo, the engine clusters already run: ``torchrun --nproc-per-node N -m ckptfix convert
    IN OUT/ --distributed``, or across hosts with ``--nnodes``). The process group is made from
    torchrun's environment on first use."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError(_UNDER_TORCHRUN)
    need_torch()
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")

    def agree(code: int) -> int:
        worst = torch.tensor([code])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return int(worst.item())

    return Split(dist.get_rank(), dist.get_world_size(), agree)


def _local_output(out: str | os.PathLike[str] | None, command: str) -> None:
    """Commands that name their outputs themselves write to local disk only (a URL as a Path
    would be a local folder named "s3:")."""
    if out is not None and is_url(str(out)):
        raise UsageError(f"{out}: {command} writes to a local path; convert (and the fixes) write to URLs")


def _write_to(out_path: str, opts: ConvertOptions, report: Report, write: Callable[[Path], None]) -> None:
    """``write(OUT)`` for a local OUT; for a URL, ``write`` to it as a :class:`RemotePath`: each
    object is uploaded as it is written and committed when complete (see
    :func:`~ckptfix.fileio.remote.upload_output`), a folder's index last. With ``--verify`` the
    output is written to a local staging path first, checked, then uploaded
    (:func:`~ckptfix.fileio.remote.staged_output`)."""
    if not is_url(out_path):
        write(Path(out_path))
        return
    if opts.dry_run:
        write(as_path(out_path))  # only named in the message
        return
    # uploaded as written: each object by atomic_output, a folder's index last (--verify checks
    # single files only: a split folder's processes upload their shards as they write them)
    if not opts.verify or opts.distributed:
        with remote_outputs(force=opts.force):
            write(as_path(out_path))
        report.shared_bytes = None
        return
    # --verify reads the output back before it is committed: written locally, then uploaded
    with staged_output(out_path, force=opts.force) as local:
        write(local)
        staged = list(report.outputs)
        report.message = report.message.replace(str(local), out_path)
    report.outputs = output_urls(out_path, local, staged)
    report.shared_bytes = None


def _identity(path: Path) -> tuple[int, int] | str | None:
    """What every spelling of one file shares: device and inode (None when there is no such
    file); for a remote object (a :class:`RemotePath`), its URL: no links, no real path."""
    if isinstance(path, RemotePath):
        return str(path)
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _real(path: Path) -> Path:
    """``path`` with its links resolved; a remote object's URL as it is."""
    return path if isinstance(path, RemotePath) else Path(os.path.realpath(path))


def _input_files(in_path: Path) -> list[Path]:
    """The files reading IN may open: the file itself, or every file of the folder it names
    (a shard folder, a DCP folder) or of its index's folder. Readers open them by path, lazily,
    while the output is being written."""
    folder = in_path if in_path.is_dir() else in_path.parent if in_path.name.endswith(".index.json") else None
    if folder is None:
        return [in_path]
    try:
        return [p for p in folder.iterdir() if p.is_file()]
    except (OSError, BadInputError):  # a folder that cannot be listed (a remote one: its server said why)
        return []


#: the names a folder of shards is written under (formats/sharded.py's write_sharded)
_SHARD_NAME = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def check_no_overlap(in_path: Path, out_path: Path, kind: str) -> None:
    """Refuse an output that overlaps the input, before anything is read or written.

    Inputs are read lazily by path while the output is written: an output file that is an input
    file, or a folder of shards written into the input's own folder (``convert DIR DIR``, or
    OUT naming that folder through a symlink or another spelling), would replace files that
    are still to be read, and the result would silently hold wrong bytes. Files and folders
    are compared by identity (device and inode: links, bind mounts, ``..``) and by real path;
    a DCP output replaces its whole folder, so no input may lie anywhere inside it.

    Paths come from :func:`~ckptfix.fileio.remote.local_or_remote`: a ``file://`` URL is the
    local path it names; a remote object (a :class:`RemotePath`) cannot be resolved or statted
    locally and is compared by its URL, with the input's URLs. A local file and a remote object
    never overlap, and nothing is asked of a server then."""
    if isinstance(in_path, RemotePath) != isinstance(out_path, RemotePath):
        return
    inputs = _input_files(in_path)
    if kind == "file":
        out_id, out_real = _identity(out_path), _real(out_path)
        for file in inputs:
            if (out_id is not None and _identity(file) == out_id) or _real(file) == out_real:
                raise UsageError(
                    f"{out_path}: the output would overwrite {file}, which the input is read from",
                    hint="write to a path outside the input checkpoint",
                )
        return
    folder_id = _identity(out_path)
    if folder_id is None:
        return  # a folder that does not exist yet holds no input
    one_file = inputs == [in_path]
    for file in inputs:
        real = _real(file)
        if kind == "dcp":
            holders = [real.parent, *real.parent.parents, file.parent, *file.parent.parents]
        elif one_file and not (_SHARD_NAME.fullmatch(file.name) or _SHARD_NAME.fullmatch(real.name)):
            continue  # a single file beside the shards, under a name no shard or index takes
        else:
            holders = [real.parent, file.parent]
        if any(_identity(h) == folder_id for h in holders):
            raise UsageError(
                f"{out_path}: the output folder holds the input's file {file}: writing it would replace files "
                "while they are being read",
                hint="write to a new folder outside the input",
            )


def _same_format(ckpt: Checkpoint, kind: str, file_format: str) -> bool:
    """Whether a byte copy of the input is the right OUT: only for safetensors, whose every byte
    the reader checked (header, and tensors tiling the data exactly), that already carries the
    ``"format": "pt"`` every ckptfix output has. A .pth is rewritten even
    then: a zip can hold records torch never reads, and ckptfix never carries a byte it did not
    check (the rewrite copies each checked record, shared on a copy-on-write file system)."""
    same = (ckpt.format, file_format) == (FORMAT_SAFETENSORS, "safetensors") and ckpt.metadata.get("format") == "pt"
    return same and kind == "file" and Path(ckpt.path).is_file()


def _copy_whole(ckpt: Checkpoint, out: Path, report: Report) -> None:
    """OUT as a copy of the input file, through the same atomic write as any output."""
    with atomic_output(out) as f, OpenFiles() as files:
        stream = OutputStream(f)
        stream.copy(FileRange(ckpt.path, 0, ckpt.file_size), files)
        stream.flush()
    report.written = True
    report.outputs = [str(out)]
    report.output_bytes = out.stat().st_size


def _size_option(value: str | int | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return parse_size(str(value))


def expand_budget(max_expand: str | int | None, input_bytes: int) -> int:
    """The bytes of tensor data a safetensors write may produce (``--max-expand``).

    Views are written out in full in safetensors, so a small file can describe a huge output
    (a stride-0 ``expand``): the budget refuses that before anything is written.
    """
    budget = _size_option(max_expand)
    return default_expand_budget(input_bytes) if budget is None else budget


def _nothing_to_do(ckpt: Checkpoint, report: Report) -> str:
    """Why there is nothing to change: every requested step's reason (each changed nothing)."""
    renames = [s for s in report.steps if s.requested.startswith(("strip ", "add ", "rename "))]
    if renames and not report.state_dicts:
        layout = ", ".join(e["path"] for e in describe_tree(ckpt.root, 8))
        return f"{report.input}: found no state dict to change (layout: {layout})"
    why = "; ".join(s.unchanged for s in report.steps) or "no change was asked for"
    return f"{report.input}: {why}"


def _write(
    ckpt: Checkpoint,
    root: Any,
    out: Path,
    kind: str,
    file_format: str,
    max_bytes: int | None,
    opts: ConvertOptions,
    report: Report,
    progress: Callable[[int], None] | None,
) -> None:
    flat: dict[str, Any] | None = None
    metadata: dict[str, str] = {}
    plan: SafetensorsPlan | None = None  # the layout checked below, reused by the write
    # safetensors writes views out in full: bounded, checked here before anything is written
    budget = expand_budget(opts.max_expand, ckpt.file_size) if file_format == "safetensors" else None
    if file_format == "safetensors" or kind == "sharded":
        flat, metadata = flat_state_dict(root, ckpt.root, opts.keep_metadata)
        inherited = {k: v for k, v in ckpt.metadata.items() if isinstance(v, str) and k not in flat}
        metadata = {**inherited, **metadata}
        if not ckpt.lazy and kind == "sharded":
            raise InputMismatchError(f"a {ckpt.format} file read through torch can only be written as a single file")
        if ckpt.lazy:
            # fails early on tensors safetensors cannot hold, and on a write beyond the budget
            plan = plan_safetensors(flat, metadata, max_data_bytes=budget)
            report.aliases = dict(plan.aliases)
        elif budget is not None:
            check_torch_expand_budget(flat, budget)
    report.metadata = metadata
    report.tensors = len(flat) if flat is not None else len(census(root).tensors)
    changes = _describe_changes(report)
    if opts.dry_run:
        if kind == "dcp":  # what the write would refuse (keys DCP cannot hold), refused now
            from .formats.dcp_writer import plan_dcp

            plan_dcp(root, opts.dcp_files or 1)
        what = f"{report.shard_format} shards" if report.shard_format else report.output_format
        report.message = f"would write {what} to {out}{changes}; nothing written (dry run)"
        return
    if kind == "dcp":
        from .formats.dcp_writer import write_dcp

        files = write_dcp(root, out, overwrite=opts.force, files=opts.dcp_files or 1, lazy=ckpt.lazy, progress=progress)
        report.outputs = [str(p) for p in files]
        report.output_bytes = sum(p.stat().st_size for p in files)
        report.shared_bytes = shared_bytes_of(report.outputs)
    elif kind == "sharded":
        if not is_url(str(out)):  # a bucket has no folders to check or make: objects name their prefix
            if out.exists() and not out.is_dir():
                raise CannotWriteError(f"{out}: exists and is not a folder")
            if not out.parent.is_dir():
                raise CannotWriteError(f"{out}: the folder {out.parent} does not exist")
            out.mkdir(exist_ok=True)
        assert flat is not None  # shards are safetensors-shaped: flattened above
        written = write_sharded(
            flat,
            out,
            max_bytes or parse_size(DEFAULT_SHARD_SIZE),
            shard_format=file_format,
            metadata=metadata,
            overwrite=opts.force,
            progress=progress,
            max_data_bytes=budget,
            split=torchrun_split() if opts.distributed else None,
            plan=plan,
        )
        report.outputs = [str(p) for p in written.files]
        report.output_bytes = sum(p.stat().st_size for p in written.files)
        report.shared_bytes = shared_bytes_of(report.outputs)
        if len(written.files) == 1:  # one shard is a plain file in the folder, no index (the hub's way)
            report.output_format, report.shard_format = _FORMAT_WORDS[file_format], None
    else:
        check = None
        if opts.verify or opts.in_place:
            planned = root if file_format == "pth" else flat
            check = lambda temp: verify_output(temp, planned, file_format, report)  # noqa: E731
        with atomic_output(out, check, in_place=opts.in_place) as f:
            if file_format == "pth":
                ckpt.write(root, f, progress=progress)
            elif ckpt.lazy:
                assert flat is not None  # flattened above for every safetensors output
                write_safetensors(flat, f, metadata, progress=progress, max_data_bytes=budget, plan=plan)
            else:
                assert flat is not None
                write_safetensors_from_torch(flat, f, metadata, max_data_bytes=budget)
            report.shared_bytes = shared_bytes(f)  # before the rename: --in-place replaces the input
        report.outputs = [str(out)]
        report.output_bytes = out.stat().st_size
    report.written = True
    count = len(report.outputs)
    report.message = f"wrote {out}" + (f" ({count} files)" if count > 1 else "") + changes


def _describe_changes(report: Report) -> str:
    parts = [phrase for step in report.steps for phrase in step.done]
    if report.aliases:
        parts.append(f"{len(report.aliases)} tied tensors stored once")
    return (": " + "; ".join(parts)) if parts else ""


def fix_prefix(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    *,
    mode: Literal["strip", "add"] = "strip",
    prefix: str = "module.",
    keys: Sequence[str] = (),
    dry_run: bool = False,
    force: bool = False,
    in_place: bool = False,
    strict: bool = False,
    verify: bool = False,
    options: ConvertOptions | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Strip (``mode="strip"``) or add (``mode="add"``) a key prefix, as ``strip-module``/``add-module`` do.

    Writes nothing when no key changes (raises :class:`CheckFailedError` with ``strict=True``),
    when ``dry_run`` is set, or when a rename would make two keys collide. ``keys`` limits the
    change to the state dicts under those dotted paths; ``options`` carries any other pipeline
    step (``map_location``, ``dtype`` ...), as :func:`convert` takes them.
    """
    if mode not in ("strip", "add"):
        raise UsageError(f"unknown mode {mode!r}")
    step: dict[str, Any] = {"strip_prefixes": (prefix,)} if mode == "strip" else {"add_prefix": prefix}
    opts = replace(
        options or ConvertOptions(),
        require_change=True,
        keys=keys,
        dry_run=dry_run,
        force=force,
        in_place=in_place,
        strict=strict,
        verify=verify,
        **step,
    )
    return convert(in_path, out_path, opts, command=f"{mode}-module", progress=progress)


def write_checkpoint(
    ckpt: Checkpoint,
    root: Any,
    out_path: str | os.PathLike[str],
    *,
    progress: Callable[[int], None] | None = None,
    max_expand: str | int | None = None,
) -> int:
    """Write ``root`` (``ckpt``'s tree, possibly transformed) to ``out_path`` atomically, in the
    format its name says (.pth family or .safetensors). Returns the bytes written.

    ``max_expand`` bounds the tensor bytes a .safetensors output may hold, as ``--max-expand``
    does (default: 16x the input's size, at least 1 GiB).
    """
    target = os.fspath(out_path)
    remote = is_url(target)  # an object in a store: a URL stays a URL (Path would make s3:// s3:/)
    dest: str | Path = target if remote else Path(target)
    _, file_format = output_target(target, None, None)
    budget = expand_budget(max_expand, ckpt.file_size)
    if file_format != "pth":
        flat, metadata = flat_state_dict(root, root, keep_metadata=False)
        plan = plan_safetensors(flat, metadata, max_data_bytes=budget)  # refuse before the output exists
    with atomic_output(dest) as out:
        if file_format == "pth":
            ckpt.write(root, out, progress=progress)
        else:
            write_safetensors(flat, out, metadata, progress=progress, max_data_bytes=budget, plan=plan)
        written = out.tell()
    return written if remote else Path(target).stat().st_size


@collector_paused()
@consistent_reads
def diff_checkpoints(
    a_path: str | os.PathLike[str],
    b_path: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    select_b: str | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    keys_only: bool = False,
) -> DiffReport:
    """Compare two checkpoints of any formats; ``options`` transforms A first (e.g. strip
    ``module.``) so a fix can be checked against a reference. Tensors are read one at a time;
    with ``keys_only`` none is (keys, dtypes, shapes: a remote input costs a few requests)."""
    from .analysis.diff import diff_trees

    opts = options or ConvertOptions()
    check_global_patterns(opts.allow_globals)
    # diff writes nothing: unknown classes (configs) are read as inert records, compared by state
    inert = not opts.unsafe_load
    with metadata_only() if keys_only else nullcontext():
        a = read_input(a_path, opts, inert_unknown=inert)
        b = read_input(b_path, replace(opts, tag=None, weights=None), inert_unknown=inert)
    scratch = Report("diff", str(a_path), None, a.format, b.format, dry_run=True)
    with about_input(str(a_path)):
        root_a = apply_transforms(a, opts, scratch)
    with about_input(str(b_path)):
        root_b = select_path(b.root, select_b, flag="--select-b")[1] if select_b else b.root
    budget = expand_budget(opts.max_expand, a.file_size + b.file_size)
    return diff_trees(
        root_a,
        root_b,
        a_name=str(a_path),
        b_name=str(b_path),
        rtol=rtol,
        atol=atol,
        keys_only=keys_only,
        expand_budget=budget,
    )


@names_input
@collector_paused()
@consistent_reads
def fit_checkpoint(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None,
    *,
    reference: str | os.PathLike[str] | None = None,
    model: str | None = None,
    model_path: Sequence[str | os.PathLike[str]] = (),
    allow_partial: bool = False,
    options: ConvertOptions | None = None,
    select: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    unsafe_load: bool = False,
    out_format: str | None = None,
    max_expand: str | int | None = None,
    ema: bool = False,
) -> tuple[FitPlan, Report | None]:
    """Make ``in_path``'s state dict match a reference's keys, and write it to ``out_path``.

    The reference is a checkpoint file (``reference``) or ``model="pkg.module:callable"``,
    imported and called only because it is named -- from installed modules and the folders in
    ``model_path``, never from the current folder (see :func:`ckptfix.fitting.reference_from_model`).
    Writes only when the result would load with ``strict=True``, or with ``allow_partial`` (then
    unexpected and wrong-shaped keys are left out, so ``load_state_dict(strict=False)`` accepts
    the file).

    ``options`` carries every other pipeline step, as :func:`convert` takes them (the keyword
    arguments ``select`` ... ``ema`` are the same fields, kept for existing callers; ``options``
    wins where both are given). ``select``/``ema`` choose the state dict that is fitted; the fit
    then joins the pipeline as its prefix steps, so the output is what :func:`convert` writes with
    ``--select`` the fitted state dict, your ``--drop``/``--keep`` (on the checkpoint's own key
    names) plus the keys a partial fit leaves out, the fit's ``--strip-prefix`` steps before yours,
    its ``--add-prefix``, then ``--rename``, ``--map-location``, ``--dtype`` and the writer's
    options. The verdict (``plan.loads_strictly``) is the fit's: steps you add after it (a drop,
    a rename) change the keys it checked.
    Returns the plan and the write report (None when nothing was written).
    """
    from .transforms.fit import best_fit, reference_from_model, shapes_of

    _local_output(out_path, "fit")

    legacy = ConvertOptions(
        select=select,
        ema=ema,
        dry_run=dry_run,
        force=force,
        unsafe_load=unsafe_load,
        out_format=out_format,
        max_expand=max_expand,
    )
    user = _merged(legacy, options)
    if (reference is None) == (model is None):
        raise UsageError("give exactly one of --reference FILE or --model package.module:callable")
    if model_path and model is None:
        raise UsageError("--model-path goes with --model (it says where to find the model's module)")
    if user.out_format == "dcp" or user.max_shard_size is not None:
        raise UsageError("fit writes one file (.pth or .safetensors), not shards or a DCP folder")
    if model is not None:
        ref_shapes = reference_from_model(model, model_path)
    else:
        assert reference is not None  # exactly one of the two, checked above
        # only its shapes are used: its other contents are read as inert records
        ref = read_checkpoint(reference, unsafe_load=user.unsafe_load, inert_unknown=True)
        found = find_state_dicts(ref.root)
        if not found:
            raise InputMismatchError(f"{reference}: no state dict found in the reference")
        ref_shapes = shapes_of(max(found, key=lambda item: len(item[1]))[1])
    check_global_patterns(user.allow_globals)
    # unknown classes read as inert records: convert() below checks what OUT carries
    ckpt = read_input(in_path, user, inert_unknown=True)
    tree, base, _ = model_or_ema(ckpt.root, user.ema)  # the model's weights, not its EMA copy (or the reverse)
    chosen = select_path(tree, user.select) if user.select else None
    plan = best_fit(tree, ref_shapes, *chosen) if chosen else best_fit(tree, ref_shapes)
    if not plan.loads_strictly and not allow_partial:
        return plan, None
    drop: list[str] = []
    if allow_partial:
        bad = set(plan.unexpected) | {m["key"] for m in plan.shape_mismatches}
        drop = [literal_glob(plan.renamed[k]) for k in sorted(bad)]
    if plan.add and user.add_prefix:
        raise UsageError(f"the fit adds {plan.add!r} already; --add-prefix {user.add_prefix!r} would add a second")
    opts = replace(
        user,
        select=format_path(base + plan.state_dict) or None,
        ema=user.ema and not base,  # a top-level EMA entry is selected by its path already
        drop=[*drop, *user.drop],
        strip_prefixes=[*plan.strips, *user.strip_prefixes],
        add_prefix=plan.add or user.add_prefix,
        require_change=False,
    )
    return plan, convert(in_path, out_path, opts, command="fit")


def _merged(legacy: ConvertOptions, options: ConvertOptions | None) -> ConvertOptions:
    """``options`` where given, else the legacy keyword arguments (fields left at their default
    in ``options`` take the keyword's value)."""
    if options is None:
        return legacy
    defaults = ConvertOptions()
    changes = {
        f.name: getattr(legacy, f.name)
        for f in fields(ConvertOptions)
        if getattr(options, f.name) == getattr(defaults, f.name)
        and getattr(legacy, f.name) != getattr(defaults, f.name)
    }
    return replace(options, **changes)


#: what publish cuts off a file name: checkpoint extensions only, so the dots of a version
#: (``net_0.3.0_e29.pth.tar``) stay in the name; longest first
_CHECKPOINT_EXTENSIONS = tuple(
    sorted(
        {".pth.tar", ".pt.tar", ".ckpt.tar", *(f"{s}.index.json" for s in CHECKPOINT_SUFFIXES), *CHECKPOINT_SUFFIXES},
        key=len,
        reverse=True,
    )
)


def checkpoint_stem(name: str) -> str:
    """``name`` without its checkpoint extension(s): ``net_0.3.0_e29.pth.tar`` -> ``net_0.3.0_e29``,
    ``model.safetensors.index.json`` -> ``model``; other dots are part of the name."""
    ext = next((e for e in _CHECKPOINT_EXTENSIONS if name.lower().endswith(e) and len(name) > len(e)), "")
    return name[: len(name) - len(ext)]


@dataclass
class PublishResult:
    path: str
    #: the published file's sha256 (None for a dry run: nothing was written)
    sha256: str | None
    report: Report


@names_input
@collector_paused()
@consistent_reads
def publish(
    in_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    out_format: str | None = None,
    name: str | None = None,
    unsafe_load: bool = False,
    allow_globals: Sequence[str] = (),
    max_expand: str | int | None = None,
    ema: bool = False,
    options: ConvertOptions | None = None,
) -> PublishResult:
    """The release preset: the weights only (the largest state dict), wrapper prefixes stripped,
    every tensor on ``cpu``, written as ``NAME-<first 8 hex of sha256>.<ext>`` -- the name
    ``torch.hub.load_state_dict_from_url(check_hash=True)``, timm and mmdet check.

    ``options`` carries every other pipeline step, as :func:`convert` takes them (``--dtype``,
    ``--drop``, ``--rename`` ...); the preset fills in what they leave open: ``select`` (the
    largest state dict), ``map_location`` (``cpu``), ``out_format`` (safetensors), and its
    wrapper strips run before any ``strip_prefixes`` given. The keyword arguments
    ``out_format`` ... ``ema`` are the same fields, kept for existing callers.
    """
    import hashlib

    _local_output(out_dir, "publish")
    legacy = ConvertOptions(
        out_format=out_format, unsafe_load=unsafe_load, allow_globals=allow_globals, max_expand=max_expand, ema=ema
    )
    user = _merged(legacy, options)
    fmt = user.out_format or "safetensors"
    if fmt not in FILE_FORMATS:
        raise UsageError(f"publish writes pth or safetensors, not {fmt!r}")
    if user.in_place or user.max_shard_size is not None:
        raise UsageError("publish writes one new file into OUTDIR (no --in-place, no --max-shard-size)")
    check_global_patterns(user.allow_globals)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CannotWriteError(f"{out_dir}: not a folder")
    ckpt = read_input(in_path, user, inert_unknown=True)
    tree = select_path(ckpt.root, user.select)[1] if user.select else ckpt.root
    found = find_state_dicts(tree)
    if not found:
        raise InputMismatchError(f"{in_path}: no state dict to publish")
    path, state_dict = max(found, key=lambda item: len(item[1]))
    if user.ema and not ema_prefix(state_dict) and isinstance(tree, Mapping):
        entry = next((e for e in EMA_ENTRIES if e in tree and looks_like_state_dict(tree[e])), None)
        if entry is None:
            raise InputMismatchError(f"{in_path}: --ema, but there is no EMA copy of the weights")
        path, state_dict = (entry,), tree[entry]
    part, _ = split_ema(state_dict, user.ema)
    chain = wrapper_chain([k for k in part if isinstance(k, str)])
    stem = name or checkpoint_stem(Path(str(in_path).rstrip("/")).name)
    ext = ".safetensors" if fmt == "safetensors" else ".pth"
    try:
        if not user.dry_run:
            out_dir.mkdir(parents=True, exist_ok=True)  # a release folder is made, as `mkdir -p` would
    except OSError as exc:
        raise CannotWriteError(f"{out_dir}: cannot create the folder ({exc.strerror})") from None
    staging = out_dir / f".{stem}.publish{ext}"
    base = select_path(ckpt.root, user.select)[0] if user.select else ()
    opts = replace(
        user,
        select=format_path(base + path) or None,
        ema=user.ema and ema_prefix(state_dict) is not None,
        strip_prefixes=[*dict.fromkeys(chain), *user.strip_prefixes],
        map_location=user.map_location or "cpu",
        out_format=fmt,
        force=True,
        require_change=False,
    )
    try:
        report = convert(in_path, staging, opts, command="publish")
        if opts.dry_run:
            final = out_dir / f"{stem}-<sha256>{ext}"
            report.output = str(final)
            report.message = f"would publish {final}{_describe_changes(report)}; nothing written (dry run)"
            return PublishResult(str(final), None, report)
        digest = hashlib.sha256()
        with open(staging, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        final = out_dir / f"{stem}-{digest.hexdigest()[:8]}{ext}"
        os.replace(staging, final)
    finally:
        staging.unlink(missing_ok=True)
    report.output = str(final)
    report.outputs = [str(final)]
    report.message = f"published {final} (sha256 {digest.hexdigest()})"
    return PublishResult(str(final), digest.hexdigest(), report)


#: the ConvertOptions fields ``average`` uses (any other one set is a usage error: it would be ignored)
AVERAGE_OPTIONS = frozenset(
    {
        *("select", "ema", "out_format", "max_shard_size", "dcp_files", "max_expand", "dry_run", "force", "verify"),
        *("tag", "weights"),
    }
)


@dataclass
class AverageReport:
    """What ``average`` did; ``to_dict()`` is the ``--json`` document."""

    #: one entry per input: ``input``, ``input_format``, ``input_bytes`` and ``state_dict``
    #: (the dotted path of the state dict averaged; ``""`` for the whole checkpoint)
    inputs: list[dict[str, Any]]
    output: str
    #: torch-zip, safetensors, sharded or dcp (the words ``inspect`` prints)
    output_format: str
    shard_format: str | None
    dry_run: bool
    #: one per input (1.0 each for a plain mean)
    coefficients: list[float]
    #: output tensors (tied keys counted once per key)
    tensors: int = 0
    #: floating-point tensors averaged
    averaged: int = 0
    #: integer/bool tensors taken from the last input
    from_last: list[str] = field(default_factory=list)
    #: keys naming the same tensor as an earlier key (ties kept)
    tied: list[str] = field(default_factory=list)
    #: input tensors read while writing (tensors x inputs for floats, once for the rest)
    reads: int = 0
    #: tensor bytes produced
    tensor_bytes: int = 0
    written: bool = False
    outputs: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    seconds: float = 0.0
    message: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _averaged_state_dict(ckpt: Checkpoint, opts: ConvertOptions) -> tuple[Mapping[str, Any], str, list[str]]:
    """The state dict of one input that ``average`` takes: after --select and --ema, the tree
    itself when it is one, else its largest state dict; its dotted path and notes."""
    base, tree = select_path(ckpt.root, opts.select) if opts.select else ((), ckpt.root)
    tree, entry, notes = model_or_ema(tree, opts.ema)
    if looks_like_state_dict(tree):
        return tree, format_path(base + entry), notes
    found = find_state_dicts(tree)
    if not found:
        layout = ", ".join(e["path"] for e in describe_tree(tree)[:8])
        raise BadInputError(
            f"{ckpt.path}: no state dict to average (layout: {layout})", hint="choose one with --select"
        )
    path, state_dict = max(found, key=lambda item: len(item[1]))
    return state_dict, format_path(base + entry + path), notes


@collector_paused()
def average_checkpoints(
    in_paths: Sequence[str | os.PathLike[str]],
    out_path: str | os.PathLike[str],
    coefficients: str | Sequence[float] | None = None,
    options: ConvertOptions | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> AverageReport:
    """The mean of several checkpoints of one model (any formats), written to ``out_path``.

    Each input's state dict is chosen as ``options.select``/``options.ema`` say (default: the
    checkpoint itself when it is a state dict, else its largest one); keys, shapes and dtypes
    must agree. ``coefficients`` (one per input, ``"1,2"`` or numbers) weigh them; the mean is
    ``sum(c_i * x_i) / sum(c_i)`` in float64, cast back per tensor; integer and bool tensors are
    the last input's (see :mod:`ckptfix.transforms.average`). Tensors are read and written one
    at a time. Options other than :data:`AVERAGE_OPTIONS` are refused rather than ignored.

    Example::

        ckptfix.average_checkpoints(["ep8.pth", "ep9.pth", "ep10.pth"], "avg.safetensors")
    """
    from .transforms.average import plan_average

    opts = options or ConvertOptions()
    defaults = ConvertOptions()
    unused = [
        f.name
        for f in fields(ConvertOptions)
        if f.name not in AVERAGE_OPTIONS and getattr(opts, f.name) != getattr(defaults, f.name)
    ]
    if unused:
        raise UsageError(
            f"average does not take {', '.join(unused)}: average first, then fix the result with ckptfix convert"
        )
    paths = [str(p) for p in in_paths]
    out = str(out_path)
    if len(paths) < 2:
        raise UsageError("average needs at least two inputs (then OUT)")
    max_bytes = _size_option(opts.max_shard_size)
    kind, file_format = output_target(out, opts.out_format, max_bytes)
    check_dcp_files(opts.dcp_files, kind)
    _size_option(opts.max_expand)
    if not opts.dry_run:
        for path in paths:
            if kind == "file":
                try:
                    check_destination(path, out, overwrite=opts.force, in_place=False)
                except UsageError as exc:  # its hint (--in-place) is for one input
                    raise UsageError(exc.message, hint="choose an output path that is not one of the inputs") from None
            check_no_overlap(Path(path), Path(out), kind)
    started = time.perf_counter()
    inputs: list[dict[str, Any]] = []
    state_dicts: list[Mapping[str, Any]] = []
    notes: list[str] = []
    total_bytes = 0
    for path in paths:
        # unknown classes are read as inert records: only the state dicts' tensors are written
        ckpt = read_checkpoint(path, inert_unknown=True, tag=opts.tag, weights=opts.weights)
        if not ckpt.lazy:
            raise UsageError(f"{path}: a {ckpt.format} file is read through torch; convert it to .pth first")
        state_dict, where, picked = _averaged_state_dict(ckpt, opts)
        notes += [f"{path}: {note}" for note in picked]
        inputs.append({"input": path, "input_format": ckpt.format, "input_bytes": ckpt.file_size, "state_dict": where})
        state_dicts.append(state_dict)
        total_bytes += ckpt.file_size
    averaged, stats = plan_average(state_dicts, paths, coefficients)
    # every output tensor is computed whole (float64) in memory: views an input expands beyond
    # its storage (stride 0) are bounded like any write of views in full, before anything is read
    try:
        check_expand_budget(
            {id(t): (k, t) for k, t in averaged.items()}.values(), expand_budget(opts.max_expand, total_bytes)
        )
    except BadInputError as exc:
        raise BadInputError(
            exc.message, hint="average computes every tensor in full; if this is intended, raise --max-expand SIZE"
        ) from None
    report = AverageReport(
        inputs=inputs,
        output=out,
        output_format=_FORMAT_WORDS[kind if kind != "file" else file_format],
        shard_format=_FORMAT_WORDS[file_format] if kind == "sharded" else None,
        dry_run=opts.dry_run,
        coefficients=stats.coefficients,
        tensors=len(averaged),
        averaged=stats.averaged,
        from_last=stats.from_last,
        tied=stats.tied,
        notes=notes,
    )
    result = Checkpoint(out, "average", averaged, total_bytes)
    scratch = Report("average", paths[-1], out, result.format, report.output_format, opts.dry_run, report.shard_format)
    _write(result, averaged, Path(out), kind, file_format, max_bytes, opts, scratch, progress)
    report.output_format, report.shard_format = scratch.output_format, scratch.shard_format  # one shard: a file
    report.written, report.outputs, report.output_bytes = scratch.written, scratch.outputs, scratch.output_bytes
    report.reads, report.tensor_bytes = stats.reads, stats.tensor_bytes
    mean = "weighted mean" if len(set(stats.coefficients)) > 1 else "mean"
    what = f"the {mean} of {len(paths)} checkpoints ({stats.averaged} tensors averaged"
    what += f", {len(stats.from_last)} integer/bool taken from the last input)"
    report.message = f"{'would write' if opts.dry_run else 'wrote'} {out}: {what}" + (
        "; nothing written (dry run)" if opts.dry_run else ""
    )
    report.seconds = time.perf_counter() - started
    return report
