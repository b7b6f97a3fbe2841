"""Config classes as training code defines them, importable by name (``config_types.Optim``), so
a checkpoint carrying them loads back with ``torch.load(weights_only=False)`` in the tests."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import pathlib
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Optim:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: list[int] = dataclasses.field(default_factory=lambda: [10, 20])


@dataclasses.dataclass(slots=True)
class Slotted:
    width: int = 64
    name: str = "slotted"


class Plain:
    """A plain class: its state is its ``__dict__``."""

    def __init__(self) -> None:
        self.seed = 7
        self.tags = ["a", "b"]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plain) and vars(self) == vars(other)


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class EnumNodeConfig:
    mode: Mode = Mode.TRAIN
    level: Level = Level.HIGH


def hydra_config() -> DictConfig:
    """What Hydra hands a training script: nested, with an interpolation, a missing value, a
    None, lists, an Enum node (from a structured config) and int keys."""
    cfg = OmegaConf.create(
        {
            "model": {"dim": 8, "layers": [1, 2, {"kind": "attn"}], "act": None},
            "optim": {"lr": 0.1, "warmup": "${optim.lr}", "betas": [0.9, 0.99]},
            "data": {"root": "/data", "missing": "???", "ids": {1: "one", 2: "two"}},
        }
    )
    cfg.structured = OmegaConf.structured(EnumNodeConfig)
    return cfg


def hyper_parameters() -> dict[str, Any]:
    """Every kind of config object issue 17 names, as a training script stores them."""
    return {
        "cfg": hydra_config(),
        "list_cfg": OmegaConf.create([1, "${0}", {"a": 2}]),
        "optim": Optim(),
        "slotted": Slotted(),
        "plain": Plain(),
        "mode": Mode.EVAL,
        "level": Level.LOW,
        "args": argparse.Namespace(lr=0.1, name="run", out=pathlib.PurePosixPath("/runs/1")),
        "out_dir": pathlib.PurePosixPath("/data/run1"),
        "best": np.float64(0.93),
        "step": np.int64(7),
        "flag": np.bool_(True),
        "confusion": np.arange(6, dtype=np.float32).reshape(2, 3),
        "point": Point(1, 2),
        "counts": collections.defaultdict(int, {"a": 1}),
        "started": datetime.datetime(2024, 5, 6, 7, 8, 9, 10),
        "elapsed": datetime.timedelta(hours=1, seconds=3),
        "typ": Any,
    }


def lightning_style(hparams: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Lightning 2.x checkpoint's layout: weights under ``state_dict`` with the module's
    attribute as prefix, optimizer state, loops, and ``hyper_parameters`` holding configs."""
    torch.manual_seed(0)
    weights = {"model.0.weight": torch.randn(4, 3), "model.0.bias": torch.randn(4), "model.1.weight": torch.randn(2, 4)}
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.1.0",
        "state_dict": weights,
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": hparams if hparams is not None else hyper_parameters(),
    }


def plain_data(value: Any) -> Any:
    """What ``--sanitize`` must make of :func:`hyper_parameters`' values, computed from the live
    objects with the libraries themselves (``OmegaConf.to_container``, ``dataclasses.asdict``...)."""
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return plain_data(OmegaConf.to_container(value, resolve=False))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_data({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, argparse.Namespace):
        return plain_data(vars(value))
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, Plain):
        return plain_data(vars(value))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return tuple(plain_data(v) for v in value)
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v) for v in value)
    if value is Any:
        return "typing.Any"
    return value
