"""README claims, each run as written (the ones other tests do not already cover)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import shutil
import struct
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, ROOT, invoke_cli
from models import TinyNet

import ckptfix

#: README.md, then the reference pages under docs/ (what moved out of it): every claim and example is
#: checked wherever it lives
PAGES = {"README.md": (ROOT / "README.md").read_text()} | {
    f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))
}
README = "\n".join(PAGES.values())


def _section(title: str) -> str:
    start = README.index(title)
    return README[start : README.index("\n#", start + 1)]


def test_the_github_actions_example_runs_on_plain_state_dicts(tmp_path: Path) -> None:
    """Every `run: ckptfix ...` line of the example, in order, from a checkout with a folder of
    plain state dicts; `> file` is stdout, as the shell would write it."""
    (tmp_path / "checkpoints" / "sub").mkdir(parents=True)
    torch.save(TinyNet().state_dict(), tmp_path / "checkpoints" / "a.pth")
    torch.save(TinyNet().state_dict(), tmp_path / "checkpoints" / "sub" / "b.pt")
    example = README[README.index("Example GitHub Actions steps") :]
    example = example[: example.index("```\n", example.index("```yaml") + 7)]
    steps = re.findall(r"^\s*run: (ckptfix .*)$", example, re.M)
    assert len(steps) == 3, steps
    for line in steps:
        args, _, target = line.partition(" > ")
        result = invoke_cli(*shlex.split(args)[1:], cwd=tmp_path)
        assert result.returncode == 0, (line, result.stderr)
        (tmp_path / target.strip()).write_text(result.stdout)
        assert json.loads(result.stdout)["ok"] is True
    assert json.loads((tmp_path / "verify.json").read_text())["counts"] == {"passed": 2, "failed": 0}
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "dist").rglob("*.safetensors")) == [
        "dist/a.safetensors",
        "dist/sub/b.safetensors",
    ]


def test_the_formats_section_names_dcp_and_inspect_reads_it() -> None:
    formats = _section("Formats read")
    assert "torch.distributed.checkpoint` (DCP)" in formats and "--format dcp" in formats
    result = invoke_cli("inspect", FIXTURES / "dcp_sharded_2ranks", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["format"] == "dcp", result.stderr


def test_every_command_in_the_table_exists_and_every_command_is_in_the_table() -> None:
    from ckptfix.cli import cli

    table = _section("## Commands")
    named = set(re.findall(r"^\| `ckptfix ([a-z-]+)", table, re.M))
    assert named == set(cli.commands), named ^ set(cli.commands)


def test_every_verify_option_in_the_readme_exists() -> None:
    from ckptfix.cli import cli

    declared = {opt for p in cli.commands["verify"].params for opt in getattr(p, "opts", [])}
    mentioned = set(re.findall(r"`(--expect-[a-z-]+)", README))
    assert mentioned and mentioned <= declared, mentioned - declared


# -- every example command line in README.md's code blocks, run as written -------------------------

#: lines of the README's shell code blocks that are not ckptfix commands CI can run here, each with why
NOT_RUN = {
    "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest tests -q": (
        "installs packages and runs this suite itself (CI's own job: .ci/run)"
    ),
    # docs/remote.md: the URLs are buckets and servers the reader has, not this machine (no network
    # here); tests/cli/test_remote.py runs the same commands against moto S3 and an HTTP server
    **dict.fromkeys(
        [
            "pip install 'ckptfix[remote]'     # fsspec + s3fs, aiohttp (http/https), huggingface_hub (hf://)",
            "pip install 'ckptfix[gcs]'        # + gcsfs for gs://",
            "pip install 'ckptfix[azure]'      # + adlfs for az://",
        ],
        "installs packages (the [remote] extra is installed for this suite)",
    ),
    **dict.fromkeys(
        [
            "ckptfix inspect s3://my-bucket/runs/42/last.ckpt",
            "ckptfix inspect s3://my-bucket/runs/42/last.ckpt --json | jq .state_dicts",
            "ckptfix scan https://example.org/models/model.pth",
            "ckptfix diff s3://my-bucket/runs/42/last.ckpt release/model.safetensors --select state_dict --keys-only",
            "ckptfix inspect hf://datasets/me/ckpts/model.safetensors",
            "ckptfix inspect s3://training/run-42/step-1000/",
            "ckptfix scan s3://training/run-42/step-1000/",
            "ckptfix convert s3://training/run-42/step-1000/ model.safetensors",
            "ckptfix convert s3://training/run-42/last.ckpt s3://releases/model-v1/ "
            "--select state_dict --strip-prefix model. --max-shard-size 5GB",
            "ckptfix inspect s3://bucket/model.pth --storage-option endpoint_url=http://minio.local:9000 "
            "--storage-option key=... --storage-option secret=...",
            "ckptfix inspect s3://public-bucket/model.pth --storage-option anon=true",
            "ckptfix convert s3://a/x.pth s3://b/x.safetensors --storage-option client_kwargs.region_name=eu-west-1",
        ],
        "names a bucket or server of the reader's (no network here): tests/cli/test_remote.py runs these against "
        "moto S3 and an HTTP server in threads",
    ),
    "torchrun --standalone --nproc-per-node 4 -m ckptfix convert big.pth out/ --max-shard-size 5GB --distributed": (
        "starts processes: tests/e2e/test_distributed.py runs it (two ranks, -m distributed)"
    ),
    "torchrun --standalone --nproc-per-node 8 -m ckptfix convert s3://training/run-42/last.ckpt "
    "s3://releases/model-v1/ --select state_dict --strip-prefix model. --max-shard-size 5GB --distributed": (
        "starts processes and names buckets of the reader's: tests/e2e/test_distributed.py runs the same "
        "against moto S3 (two ranks, -m distributed)"
    ),
    "torchrun --nproc-per-node 8 -m ckptfix convert s3://train/run-42/ s3://hub/v1/ --max-shard-size 5GB "
    "--distributed": (
        "starts processes and names buckets of the reader's: tests/e2e/test_distributed.py runs the "
        "same against moto S3 (two ranks, -m distributed)"
    ),
    **dict.fromkeys(
        [
            "apt-get install libfuzzer-19-dev",
            "native/fuzz/run.sh vm 600          # target, seconds; crashes go to native/fuzz/artifacts/vm/",
            ".venv/bin/python native/fuzz/replay.py   # the grown corpus through both engines",
        ],
        "docs/engine.md's coverage-guided fuzzing: installs a system package and fuzzes for minutes (run by "
        "hand; the differential fuzzer runs in this suite)",
    ),
    "srun --nodes 4 --ntasks-per-node 1 torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d "
    '--rdzv-endpoint "$(scontrol show hostnames | head -1):29500" --rdzv-id "$SLURM_JOB_ID" '
    "-m ckptfix convert /shared/ckpt/ /shared/hub/ --max-shard-size 5GB --distributed": (
        "a SLURM cluster's job (several hosts)"
    ),
}


def _code_blocks(language: str, text: str = README) -> list[str]:
    """The text of the pages' fenced code blocks labelled ``language`` ("" for unlabelled)."""
    blocks, current, label = [], None, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current, label = [], line.strip()[3:]
            else:
                if label == language:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line.strip())
    return blocks


def _shell_blocks() -> list[str]:
    """The command lines of the pages' unlabelled and ``bash`` code blocks (shell commands): a
    line ending in a backslash is joined to the next, comment lines are left out."""
    lines = []
    for block in _code_blocks("") + _code_blocks("bash"):
        for line in re.sub(r"\s*\\\n", " ", block).splitlines():
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


EXAMPLES = [line for line in _shell_blocks() if line not in NOT_RUN]


def test_the_lines_not_run_are_still_in_the_readme() -> None:
    assert set(NOT_RUN) <= set(_shell_blocks()), set(NOT_RUN) - set(_shell_blocks())
    assert len(EXAMPLES) >= 5, EXAMPLES


def _workspace(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files the examples name: a DataParallel checkpoint (ddp.pth), a Lightning-style
    train.ckpt whose hyper_parameters hold an omegaconf config and a class from `mypkg`, and a
    DeepSpeed run folder (ds_run/)."""
    from config_types import lightning_style
    from omegaconf import OmegaConf

    shutil.copy(FIXTURES / "dataparallel_tinynet.pth", folder / "ddp.pth")
    shutil.copy(FIXTURES / "compiled_tinynet.pth", folder / "compiled.pth")  # torch.compile's _orig_mod.
    # saved from cuda:1, as a GPU job writes it (made by the tool itself: no GPU here)
    ckptfix.convert(folder / "ddp.pth", folder / "gpu.pth", ckptfix.ConvertOptions(map_location="cuda:1"))
    mypkg = types.ModuleType("mypkg")

    @dataclasses.dataclass
    class Optim:
        lr: float = 3e-4

    Optim.__module__, Optim.__qualname__ = "mypkg", "Optim"
    mypkg.Optim = Optim  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mypkg", mypkg)
    # a real DeepSpeed ZeRO-2 run folder (docs/deepspeed.md), with a second step for --tag
    shutil.copytree(FIXTURES / "deepspeed" / "z2_bf16_w2", folder / "ds_run")
    shutil.copytree(folder / "ds_run" / "global_step2", folder / "ds_run" / "global_step1000")
    hparams = {"cfg": OmegaConf.create({"lr": 0.1, "warmup": "${lr}"}), "optim": Optim()}
    torch.save(lightning_style(hparams), folder / "train.ckpt")
    monkeypatch.delitem(sys.modules, "mypkg")


def _glob(folder: Path, pattern: str) -> list[str]:
    """A word with ``*`` expanded as the shell would, in ``folder`` (the word itself if nothing matches)."""
    return sorted(str(p.relative_to(folder)) for p in folder.glob(pattern)) or [pattern]


def _averaging_workspace(folder: Path) -> None:
    """What docs/average.md's examples name: three timm-style epochs (``state_dict`` and
    ``state_dict_ema``, other weights each), a run folder of two, the same weights as safetensors,
    shards and .pth, and two DeepSpeed run folders."""
    for epoch in (8, 9, 10):
        torch.manual_seed(epoch)
        sd, ema = TinyNet().state_dict(), TinyNet().state_dict()
        torch.save({"epoch": epoch, "state_dict": sd, "state_dict_ema": ema}, folder / f"ep{epoch}.pth")
    (folder / "run").mkdir()
    for n in (1, 2):
        shutil.copy(folder / f"ep{8 + n}.pth", folder / "run" / f"ckpt-{n}.pth.tar")
    bare = FIXTURES / "bare_tinynet.pth"
    ckptfix.convert(bare, folder / "a.safetensors")
    ckptfix.convert(bare, folder / "b", ckptfix.ConvertOptions(max_shard_size="1KB"))
    shutil.copy(bare, folder / "c.pth")
    for run in ("ds_run1", "ds_run2"):
        shutil.copytree(FIXTURES / "deepspeed" / "z2_bf16_w2", folder / run)


def test_the_averaging_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/average.md's Python block as written, on the files it names."""
    [block] = _code_blocks("python", PAGES["docs/average.md"])
    _averaging_workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    names: dict[str, object] = {}
    exec(compile(block, "docs/average.md (Python API)", "exec"), names)
    from safetensors.torch import load_file

    emas = [torch.load(tmp_path / f"ep{e}.pth", weights_only=True)["state_dict_ema"] for e in (8, 9, 10)]
    written = load_file(tmp_path / "avg.safetensors")
    assert written.keys() == emas[0].keys()
    for key, first in emas[0].items():
        if first.is_floating_point():  # (1·a + 1·b + 2·c) / 4 in float64, cast back
            mean = (emas[0][key].double() + emas[1][key].double() + 2 * emas[2][key].double()) / 4
            assert torch.equal(written[key], mean.to(first.dtype)), key
        else:  # counters: the last input's
            assert torch.equal(written[key], emas[2][key]), key


def _shown_outputs() -> list[tuple[str, str]]:
    """(command, the output the README shows for it): a one-line unlabelled block followed by a
    ``text`` block, in the README's numbered problems."""
    pairs = []
    for match in re.finditer(r"```\n(ckptfix [^\n]*)\n```\n\n```text\n(.*?)```", PAGES["README.md"], re.S):
        pairs.append((match.group(1), match.group(2)))
    return pairs


def test_the_readme_shows_the_output_each_problem_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The five problems, run as written: what each prints is what the README shows (``…`` stands
    for a hash)."""
    shown = _shown_outputs()
    assert len(shown) == 5, shown
    for number, (command, output) in enumerate(shown):
        folder = tmp_path / str(number)
        folder.mkdir()
        _workspace(folder, monkeypatch)
        result = invoke_cli(*shlex.split(command)[1:], cwd=folder)
        assert result.returncode == 0, (command, result.stderr)
        for line in output.strip().splitlines():
            pattern = ".*?".join(re.escape(part) for part in line.split("…"))
            assert re.fullmatch(pattern, result.stdout.strip()), (command, line, result.stdout)


@pytest.mark.parametrize("line", EXAMPLES)
def test_every_example_command_line_runs(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line in a fresh folder holding the files it names; `a && b` in order, each exit 0;
    `fixtures/...` is the checkout's, `/tmp/` the test's folder, `pip install` is skipped."""
    _workspace(tmp_path, monkeypatch)
    (tmp_path / "fixtures").symlink_to(FIXTURES)
    ran = 0
    for command in line.split(" && "):
        words = shlex.split(command.replace("/tmp/", f"{tmp_path}/"), comments=True)
        if words[:2] == ["ckptfix", "average"]:
            _averaging_workspace(tmp_path)
        words = [w for word in words for w in (_glob(tmp_path, word) if "*" in word else [word])]  # as a shell
        if words[:2] == ["pip", "install"]:
            continue
        assert words[0] == "ckptfix", f"not a ckptfix command: add it to NOT_RUN with a reason: {command}"
        result = invoke_cli(*words[1:], cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
        ran += 1
    assert ran, line
    if "train.ckpt out.ckpt --sanitize" in line:  # "plain data: loads with weights_only=True"
        assert torch.load(tmp_path / "out.ckpt", weights_only=True)["hyper_parameters"]["optim"] == {"lr": 3e-4}
    if "--select state_dict" in line and "train.ckpt" in line:  # "the weights only"
        assert set(torch.load(tmp_path / "out.pth", weights_only=True)) == {
            "model.0.weight",
            "model.0.bias",
            "model.1.weight",
        }


def test_the_example_checkpoint_with_configs_needs_one_of_the_three_ways_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _workspace(tmp_path, monkeypatch)
    refused = invoke_cli("strip-module", "train.ckpt", "out.ckpt", cwd=tmp_path)
    assert refused.returncode == 3 and not (tmp_path / "out.ckpt").exists(), refused.stderr
    for way_out in ("--allow-global 'omegaconf.*'", "--allow-global mypkg.Optim", "--sanitize", "--select state_dict"):
        assert way_out in refused.stderr, (way_out, refused.stderr)


def test_the_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python block as written, on the files it names (`model` is the bare TinyNet)."""
    block = _code_blocks("python", PAGES["README.md"])
    assert len(block) == 1
    shutil.copy(FIXTURES / "dataparallel_tinynet.pth", tmp_path / "ddp.pth")
    shutil.copy(FIXTURES / "ddp_cpu_tinynet.pth", tmp_path / "ddp_8gpu.pth")
    shutil.copy(FIXTURES / "lightning_tinynet.ckpt", tmp_path / "train.ckpt")
    monkeypatch.chdir(tmp_path)
    names: dict[str, object] = {"model": TinyNet()}
    exec(compile(block[0], "README.md (Python API)", "exec"), names)
    assert torch.load("bare.pth", weights_only=True).keys() == TinyNet().state_dict().keys()
    assert torch.load("bare2.pth", weights_only=True).keys() == TinyNet().state_dict().keys()
    assert isinstance(names["sd"], dict) and json.loads(json.dumps(names["info"]))["format"] == "torch-zip"
    assert names["report"].stripped == ["module."] and not names["report"].missing  # type: ignore[attr-defined]


# -- options, hooks, completion, exit codes --------------------------------------------------------

#: `--options` the README names that are not ckptfix's own, each with why
NOT_CKPTFIX_OPTIONS = {
    "--all-files": "pre-commit try-repo's",
    "--index-url": "pip's (torch's CPU build)",
    "--help": "click adds it to every command",
    # docs/remote.md's multi-process examples: torchrun's and SLURM srun's own options
    **dict.fromkeys(
        ["--standalone", "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"], "torchrun's"
    ),
    **dict.fromkeys(["--nodes", "--ntasks-per-node"], "SLURM srun's"),
    **dict.fromkeys(["--release", "--offline", "--all-targets"], "cargo's (docs/engine.md: building the native core)"),
}


def _options(command: Any) -> set[str]:
    return {o for p in command.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}


def test_every_option_the_readme_names_exists() -> None:
    from ckptfix.cli import cli

    known = _options(cli).union(*(_options(c) for c in cli.commands.values()))
    mentioned = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", README))
    assert mentioned - known - set(NOT_CKPTFIX_OPTIONS) == {"--expect"}  # `--expect-…`, the family


def test_every_option_in_a_command_table_row_is_that_commands() -> None:
    from ckptfix.cli import cli

    rows = re.findall(r"^\| `ckptfix ([a-z-]+)(.*)$", _section("## Commands"), re.M)
    assert len(rows) == len(cli.commands)
    # verify's row names the writing option each expectation is named after (`--dtype`...)
    named_after = {"verify": {"--dtype", "--map-location", "--expect"}}
    for name, row in rows:
        options = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", row))
        assert options - _options(cli.commands[name]) - named_after.get(name, set()) - {"--help"} == set(), name


def test_inspect_reads_no_tensor_data_and_verify_reads_all_of_it(tmp_path: Path) -> None:
    """One byte of a tensor record flipped: inspect (no tensor data read) does not notice; verify's
    CRC32 of every record does."""
    data = bytearray((FIXTURES / "bare_tinynet.pth").read_bytes())
    with zipfile.ZipFile(FIXTURES / "bare_tinynet.pth") as archive:
        record = archive.getinfo("bare_tinynet/data/0")
    name_len, extra_len = struct.unpack_from("<HH", data, record.header_offset + 26)
    data[record.header_offset + 30 + name_len + extra_len] ^= 0xFF
    (tmp_path / "flipped.pth").write_bytes(data)
    inspected = invoke_cli("inspect", tmp_path / "flipped.pth", "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["tensors"] == 9, inspected.stderr
    verified = invoke_cli("verify", tmp_path / "flipped.pth")
    assert verified.returncode == 1 and "CRC32" in verified.stdout + verified.stderr


def test_the_pre_commit_hooks_are_the_ones_the_readme_names() -> None:
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text()
    section = _section("### pre-commit")
    ids = re.findall(r"^- id: (\S+)", hooks, re.M)
    assert ids == ["ckptfix-verify", "ckptfix-scan"] and all(f"id: {i}" in section for i in ids)
    assert re.findall(r"^  entry: (.*)$", hooks, re.M) == ["ckptfix verify", "ckptfix scan"]
    (pattern,) = re.findall(r"`files: (.*?)`", section)
    assert re.findall(r"^  files: (.*)$", hooks, re.M) == [pattern, pattern]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_is_clicks(shell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import click.shell_completion

    # bash's script first runs `bash --version` (a process, not for this tier) to warn about bash < 4.4
    monkeypatch.setattr(click.shell_completion.BashComplete, "_check_version", lambda self: None)
    assert f"_CKPTFIX_COMPLETE={shell}_source ckptfix" in README or f"`{shell}_source`" in README
    result = invoke_cli(env={"_CKPTFIX_COMPLETE": f"{shell}_source"})
    assert result.returncode == 0 and "_CKPTFIX_COMPLETE" in result.stdout and "ckptfix" in result.stdout


def test_exit_codes_2_and_4_as_the_table_lists_them(tmp_path: Path) -> None:
    ddp, out = FIXTURES / "dataparallel_tinynet.pth", tmp_path / "out.pth"
    usage = {
        "OUT = IN without --in-place": ["strip-module", ddp, ddp],
        "--allow-global not a dotted name": ["convert", ddp, out, "--allow-global", "os system"],
        "--model not importable": ["fit", ddp, out, "--model", "no_such_module_here:build"],
        "bad option": ["strip-module", ddp, out, "--no-such-option"],
    }
    for why, args in usage.items():
        result = invoke_cli(*args)
        assert result.returncode == 2 and not out.exists(), (why, result.stderr)
    out.write_bytes(b"precious")
    cannot_write = {
        "exists, no --force": ["strip-module", ddp, out],
        "folder missing": ["strip-module", ddp, tmp_path / "no" / "such" / "out.pth"],
    }
    for why, args in cannot_write.items():
        result = invoke_cli(*args)
        assert result.returncode == 4 and len(result.stderr.splitlines()) == 1, (why, result.stderr)
    assert out.read_bytes() == b"precious"


# -- formats written, safetensors metadata, --json documents ---------------------------------------


def test_a_folder_output_is_shards_plus_an_index_unless_one_shard_holds_it(tmp_path: Path) -> None:
    bare = FIXTURES / "bare_tinynet.pth"
    assert invoke_cli("convert", bare, f"{tmp_path}/one/").returncode == 0
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    assert invoke_cli("convert", bare, f"{tmp_path}/pth/", "--format", "pth").returncode == 0
    assert sorted(p.name for p in (tmp_path / "pth").iterdir()) == ["pytorch_model.bin"]
    # 100 B: conv1.weight (432 B) is larger than the limit and gets a shard of its own
    assert invoke_cli("convert", bare, f"{tmp_path}/many/", "--max-shard-size", "100B").returncode == 0
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(index.values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [k for k, v in index.items() if v == index["conv1.weight"]] == ["conv1.weight"]


def test_max_shard_size_units_are_the_hubs() -> None:
    from ckptfix.fileio.sizes import parse_size

    assert "`2GB` = 2·10⁹ bytes, `2GiB` = 2·2³⁰" in README
    assert (parse_size("2GB"), parse_size("2GiB")) == (2 * 10**9, 2 * 2**30)


def test_keep_metadata_keeps_strings_whole_and_json_values_up_to_1_kib(tmp_path: Path) -> None:
    from safetensors import safe_open

    small = {"lr": 0.001}
    torch.save({"w": torch.ones(2), "epoch": 3, "note": "x" * 5000, "cfg": small}, tmp_path / "a.pth")
    result = invoke_cli("convert", tmp_path / "a.pth", tmp_path / "a.safetensors", "--keep-metadata")
    assert result.returncode == 0, result.stderr
    with safe_open(tmp_path / "a.safetensors", "np") as f:
        metadata = f.metadata()
    assert metadata["epoch"] == "3" and metadata["note"] == "x" * 5000 and json.loads(metadata["cfg"]) == small
    torch.save({"w": torch.ones(2), "cfg": {"a": "y" * 1100}}, tmp_path / "big.pth")  # > 1 KiB as JSON
    refused = invoke_cli("convert", tmp_path / "big.pth", tmp_path / "big.safetensors", "--keep-metadata")
    assert refused.returncode == 3 and "cfg (a dict of 1 entries)" in refused.stderr and "--drop cfg" in refused.stderr


def test_the_batch_json_example_has_the_fields_a_run_prints(tmp_path: Path) -> None:
    example = json.loads(next(b for b in _code_blocks("json") if '"counts"' in b))
    (tmp_path / "ckpts").mkdir()
    shutil.copy(FIXTURES / "dataparallel_tinynet.pth", tmp_path / "ckpts" / "a.pth")
    result = invoke_cli("strip-module", "ckpts/a.pth", "-o", "fixed/", "--json", cwd=tmp_path)
    document = json.loads(result.stdout)
    assert document.keys() == example.keys() and document["counts"].keys() == example["counts"].keys()
    assert document["files"][0].keys() == example["files"][0].keys()
    assert document["files"][0]["output"] == "fixed/a.pth" and document["files"][0]["status"] == "written"


def test_the_json_error_example_matches_a_writing_commands_error(tmp_path: Path) -> None:
    example = json.loads(next(b for b in _code_blocks("json") if '"error": {' in b))["error"]
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, tmp_path / "cfg.pth")
    result = invoke_cli("convert", "cfg.pth", "out.pth", "--json", cwd=tmp_path)
    error = json.loads(result.stdout)["error"]
    assert result.returncode == 3 and "argparse.Namespace" in error["message"]
    assert error["message"].split(":")[0] == example["message"].split(":")[0] == "cfg.pth"
    assert error["message"].split(": ")[1] == example["message"].split(": ")[1]
    assert error["type"] == example["type"] and error["hint"].startswith(example["hint"].split("...")[0])
