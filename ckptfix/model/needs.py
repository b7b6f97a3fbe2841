"""The one gate in front of torch: the core install has no torch (``pip install ckptfix``), so
every function that imports it calls :func:`need_torch` first, and a missing torch becomes one
line -- "needs torch: pip install 'ckptfix[torch]'" -- instead of an ImportError traceback.
"""

from __future__ import annotations

import sys

from ..errors import NeedsTorchError


def need_torch() -> None:
    """Return if torch can be imported; raise :class:`~ckptfix.errors.NeedsTorchError` if it is
    not installed. A torch that is installed but broken (one of its own imports fails) is not
    hidden behind that message: its error goes on."""
    if sys.modules.get("torch") is not None:
        return
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        raise NeedsTorchError from exc
