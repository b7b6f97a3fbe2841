"""A user's script against the public API, for the type checker only: never run.

``tests/test_typing.py`` runs ``mypy --strict`` on this file and expects no errors. Each
``assert_type`` pins what a call returns as a type checker sees it (``Any`` only where the
value is a checkpoint tree or whatever ``torch.load`` returns); each ``# type: ignore[...]``
below is a call the API must refuse, and ``--strict`` (``warn_unused_ignores``) fails the
check if it stops being refused.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ckptfix

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # the project's floor is 3.10: typing_extensions has it there
    from typing_extensions import assert_type

if TYPE_CHECKING:
    import torch


def _check_api(model: torch.nn.Module, path: Path) -> None:  # never called
    ckpt = ckptfix.read_checkpoint("x.pth")
    assert_type(ckpt, ckptfix.Checkpoint)
    assert_type(ckptfix.read_checkpoint(path, unsafe_load=True, allow_globals=["numpy.*"]), ckptfix.Checkpoint)
    assert_type(ckpt.root, Any)  # a checkpoint tree
    assert_type(ckpt.format, str)
    assert_type(ckpt.globals, set[str])

    result = ckptfix.strip_prefix(ckpt.root, "module.")
    assert_type(result, ckptfix.TransformResult)
    assert_type(ckptfix.add_prefix(result.root, "module.", keys=["state_dict"]), ckptfix.TransformResult)
    assert_type(result.renamed, int)
    assert_type(result.changes[0].renamed, list[tuple[str, str]])

    for sd_path, state_dict in ckptfix.find_state_dicts(ckpt.root):
        assert_type(sd_path, tuple[Any, ...])
        assert_type(state_dict, Mapping[str, Any])
        tensor = state_dict["weight"]
        if isinstance(tensor, ckptfix.TensorRef):
            assert_type(tensor.shape, tuple[int, ...])
            assert_type(tensor.storage, ckptfix.StorageRef)
            assert_type(tensor.storage.nbytes, int)

    assert_type(ckptfix.write_checkpoint(ckpt, result.root, "bare.pth"), int)
    assert_type(ckptfix.fix_prefix("ddp.pth", "bare.pth", mode="strip"), ckptfix.Report)
    options = ckptfix.ConvertOptions(select="state_dict", strip_prefixes=["model."])
    assert_type(ckptfix.convert("train.ckpt", "model.safetensors", options), ckptfix.Report)
    assert_type(ckptfix.convert(path, options=options).written, bool)
    assert_type(ckptfix.inspect_checkpoint("ddp.pth"), dict[str, Any])

    assert_type(ckptfix.load("ddp.pth", map_location="cpu"), Any)  # what torch.load returns
    assert_type(ckptfix.load(path, map_location={"cuda:1": "cuda:0"}, select="state_dict", strip_prefixes=["m."]), Any)
    report = ckptfix.load_into(model, "ddp.pth", strict=False)
    assert_type(report, ckptfix.LoadIntoReport)
    assert_type(report.missing, list[str])

    try:
        ckptfix.read_checkpoint(path)
    except ckptfix.UnsafeInputError as exc:
        assert_type(exc.global_name, str)
    except ckptfix.CkptfixError as exc:
        assert_type(exc.exit_code, ckptfix.ExitCode)
        assert_type(exc.hint, str | None)

    # what the API refuses: each must stay an error
    ckptfix.read_checkpoint(42)  # type: ignore[arg-type]
    ckptfix.strip_prefix(ckpt.root, prefix=["module."])  # type: ignore[arg-type]
    ckptfix.load(path, map_location=0)  # type: ignore[arg-type]
    ckptfix.load_into("not a model", path)  # type: ignore[arg-type]
