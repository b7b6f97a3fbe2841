"""The native pickle VM (``native/src/vm.rs``): bytes in, two pickles out, or None.

This module only moves bytes across the C ABI; what the bytes mean -- the allow-list table going
in, the tree and storage columns coming out -- is :mod:`ckptfix.pickling.native_tree`'s.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from ..errors import UsageError
from . import ENGINE_VARIABLE, Input, call, function, requested_engine

#: the VM exports' C signature (ckptfix_vm_load and ckptfix_vm_read take the same arguments)
_VM_ARGS = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.c_int32,
)


@functools.cache
def _load_function() -> Any | None:
    try:
        return function("ckptfix_vm_load", *_VM_ARGS)
    except AttributeError:  # a library built before the VM was added (same ABI): the Python VM reads
        if requested_engine() == "native":  # ... but never in silence where the native engine is asked for
            raise UsageError(
                f"{ENGINE_VARIABLE}=native: the native library has no pickle VM (a stale build)",
                hint="rebuild it (pip install -e ., or cargo build --release in native/)",
            ) from None
        return None


@functools.cache
def _read_function() -> Any | None:
    """``ckptfix_vm_read`` (the VM with the extent-check columns), or None: a library built
    before it was added reads through ``ckptfix_vm_load`` and the Python checks run."""
    try:
        return function("ckptfix_vm_read", *_VM_ARGS)
    except AttributeError:
        return None


@functools.cache
def _extents_function() -> Any | None:
    try:
        return function("ckptfix_vm_extents", *(ctypes.c_void_p, ctypes.c_size_t) * 3)
    except AttributeError:
        return None


def available() -> bool:
    """True when the native engine runs (the library is built and not switched off)."""
    return _load_function() is not None


def load(
    data: Any,
    start: int,
    end: int,
    table: bytes,
    budgets: tuple[int, int, int],
    has_loader: bool,
    checks: bool = False,
) -> bytes | None:
    """Run the native VM over ``data[start:end]`` (bytes or a read-only mmap) with the allow-list
    ``table`` and ``(max_objects, max_alloc, max_memo)``; its output, or None where the Python VM
    is to read this pickle (no library, or something the native VM leaves to it). ``checks``:
    the meta pickle also carries the extent-check columns and the nesting bound where the
    library has them (vm_checks.rs; its length says which)."""
    fn = _load_function()
    if fn is None:
        return None
    if checks:
        fn = _read_function() or fn
    source = Input(data)
    limits = (ctypes.c_uint64 * 3)(*(min(b, (1 << 64) - 1) for b in budgets))
    return call(fn, source.address, source.length, start, end, table, len(table), limits, int(has_loader))


def extents_fit(pids: bytes, needed: bytes, sizes: Any) -> bool:
    """Whether every tensor's extent (``needed``, i64 per tensor, from :func:`load`'s columns)
    fits the byte size of its storage (``sizes``: an ``array("q")`` indexed by persistent id,
    ``pids`` u32 per tensor); False also where the library cannot say (Python checks then)."""
    fn = _extents_function()
    if fn is None:
        return False
    inputs = [Input(b) for b in (pids, needed, sizes)]
    return call(fn, *(v for i in inputs for v in (i.address, i.length))) is not None


@functools.cache
def _malloc_trim() -> Any | None:
    """glibc's ``malloc_trim``, or None (another C library: nothing to do)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return fn


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
#: blocks from 2 MiB up are mapped on their own; the heap keeps up to 4 MiB free at its top
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 2 << 20, 4 << 20


def steady_heap() -> None:
    """Fix glibc's mmap and trim thresholds (:func:`_fix_mmap_threshold`) before a native
    read: the read's own large blocks then leave no heap behind them either. Only where the
    native engine runs."""
    if available():
        _fix_mmap_threshold()


@functools.cache
def _fix_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at 2 MiB (once per process).

    Setting it turns off glibc's raising it (and the trim threshold, to twice it) to each
    large block freed: the read's VM arrays raise it to 32 MiB, and then every later block up
    to that size (the emitter's arrays and output, the pickle's bytes, the zip directory) came
    from the heap, where a grown array left its old copy behind and a freed one stayed in the
    process until a trim. Mapped on their own, they go back to the system when freed and grow
    in place (``mremap``). Blocks below 2 MiB (runs of small records, ~1 MiB each) stay in the
    heap, reused without new page faults: at glibc's initial 128 KiB the 200 000-tensor
    strip-module took 206 000 page faults (140 000 before), at 2 MiB 162 000. Measured there:
    the peak 260 -> 226 MiB (bench/RESULTS.md "Native core, slice 3: writer memory")."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system, once a read's transients are gone.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB): after
    the VM's arrays are freed, the read's later blocks of a few MB (the pickle, the output, the
    columns) come from the heap, and freed there they stay in the process. Measured on the
    200 000-tensor read: 189 MiB of RSS after it, 145 MiB once trimmed, a few ms to trim
    (bench/RESULTS.md "Native core, slice 3: reader"). Only where the native engine runs: the
    Python engine's figures stay as they were. The first call also fixes the mmap threshold
    (:func:`_fix_mmap_threshold`), so the blocks freed after it need no trim."""
    if available():
        _fix_mmap_threshold()
        fn = _malloc_trim()
        if fn is not None:
            fn(0)
