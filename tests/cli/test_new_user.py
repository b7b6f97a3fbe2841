"""Issue 23, the path a new user walks: real checkpoints handled the way people expect, and
errors that name the file and the fix (each test failed before its fix)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, invoke_cli

COMPILED = FIXTURES / "compiled_tinynet.pth"
COMPILE_DDP = FIXTURES / "compile_ddp_tinynet.pth"
BARE = FIXTURES / "bare_tinynet.pth"


# ----------------------------------------------------------------------------- torch.compile


def test_strip_module_names_the_compile_prefix_and_auto_strips_any_nesting(tmp_path: Path) -> None:
    plain = invoke_cli("strip-module", COMPILED, tmp_path / "same.pth")
    assert plain.returncode == 0
    assert f"strip-module {COMPILED} {tmp_path / 'same.pth'} --prefix auto" in plain.stderr
    assert "'_orig_mod.' (torch.compile)" in plain.stderr
    bare = list(torch.load(BARE, weights_only=True))
    for source in (COMPILED, COMPILE_DDP):
        out = tmp_path / f"auto_{source.name}"
        result = invoke_cli("strip-module", source, out, "--prefix", "auto")
        assert result.returncode == 0, result.stderr
        assert list(torch.load(out, weights_only=True)) == bare
    # order-independent: module._orig_mod. as well as _orig_mod.module.
    swapped = {k.replace("_orig_mod.module.", "module._orig_mod."): v for k, v in torch.load(COMPILE_DDP).items()}
    torch.save(swapped, tmp_path / "swapped.pth")
    result = invoke_cli("strip-module", tmp_path / "swapped.pth", tmp_path / "s.pth", "--prefix", "auto")
    assert result.returncode == 0 and list(torch.load(tmp_path / "s.pth", weights_only=True)) == bare


def test_strip_module_help_says_what_it_does_when_nothing_matches() -> None:
    text = invoke_cli("strip-module", "--help").stdout
    assert "writes nothing when no key has the prefix" not in text
    assert "--prefix auto" in text


# ----------------------------------------------------------------------------- state-dict detection


def _param_store_checkpoint(tmp_path: Path) -> Path:
    """A released package's shape: a model state dict with one nested non-tensor entry."""
    path = tmp_path / "pyro.pth"
    model = {"a.weight": torch.ones(2, 2), "a.bias": torch.zeros(2), "guide._param_store": {"params": {}, "c": {}}}
    torch.save({"model": model, "epoch": 3}, path)
    return path


def test_state_dict_with_a_nested_non_tensor_entry_is_found(tmp_path: Path) -> None:
    src = _param_store_checkpoint(tmp_path)
    added = invoke_cli("add-module", src, tmp_path / "added.pth")
    assert added.returncode == 0, added.stderr
    assert list(torch.load(tmp_path / "added.pth", weights_only=True)["model"])[:2] == [
        "module.a.weight",
        "module.a.bias",
    ]
    # safetensors: the refusal names the entry and the --drop that works; publish finds the weights
    out = tmp_path / "w.safetensors"
    refused = invoke_cli("convert", src, out, "--select", "model")
    assert refused.returncode == 3 and not out.exists()
    assert str(src) in refused.stderr and "guide._param_store (a dict of 2 entries)" in refused.stderr
    assert "--drop guide._param_store" in refused.stderr
    published = invoke_cli("publish", src, tmp_path / "rel", "--drop", "guide._param_store", "--json")
    assert published.returncode == 0, published.stderr
    from safetensors.torch import load_file

    assert set(load_file(json.loads(published.stdout)["output"])) == {"a.weight", "a.bias"}


def test_explicit_select_is_honoured_whatever_else_the_mapping_holds(tmp_path: Path) -> None:
    many = {"a.weight": torch.ones(2), **{f"note{i}": i for i in range(8)}}
    torch.save({"model": many}, tmp_path / "many.pth")
    result = invoke_cli("add-module", tmp_path / "many.pth", tmp_path / "out.pth", "--select", "model")
    assert result.returncode == 0, result.stderr
    assert "module.a.weight" in torch.load(tmp_path / "out.pth", weights_only=True)


# ----------------------------------------------------------------------------- one value, not a mapping


def test_a_bare_tensor_numpy_array_or_namespace_to_safetensors_is_explained(tmp_path: Path) -> None:
    import argparse

    import numpy as np

    torch.save(torch.arange(6.0).reshape(2, 3), tmp_path / "t.pth")
    torch.save(np.arange(4, dtype=np.float32), tmp_path / "a.pth")
    torch.save(argparse.Namespace(lr=0.1), tmp_path / "ns.pth")
    expected = {
        "t.pth": ("a tensor float32 [2, 3] on cpu", "--tensor-name KEY"),
        "a.pth": ("a numpy array", "--sanitize --tensor-name KEY"),
        "ns.pth": ("an argparse.Namespace", "write a .pth file"),
    }
    for name, (holds, fix) in expected.items():
        result = invoke_cli("convert", tmp_path / name, tmp_path / "out.safetensors")
        assert result.returncode == 3, result.stderr
        assert f"{tmp_path / name}: safetensors holds named tensors, but this holds {holds}" in result.stderr
        assert fix in result.stderr and "TensorRef" not in result.stderr and "OpaqueObject" not in result.stderr
    from safetensors.torch import load_file

    for name, extra in (("t.pth", []), ("a.pth", ["--sanitize"])):
        out = tmp_path / f"{name}.safetensors"
        result = invoke_cli("convert", tmp_path / name, out, "--tensor-name", "weight", *extra)
        assert result.returncode == 0, result.stderr
        assert list(load_file(out)) == ["weight"]


# ----------------------------------------------------------------------------- errors and reports


def test_errors_name_the_file_and_input_problems_are_exit_3(tmp_path: Path) -> None:
    result = invoke_cli("convert", BARE, tmp_path / "o.safetensors", "--select", "state_dict")
    assert result.returncode == 3 and f"error: {BARE}: --select state_dict: no such entry" in result.stderr
    out = tmp_path / "exists.pth"
    out.write_bytes(b"x")
    missing = invoke_cli("strip-module", tmp_path / "missing.pth", out)
    assert missing.returncode == 3 and "missing.pth: no such file" in missing.stderr, missing.stderr
    device = invoke_cli("verify", BARE, "--expect-device", "gpu")  # named after the option given
    assert device.returncode == 2 and "invalid device 'gpu' in --expect-device" in device.stderr


def test_a_format_conversion_counts_as_written(tmp_path: Path) -> None:
    result = invoke_cli("strip-module", BARE, tmp_path / "bare.safetensors", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["written"] and not report["unchanged"]
    same = json.loads(invoke_cli("strip-module", BARE, tmp_path / "bare.pth", "--json").stdout)
    assert same["written"] and same["unchanged"]


def test_publish_cuts_only_checkpoint_extensions(tmp_path: Path) -> None:
    src = tmp_path / "net_0.3.0_e29.pth.tar"
    src.write_bytes(BARE.read_bytes())
    result = invoke_cli("publish", src, tmp_path / "rel", "--json")
    assert result.returncode == 0, result.stderr
    assert Path(json.loads(result.stdout)["output"]).name.startswith("net_0.3.0_e29-")


# ----------------------------------------------------------------------------- inspect and meta tensors


def test_inspect_says_what_it_leaves_out_and_json_is_complete(tmp_path: Path) -> None:
    torch.save({"a": {f"k{i}": i for i in range(70)}, "epoch": 7}, tmp_path / "many.pth")
    text = invoke_cli("inspect", tmp_path / "many.pth")
    assert text.returncode == 0 and "… 11 more entries (--full shows every one" in text.stdout
    assert "epoch" not in text.stdout
    full = invoke_cli("inspect", tmp_path / "many.pth", "--full")
    assert "  epoch: int: 7" in full.stdout and "more entries" not in full.stdout
    tree = json.loads(invoke_cli("inspect", tmp_path / "many.pth", "--json").stdout)["tree"]
    assert len(tree) == 71 and tree[-1] == {"path": "epoch", "kind": "int", "value": "7"}


def test_meta_tensors_are_shown_failed_by_verify_and_not_remapped(tmp_path: Path) -> None:
    torch.save(torch.nn.Linear(3, 3, device="meta").state_dict(), tmp_path / "meta.pth")
    shown = invoke_cli("inspect", tmp_path / "meta.pth")
    assert "tensors: 2 in 0 storages, 0 B of tensor data; 2 on meta, with no data" in shown.stdout
    assert "devices: meta x2" in shown.stdout and "state dict: 2 tensors on meta" in shown.stdout
    verified = invoke_cli("verify", tmp_path / "meta.pth")
    assert verified.returncode == 1 and "on the meta device and hold no data" in verified.stderr
    expected = invoke_cli("verify", tmp_path / "meta.pth", "--expect-device", "cpu", "--json")
    problems = json.loads(expected.stdout)["files"][0]["problems"]
    assert "tensors on meta (no data), expected all on cpu" in problems
    remapped = invoke_cli("remap", tmp_path / "meta.pth", tmp_path / "out.pth", "--map-location", "cpu")
    assert remapped.returncode == 3 and "no data to move" in remapped.stderr and not (tmp_path / "out.pth").exists()


def test_diff_compares_values_across_dtypes_and_tolerances_decide(tmp_path: Path) -> None:
    full = {"w": torch.linspace(-2, 2, 50), "b": torch.arange(4.0), "n": torch.arange(3)}
    torch.save(full, tmp_path / "f32.pth")
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in full.items()}, tmp_path / "f16.pth")
    exact = invoke_cli("diff", tmp_path / "f32.pth", tmp_path / "f16.pth", "--json")
    report = json.loads(exact.stdout)
    assert exact.returncode == 1 and report["mismatched"] == []
    assert {c["path"]: c["b"] for c in report["dtype_changed"]} == {"w": "float16", "b": "float16"}
    assert [d["path"] for d in report["different"]] == ["w"]  # 0..3 are exact in float16
    assert 0 < report["different"][0]["max_abs_diff"] < 1e-3
    close = invoke_cli("diff", tmp_path / "f32.pth", tmp_path / "f16.pth", "--rtol", "1e-3")
    assert close.returncode == 0, close.stdout
    assert "dtypes differ (values compared across them): 2 float32 -> float16" in close.stdout


# ----------------------------------------------------------------------------- colour


class _Terminal:
    def isatty(self) -> bool:
        return True


def test_colour_on_terminals_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptfix.cli import render

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert render.use_colour(_Terminal()) and not render.use_colour(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not render.use_colour(_Terminal())
    monkeypatch.delenv("NO_COLOR")
    render.allow_colour(False)  # a --json run
    try:
        assert not render.use_colour(_Terminal())
    finally:
        render.allow_colour(True)
    monkeypatch.setattr(render.sys, "stdout", _TerminalText())
    render.say("FAIL x.pth: broken")
    assert render.sys.stdout.getvalue() == "\x1b[31m\x1b[1mFAIL\x1b[0m x.pth: broken\n"
    # in a pipe (what invoke_cli gives) no escape sequence is ever printed
    piped = invoke_cli("verify", FIXTURES / "torchscript_tinynet.pt", BARE)
    assert piped.returncode == 1 and "FAIL" in piped.stderr and "\x1b[" not in piped.stderr + piped.stdout


class _TerminalText(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_dash_reads_stdin_and_writes_stdout(tmp_path: Path) -> None:
    from safetensors.torch import load

    data = (FIXTURES / "dataparallel_tinynet.pth").read_bytes()
    shown = invoke_cli("inspect", "-", stdin=data)
    assert shown.returncode == 0 and shown.stdout.startswith("<stdin>: a torch checkpoint in the zip format")
    piped = invoke_cli("strip-module", "-", "-", "--format", "safetensors", stdin=data)
    assert piped.returncode == 0 and "wrote <stdout>" in piped.stderr
    assert set(load(piped.stdout_bytes)) == set(torch.load(BARE, weights_only=True))
    empty = invoke_cli("convert", "-", tmp_path / "out.pth", stdin=b"")
    assert empty.returncode == 3 and "<stdin>: an empty file" in empty.stderr and not (tmp_path / "out.pth").exists()
    no_format = invoke_cli("convert", BARE, "-")
    assert no_format.returncode == 2 and "--format" in no_format.stderr and no_format.stdout_bytes == b""


def test_dash_gates_stdin_in_scan_and_verify(tmp_path: Path) -> None:
    """The CI gates read a piped file too (``curl ... | ckptfix scan -``), naming it <stdin>."""
    from hostile import make_base_zip, system_call, with_data_pkl

    clean = (FIXTURES / "dataparallel_tinynet.pth").read_bytes()
    hostile = with_data_pkl(make_base_zip(tmp_path), system_call(tmp_path / "ran"), tmp_path / "evil.pth")
    scanned = invoke_cli("scan", "-", "--json", stdin=clean)
    assert scanned.returncode == 0 and json.loads(scanned.stdout)["files"][0]["input"] == "<stdin>"
    caught = invoke_cli("scan", "-", stdin=hostile.read_bytes())
    assert caught.returncode == 1 and "<stdin>" in caught.stdout and "os.system" in caught.stdout
    verified = invoke_cli("verify", "-", "--expect-no-prefix", stdin=clean)
    assert verified.returncode == 1 and "<stdin>" in verified.stdout + verified.stderr
    assert invoke_cli("verify", "-", stdin=clean).returncode == 0


def test_the_progress_line_is_cleared_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfix.cli import render

    terminal, pipe = _TerminalText(), io.StringIO()
    monkeypatch.setattr(render.sys, "stderr", terminal)
    render.clear_progress_line()  # before an error line: the bar's line is erased, not shared
    monkeypatch.setattr(render.sys, "stderr", pipe)
    render.clear_progress_line()
    assert terminal.getvalue() == "\r\x1b[2K" and pipe.getvalue() == ""
