"""Shared helpers: run the CLI (in-process or as a process), compare checkpoints the way torch sees them.

The suite has three tiers, one folder each, and this file enforces them:

* ``tests/unit/`` -- library calls only: no CLI, no process.
* ``tests/cli/`` -- the command line in-process (:func:`invoke_cli`: ``ckptfix.cli.main`` under
  click's ``CliRunner`` isolation), exit codes, stdout and stderr exactly as a user sees them.
* ``tests/e2e/`` -- only what needs a real process: the console script and ``python -m ckptfix``,
  signals, rlimits, "torch is never imported", inputs that may crash an interpreter or whose
  memory is measured (:func:`run_cli`, :func:`run_cli_batch`, or ``subprocess`` directly).

Spawning a process from outside ``tests/e2e/`` (through any API) and :func:`invoke_cli` from
``tests/unit/`` raise :class:`TierError`. The summary line ``subprocess spawns: N`` counts them.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings as _hypothesis_settings

if TYPE_CHECKING:  # the functions below import torch themselves: the xdist controller loads this
    # file too and runs no test, so it never imports torch (1.4 s of CPU before the workers start)
    import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(FIXTURES))

# The suite's own bytecode is cached even under PYTHONDONTWRITEBYTECODE=1 (set in some shells and
# sandboxes): without the cache every pytest process rewrites the asserts of every test module
# again (about 3.5 s of CPU per xdist worker), and every ckptfix process the tests start compiles
# the package again. Only these processes are changed (the variable stays set for their children,
# which read the caches written here); what is written goes to the git-ignored __pycache__ folders.
sys.dont_write_bytecode = False

# =========================================================================== tiers


class TierError(RuntimeError):
    """A test used a helper (or spawned a process) its tier does not allow."""


#: the test file being run (set around each test's setup, call and teardown, module fixtures included)
_current_test: Path | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _current_test
    _current_test = Path(item.path)
    yield
    _current_test = None


def current_tier() -> str | None:
    """``unit``, ``cli`` or ``e2e`` for the test now running (None outside tests or tiers)."""
    if _current_test is None:
        return None
    try:
        parts = _current_test.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in ("unit", "cli", "e2e") else None


def _require_tier(what: str, allowed: tuple[str, ...], hint: str) -> None:
    tier = current_tier()
    if tier not in allowed:
        where = _current_test.relative_to(ROOT) if _current_test else "outside a test"
        raise TierError(
            f"{what} is for tests under {' or '.join(f'tests/{t}/' for t in allowed)} only, "
            f"not {where} (tier {tier}): {hint}"
        )


#: the test files that take the most CPU (CPU seconds: user + system of the test's process and the
#: processes it waited for, summed by file, the larger of CI's two passes; measured on the 2-core CI
#: machine under load, so only their order matters). They are handed out first, longest first:
#: with --dist loadfile a worker takes the next file only when it is done with one, so a long file
#: taken last keeps one core busy while the other waits (pytest-xdist's own reordering, by number of
#: tests, put the 1-test fuzzers last; pyproject turns it off). Other files follow in the usual
#: order; a file missing here, or a stale figure, only costs balance, never a result.
SLOW_FILES = {
    "e2e/test_hostile_processes.py": 16,
    "cli/test_remote.py": 12.6,
    "cli/test_hostile_core.py": 9.8,
    "e2e/test_entry_points.py": 9.7,
    "unit/test_torch_matrix.py": 8,
    "unit/test_fuzz.py": 6.2,
    "cli/test_batch.py": 5.3,
    "unit/test_differential.py": 4.9,
    "unit/test_native_vm.py": 4.8,
    "unit/test_core_v2.py": 4.8,
    "e2e/test_crash_safety.py": 4.4,
    "unit/test_convert.py": 3.7,
    "unit/test_api.py": 3.7,
    "cli/test_surgery.py": 3.5,
    "unit/test_oracle.py": 3.4,
    "cli/test_review17.py": 3.4,
    "unit/test_numeric.py": 3.3,
    "cli/test_fuzz_cli.py": 3.2,
    "e2e/test_remote_interrupt.py": 2.8,
    "unit/test_native_emit.py": 2.7,
    "cli/test_config_objects.py": 2.5,
}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of :data:`SLOW_FILES` first, longest first (a stable sort: each file's tests stay
    together and in order; every worker sorts its collection the same way)."""

    def cost(item: pytest.Item) -> float:
        try:
            return SLOW_FILES.get(Path(item.path).relative_to(TESTS).as_posix(), 0)
        except ValueError:
            return 0

    items.sort(key=lambda item: -cost(item))
    if os.environ.get("CKPTFIX_ENGINE", "").strip().lower() == "native":
        once = pytest.mark.skip(reason=ONCE_REASON)
        for item in items:
            if item.get_closest_marker("engine_independent"):
                item.add_marker(once)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported and collected so far (torch, hypothesis, the test modules) lives until
    the end: freeze it, so the garbage collector stops re-scanning it (about 10 % of the run)."""
    import gc

    gc.collect()
    gc.freeze()


# --- every process spawned from pytest is counted, and refused outside tests/e2e/ ---------------

SPAWNS: Counter[str] = Counter()
_popen_init = subprocess.Popen.__init__


#: set by tests/oracle.py around starting its one long-lived child (torch, asked what it sees):
#: the one process any tier may start, counted under "oracle"
ORACLE_SPAWN = False


def _spawned_by_test_machinery() -> bool:
    """Outside any test, pytest-xdist starts its workers (execnet) and a worker asks
    ``platform.processor()`` (``uname -p``): those spawns are the runner's, not a test's."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        name = frame.f_globals.get("__name__", "")
        if name.startswith("execnet.") or name == "platform":
            return True
        frame = frame.f_back
    return False


def _counted_popen_init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    if ORACLE_SPAWN:
        SPAWNS["oracle"] += 1
        _popen_init(self, *args, **kwargs)
        return
    if _current_test is None and _spawned_by_test_machinery():  # pytest -n N's workers, their setup
        _popen_init(self, *args, **kwargs)
        return
    _require_tier(
        "spawning a process",
        ("e2e",),
        "run the command line in-process with invoke_cli, or move the test to tests/e2e/ if it needs a process",
    )
    SPAWNS[str(_current_test.relative_to(TESTS)) if _current_test else "?"] += 1
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _counted_popen_init  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under ``pytest -n N`` each worker hands its spawn counts to the controller's summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["spawns"] = dict(SPAWNS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    SPAWNS.update(getattr(node, "workeroutput", {}).get("spawns", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SPAWNS:
        files = ", ".join(f"{name} {count}" for name, count in sorted(SPAWNS.items()))
        terminalreporter.write_line(f"subprocess spawns: {sum(SPAWNS.values())} ({files})")
    else:
        terminalreporter.write_line("subprocess spawns: 0")


# =========================================================================== running the CLI


@dataclass
class CliResult:
    """What a user sees of one ``ckptfix`` run (the fields of ``subprocess.CompletedProcess``)."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    #: run_cli_batch only: the command's own wall time, the process's peak RSS after it, and
    #: whether ``torch`` was in ``sys.modules`` after it
    seconds: float = 0.0
    #: run_cli_batch only: the CPU time the command used (user + system, this process): what a
    #: test may bound, where wall time depends on how busy the machine is
    cpu_seconds: float = 0.0
    maxrss_mib: int | None = None
    torch_imported: bool | None = None
    #: invoke_cli only: stdout as bytes (a checkpoint written to OUT -)
    stdout_bytes: bytes = b""


class DeadlineExceeded(BaseException):
    """Raised in a command that runs too long (a BaseException: ckptfix's error handling cannot swallow it)."""


#: a blocked call uses no CPU: it is caught by wall time, this many times the CPU budget (at
#: least a minute), so a busy machine (other jobs on the cores) never fails a test
def _native_skip_reason() -> str | None:
    """Why the tests of the native engine do not run in this pass, or None when they do.

    CI runs the suite twice: ``CKPTFIX_ENGINE=native`` (where a missing library is an error,
    raised here at collection, never a skip) and ``CKPTFIX_ENGINE=python`` (where these tests,
    which compare the native engine with the Python one, have nothing new to say)."""
    from ckptfix import native

    if native.requested_engine() == "python":
        return "CKPTFIX_ENGINE=python: this pass tests the Python engine (the native pass runs these)"
    if native.library() is None:
        return "no native library in this install (cargo was not on PATH when it was installed)"
    return None


NATIVE_SKIP = _native_skip_reason()
#: for tests of the native engine itself (comparisons with the Python engine, its own inputs)
needs_native = pytest.mark.skipif(NATIVE_SKIP is not None, reason=NATIVE_SKIP or "")


# --- CI's two passes: the fuzzers' inputs split between them; engine-independent tests run once ---

#: which of CI's two passes this is (.ci/run runs the suite with CKPTFIX_ENGINE=native, then with
#: CKPTFIX_ENGINE=python): (index, passes). A run with CKPTFIX_ENGINE unset or ``auto`` (the
#: README's command, one pass) is pass 0 of 1 and runs everything.
PASS_INDEX, PASSES = {"native": (0, 2), "python": (1, 2)}.get(
    os.environ.get("CKPTFIX_ENGINE", "").strip().lower(), (0, 1)
)


def fuzz_share(total: int) -> int:
    """This pass's share of a fuzzer's ``total`` inputs: all of them in a single run, half in each
    of CI's two passes -- which draw different inputs (:func:`fuzz_seed`), so a CI run still feeds
    ``total`` distinct inputs in all, half through each engine."""
    return -(-total // PASSES)


def fuzz_seed(base: int) -> int:
    """The seed of this pass's inputs: ``base`` in a single run and in CI's first pass, another in
    its second (the same inputs again would add time and no coverage)."""
    return base + PASS_INDEX


def pass_seed(test: Any) -> Any:
    """For a hypothesis test whose examples are split between CI's two passes (its
    ``settings(max_examples=fuzz_share(N))``): in CI's passes, a seed of the pass's own (the "ci"
    profile derandomizes, so both passes would otherwise draw the same examples); in a single run,
    hypothesis's usual choice."""
    from hypothesis import seed

    return seed(fuzz_seed(20261125))(test) if PASSES > 1 else test


#: the reason engine-independent tests are skipped in CI's native pass (shown in the summary)
ONCE_REASON = (
    "engine-independent (never asks which engine runs; pyproject's engine_independent marker): "
    "run once, in the CKPTFIX_ENGINE=python pass"
)


#: the engine_independent test now running reached the engine choice (what it called, first seen)
_reached_engine: list[str] = []
_in_independent_test = False


def _watch_engine_choice() -> None:
    """Wrap ``ckptfix.native``'s ``library`` and ``requested_engine`` -- every engine-dependent path
    asks one of them -- so that an ``engine_independent`` test that reaches either fails (in the
    pass that runs it): the marker is checked on every run, not taken on trust."""
    from ckptfix import native

    for name in ("library", "requested_engine"):
        original = getattr(native, name)

        def watched(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if _in_independent_test and not _reached_engine:
                _reached_engine.append(f"ckptfix.native.{_name}()")
            return _original(*args, **kwargs)

        if hasattr(original, "cache_clear"):  # library is functools.cache'd; tests clear it
            watched.cache_clear = original.cache_clear  # type: ignore[attr-defined]
        for module in [m for n, m in sys.modules.items() if n.startswith("ckptfix.native") and m is not None]:
            if getattr(module, name, None) is original:
                setattr(module, name, watched)


_watch_engine_choice()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    """Watching starts with the test's setup (its fixtures count: a fixture that reads a checkpoint
    depends on the engine) and ends after its call (:func:`pytest_runtest_call`)."""
    global _in_independent_test
    _reached_engine.clear()
    _in_independent_test = item.get_closest_marker("engine_independent") is not None
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    global _in_independent_test
    try:
        result = yield
    finally:
        _in_independent_test = False
    if _reached_engine:
        pytest.fail(
            f"marked engine_independent, but it called {_reached_engine[0]}: it depends on the engine, "
            "so both of CI's passes must run it (drop the marker)",
            pytrace=False,
        )
    return result


WALL_FACTOR = 20


@contextlib.contextmanager
def deadline(seconds: float, what: str = "the command") -> Iterator[None]:
    """Interrupt in-process work that uses more than ``seconds`` of CPU time (work, not the wall
    clock: a loaded machine stretches wall time, not work), or that blocks for
    max(60, ``WALL_FACTOR`` x ``seconds``) seconds of wall time (opening a FIFO uses no CPU).
    SIGPROF and SIGALRM interrupt Python loops and blocking system calls alike."""

    def spent(signum: int, frame: Any) -> None:
        raise DeadlineExceeded(f"{what} still running after {seconds} s of CPU time")

    def blocked(signum: int, frame: Any) -> None:
        raise DeadlineExceeded(f"{what} still running (blocked) after {wall} s")

    wall = max(60.0, WALL_FACTOR * seconds)
    previous = signal.signal(signal.SIGPROF, spent), signal.signal(signal.SIGALRM, blocked)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, wall)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGPROF, previous[0])
        signal.signal(signal.SIGALRM, previous[1])


def _outside_the_environment(module: Any) -> bool:
    """A module imported from somewhere that is neither Python, site-packages nor ckptfix itself
    (``fit --model`` imports from test folders): dropped after an in-process run, as a process
    would forget it."""
    where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
    if not where:
        return False
    where = os.path.realpath(where)
    keep = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, ROOT / "ckptfix")}
    return not any(where == k or where.startswith(k + os.sep) for k in keep)


def invoke_cli(
    *args: Any,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 120,
    cwd: str | Path = ROOT,
    umask: int | None = None,
    sys_path_0: str | Path | None = None,
    stdin: bytes | None = None,
) -> CliResult:
    """``ckptfix ARGS`` in-process: the console script's own ``ckptfix.cli.main`` (which maps every
    exception to one stderr line and an exit code, then calls ``sys.exit``) under click's
    ``CliRunner`` isolation. Returns the real exit code, stdout and stderr, separately.

    An exception that escapes ``main`` (none should: an unexpected one is its exit 5) propagates
    into the test, never hidden in a result. Per run, as in a fresh process: ``cwd`` (the checkout,
    as ``python -m ckptfix`` was run from), ``env`` overrides, ``umask``, warnings printed to stderr
    under Python's default filters; afterwards the cwd, umask, ``sys.path``, signal handlers and
    environment are restored and modules imported from outside Python and ckptfix (``fit --model``)
    are forgotten. ``sys_path_0``: what ``sys.path[0]`` is during the run (``python -m`` puts the
    current folder there). ``timeout``: seconds of CPU time before the run is interrupted as a
    hang (a blocked run: see :func:`deadline`).
    ``stdin``: what the command reads from standard input.
    """
    _require_tier(
        "invoke_cli (the CLI in-process)",
        ("cli", "e2e"),
        "unit tests call the library; move CLI tests to tests/cli/",
    )
    import click.formatting
    from click.testing import CliRunner

    from ckptfix.cli import main

    # stderr apart from stdout: always so in click >= 8.2, which dropped mix_stderr
    separate = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner).parameters else {}
    runner = CliRunner(**separate)
    argv = [str(a) for a in args]
    saved_cwd, saved_path, saved_modules = os.getcwd(), list(sys.path), set(sys.modules)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved_umask = os.umask(umask) if umask is not None else None
    code: Any = None
    try:
        # stdout is not a terminal: click wraps help at COLUMNS, else shutil's fallback of 80 columns
        # (CliRunner would force 80, where a process piped to another wraps at 78)
        columns = {} if os.environ.get("COLUMNS") else {"COLUMNS": "80"}
        with runner.isolation(input=stdin, env={**columns, **(env or {})}) as streams, warnings.catch_warnings():
            out, err = streams[0], streams[1]  # click >= 8.2: (stdout, stderr, mixed); 8.1: (stdout, stderr)
            click.formatting.FORCED_WIDTH = None  # restored by the isolation
            warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
            warnings.resetwarnings()  # a fresh interpreter's filters: show each warning, not deprecations
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            os.chdir(cwd)
            if sys_path_0 is not None:
                sys.path.insert(0, str(sys_path_0))
            try:
                with deadline(timeout, f"ckptfix {' '.join(argv)}"):
                    main(argv)
            except SystemExit as exc:
                code = exc.code
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            raw_stdout = out.getvalue()
            stdout, stderr = raw_stdout.decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")
    finally:
        os.chdir(saved_cwd)
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if _outside_the_environment(sys.modules[name]):
                del sys.modules[name]
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)
        if saved_umask is not None:
            os.umask(saved_umask)
    if code is None:
        raise AssertionError(f"ckptfix.cli.main({argv}) returned instead of exiting")
    if not isinstance(code, int):  # what the interpreter does with sys.exit("text")
        stderr += f"{code}\n"
        code = 1
    return CliResult(argv, code, stdout, stderr, stdout_bytes=raw_stdout)


def run_cli(
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | Path = ROOT,
    script: bool = False,
    umask: int | None = None,
) -> CliResult:
    """``python -m ckptfix ARGS`` (or the installed ``ckptfix`` console script) as a real process:
    tests/e2e/ only. ``env`` is added to the environment; ``umask`` is set in the child."""
    _require_tier("run_cli (a process per command)", ("e2e",), "use invoke_cli to run the CLI in-process")
    launcher = [str(Path(sys.executable).with_name("ckptfix"))] if script else [sys.executable, "-m", "ckptfix"]
    proc = subprocess.run(
        [*launcher, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )
    return CliResult([str(a) for a in args], proc.returncode, proc.stdout, proc.stderr)


_BATCH_RUNNER = """\
import contextlib, io, json, resource, signal, sys, time
from ckptfix.cli import main

class Deadline(BaseException):
    pass

def expire(signum, frame):
    raise Deadline()

signal.signal(signal.SIGALRM, expire)
jobs = json.load(open(sys.argv[1]))
timeout, isolate_torch = float(sys.argv[3]), sys.argv[4] == "1"
with open(sys.argv[2], "a") as results:
    for args in jobs:
        out, err = io.StringIO(), io.StringIO()
        code, started, cpu_started = None, time.perf_counter(), time.process_time()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main(args)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Deadline:
            code = 124
            err.write(f"still running after {timeout} s (a hang)\\n")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if code is None:
            code = -1
            err.write("main() returned instead of exiting\\n")
        record = {
            "returncode": code,
            "stdout": out.getvalue(),
            "stderr": err.getvalue(),
            "seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu_started,
            "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "torch_imported": "torch" in sys.modules,
        }
        results.write(json.dumps(record) + "\\n")
        results.flush()
        if isolate_torch and record["torch_imported"]:
            break  # the commands after this one get a process without torch
"""


def run_cli_batch(
    commands: Sequence[Sequence[Any]], *, timeout: float = 60, limit_as: int | None = None, isolate_torch: bool = False
) -> list[CliResult]:
    """Many command lines through ``ckptfix.cli.main`` in ONE fresh ``python`` process, in order:
    tests/e2e/ only. For inputs that may kill an interpreter (a crash cannot take pytest down),
    whose memory is measured (``maxrss_mib``: the process's peak RSS after each command; it only
    grows, so the first command over a limit is the one that crossed it), under an address-space
    limit (``limit_as`` bytes, the whole process), or that must not import torch (``torch_imported``;
    with ``isolate_torch``, a command that imported it is the last its process runs).

    A command killed by a signal (negative returncode, the process's stderr) or running past
    ``timeout`` (returncode 124) is reported as such, and the commands after it run in a new process.
    """
    _require_tier("run_cli_batch (a process)", ("e2e",), "use invoke_cli to run the CLI in-process")
    remaining = [[str(a) for a in command] for command in commands]
    results: list[CliResult] = []

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    with tempfile.TemporaryDirectory(prefix="ckptfix-batch-") as tmp:
        while remaining:
            jobs, out = Path(tmp) / "jobs.json", Path(tmp) / f"results-{len(results)}.jsonl"
            jobs.write_text(json.dumps(remaining))
            try:
                proc = subprocess.run(
                    [sys.executable, "-c", _BATCH_RUNNER, str(jobs), str(out), str(timeout), str(int(isolate_torch))],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    timeout=timeout * len(remaining) + 60,
                    preexec_fn=limit if limit_as is not None else None,
                )
                returncode, stderr = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired as exc:  # stuck where SIGALRM cannot reach (C code)
                returncode, stderr = 124, f"{exc.stderr or ''}the batch process hung and was killed"
            if not out.exists():  # it failed before its first command (the file is opened after the imports)
                results += [CliResult(args, returncode or -1, "", stderr) for args in remaining]
                break
            done = [json.loads(line) for line in out.read_text().splitlines()]
            for args, record in zip(remaining, done):
                results.append(CliResult(args, **record))
            if len(done) == len(remaining):
                break
            if returncode == 0 and done and done[-1]["torch_imported"] and isolate_torch:
                remaining = remaining[len(done) :]  # stopped on purpose: the rest in a new process
                continue
            # the process died (or hung) in the command after the last one it reported
            results.append(CliResult(remaining[len(done)], returncode if returncode else -1, "", stderr))
            remaining = remaining[len(done) + 1 :]
    return results


def run_cli_batches(
    groups: Mapping[Any, Sequence[Sequence[Any]]], *, timeout: float = 60
) -> dict[Any, list[CliResult]]:
    """:func:`run_cli_batch` for each group, the groups' processes side by side (two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(groups)) as pool:
        futures = {key: pool.submit(run_cli_batch, commands, timeout=timeout) for key, commands in groups.items()}
        return {key: future.result() for key, future in futures.items()}


# =========================================================================== comparing checkpoints


def train_and_save_lightning(module: Any, data: Any, path: Path, *, batch_size: int, **trainer: Any) -> None:
    """Fit a LightningModule briefly on the CPU (no logger, checkpoints, bars or summary) and save
    its checkpoint through the Trainer, as a user's training run would."""
    import warnings

    import pytorch_lightning as pl  # a test dependency (pyproject's [test] extra): never skipped
    import torch

    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    run = pl.Trainer(accelerator="cpu", enable_model_summary=False, default_root_dir=path.parent, **quiet, **trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module, torch.utils.data.DataLoader(data, batch_size=batch_size))
    run.save_checkpoint(path)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's values as raw bytes in logical (row-major) order: bitwise, NaN-safe."""
    import torch

    flat = t.detach().cpu()
    if flat.is_quantized:
        flat = flat.int_repr()
    flat = flat.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two .pth files torch loads to the same tree (what an unchanged rewrite must give)."""
    import torch

    assert_same_tree(torch.load(a, weights_only=True), torch.load(b, weights_only=True))


def assert_values(loaded: dict, original: dict) -> None:
    """Same names, and per name the same dtype, shape and bytes (strides and devices aside)."""
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert tensor_bytes(got) == tensor_bytes(tensor), name


def assert_tensor_equal(a: torch.Tensor, b: torch.Tensor, where: str, *, check_stride: bool = True) -> None:
    """Same type, dtype, shape, stride, device, requires_grad and bits; quantized, sparse, nested
    and meta tensors by their own parts (quantization parameters, indices and values, components)."""
    import torch

    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.layout == b.layout, f"{where}: layout {a.layout} != {b.layout}"
    assert a.is_nested == b.is_nested, f"{where}: nested in only one"
    assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    if a.is_nested:
        assert_same_tree(list(a.unbind()), list(b.unbind()), f"{where}(nested)", check_stride=check_stride)
        return
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    if a.layout is not torch.strided:
        parts = {
            torch.sparse_coo: lambda t: [t._indices(), t._values(), t.is_coalesced()],
            torch.sparse_csr: lambda t: [t.crow_indices(), t.col_indices(), t.values()],
            torch.sparse_bsr: lambda t: [t.crow_indices(), t.col_indices(), t.values()],
            torch.sparse_csc: lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
            torch.sparse_bsc: lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
        }[a.layout]
        assert_same_tree(parts(a), parts(b), f"{where}({a.layout})", check_stride=check_stride)
        return
    if check_stride:
        assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
    if a.is_quantized:
        scheme = a.qscheme()
        assert scheme == b.qscheme(), f"{where}: qscheme {scheme} != {b.qscheme()}"
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            params = lambda t: [t.q_scale(), t.q_zero_point()]  # noqa: E731
        else:
            params = lambda t: [t.q_per_channel_scales(), t.q_per_channel_zero_points(), t.q_per_channel_axis()]  # noqa: E731
        assert_same_tree(params(a), params(b), f"{where}(qparams)")
    if a.is_meta:  # no data to compare
        return
    assert tensor_bytes(a) == tensor_bytes(b), f"{where}: values differ"


def assert_same_tree(a: Any, b: Any, where: str = "root", *, check_stride: bool = True) -> None:
    """Structural equality of two loaded checkpoints, tensors compared bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        assert_tensor_equal(a, b, where, check_stride=check_stride)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Mapping):
        assert set(a.keys()) == set(b.keys()), f"{where}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}", check_stride=check_stride)
        meta_a, meta_b = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        assert (meta_a is None) == (meta_b is None), f"{where}: _metadata present in only one"
        if meta_a is not None:
            assert dict(meta_a) == dict(meta_b), f"{where}: _metadata {dict(meta_a)} != {dict(meta_b)}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", check_stride=check_stride)
    elif type(a).__module__ == "numpy" and hasattr(a, "tobytes"):  # arrays and scalars: dtype, shape, bits
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), f"{where}: {a!r} != {b!r}"
        else:
            assert a.tobytes() == b.tobytes(), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def sharing_groups(tree: Any) -> set[frozenset[str]]:
    """Which (non-empty) tensors share one storage, as a set of groups of tensor paths."""
    import torch

    groups: dict[tuple[str, int], set[str]] = {}

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            # an empty tensor holds no data to share; sparse, nested and meta ones no one storage
            if value.numel() and value.layout is torch.strided and not value.is_nested and not value.is_meta:
                storage = value.untyped_storage()
                groups.setdefault((str(value.device), storage.data_ptr()), set()).add(path)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, f"{path}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{path}[{i}]")

    visit(tree, "")
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def reference_strip(path: Path, *prefixes: str) -> Any:
    """What torch itself gives: load, then for each prefix in turn (default ``module.``),
    consume_prefix_in_state_dict_if_present until no key has it."""
    import torch
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    tree = torch.load(path, weights_only=True)
    for prefix in prefixes or ("module.",):
        for sd in _state_dicts(tree):
            while any(k.startswith(prefix) for k in sd):
                consume_prefix_in_state_dict_if_present(sd, prefix)
    return tree


def _state_dicts(tree: Any) -> list[dict]:
    import torch

    if isinstance(tree, Mapping) and tree and all(isinstance(v, torch.Tensor) for v in tree.values()):
        return [tree]
    if isinstance(tree, Mapping) and not ("state" in tree and "param_groups" in tree):
        return [sd for v in tree.values() for sd in _state_dicts(v)]
    if isinstance(tree, (list, tuple)):
        return [sd for v in tree for sd in _state_dicts(v)]
    return []


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``ast.parse`` of a source file, once per process: the static checks of the package
    (test_layers, test_core_v2, test_numeric) read every module, several tests each, and parsing
    the package takes half a second. The trees are shared: read them, never change them."""
    return ast.parse(path.read_text())


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


def no_temp_files(folder: Path) -> bool:
    return not any(p.name.endswith(".ckptfix-tmp") for p in folder.iterdir())


# =========================================================================== fit --model folders

#: a module defining the model ``fit --model MODULE:build`` imports
FIT_MODULE = "import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n"


def fit_marker_module(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('imported')\n" + FIT_MODULE.replace("Linear(3, 2)", "Conv2d(7, 7, 7)")


@pytest.fixture
def fit_setup(tmp_path: Path) -> dict[str, Path]:
    return make_fit_setup(tmp_path)


def make_fit_setup(tmp_path: Path) -> dict[str, Path]:
    """An installed-like module folder (on PYTHONPATH), a working folder holding shadows of it
    and of a stdlib module that the installed one imports, and a DataParallel checkpoint."""
    import torch

    site, work, models = tmp_path / "site", tmp_path / "work", tmp_path / "models"
    for folder in (site, work, models):
        folder.mkdir()
    (site / "ckptfix_shadowtest_models.py").write_text(
        "import colorsys  # stdlib, imported by nothing else\n" + FIT_MODULE
    )
    (work / "ckptfix_shadowtest_models.py").write_text(fit_marker_module(tmp_path / "shadow-models"))
    (work / "colorsys.py").write_text(fit_marker_module(tmp_path / "shadow-colorsys"))
    (models / "ckptfix_localtest_models.py").write_text(FIT_MODULE)
    torch.save(torch.nn.DataParallel(torch.nn.Linear(3, 2)).state_dict(), tmp_path / "ddp.pth")
    return {"root": tmp_path, "site": site, "work": work, "models": models, "ckpt": tmp_path / "ddp.pth"}


# =========================================================================== hypothesis

# CI (CI=1, set by .ci/run) runs a fixed set of generated examples: the same verdict on every run.
# Tests that set max_examples themselves keep their count; the profile fixes everything else.
_hypothesis_settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=50, deadline=None, print_blob=True
)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")


@pytest.fixture(scope="module")
def base_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine torch.save zip (tests/hostile.py ``make_base_zip``) the hostile tests rewrite."""
    from hostile import make_base_zip

    return make_base_zip(tmp_path_factory.mktemp("base"))
