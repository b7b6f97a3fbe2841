"""The writing commands as one table and one runner: IN OUT is a batch of one, so ``-q`` and the
batch-only options mean the same (or are refused) in both forms. In-process (``cli.main``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_same_checkpoint

from ckptfix.cli import WRITE_COMMANDS, cli, main


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.fixture
def ddp(tmp_path: Path) -> Path:
    path = tmp_path / "ddp.pth"
    torch.save({"module.w": torch.arange(4.0), "module.b": torch.zeros(2)}, path)
    return path


def test_every_row_is_a_registered_command_with_an_example() -> None:
    for spec in WRITE_COMMANDS:
        command = cli.commands[spec.name]
        assert command.help == spec.help
        assert f"ckptfix {spec.name} " in spec.help, f"{spec.name}: --help needs an example"
        names = {p.name for p in command.params}
        assert {"paths", "output_dir", "jobs", "quiet", "as_json", "dry_run", "in_place"} <= names


def test_quiet_in_in_out_form_prints_nothing_on_success(capsys: pytest.CaptureFixture[str], ddp: Path) -> None:
    out_path = ddp.with_name("bare.pth")
    code, out, err = run(capsys, "strip-module", ddp, out_path, "-q")
    assert (code, out, err) == (0, "", "")
    assert list(torch.load(out_path, weights_only=True)) == ["w", "b"]
    code, out, err = run(capsys, "strip-module", ddp, ddp.with_name("b2.pth"))
    assert code == 0 and out.startswith("wrote ") and err == ""  # without -q it says what it did


@pytest.mark.parametrize("flag", [["-j", "2"], ["--jobs", "1"], ["--continue-on-error"], ["--recursive"]])
def test_batch_options_with_in_out_are_a_usage_error(
    capsys: pytest.CaptureFixture[str], ddp: Path, flag: list[str]
) -> None:
    out_path = ddp.with_name("bare.pth")
    code, _, err = run(capsys, "strip-module", ddp, out_path, *flag)
    assert code == 2 and "IN OUT names one file" in err and err.count("\n") == 1
    assert not out_path.exists()


def test_backup_without_in_place_is_a_usage_error(capsys: pytest.CaptureFixture[str], ddp: Path) -> None:
    code, _, err = run(capsys, "strip-module", ddp, ddp.with_name("bare.pth"), "--backup", ".orig")
    assert code == 2 and "--backup goes with --in-place" in err


def test_errors_in_in_out_form_are_one_line_with_their_exit_code(
    capsys: pytest.CaptureFixture[str], ddp: Path, tmp_path: Path
) -> None:
    code, out, err = run(capsys, "strip-module", tmp_path / "missing.pth", tmp_path / "o.pth")
    assert code == 3 and out == "" and err.startswith("ckptfix: error: ") and err.count("\n") == 1
    code, _, err = run(capsys, "strip-module", ddp, tmp_path / "no" / "such" / "o.pth")
    assert code == 4 and "does not exist" in err


def test_a_preset_refusal_is_a_usage_error(capsys: pytest.CaptureFixture[str], ddp: Path) -> None:
    assert run(capsys, "rename", ddp, ddp.with_name("r.pth"))[0] == 2
    assert run(capsys, "remap", ddp, ddp.with_name("r.pth"))[0] == 2


def test_nothing_to_change_names_every_requested_step(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The message is built from the steps: each one that changed nothing says why. OUT is
    still written (the input unchanged) unless --strict, and --in-place leaves the file alone."""
    path = tmp_path / "bare.pth"
    torch.save({"w": torch.ones(2)}, path)
    out = tmp_path / "out.pth"
    code, stdout, err = run(capsys, "rename", path, out, "--rule", "^nomatch=>x", "--strip-prefix", "model.")
    assert code == 0
    assert_same_checkpoint(out, path)
    assert "no key starts with 'model.'" in stdout and "no key matches the rename rules" in stdout
    assert stdout.rstrip().endswith("unchanged") and "is the input unchanged" in err
    code, _, err = run(capsys, "rename", path, tmp_path / "strict.pth", "--rule", "^nomatch=>x", "--strict")
    assert code == 1 and "no key matches the rename rules" in err and not (tmp_path / "strict.pth").exists()
    before = path.stat().st_mtime_ns
    code, stdout, _ = run(capsys, "rename", path, "--in-place", "--rule", "^nomatch=>x")
    assert code == 0 and path.stat().st_mtime_ns == before


def test_batch_with_nothing_to_change_still_fills_the_output_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ddp: Path
) -> None:
    import json

    bare = tmp_path / "bare.pth"
    torch.save({"w": torch.ones(2)}, bare)
    out_dir = tmp_path / "out"
    code, stdout, _ = run(capsys, "strip-module", ddp, bare, "-o", out_dir, "--json")
    document = json.loads(stdout)
    assert code == 0 and [f["status"] for f in document["files"]] == ["written", "unchanged"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["bare.pth", "ddp.pth"]
    assert all(Path(f["output"]).exists() for f in document["files"])


def test_max_shard_size_with_a_file_name_is_a_usage_error(capsys: pytest.CaptureFixture[str], ddp: Path) -> None:
    """OUT's kind is never guessed silently: not a folder called model.safetensors."""
    out = ddp.with_name("model.safetensors")
    code, _, err = run(capsys, "convert", ddp, out, "--max-shard-size", "1MB")
    assert code == 2 and "name the folder" in err and str(ddp.with_name("model")) + "/" in err
    assert not out.exists()


def test_json_on_error_is_one_object_on_stdout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A script reading --json from stdout always gets one JSON object, failure included."""
    import json

    for args in (
        ["inspect", tmp_path / "missing.pth", "--json"],
        ["strip-module", tmp_path / "missing.pth", tmp_path / "o.pth", "--json"],
        ["strip-module", tmp_path / "missing.pth", tmp_path / "o.pth", "--no-such-option", "--json"],
    ):
        code, out, err = run(capsys, *args)
        document = json.loads(out)
        assert document["schema_version"] == 2 and document["ok"] is False
        assert document["exit_code"] == code and code in (2, 3)
        assert document["error"]["message"] and err.count("\n") >= 1


@pytest.mark.parametrize(
    ("alias", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("half", torch.float16)]
)
def test_dtype_aliases(capsys: pytest.CaptureFixture[str], tmp_path: Path, alias: str, dtype: torch.dtype) -> None:
    src, out = tmp_path / "m.pth", tmp_path / "o.pth"
    torch.save({"w": torch.linspace(0, 1, 5)}, src)
    code, _, err = run(capsys, "convert", src, out, "--dtype", alias)
    assert code == 0, err
    assert torch.load(out, weights_only=True)["w"].dtype == dtype


def test_remap_to_safetensors_says_there_are_no_device_tags(capsys: pytest.CaptureFixture[str], ddp: Path) -> None:
    """safetensors has no device tags: remap says so and writes the weights unchanged, never
    claiming moves it cannot write."""
    import json

    out = ddp.with_name("w.safetensors")
    code, stdout, _ = run(capsys, "remap", ddp, out, "--map-location", "cuda:0", "--json")
    report = json.loads(stdout)
    # a format conversion is written, not "unchanged"
    assert code == 0 and out.exists() and report["device_moves"] == {} and not report["unchanged"] and report["written"]
    assert report["steps"] == [{"step": "--map-location cuda:0", "changed": False}]
    assert any("no device tags" in note for note in report["notes"])


def test_unchanged_output_never_carries_bytes_ckptfix_did_not_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With nothing to change, a .pth is rewritten from its checked records, not byte-copied: a
    record torch never reads stays out, as in any output."""
    import zipfile

    src = tmp_path / "a.pth"
    torch.save({"w": torch.ones(2)}, src)
    with zipfile.ZipFile(src, "a") as z:
        z.writestr(z.namelist()[0].split("/")[0] + "/extra.bin", b"SMUGGLED" * 8)
    out = tmp_path / "b.pth"
    code, _, err = run(capsys, "strip-module", src, out)
    assert code == 0 and "not written to outputs" in err
    assert b"SMUGGLED" not in out.read_bytes()
    assert_same_checkpoint(out, src)


def test_unchanged_safetensors_output_still_carries_the_hub_marker(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A byte copy only when the input already has {"format": "pt"}; otherwise it is written anew."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for metadata in (None, {"format": "pt"}):
        src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
        save_file({"w": torch.ones(2)}, src, metadata=metadata)
        out.unlink(missing_ok=True)
        assert run(capsys, "strip-module", src, out)[0] == 0
        with safe_open(out, "pt") as f:
            assert f.metadata() == {"format": "pt"}
        assert (out.read_bytes() == src.read_bytes()) == (metadata is not None)
