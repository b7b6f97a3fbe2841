"""Formats ckptfix hands to torch itself: legacy pickles, old tar files, trusted pickles.

These are rare and small, so the cost of importing torch and holding the tensors in memory
is acceptable. Loading is ``weights_only=True`` unless the user passed ``--unsafe-load``.
Tensors are loaded to the CPU (the file's device tags cannot be restored without the
device), which the caller reports.
"""

from __future__ import annotations

from typing import BinaryIO

from ..errors import BadInputError, UnsafeInputError
from ..model.needs import need_torch
from ..model.refs import Tree


def load_with_torch(path: str, *, weights_only: bool = True) -> Tree:
    """``torch.load`` onto the CPU, turning its failures into one-line ckptfix errors."""
    import pickle

    need_torch()
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        message = str(exc)
        marker = "GLOBAL "
        if weights_only and marker in message:
            name = message.split(marker, 1)[1].split(" ", 1)[0]
            raise UnsafeInputError(name, path) from exc
        raise BadInputError(f"{path}: torch could not read it: {message.splitlines()[0][:200]}") from exc
    except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError ... on bad files
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise BadInputError(f"{path}: torch could not read it: {first[:200]}") from exc


def save_with_torch(root: Tree, out: BinaryIO) -> None:
    """``torch.save`` in the default (zip) format."""
    need_torch()
    import torch

    torch.save(root, out)
