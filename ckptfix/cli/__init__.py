"""The ``ckptfix`` command line: parse, call the library, print. No logic of its own."""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from .. import __version__
from ..errors import CkptfixError, one_line

EXIT_INTERNAL = 5
EXIT_INTERRUPTED = 130

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=_CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="ckptfix")
@click.option("--debug", is_flag=True, help="Show a traceback on errors (for bug reports).")
def cli(debug: bool) -> None:
    """Repair and convert PyTorch checkpoints without running code from them.

    \b
    Examples:
      ckptfix inspect model.pth
      ckptfix strip-module ddp.pth bare.pth
      ckptfix strip-module compiled.pth bare.pth --prefix _orig_mod.
      ckptfix add-module bare.pth ddp.pth
      ckptfix remap gpu.pth cpu.pth --map-location cpu
      ckptfix convert model.pth model.safetensors

    Exit codes: 0 ok, 1 a check failed, 2 usage error, 3 bad or unsafe input,
    4 cannot write the output, 5 internal error.
    """


def _emit_json(data: Any) -> None:
    """The --json document: names exactly as the file holds them (JSON escapes control characters)."""
    click.echo(json.dumps(data, indent=2, default=str))


def _printable(data: Any) -> Any:
    """A copy of ``data`` for human output, every string in it passed through :func:`one_line`.

    Keys, paths and global names come from the file (or a folder's listing), so they may hold
    newlines, carriage returns or terminal escape sequences; printed raw, they would fake or
    hide report lines, or drive the user's terminal. Escaping keeps each name on its line and
    visible (``\\x1b[31m``, ``a\\nb``); ``--json`` keeps the exact text.
    """
    if isinstance(data, str):
        return one_line(data)
    if isinstance(data, dict):
        return {_printable(k): _printable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_printable(v) for v in data)
    return data


def _say(line: str, err: bool = False) -> None:
    """Print one line of human output, with anything non-printable in it escaped."""
    click.echo(one_line(line), err=err)


def _progress_for(path: str) -> tuple[Callable[[int], None] | None, Callable[[bool], None]]:
    """A byte-count progress bar on a terminal's stderr (large files only); nothing in CI logs or pipes.

    Returns the update callback and a closer taking whether the work succeeded.
    """
    try:
        size = os.path.getsize(path) if sys.stderr.isatty() else 0
    except OSError:  # a broken input is reported by the reader, with the right exit code
        size = 0
    if size < 64 << 20:
        return None, lambda ok: None
    bar = click.progressbar(length=size, file=sys.stderr, label="copying tensors", show_pos=False)
    bar.__enter__()

    def close(ok: bool) -> None:
        if ok:
            bar.update(bar.length - bar.pos)  # headers and the pickle are not counted as they go
        bar.__exit__(None, None, None)

    return bar.update, close


def _apply(options: list[Callable[[Callable[..., Any]], Callable[..., Any]]]) -> Callable[..., Any]:
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


_IN_OUT = _apply(
    [
        click.argument("in_path", metavar="IN", type=click.Path()),
        click.argument("out_path", metavar="OUT", required=False, type=click.Path()),
    ]
)


def _global_patterns(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """Check --allow-global patterns while parsing: a pattern that is not a dotted name (a newline,
    a space, NUL, an empty part) could match, and so carry into the output, a global name holding
    pickle opcodes. Raises ckptfix's UsageError so the message is one line (exit 2)."""
    from ..pickling.names import check_global_patterns

    check_global_patterns(value)
    return value


#: IN OUT, or many inputs with -o DIR / --in-place (files, folders of checkpoints, shard folders)
_INPUTS = _apply(
    [
        click.argument("paths", nargs=-1, required=True, metavar="IN... [OUT]", type=click.Path()),
        click.option(
            "-o",
            "--output-dir",
            type=click.Path(file_okay=False),
            help="Write every input into DIR, keeping names (the extension follows --format).",
        ),
        click.option("--recursive", is_flag=True, help="Folder inputs: include sub-folders."),
        click.option(
            "-j",
            "--jobs",
            type=click.IntRange(min=1),
            default=os.cpu_count() or 1,
            show_default="CPUs",
            help="Files processed in parallel.",
        ),
        click.option(
            "--continue-on-error",
            is_flag=True,
            help="Process every input and report failures at the end (default: stop at the first).",
        ),
        click.option("--backup", metavar="SUFFIX", help="With --in-place: keep the original as IN+SUFFIX."),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors."),
    ]
)

#: every writing command takes it (fit and publish too, outside the shared pipeline options)
_MAX_EXPAND = click.option(
    "--max-expand",
    metavar="SIZE",
    help="safetensors: refuse (exit 3) a write that would produce more than SIZE of tensor data by writing views "
    "out in full, e.g. a stride-0 expand (default: 16x the input size, at least 1GiB).",
)

#: the options every writing command shares (one pipeline: ckptfix.ops.convert)
_PIPELINE = _apply(
    [
        click.option("--select", metavar="PATH", help="Use this sub-tree as the checkpoint, e.g. state_dict or ema."),
        click.option(
            "--drop",
            multiple=True,
            metavar="GLOB",
            help="Drop entries whose dotted path (or state-dict key) matches, e.g. optimizer or 'ema.*'.",
        ),
        click.option(
            "--keep",
            multiple=True,
            metavar="GLOB",
            help="In state dicts, keep only keys matching GLOB, e.g. 'backbone.*' (repeatable).",
        ),
        click.option(
            "--strip-prefix",
            "strip_prefixes",
            multiple=True,
            metavar="P",
            help="Strip this key prefix (repeatable; applied in order).",
        ),
        click.option("--add-prefix", metavar="P", help="Add this key prefix to keys lacking it."),
        click.option(
            "--rename",
            multiple=True,
            metavar="RULE",
            help="Rename state-dict keys: 'REGEX=>REPLACEMENT' (Python re, backrefs; repeatable, in order).",
        ),
        click.option(
            "--key",
            "keys",
            multiple=True,
            metavar="PATH",
            help="Only rename keys of the state dict(s) at or under this dotted path (repeatable).",
        ),
        click.option(
            "--map-location",
            "map_location",
            multiple=True,
            metavar="SPEC",
            help="Rewrite device tags: 'cpu', 'cuda' (= cuda:0), 'cuda:1', or FROM=TO pairs "
            "(repeatable or comma-separated): cuda:1=cuda:0,cuda:2=cpu; FROM 'cuda' means any cuda:N.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["float16", "bfloat16", "float32", "float64"]),
            help="Cast floating-point state-dict tensors (ints, bools, optimizer state untouched).",
        ),
        click.option(
            "--dtype-keep",
            "dtype_keep",
            multiple=True,
            metavar="GLOB",
            help="With --dtype: keep keys matching GLOB as they are, e.g. '*norm*' (repeatable).",
        ),
        click.option(
            "--format",
            "out_format",
            type=click.Choice(["pth", "safetensors", "dcp"]),
            help="Output format (default: from OUT's extension; a folder means safetensors shards; "
            "dcp: a torch.distributed.checkpoint folder).",
        ),
        click.option(
            "--max-shard-size", metavar="SIZE", help="Write HF-style shards of at most SIZE (e.g. 2GB, 5GiB)."
        ),
        _MAX_EXPAND,
        click.option(
            "--keep-metadata",
            is_flag=True,
            help="safetensors: keep small plain values (epoch, config) as __metadata__ strings.",
        ),
        click.option("--dry-run", is_flag=True, help="Say what would change; write nothing."),
        click.option("--force", is_flag=True, help="Overwrite OUT if it exists."),
        click.option("--in-place", is_flag=True, help="Replace IN atomically (no OUT); implies --verify."),
        click.option(
            "--verify",
            is_flag=True,
            help="Re-read the output and check every tensor's bytes, keys, dtypes, shapes, devices and "
            "ties against the plan before it replaces anything (exit 4 if not).",
        ),
        click.option(
            "--unsafe-load",
            is_flag=True,
            help="For TRUSTED files only: allow torch.load(weights_only=False), which runs code "
            "from the file, when the safe reader refuses it.",
        ),
        click.option(
            "--allow-global",
            "allow_globals",
            multiple=True,
            metavar="NAME",
            callback=_global_patterns,
            help="Keep objects of this pickle global (or glob, e.g. 'numpy.*') as they are, without "
            "importing or running anything; the output carries them unchanged. NAME is a dotted Python "
            "name; parts may hold * ? [...] globs (anything else is a usage error).",
        ),
        click.option(
            "--sanitize",
            is_flag=True,
            help="Replace argparse.Namespace, numpy values and pathlib paths by plain data (dict, numbers, "
            "tensors, str) so the output loads with weights_only=True.",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout."),
    ]
)

_PREFIX_COMMAND = _apply(
    [
        click.option(
            "--prefix",
            default="module.",
            show_default=True,
            help="The key prefix (a module name; a trailing dot is added if missing).",
        ),
        click.option("--strict", is_flag=True, help="Exit 1 when there is nothing to change."),
    ]
)


def _run(command: str, paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Build the options and run one file (IN OUT) or a batch (-o DIR, --in-place, folders)."""
    from ..pipeline import ConvertOptions

    batch = {k: kw.pop(k) for k in ("output_dir", "recursive", "jobs", "continue_on_error", "backup", "quiet")}
    prefix, strict, kw_rules = kw.pop("prefix", None), kw.pop("strict", False), kw.pop("rules", ())
    kw["map_location"] = ",".join(kw["map_location"]) or None
    opts = ConvertOptions(**kw, strict=strict)
    if command == "strip-module":
        opts.strip_prefixes = [prefix, *opts.strip_prefixes]
        opts.require_change = True
    elif command == "add-module":
        opts.add_prefix = prefix
        opts.require_change = True
    elif command == "rename":
        opts.rename = [*kw_rules, *opts.rename]
        if not opts.rename:
            raise click.UsageError("rename needs at least one --rule 'REGEX=>REPLACEMENT'")
        opts.require_change = True
    elif command == "prune":
        opts.prune = True
        opts.require_change = True
    elif command == "remap":
        if not opts.map_location:
            raise click.UsageError("remap needs --map-location, e.g. --map-location cpu")
        opts.require_change = True
    if batch["output_dir"] is None and not opts.in_place:
        if len(paths) != 2:
            raise click.UsageError("give IN OUT, or several inputs with -o DIR (or --in-place)")
        if batch["backup"]:
            raise click.UsageError("--backup goes with --in-place")
        return _run_single(command, paths[0], paths[1], opts, as_json)
    return _run_batch(command, paths, opts, as_json, **batch)


def _run_single(command: str, in_path: str, out_path: str, opts: Any, as_json: bool) -> int:
    from ..pipeline import convert

    progress, close = (None, lambda ok: None) if (as_json or opts.dry_run) else _progress_for(in_path)
    ok = False
    try:
        report = convert(in_path, out_path, opts, command=command, progress=progress)
        ok = True
    finally:
        close(ok)
    if as_json:
        _emit_json(report.to_dict())
        return 0
    for note in report.notes:
        _say(f"note: {note}", err=True)
    if opts.dry_run:
        for change in report.state_dicts:
            for old, new in change["renames"][:20]:
                _say(f"  {old} -> {new}")
            if len(change["renames"]) > 20:
                _say(f"  ... and {len(change['renames']) - 20} more in {change['path'] or '(top level)'}")
    _say(report.message)
    return 0


def _run_batch(
    command: str,
    paths: tuple[str, ...],
    opts: Any,
    as_json: bool,
    *,
    output_dir: str | None,
    recursive: bool,
    jobs: int,
    continue_on_error: bool,
    backup: str | None,
    quiet: bool,
) -> int:
    from pathlib import Path

    from ..batch import expand_inputs, plan_outputs, run_batch

    if output_dir is not None and opts.in_place:
        raise click.UsageError("give either -o DIR or --in-place, not both")
    if backup and not opts.in_place:
        raise click.UsageError("--backup goes with --in-place")
    inputs = expand_inputs(paths, recursive)
    out_dir = Path(output_dir) if output_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    pairs = plan_outputs(inputs, out_dir, opts.in_place, opts.out_format)
    bar = None
    if not (as_json or quiet) and sys.stderr.isatty() and len(pairs) > 1:
        bar = click.progressbar(length=len(pairs), file=sys.stderr, label=command, show_pos=True)
        bar.__enter__()

    def on_result(result: Any) -> None:
        if result.status == "failed":
            _say(f"ckptfix: error: {result.message}", err=True)
        elif bar is None and not (as_json or quiet):
            _say(result.message if result.status == "unchanged" else f"{result.input}: {result.message}", err=True)
        if bar is not None:
            bar.update(1)

    try:
        report = run_batch(
            command, pairs, opts, jobs=jobs, continue_on_error=continue_on_error, backup=backup, on_result=on_result
        )
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    summary = report.to_dict()
    if as_json:
        _emit_json(summary)
    elif not quiet:
        stopped = "; stopped at the first failure" if report.stopped_early else ""
        click.echo(
            f"{summary['written']} written, {summary['unchanged']} unchanged, {summary['failed']} failed "
            f"of {len(pairs)} ({report.seconds:.2f} s){stopped}"
        )
    return report.exit_code


@cli.command("convert", context_settings=_CONTEXT)
@_INPUTS
@_PIPELINE
def convert_command(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Convert between .pth, safetensors and HF-style shards, applying any fixes on the way.

    The output format follows OUT: .safetensors; .pth/.pt/.bin/.ckpt/.tar are torch's zip
    format; a folder (ending in /) or --max-shard-size writes shards plus an *.index.json.
    IN may be a .pth (any torch zip), legacy torch file, .safetensors, shard index or folder.
    Tensor bytes stream from file to file; tied weights are stored once in safetensors and
    restored when converting back.

    \b
    Examples:
      ckptfix convert model.pth model.safetensors
      ckptfix convert model.safetensors model.pth
      ckptfix convert ckpt.pth out_dir/ --max-shard-size 2GB
      ckptfix convert out_dir/model.safetensors.index.json merged.pth
      ckptfix convert train.ckpt weights.safetensors --select state_dict --strip-prefix model.
      ckptfix convert model.pth model_fp16.safetensors --dtype float16 --dtype-keep '*norm*'
      ckptfix convert model.pth dcp_dir/ --format dcp
      ckptfix convert dcp_dir/ model.pth --unsafe-load    # DCP metadata is a plain pickle
      ckptfix convert ckpts/ -o dist/ --recursive --format safetensors --select state_dict
    """
    return _run("convert", paths, as_json, **kw)


@cli.command("strip-module", context_settings=_CONTEXT)
@_INPUTS
@_PREFIX_COMMAND
@_PIPELINE
def strip_module(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Strip a wrapper prefix (default 'module.') from every state-dict key.

    Fixes "Missing key(s) ... Unexpected key(s) ... module.xxx" when a checkpoint saved from
    nn.DataParallel / DistributedDataParallel is loaded into the bare model. Repeated
    prefixes are stripped too (module.module.x -> x). Optimizer state is never renamed.
    Tensor bytes are copied, not loaded; torch is not imported for zip checkpoints.
    Same as `convert --strip-prefix module.`, but writes nothing when no key has the prefix.

    \b
    Examples:
      ckptfix strip-module ddp.pth bare.pth
      ckptfix strip-module compiled.pth bare.pth --prefix _orig_mod.
      ckptfix strip-module train.ckpt fixed.ckpt --key state_dict --dry-run
      ckptfix strip-module ddp.pth bare.safetensors --map-location cpu
      ckptfix strip-module model.pth --in-place --backup .orig
      ckptfix strip-module ckpts/*.pth -o fixed/ --jobs 4 --continue-on-error --json
    """
    return _run("strip-module", paths, as_json, **kw)


@cli.command("add-module", context_settings=_CONTEXT)
@_INPUTS
@_PREFIX_COMMAND
@_PIPELINE
def add_module(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Add a wrapper prefix (default 'module.') to every state-dict key lacking it.

    For loading a bare model's weights into a DataParallel/DDP-wrapped model with strict=True.
    Keys that already have the prefix are left alone.

    \b
    Examples:
      ckptfix add-module bare.pth ddp.pth
      ckptfix add-module bare.pth compiled.pth --prefix _orig_mod.
    """
    return _run("add-module", paths, as_json, **kw)


@cli.command("remap", context_settings=_CONTEXT)
@_INPUTS
@click.option("--strict", is_flag=True, help="Exit 1 when no device tag changes.")
@_PIPELINE
def remap(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Rewrite the device tags of a checkpoint's storages (no GPU needed, no data decoded).

    Fixes "Attempting to deserialize object on a CUDA device but torch.cuda.is_available()
    is False" and "... on CUDA device 2 but torch.cuda.device_count() is 1": the output loads
    with plain torch.load(path) where the target device exists, no map_location needed.
    SPEC is one device for every storage, or FROM=TO pairs for some (FROM 'cuda' = any cuda:N).

    \b
    Examples:
      ckptfix remap gpu.pth cpu.pth --map-location cpu
      ckptfix remap 8gpu.pth one_gpu.pth --map-location cuda=cuda:0
      ckptfix remap model.pth --in-place --map-location cuda:1=cuda:0,cuda:2=cuda:0
    """
    return _run("remap", paths, as_json, **kw)


@cli.command("rename", context_settings=_CONTEXT)
@_INPUTS
@click.option(
    "--rule",
    "rules",
    multiple=True,
    metavar="RULE",
    help="'REGEX=>REPLACEMENT', Python re syntax with backrefs; repeatable, applied in order.",
)
@click.option("--strict", is_flag=True, help="Exit 1 when no key matches.")
@_PIPELINE
def rename(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Rename state-dict keys with regular expressions (like mmengine's revise_keys).

    Rules apply in order to every state-dict key (or those under --key). A rename that would
    give two keys the same name is an error naming both; --dry-run prints old -> new.

    \b
    Examples:
      ckptfix rename in.pth out.pth --rule '^backbone\\.=>encoder.'
      ckptfix rename in.pth out.pth --rule '^(\\w+)\\.conv(\\d)=>\\1.convs.\\2' --dry-run
    """
    return _run("rename", paths, as_json, **kw)


@cli.command("prune", context_settings=_CONTEXT)
@_INPUTS
@click.option("--strict", is_flag=True, help="Exit 1 when there is nothing to prune.")
@_PIPELINE
def prune(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
    """Keep only the weights: drop optimizer, scheduler, loop, callback, AMP and RNG state.

    State dicts (EMA copies included) and small values (epoch, config) stay; the report says
    how many bytes of tensors were dropped. Combine with --select state_dict to keep just the
    weights, or --drop for more.

    \b
    Examples:
      ckptfix prune train.ckpt weights.ckpt
      ckptfix prune train.pth weights.safetensors --select model
    """
    return _run("prune", paths, as_json, **kw)


@cli.command("fit", context_settings=_CONTEXT)
@_IN_OUT
@click.option("--reference", metavar="REF", type=click.Path(), help="A checkpoint whose keys to match (any format).")
@click.option(
    "--model",
    metavar="MODULE:CALLABLE",
    help="Match the state dict of MODULE:CALLABLE() (imported and called only because you name it; "
    "from installed modules and --model-path folders, never from the current folder).",
)
@click.option(
    "--model-path",
    "model_path",
    multiple=True,
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="With --model: search this folder first for MODULE (repeatable, in order; '.' for the current folder).",
)
@click.option("--select", metavar="PATH", help="The state dict to fit (default: the one that fits best).")
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Write even when keys stay missing/unexpected (those and wrong-shaped keys are left out).",
)
@click.option("--format", "out_format", type=click.Choice(["pth", "safetensors"]), help="Output format.")
@click.option("--dry-run", is_flag=True, help="Report the plan; write nothing.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@click.option("--unsafe-load", is_flag=True, help="For TRUSTED files only: allow torch.load(weights_only=False).")
@_MAX_EXPAND
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def fit(in_path: str, out_path: str | None, as_json: bool, **kw: Any) -> int:
    """Make a checkpoint's state dict match a model's keys, and write just that state dict.

    Works out which wrapper prefixes to strip (module., _orig_mod., model., nested) or which
    common prefix differs, applies it, and reports keys still missing or unexpected and shape
    mismatches. Exit 0 only when OUT loads with strict=True; otherwise exit 1, and OUT is
    written only with --allow-partial. Keys are never matched by position.

    \b
    Examples:
      ckptfix fit ddp.pth fixed.pth --reference bare_model.pth
      ckptfix fit train.ckpt weights.safetensors --model mypkg.models:build_model
      ckptfix fit train.ckpt weights.safetensors --model models:build --model-path ./src
      ckptfix fit pretrained.pth init.pth --reference new_head.pth --allow-partial
    """
    from ..pipeline import fit_checkpoint

    plan, report = fit_checkpoint(in_path, out_path, **kw)
    if as_json:
        _emit_json({"plan": plan.to_dict(), "write": report.to_dict() if report else None})
    else:
        click.echo(_describe_fit(plan))
        _say(
            report.message
            if report
            else "nothing written: the result would not load with strict=True "
            "(use --allow-partial to write the keys that fit)"
        )
    return 0 if plan.loads_strictly else 1


def _describe_fit(plan: Any) -> str:
    """The human fit report; every key is escaped (they come from the files, or the model)."""
    steps = [f"strip {p!r}" for p in plan.strips] + ([f"add {plan.add!r}"] if plan.add else [])
    lines = [f"fit: {', '.join(steps) or 'no renaming needed'}; {plan.matched} keys match the reference"]
    if plan.missing:
        lines.append(f"missing ({len(plan.missing)}): {', '.join(map(one_line, plan.missing[:20]))}")
    if plan.missing_num_batches_tracked:
        lines.append(
            f"missing num_batches_tracked ({len(plan.missing_num_batches_tracked)}): BatchNorm fills "
            "these in when loading; not an error"
        )
    if plan.unexpected:
        lines.append(f"unexpected ({len(plan.unexpected)}): {', '.join(map(one_line, plan.unexpected[:20]))}")
    for m in plan.shape_mismatches[:20]:
        lines.append(
            f"shape mismatch: {one_line(m['key'])}: checkpoint {m['checkpoint']} vs reference {m['reference']}"
        )
    return "\n".join(lines)


@cli.command("diff", context_settings=_CONTEXT)
@click.argument("a_path", metavar="A", type=click.Path())
@click.argument("b_path", metavar="B", type=click.Path())
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (torch.isclose).")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance (torch.isclose).")
@click.option("--select", metavar="PATH", help="Compare this sub-tree of A (e.g. state_dict).")
@click.option("--select-b", metavar="PATH", help="Compare this sub-tree of B.")
@click.option(
    "--strip-prefix", "strip_prefixes", multiple=True, metavar="P", help="Strip this prefix from A's keys first."
)
@click.option("--add-prefix", metavar="P", help="Add this prefix to A's keys first.")
@click.option("--rename", multiple=True, metavar="RULE", help="Rename A's keys first: 'REGEX=>REPLACEMENT'.")
@click.option("--drop", multiple=True, metavar="GLOB", help="Leave entries of A matching GLOB out of the comparison.")
@click.option("--unsafe-load", is_flag=True, help="For TRUSTED files only: allow torch.load(weights_only=False).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def diff_command(
    a_path: str, b_path: str, rtol: float, atol: float, select_b: str | None, as_json: bool, **kw: Any
) -> int:
    """Compare two checkpoints of any formats: keys, shapes, dtypes and values.

    Tensors are compared one at a time by their bytes (exact, NaN-aware); differing ones are
    measured (max abs/rel difference, count of differing elements). Transform A first to check a
    fix. Exit 0 when equal (within --rtol/--atol), 1 when different.

    \b
    Examples:
      ckptfix diff model.pth model.safetensors
      ckptfix diff ddp.pth bare.pth --strip-prefix module.
      ckptfix diff train.ckpt weights.safetensors --select state_dict --strip-prefix model. --json
      ckptfix diff a.pth b.pth --rtol 1e-3 --atol 1e-5
    """
    from ..analysis.diff import render
    from ..pipeline import ConvertOptions, diff_checkpoints

    report = diff_checkpoints(a_path, b_path, ConvertOptions(**kw), select_b=select_b, rtol=rtol, atol=atol)
    if as_json:
        _emit_json(report.to_dict())
    else:
        click.echo(render(type(report)(**_printable(report.to_dict()))))
    return 0 if report.equal else 1


@cli.command("verify", context_settings=_CONTEXT)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=click.Path())
@click.option(
    "--expect-prefix",
    metavar="none|PREFIX",
    help="Require no wrapper prefix on any key ('none'), or PREFIX on every key.",
)
@click.option("--expect-device", metavar="DEVICE", help="Require every storage on DEVICE (e.g. cpu).")
@click.option("--recursive", is_flag=True, help="Folder inputs: include sub-folders.")
@click.option("-q", "--quiet", is_flag=True, help="Print only failures.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def verify(
    paths: tuple[str, ...],
    expect_prefix: str | None,
    expect_device: str | None,
    recursive: bool,
    quiet: bool,
    as_json: bool,
) -> int:
    """Check checkpoints load safely and completely: a CI gate (exit 1 if any check fails).

    Each file is read by the safe readers (offsets in range, tensors inside their storages,
    shard indexes consistent), every zip record's CRC32 is checked, all tensor data is read,
    and optionally key prefixes and devices are as expected.

    \b
    Examples:
      ckptfix verify checkpoints/ --recursive
      ckptfix verify release/*.safetensors --expect-prefix none --expect-device cpu --json
    """
    from ..analysis.verify import verify_path
    from ..batch import expand_inputs

    results = [
        verify_path(p, expect_prefix=expect_prefix, expect_device=expect_device)
        for p, _ in expand_inputs(paths, recursive)
    ]
    failed = [r for r in results if not r.ok]
    if as_json:
        _emit_json({"ok": len(results) - len(failed), "failed": len(failed), "files": [r.to_dict() for r in results]})
    else:
        for r in results:
            if not r.ok:
                _say(f"FAIL {r.path}: " + "; ".join(r.problems), err=True)
            elif not quiet:
                _say(f"ok   {r.path} ({r.format})" + ("".join(f"; {n}" for n in r.notes)))
        if not quiet:
            click.echo(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


@cli.command("publish", context_settings=_CONTEXT)
@click.argument("in_path", metavar="IN", type=click.Path())
@click.argument("out_dir", metavar="OUTDIR", type=click.Path(file_okay=False))
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["safetensors", "pth"]),
    default="safetensors",
    show_default=True,
    help="Output format.",
)
@click.option("--name", help="File name stem (default: IN's name without extensions).")
@click.option("--unsafe-load", is_flag=True, help="For TRUSTED files only: allow torch.load(weights_only=False).")
@click.option(
    "--allow-global",
    "allow_globals",
    multiple=True,
    metavar="NAME",
    callback=_global_patterns,
    help="Read objects of this global (dotted name, * ? [...] globs) as opaque records (they are not published).",
)
@_MAX_EXPAND
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def publish_command(in_path: str, out_dir: str, as_json: bool, **kw: Any) -> int:
    """Release preset: weights only, wrapper prefixes stripped, on cpu, named by content hash.

    Writes OUTDIR/NAME-<first 8 hex of sha256>.<ext>, the name torch.hub's
    load_state_dict_from_url(check_hash=True), timm and mmdet verify, and prints the full sha256.

    \b
    Examples:
      ckptfix publish train.ckpt release/ --name resnet50
      ckptfix publish ddp.pth release/ --format pth
    """
    from ..pipeline import publish

    result = publish(in_path, out_dir, **kw)
    if as_json:
        _emit_json({"path": result.path, "sha256": result.sha256, "report": result.report.to_dict()})
    else:
        _say(result.report.message)
    return 0


@cli.command("scan", context_settings=_CONTEXT)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=click.Path())
@click.option("--recursive", is_flag=True, help="Folder inputs: include sub-folders.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def scan(paths: tuple[str, ...], recursive: bool, as_json: bool) -> int:
    """List every global each file's pickles reference, and judge them; never runs anything.

    Verdicts: safe (what torch.load(weights_only=True) accepts), benign (argparse.Namespace,
    numpy values, pathlib paths: keep with --allow-global, convert with --sanitize), dangerous
    (os, subprocess, eval/exec, torch's own loaders, any unknown module). Nested pickles are
    scanned too. Exit 1 if anything dangerous is found, 3 if a file cannot be scanned.

    \b
    Examples:
      ckptfix scan downloaded.pth
      ckptfix scan models/ --recursive --json
    """
    from ..analysis.scan import scan_path
    from ..batch import expand_inputs

    results = [scan_path(p) for p, _ in expand_inputs(paths, recursive)]
    if as_json:
        _emit_json({"files": [r.to_dict() for r in results]})
    else:
        for r in results:
            verdicts: dict[str, set[str]] = {}
            for g in r.globals:
                verdicts.setdefault(g.verdict, set()).add(g.name)
            status = "DANGEROUS" if r.dangerous else ("ERROR" if r.error else "ok")
            _say(f"{status} {r.path} ({r.format})" + (f": {r.error}" if r.error else ""))
            for verdict in ("dangerous", "benign", "safe"):
                if verdict in verdicts:
                    _say(f"  {verdict}: {', '.join(sorted(verdicts[verdict]))}")
    if any(r.dangerous for r in results):
        return 1
    return 3 if any(r.error for r in results) else 0


@cli.command("inspect", context_settings=_CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--unsafe-load", is_flag=True, help="For TRUSTED files only: fall back to torch.load(weights_only=False)."
)
@click.option(
    "--allow-global",
    "allow_globals",
    multiple=True,
    metavar="NAME",
    callback=_global_patterns,
    help="Read objects of this global (dotted name, * ? [...] globs) as opaque records, never imported or run.",
)
def inspect_command(path: str, as_json: bool, unsafe_load: bool, allow_globals: tuple[str, ...]) -> int:
    """Describe a checkpoint without reading its tensor data.

    Shows the format, where the state dicts are and which prefixes their keys share,
    other values (epoch, optimizer state), tensor count and bytes, dtypes, device tags,
    tensors sharing storage, and every global the pickle references.

    \b
    Examples:
      ckptfix inspect model.pth
      ckptfix inspect model.pth --json | jq .devices
    """
    from ..analysis.inspect import render
    from ..pipeline import inspect_checkpoint

    summary = inspect_checkpoint(path, unsafe_load=unsafe_load, allow_globals=allow_globals)
    if as_json:
        _emit_json(summary)
    else:
        click.echo(render(_printable(summary)))
    return 0


def _on_sigterm(signum: int, frame: Any) -> None:
    # turn SIGTERM into an exception so temporary files are cleaned up on the way out
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps every error to one stderr line and a documented exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = cli.main(args=args, prog_name="ckptfix", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("ckptfix: interrupted", err=True)
        code = EXIT_INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except CkptfixError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"ckptfix: error: {exc}", err=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        click.echo("ckptfix: interrupted; no output was written", err=True)
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        code = 0
    except Exception as exc:
        if debug:
            traceback.print_exc()
        click.echo(
            one_line(f"ckptfix: internal error (please report with --debug): {type(exc).__name__}: {exc}"), err=True
        )
        code = EXIT_INTERNAL
    sys.exit(code if isinstance(code, int) else 0)
