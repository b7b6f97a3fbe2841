"""ckptfix: repair and convert PyTorch checkpoints without loading them.

Python API (the CLI is a thin layer over these)::

    import ckptfix
    ckpt = ckptfix.read_checkpoint("ddp.pth")          # lazy: no tensor data read, no torch import
    result = ckptfix.strip_prefix(ckpt.root, "module.")
    ckptfix.write_checkpoint(ckpt, result.root, "bare.pth")
    report = ckptfix.fix_prefix("ddp.pth", "bare.pth", mode="strip")   # all of the above
    info = ckptfix.inspect_checkpoint("ddp.pth")
"""

from __future__ import annotations

__version__ = "0.1.0"
