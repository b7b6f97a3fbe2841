"""``-`` for standard input or output, where a command reads or writes one file.

Checkpoints are read by offset (zip directories at the end, safetensors headers first), so a
pipe is first copied into a private temporary folder and read from there; an output named
``-`` is written there (atomically, as any output) and then copied to standard output, so a
failed write never sends half a checkpoint down the pipe. The temporary folder goes away
whatever happens.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CkptfixError, UsageError
from . import render

#: what ``-`` means on the command line
STREAM = "-"
#: the file name a piped input gets (what messages about it say)
STDIN_NAME = "stdin"


@contextmanager
def stdio_paths(
    in_path: str | None, out_path: str | None, out_format: str | None
) -> Iterator[tuple[str | None, str | None]]:
    """``(in, out)`` as real paths: ``-`` for IN is standard input copied to a temporary file,
    ``-`` for OUT a temporary file copied to standard output once the command succeeded."""
    if STREAM not in (in_path, out_path):
        yield in_path, out_path
        return
    if out_path == STREAM and out_format is None:
        raise UsageError("OUT - (standard output) has no extension to tell the format: add --format pth or safetensors")
    import shutil  # here: only a command reading or writing a pipe needs these (start-up, issue 26)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptfix-stdio-") as folder:
        real_in = in_path
        if in_path == STREAM:
            real_in = str(Path(folder) / STDIN_NAME)
            with open(real_in, "wb") as f:
                shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
        real_out = out_path
        if out_path == STREAM:
            real_out = str(Path(folder) / f"stdout.{'safetensors' if out_format == 'safetensors' else 'pth'}")
        names = {real: shown for real, shown in ((real_in, "<stdin>"), (real_out, "<stdout>")) if real != STREAM}
        render.STREAM_NAMES.update({k: v for k, v in names.items() if k})  # output names the stream
        try:
            yield real_in, real_out
        except CkptfixError as exc:  # name the stream, not the temporary file standing for it
            for real, shown in names.items():
                if real:
                    exc.message = exc.message.replace(real, shown)
            exc.args = (exc.message,)
            raise
        finally:
            for real in names:
                render.STREAM_NAMES.pop(str(real), None)
        if out_path == STREAM and real_out is not None and Path(real_out).is_file():
            with open(real_out, "rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()
