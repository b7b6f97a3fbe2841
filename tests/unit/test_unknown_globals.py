"""Issue 17, library level and free of omegaconf: unknown classes read as inert records, the
writers' guard, the dangerous list, what --allow-global keeps along, scan's verdicts, and
--sanitize's rules on objects pickled every way Python pickles them."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import pickle
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptfix import UnsafeInputError, read_checkpoint
from ckptfix.analysis.scan import classify
from ckptfix.formats.torchzip import write_torch_zip
from ckptfix.pickling.globals import DANGEROUS, allow_options, canonical_name, danger, kept_along, plain_data
from ckptfix.pickling.reader import foreign_globals
from ckptfix.transforms.sanitize import sanitize


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1
    color: Color = Color.RED
    kind: Any = typing.Any


@dataclasses.dataclass(slots=True)
class Slots:
    n: int = 3


class Old:
    """Pickled by protocol 0/1 through copyreg._reconstructor."""

    def __init__(self) -> None:
        self.a = [1, 2]


Pair = collections.namedtuple("Pair", "a b")

VALUES: dict[str, tuple[Any, Any]] = {  # live value, what --sanitize must make of it
    "dataclass": (Cfg(), {"lr": 0.1, "color": "red", "kind": "typing.Any"}),
    "slots": (Slots(), {"n": 3}),
    "enum": (Color.RED, "red"),
    "namedtuple": (Pair(1, "x"), (1, "x")),
    "deque": (collections.deque([1, 2]), [1, 2]),
    "defaultdict": (collections.defaultdict(list, {"k": [1]}), {"k": [1]}),
    "datetime": (datetime.datetime(2020, 1, 2, 3, 4, 5, 6), "2020-01-02T03:04:05.000006"),
    "date": (datetime.date(2020, 1, 2), "2020-01-02"),
    "timedelta": (datetime.timedelta(days=1, microseconds=5), 86400.000005),
    "typing": (typing.Optional, "typing.Optional"),
    "time": (datetime.time(1, 2, 3), "01:02:03"),
    "numpy dtype": (np.dtype("float16"), "float16"),
    "empty bytes": (b"", b""),
}


def _write(root: Any, source: Any, path: Path) -> Path:
    with open(path, "wb") as out:
        write_torch_zip(root, out, source=source)
    return path


def _save(tmp_path: Path, value: Any, protocol: int = 2, name: str = "c.pth") -> Path:
    path = tmp_path / name
    torch.save({"state_dict": {"w": torch.ones(2)}, "extra": value}, path, pickle_protocol=protocol)
    return path


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("case", sorted(VALUES))
def test_sanitize_rules_match_the_live_objects(tmp_path: Path, case: str, protocol: int) -> None:
    value, expected = VALUES[case]
    ckpt = read_checkpoint(_save(tmp_path, value, protocol), inert_unknown=True)
    root, _ = sanitize(ckpt.root)
    assert root["extra"] == expected and type(root["extra"]) is type(expected), root["extra"]
    assert not foreign_globals(root).unallowed
    out = _write(root, ckpt.archive, tmp_path / "out.pth")  # the plain result is writable, and loads safely
    assert torch.load(out, weights_only=True)["extra"] == expected


def test_empty_numpy_arrays_sanitize(tmp_path: Path) -> None:
    """Protocol 2 pickles an empty array's bytes as ``bytes()``: a builtin call, converted first."""
    ckpt = read_checkpoint(_save(tmp_path, np.zeros((0, 3), dtype=np.int16)), inert_unknown=True)
    root, _ = sanitize(ckpt.root)
    out = torch.load(_write(root, ckpt.archive, tmp_path / "out.pth"), weights_only=True)["extra"]
    assert out.shape == (0, 3) and out.dtype == torch.int16


def test_protocol_1_objects_sanitize_through_the_reconstructor(tmp_path: Path) -> None:
    """Protocols 0/1 pickle objects through copyreg._reconstructor. (A protocol-0 legacy torch
    file cannot be made: pickle writes its storage ids as text, which torch.load cannot read.)"""
    path = tmp_path / "p1.pth"
    torch.save({"old": Old()}, path, pickle_protocol=1, _use_new_zipfile_serialization=False)
    assert torch.load(path, weights_only=False)["old"].a == [1, 2]  # torch reads protocol-1 legacy files
    ckpt = read_checkpoint(path, inert_unknown=True)
    assert "copyreg._reconstructor" in ckpt.globals
    assert sanitize(ckpt.root)[0]["old"] == {"a": [1, 2]}


def test_unknown_classes_are_refused_unless_asked_and_never_written(tmp_path: Path) -> None:
    path = _save(tmp_path, Cfg())
    with pytest.raises(UnsafeInputError, match="Cfg"):
        read_checkpoint(path)  # the default stays strict (verify, diff)
    ckpt = read_checkpoint(path, inert_unknown=True)
    found = foreign_globals(ckpt.root).unallowed
    assert set(found) == {f"{__name__}.Cfg", f"{__name__}.Color", "typing.Any"}
    assert found[f"{__name__}.Cfg"] == [("extra",)]
    with pytest.raises(UnsafeInputError, match="refusing to write"):  # the writers' own guard
        _write(ckpt.root, ckpt.archive, tmp_path / "all.pth")
    out = _write(ckpt.root["state_dict"], ckpt.archive, tmp_path / "part.pth")  # the part without them
    assert torch.load(out, weights_only=True).keys() == {"w"}


def test_allowing_a_class_keeps_along_the_plain_types_it_is_rebuilt_through(tmp_path: Path) -> None:
    path = _save(tmp_path, Cfg())
    ckpt = read_checkpoint(path, allow_globals=[f"{__name__}.*"], inert_unknown=True)
    found = foreign_globals(ckpt.root)
    assert not found.unallowed and "typing.Any" in found.allowed
    out = _write(ckpt.root, ckpt.archive, tmp_path / "kept.pth")
    assert torch.load(out, weights_only=False)["extra"] == Cfg()


def test_dangerous_names_cannot_be_allowed_or_hidden(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (getattr, ("text", "upper"))

    path = _save(tmp_path, Evil())
    for allow in ([], ["builtins.*"], ["*"]):
        with pytest.raises(UnsafeInputError) as refused:
            read_checkpoint(path, allow_globals=allow, inert_unknown=True)
        assert refused.value.hostile == ["builtins.getattr"] and "--allow-global" not in str(refused.value)
    # Python 2 and C-module spellings are judged by the name Python 3 imports
    for pickled, real in (("commands.getoutput", "subprocess.getoutput"), ("posix.system", "os.system")):
        assert canonical_name(pickled) == real and danger(pickled) == danger(real) is not None
    assert canonical_name("builtins.long") == "builtins.int" and danger("cPickle.loads")
    assert all(reason for reason in DANGEROUS.values())


def test_refusal_options_are_ready_to_paste() -> None:
    names = ["omegaconf.dictconfig.DictConfig", "omegaconf.nodes.AnyNode", "typing.Any", "builtins.long", "mod.One"]
    assert allow_options(names) == ["--allow-global 'omegaconf.*'", "--allow-global mod.One"]
    assert kept_along(names) == ["typing.Any", "builtins.int"]
    assert allow_options(["typing.Any"]) == ["--allow-global typing.Any"]  # alone, it must be named
    assert allow_options(["os.system", "argparse.Namespace"]) == ["--allow-global argparse.Namespace"]
    assert allow_options(["torch.nn.Linear", "torch.nn.Conv2d"]) == [  # never a wildcard over torch
        "--allow-global torch.nn.Linear",
        "--allow-global torch.nn.Conv2d",
    ]


@pytest.mark.parametrize(
    ("name", "verdict"),
    [
        ("posix.system", "dangerous"),
        ("builtins.getattr", "dangerous"),
        ("torch.storage._load_from_bytes", "dangerous"),
        ("commands.Popen", "dangerous"),
        ("typing.get_type_hints", "dangerous"),
        ("omegaconf.dictconfig.DictConfig", "unknown"),
        ("mypkg.Config", "unknown"),
        ("functools.partial", "unknown"),
        ("typing.Any", "safe"),
        ("builtins.long", "safe"),
        ("collections.defaultdict", "safe"),
        ("numpy.core.multiarray._reconstruct", "safe"),
        ("torch._utils._rebuild_tensor_v2", "safe"),
    ],
)
def test_scan_verdicts(name: str, verdict: str) -> None:
    got, reason = classify(name)
    assert got == verdict and reason, (name, got)
    assert plain_data(name) == (verdict == "safe" and not name.startswith("torch."))


def test_pickle_of_config_is_protocol_independent_for_the_reader(tmp_path: Path) -> None:
    """The same object pickled at protocols 2 and 4 (STACK_GLOBAL, frames, memo) reads alike."""
    trees = [read_checkpoint(_save(tmp_path, Cfg(), p, f"{p}.pth"), inert_unknown=True) for p in (2, 4)]
    assert [sanitize(t.root)[0]["extra"] for t in trees] == [VALUES["dataclass"][1]] * 2
    assert pickle.loads(pickle.dumps(Cfg())) == Cfg()  # the live class round-trips (sanity of the fixture)
