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

from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562), so `ckptfix --help` and the CLI's
# fast paths do not pay for modules a command does not need.
_EXPORTS = {
    "LoadIntoError": "api",
    "LoadIntoReport": "api",
    "load": "api",
    "load_into": "api",
    "Checkpoint": "formats.checkpoint",
    "read_checkpoint": "formats.checkpoint",
    "BadInputError": "errors",
    "CannotWriteError": "errors",
    "CheckFailedError": "errors",
    "CkptfixError": "errors",
    "NeedsTorchError": "errors",
    "UnsafeInputError": "errors",
    "UsageError": "errors",
    "ExitCode": "errors",
    "AverageReport": "pipeline",
    "ConvertOptions": "pipeline",
    "average_checkpoints": "pipeline",
    "Report": "pipeline",
    "convert": "pipeline",
    "fix_prefix": "pipeline",
    "inspect_checkpoint": "analysis.inspect",
    "write_checkpoint": "pipeline",
    "TransformResult": "transforms.prefix",
    "add_prefix": "transforms.prefix",
    "strip_prefix": "transforms.prefix",
    "StorageRef": "model.refs",
    "TensorRef": "model.refs",
    "find_state_dicts": "model.statedicts",
}


if TYPE_CHECKING:
    # What a type checker sees: the same names from the same modules as _EXPORTS (a test keeps
    # the two in step), so ``ckptfix.load`` has load's signature rather than __getattr__'s object.
    from .analysis.inspect import inspect_checkpoint
    from .api import LoadIntoError, LoadIntoReport, load, load_into
    from .errors import (
        BadInputError,
        CannotWriteError,
        CheckFailedError,
        CkptfixError,
        ExitCode,
        NeedsTorchError,
        UnsafeInputError,
        UsageError,
    )
    from .formats.checkpoint import Checkpoint, read_checkpoint
    from .model.refs import StorageRef, TensorRef
    from .model.statedicts import find_state_dicts
    from .pipeline import (
        AverageReport,
        ConvertOptions,
        Report,
        average_checkpoints,
        convert,
        fix_prefix,
        write_checkpoint,
    )
    from .transforms.prefix import TransformResult, add_prefix, strip_prefix


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AverageReport",
    "BadInputError",
    "CannotWriteError",
    "CheckFailedError",
    "Checkpoint",
    "CkptfixError",
    "ConvertOptions",
    "ExitCode",
    "LoadIntoError",
    "LoadIntoReport",
    "NeedsTorchError",
    "Report",
    "StorageRef",
    "TensorRef",
    "TransformResult",
    "UnsafeInputError",
    "UsageError",
    "__version__",
    "add_prefix",
    "average_checkpoints",
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
