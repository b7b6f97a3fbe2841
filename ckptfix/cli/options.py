"""The option bundles the commands share (declared once, so every command spells them alike).

``INPUTS`` is the input side of every writing command (IN OUT, or many inputs with ``-o DIR`` /
``--in-place``); ``BATCH_OPTIONS`` names the ones that only mean something for several inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from ..formats.detect import OUTPUT_FORMATS
from ..model.dtypes import CAST_ALIASES, CASTABLE

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

#: options of INPUTS that apply to a run over several inputs, not to IN OUT
BATCH_OPTIONS = ("output_dir", "recursive", "jobs", "continue_on_error", "backup", "quiet")


def apply(options: list[Decorator]) -> Decorator:
    """Several click decorators as one, applied in the order listed."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


IN_OUT = apply(
    [
        click.argument("in_path", metavar="IN", type=click.Path()),
        click.argument("out_path", metavar="OUT", required=False, type=click.Path()),
    ]
)


def global_patterns(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """Check --allow-global patterns while parsing: a pattern that is not a dotted name (a newline,
    a space, NUL, an empty part) could match, and so carry into the output, a global name holding
    pickle opcodes. Raises ckptfix's UsageError so the message is one line (exit 2)."""
    from ..pickling.names import check_global_patterns

    check_global_patterns(value)
    return value


def allow_global(help: str) -> Decorator:
    """``--allow-global NAME`` (repeatable), checked while parsing; ``help`` says what it does
    for the command (kept and written through, or read and left out)."""
    return click.option(
        "--allow-global", "allow_globals", multiple=True, metavar="NAME", callback=global_patterns, help=help
    )


#: IN OUT, or many inputs with -o DIR / --in-place (files, folders of checkpoints, shard folders)
INPUTS = apply(
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
MAX_EXPAND = click.option(
    "--max-expand",
    metavar="SIZE",
    help="safetensors: refuse (exit 3) a write that would produce more than SIZE of tensor data by writing views "
    "out in full, e.g. a stride-0 expand (default: 16x the input size, at least 1GiB).",
)


def _storage_options(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) configures how URLs are opened (fsspec's
    storage options; dotted keys nest: client_kwargs.region_name=eu-west-1)."""
    from ..fileio.remote import configure, merge_option, parse_storage_option

    options: dict[str, Any] = {}  # none given: none (one command's options never reach the next)
    for text in value:
        merge_option(options, *parse_storage_option(text))
    configure(storage_options=options)


def _max_concurrency(ctx: click.Context, param: click.Parameter, value: int) -> None:
    from ..fileio.remote import configure

    configure(max_concurrency=value)


#: how inputs (and outputs) named by URL are reached: s3://, gs://, az://, hf://, https://,
#: file://, memory:// through fsspec (the ckptfix[remote] extra); every command that reads takes it
REMOTE_OPTIONS: list[Decorator] = [
    click.option(
        "--storage-option",
        "storage_options",
        multiple=True,
        metavar="KEY=VALUE",
        expose_value=False,
        callback=_storage_options,
        help="For URL inputs (s3://, gs://, hf://, https://...): an fsspec storage option, e.g. "
        "endpoint_url=http://127.0.0.1:9000 or anon=true (repeatable; the environment's settings apply too).",
    ),
    click.option(
        "--max-concurrency",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        expose_value=False,
        callback=_max_concurrency,
        help="For URL inputs: ranged requests in flight at once (memory stays at that many 8 MiB parts).",
    ),
]
REMOTE = apply(REMOTE_OPTIONS)

#: the options every writing command shares (one pipeline: ckptfix.pipeline.convert): the
#: table-built commands, fit and publish alike; ``tests/cli/test_shared_options.py`` checks it
PIPELINE_OPTIONS: list[Decorator] = [
    click.option("--select", metavar="PATH", help="Use this sub-tree as the checkpoint, e.g. state_dict or ema."),
    click.option(
        "--ema",
        is_flag=True,
        help="Take the EMA copy of the weights (state_dict_ema/model_ema/ema, or a model_ema. submodule beside "
        "the model's; with --select the model's own part is taken by default).",
    ),
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
        "--rule",
        "rename",
        multiple=True,
        metavar="RULE",
        help="Rename state-dict keys: 'REGEX=>REPLACEMENT' (Python re, backrefs; repeatable, in order; "
        "--rule is the same option).",
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
        type=click.Choice([*CASTABLE, *CAST_ALIASES]),
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
        type=click.Choice(OUTPUT_FORMATS),
        help="Output format (default: from OUT's extension; a folder means safetensors shards; "
        "dcp: a torch.distributed.checkpoint folder).",
    ),
    click.option("--max-shard-size", metavar="SIZE", help="Write HF-style shards of at most SIZE (e.g. 2GB, 5GiB)."),
    click.option(
        "--dcp-files",
        "dcp_files",
        type=int,
        metavar="N",
        help="With --format dcp: split the folder into N .distcp files, each tensor cut by rows as FSDP2 "
        "shards it over N ranks (each rank then reads one file).",
    ),
    MAX_EXPAND,
    click.option(
        "--keep-metadata",
        is_flag=True,
        help="safetensors: keep small plain values (epoch, config) as __metadata__ strings.",
    ),
    click.option(
        "--tensor-name",
        metavar="KEY",
        help="The checkpoint is one tensor (a numpy array, with --sanitize): store it under the name KEY, "
        "as safetensors needs.",
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
    allow_global(
        "Keep objects of this pickle global (or glob, e.g. 'numpy.*') as they are, without "
        "importing or running anything; the output carries them unchanged. NAME is a dotted Python "
        "name; parts may hold * ? [...] globs (anything else is a usage error)."
    ),
    click.option(
        "--sanitize",
        is_flag=True,
        help="Replace argparse.Namespace, numpy values and pathlib paths by plain data (dict, numbers, "
        "tensors, str) so the output loads with weights_only=True.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print a JSON report on stdout."),
    *REMOTE_OPTIONS,
]

#: what to read from a DeepSpeed checkpoint folder (every command that reads one takes them)
DEEPSPEED_OPTIONS: list[Decorator] = [
    click.option(
        "--tag",
        metavar="TAG",
        help="DeepSpeed folders: the checkpoint tag to read, e.g. global_step100 (default: the one 'latest' names).",
    ),
    click.option(
        "--weights",
        type=click.Choice(["fp32", "module"]),
        help="DeepSpeed folders: fp32 = the optimizer's fp32 master weights (default for ZeRO 1-3, as "
        "zero_to_fp32.py); module = the weights as trained (fp16/bf16 for mixed precision; ZeRO-0's only ones).",
    ),
]
PIPELINE_OPTIONS += DEEPSPEED_OPTIONS
DEEPSPEED = apply(DEEPSPEED_OPTIONS)
PIPELINE = apply(PIPELINE_OPTIONS)


def option_names(options: Decorator) -> list[str]:
    """The parameter names a bundle of options declares (what a command built with it takes)."""

    def probe() -> None:
        """Only carries the options."""

    return [param.name for param in getattr(options(probe), "__click_params__", []) if param.name]


#: the pipeline options a command that writes one new file (fit, publish) cannot honour: its help
#: does not offer them, so every option a help lists is one the command takes
REFUSED_BY = {
    "fit": ("max_shard_size", "dcp_files"),
    "publish": ("max_shard_size", "in_place", "dcp_files"),
}


def pipeline_for(command: str) -> Decorator:
    """PIPELINE without the options ``command`` refuses (:data:`REFUSED_BY`)."""
    refused = REFUSED_BY.get(command, ())
    return apply([o for o in PIPELINE_OPTIONS if not set(option_names(o)) & set(refused)])


PREFIX = apply(
    [
        click.option(
            "--prefix",
            default="module.",
            show_default=True,
            help="The key prefix (a module name; a trailing dot is added if missing). strip-module: 'auto' "
            "strips every wrapper prefix all keys share (module., _orig_mod., _forward_module.).",
        ),
        click.option("--strict", is_flag=True, help="Exit 1 when there is nothing to change."),
    ]
)


def pick(options: list[Decorator], *names: str) -> Decorator:
    """The options of a bundle whose parameter names are ``names`` (a command that shares some of
    a bundle's options, spelled and explained exactly as the others spell them)."""
    chosen = [option for option in options if set(option_names(option)) & set(names)]
    missing = set(names) - {name for option in chosen for name in option_names(option)}
    assert not missing, f"no such options: {sorted(missing)}"
    return apply(chosen)


#: what ``average`` takes from the pipeline's options: the choice of state dict in each input, and
#: the writer's (its other steps apply to one checkpoint: run them on the result with convert)
AVERAGE = pick(
    PIPELINE_OPTIONS,
    "select",
    "ema",
    "out_format",
    "max_shard_size",
    "dcp_files",
    "max_expand",
    "dry_run",
    "force",
    "verify",
    "as_json",
    "tag",
    "weights",
)
