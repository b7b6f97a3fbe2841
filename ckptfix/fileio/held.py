"""Outputs written in full whose commit waits: a folder of shards is committed together.

A shard folder is complete when its index is there; its shards should appear only when all of
them were written, by one process or by the many of a ``torchrun`` split (which must first
agree that every part succeeded). :func:`held_outputs` makes that so for every output written
through :func:`~ckptfix.fileio.atomic.atomic_output` within it: a local file stays a temporary
file until the hold commits (then renamed), an upload has every part sent but is completed
only then (one metadata call each), and undoing the hold drops or deletes them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class _Held:
    """One output written in full and not yet committed (see :func:`held_outputs`)."""

    commit: Callable[[], None]  # make it the destination (rename; complete the upload)
    discard: Callable[[], None]  # before commit: drop it (remove the temporary file; abort the upload)
    delete: Callable[[], None]  # after commit: remove the destination again
    committed: bool = False


class HeldOutputs:
    """Outputs written in full whose last step waits: nothing of them is visible until
    :meth:`commit`, which makes them all destinations (renames; completed multipart uploads,
    a metadata call each), and :meth:`undo` leaves nothing of them, committed or not. A folder
    of shards is written so: every shard is written first (by one process or by many, which
    agree that all succeeded before any commits), then committed, then the index."""

    def __init__(self) -> None:
        self._outputs: list[_Held] = []

    def hold(self, commit: Callable[[], None], discard: Callable[[], None], delete: Callable[[], None]) -> None:
        self._outputs.append(_Held(commit, discard, delete))

    def commit(self) -> None:
        for held in self._outputs:
            if not held.committed:
                held.commit()
                held.committed = True

    def undo(self) -> None:
        """Every output of this hold gone: uncommitted ones dropped, committed ones deleted
        (best effort, one by one: a failure to remove one does not keep the others)."""
        outputs, self._outputs = self._outputs, []
        for held in outputs:
            with contextlib.suppress(Exception):
                (held.delete if held.committed else held.discard)()

    def drop_uncommitted(self) -> None:
        for held in self._outputs:
            if not held.committed:
                with contextlib.suppress(Exception):
                    held.discard()
        self._outputs = [h for h in self._outputs if h.committed]


_holding: ContextVar[HeldOutputs | None] = ContextVar("ckptfix_held_outputs", default=None)


@contextmanager
def held_outputs() -> Iterator[HeldOutputs]:
    """Within this, :func:`atomic_output` writes each output in full (a temporary file; every
    part of an upload sent) and holds its commit for :meth:`HeldOutputs.commit`. On an error
    everything held is undone; on a clean exit whatever was not committed is dropped (a
    forgotten commit leaves no temporary file and no upload in progress)."""
    held = HeldOutputs()
    token = _holding.set(held)
    try:
        yield held
    except BaseException:
        held.undo()
        raise
    finally:
        _holding.reset(token)
        held.drop_uncommitted()


def holding() -> HeldOutputs | None:
    """The :func:`held_outputs` this code runs within, if any."""
    return _holding.get()
