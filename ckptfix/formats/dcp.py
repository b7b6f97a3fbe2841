"""``torch.distributed.checkpoint`` (DCP) folders, the format FSDP and multi-node training write.

Both directions go through torch's own code, which holds the whole state dict in memory.

Reading is refused unless the user passes ``--unsafe-load``: torch reads a DCP folder's
``.metadata`` with plain ``pickle.load`` (torch 2.13, ``FileSystemReader.read_metadata``), so a
hostile folder runs code the moment torch opens it, and ckptfix cannot vet that file the way it
vets ``data.pkl``. Writing is safe: ``torch.distributed.checkpoint.save`` on tensors ckptfix
loaded with ``weights_only=True``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import BadInputError, CannotWriteError
from ..model.needs import need_torch
from ..model.refs import Tree

METADATA_NAME = ".metadata"


def is_dcp_folder(folder: Path) -> bool:
    return (folder / METADATA_NAME).is_file()


def read_dcp(folder: Path) -> Tree:
    """The folder's state dict as real tensors, via ``dcp_to_torch_save`` (trusted folders only)."""
    need_torch()
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix=".ckptfix-dcp-") as tmp:
        flat = Path(tmp) / "state.pth"
        try:
            with warnings.catch_warnings():  # "assuming the intent is to ... single process"
                warnings.simplefilter("ignore")
                dcp_to_torch_save(folder, flat)
        except Exception as exc:  # torch raises many kinds on a broken folder
            raise BadInputError(f"{folder}: torch could not read this DCP folder: {exc}"[:300]) from exc
        return torch.load(flat, map_location="cpu", weights_only=False)


def write_dcp(write_pth: Callable[[BinaryIO], None], dest: Path, *, overwrite: bool) -> list[Path]:
    """Write a DCP folder at ``dest`` from a checkpoint that ``write_pth`` writes as .pth.

    The state dict is materialised with ``torch.load(weights_only=True, mmap=True)`` from a
    temporary .pth, saved with ``torch.distributed.checkpoint.save`` into a temporary folder
    beside ``dest``, and renamed into place: ``dest`` is complete or untouched.
    """
    need_torch()
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if dest.exists() and not overwrite:
        raise CannotWriteError(f"{dest}: already exists", hint="pass --force to overwrite it")
    if not dest.parent.is_dir():
        raise CannotWriteError(f"{dest}: the folder {dest.parent} does not exist")
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".ckptfix-tmp", dir=dest.parent))
    try:
        with open(work / "state.pth", "wb") as f:
            write_pth(f)
        state = torch.load(work / "state.pth", weights_only=True, mmap=True)
        if not isinstance(state, dict):
            raise CannotWriteError(f"{dest}: DCP needs a dict at the top level, not a {type(state).__name__}")
        staged = work / "dcp"
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore")
            dcp_save(state, storage_writer=FileSystemWriter(staged), no_dist=True)
        del state
        if dest.exists():
            old = work / "previous"
            os.replace(dest, old)
        os.replace(staged, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(p for p in dest.iterdir())
