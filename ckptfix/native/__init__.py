"""The native engine: finding, loading and calling the Rust core (``native/`` in the source tree).

The pure-Python engine is the reference and is always there; the native library, built from
``native/`` when ``cargo`` is present at install time, runs the hot loops with the same
semantics (docs/engine.md). This package is the only place that knows the library exists: the
layers above ask for a native function and get ``None`` when the Python engine is to run.

Which engine runs: ``CKPTFIX_ENGINE`` is ``auto`` (the default: native when the library is
built), ``native`` (refuse to run without it: CI and benchmarks use this so a silent fallback
cannot pass for the native engine) or ``python`` (the reference, even when the library is
built). ``CKPTFIX_NATIVE_LIB`` names a library file to load instead of the installed one (a
``cargo build`` in a checkout).

Why ``ctypes`` and a C ABI rather than a binding crate: crates.io is not reachable where ckptfix
is built (so no PyO3 beyond Debian's old 0.17), one library serves every Python version (the
wheel is ``py3-none-<platform>``), and loading it costs about a millisecond.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import BadInputError, UsageError

ENGINE_VARIABLE = "CKPTFIX_ENGINE"
LIBRARY_VARIABLE = "CKPTFIX_NATIVE_LIB"
ENGINES = ("auto", "native", "python")

#: what the build leaves in this folder, per platform (setup.py's build_native writes it)
LIBRARY_NAMES = ("libckptfix_native.so", "libckptfix_native.dylib", "ckptfix_native.dll")

#: the ABI this module speaks (native/src/lib.rs: ABI_VERSION); a library built for another
#: one -- a stale build left in an editable checkout -- is not loaded
ABI_VERSION = 1

#: ffi.rs's Status values
OK, UNSUPPORTED, BAD_INPUT, INTERNAL = 0, 1, 2, 3


class OutBuf(ctypes.Structure):
    """ffi.rs's ``OutBuf``: bytes owned by the library until handed to ``ckptfix_free``."""

    _fields_ = (("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t), ("cap", ctypes.c_size_t))


def requested_engine() -> str:
    """``CKPTFIX_ENGINE``, checked (a typo must not quietly select an engine)."""
    choice = os.environ.get(ENGINE_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in ENGINES:
        raise UsageError(
            f"{ENGINE_VARIABLE}={choice!r} is not an engine",
            hint=f"use one of {', '.join(ENGINES)} (or unset it)",
        )
    return choice


def library_path() -> Path | None:
    """The native library to load: ``CKPTFIX_NATIVE_LIB``, else the one built into this package."""
    named = os.environ.get(LIBRARY_VARIABLE)
    if named:
        return Path(named)
    here = Path(__file__).parent
    return next((here / name for name in LIBRARY_NAMES if (here / name).is_file()), None)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded native library, or None when the Python engine is to run."""
    choice = requested_engine()
    if choice == "python":
        return None
    path = library_path()
    problem = None
    lib = None
    if path is None:
        problem = "no native library is built in this install"
    else:
        try:
            lib = ctypes.CDLL(str(path))
            lib.ckptfix_abi_version.restype = ctypes.c_uint32
            built_for = lib.ckptfix_abi_version()
        except (OSError, AttributeError) as exc:
            problem = f"{path} cannot be loaded ({exc})"
        else:
            if built_for != ABI_VERSION:
                problem = f"{path} was built for ABI {built_for}, this ckptfix speaks {ABI_VERSION} (a stale build)"
    if problem is not None:
        if choice == "native":
            raise UsageError(
                f"{ENGINE_VARIABLE}=native: {problem}",
                hint="install from a source tree with cargo on PATH (pip install -e .), or unset CKPTFIX_ENGINE",
            )
        return None
    assert lib is not None
    lib.ckptfix_free.argtypes = (OutBuf,)
    lib.ckptfix_free.restype = None
    return lib


def engine() -> str:
    """The engine that runs in this process: ``native`` or ``python``."""
    return "native" if library() is not None else "python"


def function(name: str, *argtypes: Any) -> Any | None:
    """The library's exported ``name`` with its argument types set (an ``OutBuf*`` last, an
    ``int`` status returned), or None when the Python engine is to run."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes = (*argtypes, ctypes.POINTER(OutBuf))
    fn.restype = ctypes.c_int32
    return fn


class Input:
    """A Python buffer as the ``(pointer, length)`` pair the C ABI takes, kept alive with it.

    ``bytes`` are passed in place; a writable buffer (``bytearray``, a writable ``mmap``) too;
    a read-only ``memoryview``/``mmap`` goes through numpy, which exposes its address without a
    copy (ctypes cannot).
    """

    __slots__ = ("_keep", "address", "length")

    def __init__(self, data: Any) -> None:
        view = memoryview(data)
        self.length = view.nbytes
        if self.length == 0:
            self._keep: Any = None
            self.address = None
        elif isinstance(data, bytes):
            self._keep = ctypes.c_char_p(data)
            self.address = ctypes.cast(self._keep, ctypes.c_void_p).value
        elif not view.readonly:
            self._keep = (ctypes.c_char * self.length).from_buffer(view)
            self.address = ctypes.addressof(self._keep)
        else:
            import numpy as np

            self._keep = np.frombuffer(view, dtype=np.uint8)
            self.address = self._keep.ctypes.data


def call_into(sink: Callable[[memoryview], object], fn: Any, *args: Any) -> bool:
    """:func:`call`, handing the output to ``sink`` as a view of the library's own buffer (no
    copy into a ``bytes``: for outputs of many MB, such as a zip's central directory, written
    once and dropped); the view is invalid once ``sink`` returns. True when ``sink`` got the
    output, False for "leave it to the Python engine"; errors raise as :func:`call`'s do."""
    out = OutBuf()
    status = fn(*args, ctypes.byref(out))
    held = False  # the buffer is still exported after ``sink``: leaked rather than freed
    try:
        if status == OK:
            if out.len:
                buffer = (ctypes.c_char * out.len).from_address(out.ptr)
                raw = memoryview(buffer)
                view = raw.cast("B")
                try:
                    sink(view)
                finally:
                    # a view kept past ``sink`` must fail when used, never read freed memory:
                    # ours are released here, and while any other view of the buffer lives (one
                    # made from ours holds the buffer object), the memory is left allocated
                    try:
                        view.release()
                        raw.release()
                    except BufferError:
                        pass
                    held = sys.getrefcount(buffer) > 2  # more than this name and the argument
            return True
        message = ctypes.string_at(out.ptr, out.len).decode("utf-8", "replace") if out.len else ""
    finally:
        library_ = library()
        if library_ is not None and out.ptr and not held:
            library_.ckptfix_free(out)
    if status == UNSUPPORTED:
        return False
    if status == BAD_INPUT:
        raise BadInputError(message)
    raise RuntimeError(message or f"native call returned status {status}")


def call(fn: Any, *args: Any) -> bytes | None:
    """Call an exported function; its output bytes, or None for "leave it to the Python engine".

    A ``BadInput`` status raises :class:`BadInputError` with the library's one-line message (the
    caller adds the file name); ``Internal`` (a caught panic) raises RuntimeError: a bug, exit 5.
    """
    out = OutBuf()
    status = fn(*args, ctypes.byref(out))
    try:
        data = ctypes.string_at(out.ptr, out.len) if out.len else b""
    finally:
        library_ = library()
        if library_ is not None and out.ptr:
            library_.ckptfix_free(out)
    if status == OK:
        return data
    if status == UNSUPPORTED:
        return None
    message = data.decode("utf-8", "replace")
    if status == BAD_INPUT:
        raise BadInputError(message)
    raise RuntimeError(message or f"native call returned status {status}")
