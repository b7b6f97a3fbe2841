"""The commands, as data where they share a shape: every writing command is one row of
:data:`WRITE_COMMANDS` (its own options, how they preset the pipeline, its help), built into a
click command by :func:`_write_command` and run by :func:`run_write` -- one file (``IN OUT``,
a batch of one) or many (``-o DIR``, ``--in-place``, folders) through the same runner, so ``-q``,
``--json`` and ``--verify`` mean the same in both forms. Adding a writing command is one row.

The six other commands (fit, diff, verify, publish, scan, inspect) each have their own shape
and are written out below. No command holds logic: it parses, calls the library, renders.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from .. import __version__
from ..errors import ExitCode, UsageError
from ..formats.detect import FORMAT_NAME_ALIASES, FORMAT_NAMES
from ..model.dtypes import CAST_ALIASES, CASTABLE
from . import render
from .options import (
    AVERAGE,
    BATCH_OPTIONS,
    DEEPSPEED,
    IN_OUT,
    INPUTS,
    PIPELINE,
    PREFIX,
    REMOTE,
    Decorator,
    allow_global,
    apply,
    pipeline_for,
)
from .render import emit_json, printable, say
from .stdio import STREAM, stdio_paths

if TYPE_CHECKING:  # the pipeline (and all it reads with) is imported when a command runs, not for --help
    from ..pipeline import ConvertOptions

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def package_version() -> str:
    """The installed distribution's version (its metadata: what pip installed), or the source
    tree's ``ckptfix.__version__`` when there is no metadata (run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ckptfix")
    except PackageNotFoundError:
        return __version__


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from ..native import engine

        click.echo(f"ckptfix, version {package_version()} ({engine()} engine)")
        ctx.exit()


@click.group(context_settings=CONTEXT)
@click.option(
    "-V",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version (from the installed package's metadata) and the engine (native or python), and exit.",
)
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


# ----------------------------------------------------------------------------- writing commands


@dataclass(frozen=True)
class WriteCommand:
    """One writing command: the pipeline with a preset.

    ``preset(options, own)`` returns the :class:`ConvertOptions` to run, given the pipeline
    options from the command line and the command's ``own`` options (those in ``options``
    that are not :class:`ConvertOptions` fields); it raises :class:`UsageError` for a
    combination that cannot work. ``require_change``: write nothing when no step changed anything.
    """

    name: str
    help: str
    options: tuple[Decorator, ...] = ()
    preset: Callable[[ConvertOptions, dict[str, Any]], ConvertOptions] = lambda opts, own: opts
    require_change: bool = True


def _strict(what: str) -> Decorator:
    return click.option("--strict", is_flag=True, help=f"Exit 1 when {what}.")


def _needs_rules(opts: ConvertOptions, own: dict[str, Any]) -> ConvertOptions:
    if not opts.rename:
        raise UsageError("rename needs at least one --rule 'REGEX=>REPLACEMENT'")
    return opts


def _needs_map_location(opts: ConvertOptions, own: dict[str, Any]) -> ConvertOptions:
    if not opts.map_location:
        raise UsageError("remap needs --map-location, e.g. --map-location cpu")
    return opts


WRITE_COMMANDS = (
    WriteCommand(
        "convert",
        """Convert between .pth, safetensors and HF-style shards, applying any fixes on the way.

    The output format follows OUT: .safetensors; .pth/.pt/.bin/.ckpt/.tar are torch's zip
    format; a folder (ending in /) or --max-shard-size writes shards plus an *.index.json.
    IN may be a .pth (any torch zip), legacy torch file, .safetensors, shard index or folder.
    IN - reads standard input; OUT - writes standard output (with --format).
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
      torchrun --nproc-per-node 4 -m ckptfix convert big/ out/ --max-shard-size 5GB --distributed
      torchrun --nproc-per-node 4 -m ckptfix convert s3://a/run/ s3://b/hub/ --max-shard-size 5GB --distributed
    """,
        options=(
            click.option(
                "--distributed",
                is_flag=True,
                help="Under torchrun: split a shard-folder output (a local folder or a URL) by shard over "
                "its processes (gloo); shards are committed once all are written, rank 0 writes the index last.",
            ),
        ),
        require_change=False,
    ),
    WriteCommand(
        "strip-module",
        """Strip a wrapper prefix (default 'module.') from every state-dict key.

    Fixes "Missing key(s) ... Unexpected key(s) ... module.xxx" when a checkpoint saved from
    nn.DataParallel / DistributedDataParallel is loaded into the bare model. Repeated
    prefixes are stripped too (module.module.x -> x). --prefix auto strips every wrapper
    prefix all keys share (module., torch.compile's _orig_mod., Fabric's _forward_module.),
    nested in any order. Optimizer state is never renamed. Tensor bytes are copied, not
    loaded; torch is not imported for zip checkpoints. Same as `convert --strip-prefix
    module.`, except when no key has the prefix: then OUT is the input unchanged (exit 0;
    exit 1 with --strict) and a wrapper prefix the keys do carry is named, with the command.

    \b
    Examples:
      ckptfix strip-module ddp.pth bare.pth
      ckptfix strip-module compiled.pth bare.pth --prefix auto
      ckptfix strip-module compiled.pth bare.pth --prefix _orig_mod.
      ckptfix strip-module train.ckpt fixed.ckpt --key state_dict --dry-run
      ckptfix strip-module ddp.pth bare.safetensors --map-location cpu
      ckptfix strip-module model.pth --in-place --backup .orig
      ckptfix strip-module ckpts/*.pth -o fixed/ --jobs 4 --continue-on-error --json
    """,
        (PREFIX,),
        lambda opts, own: replace(opts, strip_prefixes=(own["prefix"], *opts.strip_prefixes)),
    ),
    WriteCommand(
        "add-module",
        """Add a wrapper prefix (default 'module.') to every state-dict key lacking it.

    For loading a bare model's weights into a DataParallel/DDP-wrapped model with strict=True.
    Keys that already have the prefix are left alone.

    \b
    Examples:
      ckptfix add-module bare.pth ddp.pth
      ckptfix add-module bare.pth compiled.pth --prefix _orig_mod.
    """,
        (PREFIX,),
        lambda opts, own: replace(opts, add_prefix=own["prefix"]),
    ),
    WriteCommand(
        "remap",
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
    """,
        (_strict("no device tag changes"),),
        _needs_map_location,
    ),
    WriteCommand(
        "rename",
        """Rename state-dict keys with regular expressions (like mmengine's revise_keys).

    Rules apply in order to every state-dict key (or those under --key). A rename that would
    give two keys the same name is an error naming both; --dry-run prints old -> new.

    \b
    Examples:
      ckptfix rename in.pth out.pth --rule '^backbone\\.=>encoder.'
      ckptfix rename in.pth out.pth --rule '^(\\w+)\\.conv(\\d)=>\\1.convs.\\2' --dry-run
    """,
        (_strict("no key matches"),),
        _needs_rules,
    ),
    WriteCommand(
        "prune",
        """Keep only the weights: drop optimizer, scheduler, loop, callback, AMP and RNG state.

    State dicts (EMA copies included) and small values (epoch, config) stay; the report says
    how many bytes of tensors were dropped. Combine with --select state_dict to keep just the
    weights, or --drop for more.

    \b
    Examples:
      ckptfix prune train.ckpt weights.ckpt
      ckptfix prune train.pth weights.safetensors --select model
    """,
        (_strict("there is nothing to prune"),),
        lambda opts, own: replace(opts, prune=True),
    ),
)


def _streamed(
    in_path: str, out_path: str | None, out_format: str | None, as_json: bool, work: Callable[[str, str | None], int]
) -> int:
    """``work(IN, OUT)`` with ``-`` standing for standard input or output (:func:`stdio_paths`):
    the report goes to stderr when stdout carries the checkpoint, and a run that does not end
    in exit 0 sends nothing down the pipe."""
    if STREAM not in (in_path, out_path):
        return work(in_path, out_path)
    if out_path == STREAM and as_json:
        raise UsageError("--json prints on standard output, which OUT - fills with the checkpoint")
    with stdio_paths(in_path, out_path, out_format) as (real_in, real_out):
        with contextlib.redirect_stdout(sys.stderr) if out_path == STREAM else contextlib.nullcontext():
            code = work(str(real_in), None if real_out is None else str(real_out))
        if code != ExitCode.OK and real_out is not None:
            Path(real_out).unlink(missing_ok=True)
        return code


def _write_command(spec: WriteCommand) -> click.Command:
    """Build the click command for one row: INPUTS, the row's own options, then PIPELINE."""

    def run(paths: tuple[str, ...], as_json: bool, **kw: Any) -> int:
        if len(paths) == 2 and STREAM in paths and not kw.get("output_dir") and not kw.get("in_place"):
            return _streamed(
                paths[0],
                paths[1],
                kw.get("out_format"),
                as_json,
                lambda i, o: run_write(spec, (i, str(o)), as_json, kw),
            )
        return run_write(spec, paths, as_json, kw)

    run.__doc__ = spec.help
    return click.command(spec.name, context_settings=CONTEXT)(apply([INPUTS, *spec.options, PIPELINE])(run))


def pipeline_options(kw: dict[str, Any], **preset: Any) -> ConvertOptions:
    """The shared pipeline options (PIPELINE) as a :class:`ConvertOptions`, popped from ``kw``;
    what is left in ``kw`` is the command's own options."""
    from ..pipeline import ConvertOptions

    option_fields = {f.name for f in fields(ConvertOptions)}
    values = {k: kw.pop(k) for k in list(kw) if k in option_fields}
    values["map_location"] = ",".join(values.get("map_location") or ()) or None
    return ConvertOptions(**values, **preset)


def run_write(spec: WriteCommand, paths: tuple[str, ...], as_json: bool, kw: dict[str, Any]) -> int:
    """Build the options and run one file (IN OUT) or a batch (-o DIR, --in-place, folders)."""
    from ..batch import expand_inputs, plan_outputs, run_batch
    from ..fileio.urls import is_url

    batch = {k: kw.pop(k) for k in BATCH_OPTIONS}
    opts = pipeline_options(kw, require_change=spec.require_change)
    opts = spec.preset(opts, kw)
    single = batch["output_dir"] is None and not opts.in_place
    if single:
        if len(paths) != 2:
            raise UsageError("give IN OUT, or several inputs with -o DIR (or --in-place)")
        _refuse_batch_flags()
        pairs = [(paths[0], paths[1])]
    else:
        if batch["output_dir"] is not None and opts.in_place:
            raise UsageError("give either -o DIR or --in-place, not both")
        if any(is_url(p) for p in (*paths, batch["output_dir"] or "")):
            raise UsageError("several inputs (-o DIR, --in-place) are local files; give a URL as IN OUT, one at a time")
        inputs = expand_inputs(paths, batch["recursive"])
        out_dir = Path(batch["output_dir"]) if batch["output_dir"] else None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
        pairs = plan_outputs(inputs, out_dir, opts.in_place, opts.out_format)
        for src, dst in pairs:
            if dst != src:  # -o DIR keeps the inputs' sub-folders
                Path(dst).parent.mkdir(parents=True, exist_ok=True)
    if batch["backup"] and not opts.in_place:
        raise UsageError("--backup goes with --in-place")
    quiet = batch["quiet"]
    progress: Callable[[int], None] | None = None
    close: Callable[[bool], None] = render.no_close
    if single and not (as_json or quiet or opts.dry_run):
        progress, close = render.byte_progress(paths[0])
    bar = None
    if not single and not (as_json or quiet) and sys.stderr.isatty() and len(pairs) > 1:
        bar = click.progressbar(length=len(pairs), file=sys.stderr, label=spec.name, show_pos=True)
        bar.__enter__()

    def on_result(result: Any) -> None:
        if result.status == "failed":
            if bar is not None or progress is not None:
                render.clear_progress_line()
            say(f"ckptfix: error: {result.message}", err=True)
        elif not single and bar is None and not (as_json or quiet):
            say(render.batch_line(result), err=True)
        if bar is not None:
            bar.update(1)

    ok = False
    try:
        report = run_batch(
            spec.name,
            pairs,
            opts,
            jobs=batch["jobs"],
            continue_on_error=batch["continue_on_error"],
            backup=batch["backup"],
            on_result=on_result,
            progress=progress,
            raise_bugs=single,
        )
        ok = not report.failed
    finally:
        close(ok)
        if bar is not None:
            bar.__exit__(None, None, None)
    if single:
        (result,) = report.files
        if result.status == "failed" and as_json:
            error = result.error or {"message": result.message}
            render.json_error(
                spec.name, result.exit_code, error["message"], error.get("type", "Error"), error.get("hint")
            )
        elif result.status != "failed":
            assert result.report is not None  # a file that did not fail has its report
            if as_json:
                emit_json(spec.name, report.exit_code, result.report)
            elif not quiet:
                render.file_report(result.report, dry_run=opts.dry_run)
        return report.exit_code
    summary = report.to_dict()
    if as_json:
        emit_json(spec.name, report.exit_code, summary)
    elif not quiet:
        click.echo(render.batch_summary(summary, len(pairs), report.seconds, report.stopped_early))
    return report.exit_code


def _refuse_batch_flags() -> None:
    """IN OUT is one file: the options for several inputs, given on the command line, are a
    usage error rather than silently ignored."""
    ctx = click.get_current_context()
    for name, flag in (("jobs", "--jobs"), ("recursive", "--recursive"), ("continue_on_error", "--continue-on-error")):
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            raise UsageError(f"{flag} is for several inputs (-o DIR or --in-place); IN OUT names one file")


for _spec in WRITE_COMMANDS:
    cli.add_command(_write_command(_spec))

#: every command that writes a checkpoint: the table's rows, then fit and publish (defined
#: below); each takes the shared pipeline options (options.PIPELINE)
WRITING_COMMANDS = (*(spec.name for spec in WRITE_COMMANDS), "fit", "publish")


# ----------------------------------------------------------------------------- the other commands


@cli.command("fit", context_settings=CONTEXT)
@IN_OUT
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
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Write even when keys stay missing/unexpected (those and wrong-shaped keys are left out).",
)
@pipeline_for("fit")
def fit(in_path: str, out_path: str | None, as_json: bool, **kw: Any) -> int:
    """Make a checkpoint's state dict match a model's keys, and write just that state dict.

    Works out which wrapper prefixes to strip (module., _orig_mod., model., nested) or which
    common prefix differs, applies it, and reports keys still missing or unexpected and shape
    mismatches. Exit 0 only when OUT loads with strict=True; otherwise exit 1, and OUT is
    written only with --allow-partial. Keys are never matched by position.

    Takes every option convert takes, in the same pipeline: --select/--ema choose the state
    dict to fit (default: the one that fits best); the fit's prefix changes run as the first
    --strip-prefix/--add-prefix steps; then --drop/--keep (matched on the checkpoint's own key
    names, as in convert), your --strip-prefix/--rename, --map-location, --dtype, and the
    writer's options. The exit status is the fit's verdict: a --drop or --rename you add
    changes the keys after it.

    \b
    Examples:
      ckptfix fit ddp.pth fixed.pth --reference bare_model.pth
      ckptfix fit train.ckpt weights.safetensors --model mypkg.models:build_model
      ckptfix fit train.ckpt weights.safetensors --model models:build --model-path ./src
      ckptfix fit pretrained.pth init.pth --reference new_head.pth --allow-partial
      ckptfix fit gpu_ddp.pth cpu_fp16.pth --reference bare.pth --map-location cpu --dtype float16
      cat ddp.pth | ckptfix fit - - --reference bare.pth --format safetensors > fixed.safetensors
    """
    from ..pipeline import fit_checkpoint

    opts = pipeline_options(kw)

    def work(real_in: str, real_out: str | None) -> int:
        plan, report = fit_checkpoint(real_in, real_out, options=opts, **kw)
        code = ExitCode.OK if plan.loads_strictly else ExitCode.CHECK_FAILED
        if as_json:
            written = report.to_dict() if report else {"input": in_path, "output": out_path, "written": False}
            emit_json("fit", code, {**written, "plan": plan.to_dict()})
        else:
            click.echo(render.fit_plan(plan))
            say(
                report.message
                if report
                else "nothing written: the result would not load with strict=True "
                "(use --allow-partial to write the keys that fit)"
            )
        return code

    return _streamed(in_path, out_path, opts.out_format, as_json, work)


@cli.command("diff", context_settings=CONTEXT)
@click.argument("a_path", metavar="A", type=click.Path())
@click.argument("b_path", metavar="B", type=click.Path())
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (as in torch.isclose).")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance (as in torch.isclose).")
@click.option("--select", metavar="PATH", help="Compare this sub-tree of A (e.g. state_dict).")
@click.option("--select-b", metavar="PATH", help="Compare this sub-tree of B.")
@click.option(
    "--strip-prefix", "strip_prefixes", multiple=True, metavar="P", help="Strip this prefix from A's keys first."
)
@click.option("--add-prefix", metavar="P", help="Add this prefix to A's keys first.")
@click.option("--rename", multiple=True, metavar="RULE", help="Rename A's keys first: 'REGEX=>REPLACEMENT'.")
@click.option("--drop", multiple=True, metavar="GLOB", help="Leave entries of A matching GLOB out of the comparison.")
@click.option("--unsafe-load", is_flag=True, help="For TRUSTED files only: allow torch.load(weights_only=False).")
@click.option(
    "--keys-only",
    is_flag=True,
    help="Compare keys, dtypes, shapes and other values; read no tensor data (a remote checkpoint: a few requests).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@REMOTE
@DEEPSPEED
def diff_command(
    a_path: str,
    b_path: str,
    rtol: float,
    atol: float,
    select_b: str | None,
    keys_only: bool,
    as_json: bool,
    **kw: Any,
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
      ckptfix diff s3://bucket/run/last.ckpt model.safetensors --select state_dict --keys-only
    """
    from ..analysis.diff import render
    from ..pipeline import ConvertOptions, diff_checkpoints

    report = diff_checkpoints(
        a_path, b_path, ConvertOptions(**kw), select_b=select_b, rtol=rtol, atol=atol, keys_only=keys_only
    )
    code = ExitCode.OK if report.equal else ExitCode.CHECK_FAILED
    if as_json:
        emit_json("diff", code, report.to_dict())
    else:
        click.echo(render(type(report)(**printable(report.to_dict()))))
    return code


@contextlib.contextmanager
def _one_or_stdin(paths: tuple[str, ...], recursive: bool) -> Iterator[list[str]]:
    """The files a checking command reads: PATH... expanded, or standard input for a lone ``-``
    (copied to a private temporary file first: checkpoints are read by offset)."""
    from ..batch import expand_inputs

    if paths == (STREAM,):
        with stdio_paths(STREAM, None, None) as (real, _):
            yield [str(real)]
        return
    yield [str(p) for p, _ in expand_inputs(paths, recursive)]


@cli.command("verify", context_settings=CONTEXT)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=click.Path())
@click.option(
    "--expect-prefix",
    metavar="none|PREFIX",
    help="Require no wrapper prefix on any key ('none', what strip-module gives), or PREFIX on every key.",
)
@click.option("--expect-no-prefix", is_flag=True, help="Same as --expect-prefix none.")
@click.option(
    "--expect-device", metavar="DEVICE", help="Require every storage on DEVICE, as --map-location DEVICE writes."
)
@click.option(
    "--expect-dtype",
    type=click.Choice([*CASTABLE, *CAST_ALIASES]),
    help="Require every floating-point state-dict tensor to be DTYPE, as --dtype DTYPE writes.",
)
@click.option(
    "--expect-format",
    type=click.Choice([*FORMAT_NAMES, *FORMAT_NAME_ALIASES]),
    help="Require this format, as inspect names it (pth = torch-zip, what --format pth writes).",
)
@click.option("--expect-keys", type=click.IntRange(min=0), metavar="N", help="Require exactly N state-dict keys.")
@click.option(
    "--expect-metadata",
    multiple=True,
    metavar="KEY=VALUE",
    help="Require this safetensors __metadata__ entry, e.g. format=pt (what transformers needs; repeatable).",
)
@click.option("--recursive", is_flag=True, help="Folder inputs: include sub-folders.")
@click.option("-q", "--quiet", is_flag=True, help="Print only failures.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@REMOTE
def verify(
    paths: tuple[str, ...],
    expect_prefix: str | None,
    expect_no_prefix: bool,
    expect_device: str | None,
    expect_dtype: str | None,
    expect_format: str | None,
    expect_keys: int | None,
    expect_metadata: tuple[str, ...],
    recursive: bool,
    quiet: bool,
    as_json: bool,
) -> int:
    """Check checkpoints load safely and completely: a CI gate (exit 1 if any check fails).

    Each file is read by the safe readers (offsets in range, tensors inside their storages,
    shard indexes consistent; safetensors headers held to the safetensors library's own rules,
    and a key repeated in one is refused), every zip record's CRC32 is checked, all tensor data
    is read, and the --expect-* options hold. Each expectation is named after the writing option
    that makes a file meet it, and a failure says which command fixes it.

    \b
    Examples:
      ckptfix verify checkpoints/ --recursive
      curl -sL https://example.com/model.pth | ckptfix verify -
      ckptfix verify release/*.safetensors --expect-no-prefix --expect-device cpu --json
      ckptfix verify model.safetensors --expect-format safetensors --expect-dtype bfloat16 --expect-metadata format=pt
    """
    from ..analysis.verify import Expectations, verify_path

    if expect_no_prefix and expect_prefix not in (None, "none"):
        raise UsageError("give --expect-no-prefix or --expect-prefix PREFIX, not both")
    expect = Expectations(
        prefix="none" if expect_no_prefix else expect_prefix,
        device=expect_device,
        dtype=expect_dtype,
        format=expect_format,
        keys=expect_keys,
        metadata=expect_metadata,
    )
    with _one_or_stdin(paths, recursive) as inputs:
        results = [verify_path(p, expect) for p in inputs]
    if paths == (STREAM,):
        results[0].input = "<stdin>"
    failed = [r for r in results if not r.ok]
    code = ExitCode.CHECK_FAILED if failed else ExitCode.OK
    if as_json:
        counts = {"passed": len(results) - len(failed), "failed": len(failed)}
        emit_json("verify", code, {"counts": counts, "files": [r.to_dict() for r in results]})
    else:
        render.verify_results(results, quiet)
    return code


@cli.command("publish", context_settings=CONTEXT)
@click.argument("in_path", metavar="IN", type=click.Path())
@click.argument("out_dir", metavar="OUTDIR", type=click.Path(file_okay=False))
@click.option("--name", help="File name stem (default: IN's name without extensions).")
@pipeline_for("publish")
def publish_command(in_path: str, out_dir: str, as_json: bool, **kw: Any) -> int:
    """Release preset: weights only, wrapper prefixes stripped, on cpu, named by content hash.

    Writes OUTDIR/NAME-<first 8 hex of sha256>.<ext> (--format safetensors, the default, or
    pth; OUTDIR is created if missing), the name torch.hub's
    load_state_dict_from_url(check_hash=True), timm and mmdet verify, and prints the full sha256.
    Takes every option convert takes; the preset fills in what they leave open: --select (the
    largest state dict), --map-location (cpu), and its wrapper strips run before your
    --strip-prefix.

    \b
    Examples:
      ckptfix publish train.ckpt release/ --name resnet50
      ckptfix publish ddp.pth release/ --format pth
      ckptfix publish train.ckpt release/ --dtype bfloat16 --drop '*.num_batches_tracked'
    """
    from ..pipeline import publish

    opts = pipeline_options(kw)
    result = publish(in_path, out_dir, options=opts, **kw)
    if as_json:
        emit_json("publish", ExitCode.OK, {**result.report.to_dict(), "sha256": result.sha256})
    else:
        say(result.report.message)
    return ExitCode.OK


@cli.command("scan", context_settings=CONTEXT)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=click.Path())
@click.option("--recursive", is_flag=True, help="Folder inputs: include sub-folders.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@click.option("--strict", is_flag=True, help="Exit 1 for unknown classes too, not only dangerous ones.")
@REMOTE
def scan(paths: tuple[str, ...], recursive: bool, as_json: bool, strict: bool) -> int:
    """List every global each file's pickles reference, and judge them; never runs anything.

    Verdicts: dangerous (runs code or touches the system when unpickled: os, subprocess,
    eval/exec/getattr, torch's own loaders...; each with its reason), unknown (third-party
    classes such as omegaconf configs: importing them runs their package's code, but they are
    no attack by themselves), safe (what torch.load(weights_only=True) accepts, and the
    standard library's plain data types). Nested pickles are scanned too. Exit 1 if anything
    dangerous is found (with --strict: or unknown), 3 if a file cannot be scanned.

    \b
    Examples:
      ckptfix scan downloaded.pth
      curl -sL https://example.com/model.pth | ckptfix scan -
      ckptfix scan models/ --recursive --json
      ckptfix scan release/ --recursive --strict
    """
    from ..analysis.scan import scan_path

    with _one_or_stdin(paths, recursive) as inputs:
        results = [scan_path(p) for p in inputs]
    if paths == (STREAM,):
        results[0].path = "<stdin>"
    if any(r.dangerous or (strict and r.unknown) for r in results):
        code = ExitCode.CHECK_FAILED
    else:
        code = ExitCode.BAD_INPUT if any(r.error for r in results) else ExitCode.OK
    if as_json:
        emit_json("scan", code, {"files": [r.to_dict() for r in results]})
    else:
        render.scan_results(results)
    return code


@cli.command("inspect", context_settings=CONTEXT)
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--unsafe-load", is_flag=True, help="For TRUSTED files only: fall back to torch.load(weights_only=False)."
)
@click.option("--full", is_flag=True, help="Show every layout entry (the text report shows the first 60).")
@allow_global("Read objects of this global (dotted name, * ? [...] globs) as opaque records, never imported or run.")
@REMOTE
@DEEPSPEED
def inspect_command(
    path: str,
    as_json: bool,
    unsafe_load: bool,
    full: bool,
    allow_globals: tuple[str, ...],
    tag: str | None = None,
    weights: str | None = None,
) -> int:
    """Describe a checkpoint without reading its tensor data.

    Shows the format, where the state dicts are and which prefixes their keys share,
    other values (epoch, optimizer state), tensor count and bytes, dtypes, device tags,
    tensors sharing storage, and every global the pickle references. PATH - reads
    standard input.

    \b
    Examples:
      ckptfix inspect model.pth
      curl -sL https://example.com/model.pth | ckptfix inspect -
      ckptfix inspect model.pth --json | jq .devices
      ckptfix inspect ds_run/ --json | jq .deepspeed
    """
    from ..analysis.inspect import inspect_checkpoint, render  # not via pipeline: it imports every writer

    with stdio_paths(path, None, None) as (real, _):  # "-": standard input
        summary = inspect_checkpoint(
            str(real), unsafe_load=unsafe_load, allow_globals=allow_globals, tag=tag, weights=weights
        )
    summary["input"] = "<stdin>" if path == STREAM else summary["input"]
    if as_json:
        emit_json("inspect", ExitCode.OK, summary)
    else:
        for line in render(printable(summary), full=full).splitlines():
            say(line)  # its warning lines in colour on a terminal
    return ExitCode.OK


@cli.command("average", context_settings=CONTEXT)
@click.argument("paths", nargs=-1, required=True, metavar="IN... OUT", type=click.Path())
@click.option(
    "--coefficients",
    metavar="C1,C2,...",
    help="Weigh the inputs: one number >= 0 per input, in order (default: all 1, a plain mean). Not named "
    "--weights: that option picks a DeepSpeed folder's weights (fp32 or module), here as on every reading command.",
)
@AVERAGE
def average_command(paths: tuple[str, ...], coefficients: str | None, as_json: bool, **kw: Any) -> int:
    """Average several checkpoints of one model (any formats) into one: mean or weighted mean.

    Each floating-point tensor is summed over the inputs in float64 (times its coefficient),
    divided by the coefficients' sum and cast back to its own dtype -- timm's avg_checkpoints.py
    arithmetic, bit for bit, without its float32-only output. Integer and bool tensors
    (num_batches_tracked) are the last input's. Keys, shapes and dtypes must agree (exit 3
    names the ones that do not). --select/--ema choose the state dict in every input (default:
    the checkpoint itself, or its largest state dict). One tensor at a time: memory does not grow
    with the number of inputs or the size of the model. No torch needed.

    \b
    Examples:
      ckptfix average ep8.pth ep9.pth ep10.pth avg.pth
      ckptfix average run/ckpt-*.pth.tar avg.safetensors --ema
      ckptfix average a.safetensors b/ c.pth soup.safetensors --coefficients 1,1,2
      ckptfix average ds_run1/ ds_run2/ avg/ --max-shard-size 2GB --json
    """
    from ..pipeline import average_checkpoints

    if len(paths) < 3:
        raise UsageError("give at least two inputs, then OUT: ckptfix average A B OUT")
    opts = pipeline_options(kw)
    report = average_checkpoints(paths[:-1], paths[-1], coefficients, opts)
    if as_json:
        emit_json("average", ExitCode.OK, report.to_dict())
    else:
        say(report.message)
        for note in report.notes:
            say(f"note: {note}", err=True)
    return ExitCode.OK
