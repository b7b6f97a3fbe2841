"""The reader's tree from the native VM's output: the same records the Python VM builds.

The native VM (``native/src/vm.rs``) reads the pickle with the reader's semantics and hands back
(1) where it ended, the globals it named and each storage persistent id as columns, and (2) the
tree as a plain pickle without a single GLOBAL, in which every record is a persistent id into a
table made here: the record classes, the :class:`Global` records (made by the reader's own
``find_global``), the storages and their dtypes. CPython's C unpickler builds the tree from it; a
``TensorRef`` is a REDUCE of the class itself, so the Python code that runs per tensor is its
dataclass ``__init__`` (measured: ~0.7 us; bench/RESULTS.md "Native core: pickle VM").

The storages: a loader with a ``many`` method (:class:`BulkStorageLoader`: the torch zip
reader's) resolves every persistent id at once, over columns; any other loader, or a ``many``
that declines (it found something to refuse, or something it does not model), is called once
per persistent id in pickle order, as the Python VM calls it -- so caching and errors are the
loader's own, by construction.

The extent check (``model/walk.py``'s ``check_extents``): with a bulk loader the VM also returns
each tensor's storage and extent in bytes, and the nesting bound of the tree (vm_checks.rs);
when every extent fits its storage and the bound is within :data:`MAX_NESTING`, the loader is
told (``extents_checked``) and its reader can skip the Python walk, which would find nothing.
Anything else leaves the flag down and the Python check runs, with its own message.

Why this is safe to hand to ``pickle``: the bytes are the native VM's, not the file's; they name
no global (:class:`_TreeUnpickler` refuses any), every persistent id is an index into the table,
and the VM only returns trees it built within the same budgets as the Python VM.
"""

from __future__ import annotations

import io
import pickle
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import BadInputError
from ..model.refs import ABSENT, EMPTY_HOOKS, Global, ParamInfo, Reduce, StorageRef, TensorRef
from ..model.walk import MAX_NESTING
from ..native import vm as native_vm
from .vm import Budgets, collector_paused

#: the first entries of the persistent-id table, in vm.rs's PID_* order
_FIXED: tuple[Any, ...] = (TensorRef, OrderedDict, ABSENT, EMPTY_HOOKS, Reduce, ParamInfo)


class BulkStorageLoader(Protocol):
    """A storage loader that can also resolve all persistent ids at once (the zip reader's)."""

    #: set True here when the native pass found every tensor inside its storage (see the module)
    extents_checked: bool

    def __call__(self, storage_type: Global, key: str, location: str, numel: int, view: Any) -> StorageRef: ...

    def many(
        self, globals_: list[Global], kinds: list[int], keys: list[str], locations: list[str], numels: list[int]
    ) -> tuple[list[StorageRef], array[int]] | None:
        """The storage of every persistent id (``kinds`` index ``globals_``) and each one's size
        in bytes (``array("q")``), exactly as calling the loader per id in order would give them;
        or None where the per-id calls must run (they raise the error, or give the result)."""
        ...


class _TreeUnpickler(pickle.Unpickler):
    """CPython's C unpickler over the native VM's output, which names no global."""

    def find_class(self, module: str, name: str) -> Any:
        raise BadInputError(f"native engine bug: its output names a global {module}.{name}")


def load(
    data: Any,
    start: int,
    budgets: Budgets,
    table: bytes,
    find_global: Callable[[str, str], Global],
    load_storage: Callable[[Global, str, str, int, Any], StorageRef] | None,
) -> tuple[Any, int] | None:
    """The tree of the pickle at ``data[start:]`` and the offset after its STOP, or None where the
    Python VM is to read it (no native library, or a pickle using what the native VM leaves to it)."""
    if type(data) is not bytes:
        # a legacy file's memory map: its tree's persistent ids carry views, which the native VM
        # leaves to Python anyway, and passing a read-only map would import numpy (native/Input)
        return None
    limits = (budgets.max_objects, budgets.max_alloc, budgets.max_memo)
    bulk: BulkStorageLoader | None = load_storage if hasattr(load_storage, "many") else None  # type: ignore[assignment]
    out = native_vm.load(data, start, len(data), table, limits, load_storage is not None, bulk is not None)
    if out is None:
        return None
    stream = io.BytesIO(out)
    with collector_paused():
        end, names, kinds, keys, locations, numels, *checks = _TreeUnpickler(stream).load()
        globals_ = [find_global(module, name) for module, name in names]
        storages: list[Any] = []
        resolved = bulk.many(globals_, kinds, keys, locations, numels) if bulk is not None else None
        if resolved is not None:
            storages, sizes = resolved
        elif load_storage is not None:
            storages = [
                load_storage(globals_[kind], key, location, numel, None)
                for kind, key, location, numel in zip(kinds, keys, locations, numels)
            ]
        unpickler = _TreeUnpickler(stream)
        unpickler.persistent_load = [*_FIXED, *globals_, *storages, *[s.dtype for s in storages]].__getitem__  # type: ignore[method-assign]
        tree = unpickler.load()
    if bulk is not None and resolved is not None and checks:
        pids, needed, bound = checks
        bulk.extents_checked = 0 <= bound <= MAX_NESTING and native_vm.extents_fit(pids, needed, sizes)
    return tree, end
