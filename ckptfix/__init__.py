"""ckptfix: repair and convert PyTorch checkpoints without loading them.

Python API (the CLI is a thin layer over these)::

    import ckptfix
    ckpt = ckptfix.read_checkpoint("ddp.pth")      # lazy: no tensor data read, no torch import
    result = ckptfix.strip_prefix(ckpt.root, "module.")
    ckptfix.write_checkpoint(ckpt, result.root, "bare.pth")

    ckptfix.fix_prefix("ddp.pth", "bare.pth", mode="strip")   # the three steps above, with checks
    ckptfix.convert("train.ckpt", "model.safetensors",        # any format to any, with fixes
                    ckptfix.ConvertOptions(select="state_dict", strip_prefixes=["model."]))
    ckptfix.inspect_checkpoint("ddp.pth")                     # what `ckptfix inspect --json` prints
    sd = ckptfix.load("ddp.pth", map_location="cpu")          # real tensors, like torch.load
    ckptfix.load_into(model, "ddp.pth")                       # fits wrapper prefixes, then loads
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import LoadIntoReport, load, load_into
from .checkpoint import Checkpoint, read_checkpoint
from .errors import (
    BadInputError,
    CannotWriteError,
    CheckFailedError,
    CkptfixError,
    UnsafeInputError,
    UsageError,
)
from .ops import ConvertOptions, Report, convert, fix_prefix, inspect_checkpoint, write_checkpoint
from .transforms import TransformResult, add_prefix, strip_prefix
from .tree import StorageRef, TensorRef, find_state_dicts

__all__ = [
    "BadInputError",
    "CannotWriteError",
    "CheckFailedError",
    "Checkpoint",
    "CkptfixError",
    "ConvertOptions",
    "LoadIntoReport",
    "Report",
    "StorageRef",
    "TensorRef",
    "TransformResult",
    "UnsafeInputError",
    "UsageError",
    "__version__",
    "add_prefix",
    "convert",
    "find_state_dicts",
    "fix_prefix",
    "inspect_checkpoint",
    "load",
    "load_into",
    "read_checkpoint",
    "strip_prefix",
    "write_checkpoint",
]
