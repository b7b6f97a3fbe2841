"""ckptfix installs like a real tool: the sdist is complete (the suite runs from it), the sdist
and the wheel build without warnings and pass ``twine check``, and the pre-commit hooks work
through ``pre-commit try-repo`` (the metadata itself: ``tests/unit/test_distribution.py``).

The build and pre-commit tests take seconds each (marked ``packaging``: ``-m 'not packaging'``
leaves them out); they skip, saying why, where a tool is missing or the package index cannot be
reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT

packaging = pytest.mark.packaging

#: what pip prints when it cannot reach the index (the build backend or a dependency)
_OFFLINE = ("Could not find a version", "No matching distribution", "Failed to establish", "Temporary failure")


def _tracked(*folders: str) -> set[str]:
    """Files git knows (committed or new, not ignored) under ``folders``, relative to the root."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot list the files the sdist must hold")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", *folders],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    return {name for name in listed.split("\0") if name and (ROOT / name).is_file()}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """sdist and wheel built from this tree (without bytecode-suppressing env), and the log."""
    pytest.importorskip("build", reason="`build` is not installed (pip install build)")
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    try:  # without isolation when this environment has the build backend (no index needed)
        isolation = [] if int(version("setuptools").split(".")[0]) < 77 else ["--no-isolation"]
    except PackageNotFoundError:
        isolation = []
    # the sdist and the wheel built from it, as `python -m build` does by default
    result = subprocess.run(
        [sys.executable, "-m", "build", *isolation, "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    log = result.stdout + result.stderr
    if result.returncode and any(s in log for s in _OFFLINE):
        pytest.skip(f"the build backend could not be installed (no package index?): {log[-300:]}")
    assert result.returncode == 0, log
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' scratch folder
    return out, log


@packaging
def test_sdist_and_wheel_build_without_warnings(dist: tuple[Path, str]) -> None:
    out, log = dist
    noisy = [line for line in log.splitlines() if any(w in line.lower() for w in ("warning", "deprecat"))]
    assert not noisy, "\n".join(noisy)
    assert len(list(out.glob("ckptfix-*.tar.gz"))) == 1 and len(list(out.glob("ckptfix-*.whl"))) == 1


@packaging
def test_twine_check_passes(dist: tuple[Path, str]) -> None:
    pytest.importorskip("twine", reason="`twine` is not installed (pip install twine)")
    out, _ = dist
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, out.iterdir())], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@packaging
def test_sdist_holds_the_suite_and_it_runs_from_there(dist: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = dist
    (sdist,) = out.glob("ckptfix-*.tar.gz")
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(tmp_path, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: our own archive, just built
            archive.extractall(tmp_path)
    (tree,) = tmp_path.iterdir()
    shipped = {str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()}
    needed = _tracked("tests", "fixtures", "ckptfix", "docs") | {
        "LICENSE",
        "README.md",
        "pyproject.toml",
        ".pre-commit-hooks.yaml",
    }
    assert not needed - shipped, f"missing from the sdist: {sorted(needed - shipped)}"
    assert not [p for p in shipped if "__pycache__" in p or p.endswith(".pyc")]
    for name in ("conftest.py", "strategies.py"):
        assert f"tests/{name}" in shipped
    # a fast subset, from the unpacked tree and its own package (whatever the tests' layout; the
    # mypy run on a user's script is left out: it takes longer than the rest together)
    subset = [str(p.relative_to(tree)) for p in tree.glob("tests/**/test_layers.py")]
    subset += [str(p.relative_to(tree)) for p in tree.glob("tests/**/test_typing.py")]
    assert len(subset) == 2, subset
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *subset, "-k", "not type_checks"],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert (
        " passed" in run.stdout
        and str(tree)
        in subprocess.run(
            [sys.executable, "-c", "import ckptfix; print(ckptfix.__file__)"],
            capture_output=True,
            text=True,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
        ).stdout
    )


@packaging
def test_pre_commit_hooks_through_try_repo(tmp_path: Path) -> None:
    """A repository that commits a good checkpoint and a TorchScript archive (not a checkpoint,
    its pickle names code): both hooks fail on the archive and pass on the good file alone."""
    if shutil.which("pre-commit") is None and shutil.which("pre-commit", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("pre-commit is not installed (pip install pre-commit)")
    pre_commit = shutil.which("pre-commit", path=str(Path(sys.executable).parent)) or "pre-commit"
    git = [
        "git",
        "-c",
        "user.name=ckptfix",
        "-c",
        "user.email=ckptfix@example.invalid",
        "-c",
        "init.defaultBranch=main",
    ]
    # the hooks' repository: this tree as it is now (uncommitted edits too), one commit, so both
    # runs below share one installed environment
    hooks = tmp_path / "hooks"
    for name in _tracked():
        (hooks / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, hooks / name)
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(FIXTURES / "bare_tinynet.pth", user / "good.pth")
    shutil.copy(FIXTURES / "torchscript_tinynet.pt", user / "bad.pt")
    (user / "notes.txt").write_text("not a checkpoint: the hooks never see it\n")
    for repo in (hooks, user):
        subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
        subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "-m", "files"], cwd=repo, check=True)
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "cache"), "PRE_COMMIT_COLOR": "never"}

    def try_repo(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [pre_commit, "try-repo", str(hooks), *args], capture_output=True, text=True, cwd=user, env=env, timeout=300
        )
        if done.returncode and any(s in done.stdout + done.stderr for s in _OFFLINE):
            pytest.skip(f"pre-commit could not install the hooks (no package index?): {done.stdout[-300:]}")
        return done

    both = try_repo("--all-files")
    log = both.stdout + both.stderr
    assert both.returncode == 1, log
    assert "ckptfix verify" in log and "ckptfix scan" in log and log.count("Failed") == 2, log
    assert "DANGEROUS bad.pt" in log and "FAIL bad.pt" in log and "ok   good.pth" in log, log
    assert "notes.txt" not in log
    good = try_repo("--files", "good.pth")
    assert good.returncode == 0 and (good.stdout + good.stderr).count("Passed") == 2, good.stdout + good.stderr


@packaging
def test_the_wheel_is_one_per_platform_and_carries_the_native_core_built_from_the_sdist(dist: tuple[Path, str]) -> None:
    """``python -m build`` makes the wheel from the sdist, so a library in it was compiled from the
    sdist's ``native/`` sources; the library has no Python ABI (ctypes loads it), hence one
    ``py3-none-<platform>`` wheel for every Python 3 (docs/engine.md)."""
    import sysconfig
    import zipfile

    out, log = dist
    (wheel,) = out.glob("ckptfix-*.whl")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-py3-none-{platform}.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptfix/native/crc.py" in names
    if shutil.which("cargo") is None:
        assert "cargo not found" in log, log[-2000:]
        return
    (library,) = [n for n in names if n.startswith("ckptfix/native/") and "ckptfix_native" in n]
    assert library.rsplit("/", 1)[1] in ("libckptfix_native.so", "libckptfix_native.dylib", "ckptfix_native.dll")
    assert "Compiling ckptfix_native" in log or "Finished" in log, log[-2000:]
