"""inspect's lean paths (issue 26: ``inspect`` <= 0.5 s on 200 000 tensors): the tree a command
line's last command read is left to the operating system, and the prefix counts take their
shortcut only where it gives what counting every key gives."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES
from test_walk_columns import _common_prefixes_by_loop

from ckptfix.analysis.inspect import common_prefixes
from ckptfix.batch import run_batch
from ckptfix.formats.checkpoint import Checkpoint
from ckptfix.pickling import vm
from ckptfix.pickling.vm import keep_until_exit, last_command
from ckptfix.pipeline import ConvertOptions


class _Tree:
    """Stands for a checkpoint tree: an object the collector tracks."""

    def __init__(self) -> None:
        self.children: list[Any] = [{"w": 1}]


def test_outside_the_last_command_nothing_is_kept() -> None:
    # a library call or an in-process test run: the tree is freed as usual, nothing frozen
    frozen, kept = gc.get_freeze_count(), len(vm._KEPT)
    keep_until_exit(_Tree())
    assert gc.get_freeze_count() == frozen and len(vm._KEPT) == kept


def test_within_the_last_command_the_tree_is_kept_and_frozen() -> None:
    tree = _Tree()
    with last_command():
        keep_until_exit(tree)
        keep_until_exit(_Tree())  # one tree per command: a second one is freed as usual
    try:
        assert len(vm._KEPT) == 2
        assert vm._KEPT[-1] is tree
        assert gc.get_freeze_count() > 0  # no collection looks at it again
        assert vm._KEPT[0] is vm._KEPT  # the cycle that leaves it alive past module clean-up
    finally:
        del vm._KEPT[-1]
        gc.unfreeze()
    with last_command():
        pass
    keep_until_exit(_Tree())  # the mark ends with the block
    assert len(vm._KEPT) == 1


@pytest.mark.parametrize(
    "keys",
    [
        ["_orig_mod.module.a.w", "_orig_mod.module.b.w", "x.w"],  # nested chain on most keys
        ["module._orig_mod.a", "module.b", "module.c", "d"],  # a wrapper, nested on some keys
        ["module.a", "model.b"],  # two wrappers, each on half: first met first
        ["model.a", "module.b", "module.c", "model.d"],
        ["module.a", "module.module.b", "c"],
        ["module.", "module.x", "module"],  # the wrapper alone as a key
        ["a.b", "a.c", "b"],  # no wrapper at all
    ],
)
def test_prefix_shortcuts_count_as_every_key(keys: list[str]) -> None:
    assert common_prefixes(keys) == _common_prefixes_by_loop(keys)


def _kept_by(run: Any) -> list[Any]:
    """What ``run()`` left kept within the console script's one command (then let go again)."""
    before = len(vm._KEPT)
    with last_command():
        run()
    kept = vm._KEPT[before:]
    del vm._KEPT[before:]
    gc.unfreeze()
    return kept


def test_a_writing_command_keeps_its_one_tree_and_a_batch_keeps_none(tmp_path: Path) -> None:
    """convert (strip-module and the other writing commands) leaves the tree it read to the OS
    as inspect does; a batch of many files keeps none (the first file's tree must not stay alive
    beside every later one's), in this process or its workers."""
    src = FIXTURES / "dataparallel_tinynet.pth"
    one = _kept_by(
        lambda: run_batch(
            "strip-module", [(str(src), str(tmp_path / "a.pth"))], ConvertOptions(), jobs=1, continue_on_error=False
        )
    )
    assert len(one) == 1 and isinstance(one[0], Checkpoint) and (tmp_path / "a.pth").exists()
    pairs = [(str(src), str(tmp_path / f"b{i}.pth")) for i in range(2)]
    assert _kept_by(lambda: run_batch("strip-module", pairs, ConvertOptions(), jobs=1, continue_on_error=False)) == []
    assert all(Path(dst).exists() for _, dst in pairs)
