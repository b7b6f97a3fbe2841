"""The oracle: what does torch see in this file? -- asked of torch itself, with nothing from the file run.

``scan`` and ``verify`` are gates people put in front of ``torch.load``; the reader claims to read
what torch reads. Both claims are tested here against torch, not against our idea of torch:
:func:`torch_view` asks a child process (``tests/oracle_child.py``: one per test session, torch
imported once, address space capped, every request under a time limit, restarted when it dies)
for

* ``globals`` -- every global CPython's C unpickler resolves when ``torch.load(weights_only=False)``
  reads the file (every pickle torch unpickles: the tar members, the legacy header pickles,
  ``data.pkl``, nested ``_load_from_bytes`` pickles, a DCP folder's ``.metadata`` and items), in
  the order resolved, after CPython's Python-2 renaming; anything off torch's allow-list was an
  inert stand-in, so reading went as far as CPython itself goes;
* ``tree`` -- what ``torch.load(weights_only=True)`` returns (or ``weights_only_error``).

The assertions (:func:`assert_scan_sees_what_torch_resolves`, :func:`assert_reads_as_torch`) compare
ckptfix with that. ``tests/unit/test_oracle.py`` keeps the oracle itself honest: it must record a
payload without running it, and it must fail when pointed at a reader that differs.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import conftest
import torch

CHILD = Path(__file__).with_name("oracle_child.py")


@dataclass(frozen=True)
class TorchView:
    """What torch sees in one file (see the module docstring)."""

    path: str
    globals: tuple[str, ...] = ()
    #: what torch.load(weights_only=False) raised with stand-ins in place (None: it loaded)
    error: str | None = None
    tree: Any = None
    weights_only_error: str | None = None
    #: the child died or ran out of time/memory on this file (torch itself would have too)
    crashed: str | None = None

    @property
    def loads(self) -> bool:
        """``torch.load(weights_only=True)`` returns something."""
        return self.crashed is None and self.weights_only_error is None


class _Child:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            conftest.ORACLE_SPAWN = True
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, str(CHILD)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
            finally:
                conftest.ORACLE_SPAWN = False
            assert self._read(self.proc, 6, 120.0) == b"ready\n", "the oracle's child did not start"
        return self.proc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], count: int, timeout: float) -> bytes | None:
        assert proc.stdout is not None
        fd, chunks, left = proc.stdout.fileno(), [], count
        deadline = _now() + timeout
        while left:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - _now()))
            if not ready:
                return None
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self.start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        head = self._read(proc, 8, timeout)
        body = self._read(proc, struct.unpack("<Q", head)[0], timeout) if head else None
        if body is None:
            try:  # the pipe closed (the child is dying: wait for its status) or time ran out
                status: int | None = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            self.stop()
            if status is not None and status < 0:
                return {"crashed": f"killed by {signal.Signals(-status).name}"}
            return {"crashed": "no answer within the time limit" if status is None else f"exit status {status}"}
        answer: dict[str, Any] = pickle.loads(body)  # our own child's reply, not the file
        return answer


def _now() -> float:
    import time

    return time.monotonic()


_CHILD = _Child()
atexit.register(_CHILD.stop)


def torch_view(path: str | Path, *, dcp: bool = False, mmap: bool = False, timeout: float = 60.0) -> TorchView:
    """Ask torch what it sees in ``path`` (a file, or a DCP folder with ``dcp=True``)."""
    reply = _CHILD.ask({"path": str(path), "kind": "dcp" if dcp else "file", "mmap": mmap}, timeout)
    if "crashed" in reply:
        return TorchView(str(path), crashed=reply["crashed"])
    tree = reply["tree"]
    if isinstance(tree, bytes):
        tree = torch.load(io.BytesIO(tree), weights_only=True)
    elif isinstance(tree, str):  # the child could not send it: say so where a tree was expected
        raise AssertionError(f"oracle: {path}: {tree}")
    return TorchView(str(path), tuple(reply["globals"]), reply["error"], tree, reply["wo_error"])


@dataclass(frozen=True)
class PickleView:
    """What CPython's C unpickler resolves in one raw pickle (as torch reads ``data.pkl``), and
    whether torch's weights-only unpickler accepts it (``weights_only_error`` None)."""

    globals: tuple[str, ...]
    error: str | None
    weights_only_error: str | None


def pickle_views(pickles: list[bytes], *, stream: str = "bytesio", timeout: float = 60.0) -> list[PickleView]:
    """Many raw pickles in one request (the fuzzer's batches): read by CPython from a ``BytesIO``
    (``stream="bytesio"``, torch's ``data.pkl``) or a buffered file (``"file"``: legacy files)."""
    import base64

    request = {"kind": "pickles", "stream": stream, "pickles": [base64.b64encode(p).decode() for p in pickles]}
    reply = _CHILD.ask(request, timeout)
    if "crashed" in reply:
        raise AssertionError(f"oracle: a batch of {len(pickles)} pickles crashed the child: {reply['crashed']}")
    return [PickleView(tuple(found), error, wo) for found, error, wo in reply["results"]]


def torch_views(paths: Iterable[str | Path], **kwargs: Any) -> list[TorchView]:
    return [torch_view(p, **kwargs) for p in paths]


# =========================================================================== the comparisons


def canonical(names: Iterable[str]) -> set[str]:
    """Names as ckptfix reports them (``posix.system`` is ``os.system``): the common ground."""
    from ckptfix.pickling.globals import canonical_name

    return {canonical_name(n) for n in names}


def missed_by_scan(view: TorchView, scanned: Iterable[str]) -> set[str]:
    """The globals torch resolved that a scan's list does not name."""
    return canonical(view.globals) - canonical(scanned)


def dangerous_names(names: Iterable[str]) -> set[str]:
    from ckptfix.analysis.scan import classify

    return {n for n in canonical(names) if classify(n)[0] == "dangerous"}


def assert_scan_sees_what_torch_resolves(path: str | Path, *, dcp: bool = False) -> TorchView:
    """ckptfix's ``scan`` names every global torch resolves in ``path``, and calls the file
    dangerous whenever one of them is; returns torch's view for further checks."""
    from ckptfix.analysis.scan import scan_path

    view = torch_view(path, dcp=dcp)
    result = scan_path(path)
    scanned = [g.name for g in result.globals]
    missed = missed_by_scan(view, scanned)
    assert not missed, (
        f"{path}: torch resolves {sorted(missed)} that scan does not report (scan: {sorted(set(scanned))})"
    )
    if dangerous_names(view.globals):
        assert result.dangerous, f"{path}: torch resolves {sorted(dangerous_names(view.globals))}; scan calls it clean"
    return view


def assert_reads_as_torch(path: str | Path, written: str | Path) -> None:
    """ckptfix's output ``written`` (made from ``path``) loads in torch as the same tree, values,
    dtypes, shapes and strides as ``path`` itself does."""
    source, output = torch_view(path), torch_view(written)
    assert source.loads, f"{path}: torch refuses it: {source.weights_only_error or source.crashed}"
    assert output.loads, f"{written}: torch refuses ckptfix's output: {output.weights_only_error or output.crashed}"
    conftest.assert_same_tree(output.tree, source.tree)
