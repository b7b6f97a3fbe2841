"""A sharded write split over processes (formats.sharded.Split), with threads standing in for
torchrun's ranks and a barrier for gloo's all-reduce: the same files as one writer, and a
failure in any part leaves nothing (tests/e2e/test_distributed.py runs the real torchrun)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.errors import CannotWriteError
from ckptfix.formats.checkpoint import read_checkpoint
from ckptfix.formats.sharded import Split, write_sharded


class Collective:
    """agree for ``world`` threads: every one's code, combined (the worst), once all have called."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=20)
        self.codes: list[int] = []
        self.lock = threading.Lock()

    def agree(self, code: int) -> int:
        with self.lock:
            self.codes.append(code)
        self.barrier.wait()
        result = max(self.codes)
        self.barrier.wait()  # everyone has read the codes: the next round starts clean
        with self.lock:
            self.codes.clear()
        self.barrier.wait()
        return result


def _split_write(state: dict[str, Any], out: Path, world: int, fail_rank: int | None = None) -> list[Any]:
    collective, outcomes = Collective(world), [None] * world

    def rank(r: int) -> None:
        def progress(count: int) -> None:
            if r == fail_rank:
                raise OSError(28, "No space left on device")

        try:
            outcomes[r] = write_sharded(state, out, 9000, split=Split(r, world, collective.agree), progress=progress)
        except BaseException as exc:
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return outcomes


@pytest.fixture
def state(tmp_path: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    save_file(
        {f"layer{i}.weight": torch.randn(32, 32, generator=gen) for i in range(9)}, str(tmp_path / "in.safetensors")
    )
    root = read_checkpoint(tmp_path / "in.safetensors").root
    assert isinstance(root, dict)
    return root


def test_the_split_writes_what_one_writer_writes(state: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    write_sharded(state, tmp_path / "one", 9000)
    outcomes = _split_write(state, tmp_path / "split", 3)
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(names) == 6 and names == sorted(p.name for p in (tmp_path / "split").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "split" / name).read_bytes()


def test_a_part_that_fails_leaves_no_shard_and_no_index(state: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "split"
    out.mkdir()
    outcomes = _split_write(state, out, 3, fail_rank=1)
    assert isinstance(outcomes[1], CannotWriteError) and "no space" in str(outcomes[1])
    others = [outcomes[r] for r in (0, 2)]
    assert all(isinstance(o, CannotWriteError) and "another process" in str(o) for o in others), outcomes
    assert list(out.iterdir()) == []  # ranks 0 and 2 wrote theirs, then removed them


def test_a_step_failing_on_one_rank_fails_every_rank_with_its_code_after_all_have_undone() -> None:
    """``together``: rank 2 cannot read (exit 3); ranks 0 and 1 did their part, and fail too,
    with that code; every rank undoes its part before any rank raises (a rank that left early
    would let torchrun stop the others mid-cleanup)."""
    import time

    from ckptfix.errors import BadInputError
    from ckptfix.formats.sharded import together

    world, collective = 3, Collective(3)
    events: list[tuple[str, int]] = []
    outcomes: list[BaseException | None] = [None] * world

    def rank(r: int) -> None:
        def work() -> None:
            if r == 2:
                raise BadInputError("in.pth: truncated")

        def undo() -> None:
            if r == 0:
                time.sleep(0.2)  # a slow cleanup: the others must wait for it
            events.append(("undo", r))

        try:
            together(Split(r, world, collective.agree), work, "out/", undo=undo)
        except BaseException as exc:
            events.append(("raised", r))
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert str(outcomes[2]) == "in.pth: truncated"
    for r in (0, 1):
        assert isinstance(outcomes[r], BadInputError), outcomes
        assert "another process of the split write failed (exit 3)" in str(outcomes[r])
    assert sorted(events[:world]) == [("undo", 0), ("undo", 1), ("undo", 2)], events
