"""THE walk over a checkpoint tree, and the few operations built on it.

A tree is plain Python containers (dict, OrderedDict with its ``_metadata``, list, tuple, set)
whose leaves are the records of :mod:`ckptfix.model.refs`. :func:`walk` is the only traversal:
iterative, each container entered once, cycle-safe, depth-limited by :data:`MAX_NESTING` (the
reader's own limit). :func:`substitute` rebuilds a tree with some nodes replaced, keeping
sharing and cycles; :func:`check_extents` checks every tensor against its storage once the tree
is final.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, countOf, mul
from typing import Any, TypeAlias, TypeVar, cast

from ..errors import BadInputError
from .dtypes import DTYPE_ITEMSIZE
from .paths import Path, format_path
from .refs import ABSENT, EMPTY_HOOKS, Global, OpaqueObject, Reduce, StorageRef, TensorRef, Tree, _EmptyHooks

_K = TypeVar("_K")
_V = TypeVar("_V")

#: containers nested deeper than this are refused: real checkpoints nest a few levels; a hostile
#: pickle nests 10**5 deep to crash recursive code. The reader, the walk and the writer share it.
MAX_NESTING = 1000

#: path element for an OrderedDict's attributes (``Module.state_dict()``'s ``_metadata``)
ATTRS = "__dict__"


def _dict_children(value: dict[Any, Any]) -> Iterable[tuple[Any, Any]]:
    return value.items()


def _mapping_children(value: Any) -> Iterable[tuple[Any, Any]]:
    attrs = getattr(value, "__dict__", None)
    return chain(value.items(), ((ATTRS, attrs),)) if attrs else value.items()


def _reduce_children(value: Reduce) -> Iterable[tuple[Any, Any]]:
    items: list[tuple[Any, Any]] = list(enumerate(value.args))
    if value.state is not ABSENT:
        items.append(("__state__", value.state))
    return items


def _opaque_children(value: OpaqueObject) -> Iterable[tuple[Any, Any]]:
    items: list[tuple[Any, Any]] = [
        ("__args__", value.args),
        ("__items__", value.items),
        ("__dictitems__", value.dictitems),
    ]
    if value.kwargs:
        items.append(("__kwargs__", value.kwargs))
    if value.state is not ABSENT:
        items.append(("__state__", value.state))
    return items


def _tensor_children(value: TensorRef) -> Iterable[tuple[Any, Any]]:
    """What a tensor record carries besides its storage: hooks, metadata, parameter state --
    all data the pickle made, so the walk (depth, extents, storages) must see inside them."""
    items: list[tuple[Any, Any]] = []
    if value.hooks:
        items.append(("__hooks__", value.hooks))
    if value.metadata is not ABSENT:
        items.append(("__metadata__", value.metadata))
    if value.param is not None:
        items.append(("__param__", (value.param.requires_grad, value.param.hooks, value.param.state)))
    return items


#: exact type -> its children as (key, child) pairs: the one place that says what a node holds
CHILDREN: dict[type, Callable[[Any], Iterable[tuple[Any, Any]]]] = {
    dict: _dict_children,
    OrderedDict: _mapping_children,
    Counter: _mapping_children,
    list: enumerate,
    tuple: enumerate,
    set: enumerate,
    frozenset: enumerate,
    Reduce: _reduce_children,
    OpaqueObject: _opaque_children,
    TensorRef: _tensor_children,
}
#: values that hold nothing the walk needs to see
_ATOMS: frozenset[type] = frozenset({str, int, float, bool, type(None), bytes, bytearray, complex, Global, _EmptyHooks})


def _getter(value: Any) -> Callable[[Any], Iterable[tuple[Any, Any]]] | None:
    getter = CHILDREN.get(type(value))
    if getter is not None or type(value) in _ATOMS:
        return getter
    if isinstance(value, Mapping):
        return _mapping_children
    if isinstance(value, (list, tuple)):
        return enumerate
    if isinstance(value, OpaqueObject):
        return _opaque_children
    if isinstance(value, TensorRef):
        return _tensor_children
    return None


def children_of(value: Any) -> list[tuple[Any, Any]] | None:
    """The (key, child) pairs of a node, or None for an atom or a storage."""
    getter = _getter(value)
    return None if getter is None else list(getter(value))


def walk(
    root: Tree,
    descend: Callable[[Path, Any], bool] | None = None,
    *,
    limit: int = MAX_NESTING,
    leaves: bool = False,
    revisit: Callable[[Any], None] | None = None,
) -> Iterator[tuple[Path, Any]]:
    """THE traversal: every container and record under ``root`` with its path, in order.

    Iterative (a stack of child iterators: any depth the reader accepts, no recursion), and
    each container is entered once (a visited set by ``id``), so shared sub-trees cost once
    and cycles end. Tensor and storage records are yielded on every path that reaches them
    (a tied weight has two names) but entered once; a tensor's storage is not yielded (it is
    ``tensor.storage``), a storage pickled on its own is. Atoms (str, int, ...) are not
    yielded. ``descend(path, value)`` returning False keeps the walk out of that node.
    Deeper than ``limit`` is :class:`BadInputError` -- the same limit the reader enforces.
    ``leaves=True`` also yields everything else a container holds -- atoms, real torch
    tensors, anything a transform put there -- on every path that reaches it.
    ``revisit(value)`` is called each time a container or record is reached again (shared, or
    a cycle): the writer memoizes exactly those.
    """
    getter = _getter(root)
    if getter is None:
        if leaves or isinstance(root, StorageRef):
            yield (), root
        return
    seen: set[int] = {id(root)}
    yield (), root
    if descend is not None and not descend((), root):
        return
    stack: list[tuple[Path, Iterator[tuple[Any, Any]]]] = [((), iter(getter(root)))]
    atoms, children, empty = _ATOMS, CHILDREN, EMPTY_HOOKS
    while stack:
        path, items = stack[-1]
        for key, child in items:
            kind = type(child)
            if kind in atoms:
                if leaves:
                    yield path + (key,), child
                continue
            if kind is TensorRef:
                child_path = path + (key,)
                hooks = child.hooks  # the shared empty marker by identity: its __bool__ is a Python call
                inner = (hooks is not empty and bool(hooks)) or child.metadata is not ABSENT or child.param is not None
                first = False
                if inner or revisit is not None:
                    first = id(child) not in seen
                    if first:
                        seen.add(id(child))
                    elif revisit is not None:
                        revisit(child)
                yield child_path, child
                if inner and first and (descend is None or descend(child_path, child)):
                    stack.append((child_path, iter(_tensor_children(child))))
                    break
                continue
            if kind is StorageRef:
                yield path + (key,), child
                continue
            child_getter = children.get(kind) or _getter(child)
            if child_getter is None:
                if leaves:
                    yield path + (key,), child
                continue
            if id(child) in seen:
                if revisit is not None:
                    revisit(child)
                continue
            seen.add(id(child))
            child_path = path + (key,)
            if len(child_path) > limit:
                raise BadInputError(f"corrupt or hostile checkpoint: containers nested more than {limit} deep")
            yield child_path, child
            if descend is None or descend(child_path, child):
                stack.append((child_path, iter(child_getter(child))))
                break
        else:
            stack.pop()


@dataclass(slots=True)
class Census:
    """What :func:`walk` with ``leaves=True`` would yield, sorted into lists by kind, in walk
    order: :func:`census` makes it in one pass with no Python call per tensor, for the code that
    counts and sums over a whole tree (``inspect``) rather than looking at each node's path."""

    #: every tensor record, once per path that reaches it (a tied weight twice), as walk yields them
    tensors: list[TensorRef] = field(default_factory=list)
    #: storage records held directly (not through a tensor), once per path
    storages: list[StorageRef] = field(default_factory=list)
    #: the rest that is neither an atom nor a plain container: Reduce and OpaqueObject records
    #: (once each: they are entered once), and leaves walk does not know (real torch tensors,
    #: on every path)
    records: list[Any] = field(default_factory=list)

    def distinct_storages(self) -> list[StorageRef]:
        """Every storage record the tree uses, through tensors or directly, once each: those
        of the tensors first (in walk order), then the others (not :func:`iter_storages`'s
        order where a storage is pickled on its own: for sums and sets)."""
        used = list(map(_STORAGE, self.tensors)) + self.storages
        return list(dict(zip(map(id, used), used)).values())

    def nbytes(self) -> int:
        """The bytes of :meth:`distinct_storages` together (each counted once)."""
        storages = self.distinct_storages()
        return sum(map(mul, map(_NUMEL, storages), map(_ITEMSIZE, storages)))


_STORAGE, _NUMEL, _ITEMSIZE = attrgetter("storage"), attrgetter("numel"), attrgetter("itemsize")

#: what census files as a record: the nodes that are neither plain containers nor tensors
_RECORDS = (Reduce, OpaqueObject)


#: what :func:`census` learnt of the plain containers it took in bulk, by ``id``: their tensors
#: and the dicts inside them, so a census of a part of the same tree (inspect's per-entry
#: counts) takes them again without looking. Valid while the tree is not changed.
BulkMemo: TypeAlias = dict[int, tuple[list[TensorRef], set[int]]]


def census(root: Tree, *, limit: int = MAX_NESTING, memo: BulkMemo | None = None) -> Census:
    """One pass over ``root`` with :func:`walk`'s rules (iterative, each container entered once,
    tensors counted on every path, the same depth limit), collecting instead of yielding: the
    loop body for a tensor is a few bytecodes, where a walk costs a generator step and a path;
    a plain container of tensors (or of plain dicts of tensors) is taken whole, in C loops.
    ``memo``: share what was taken whole between censuses of one unchanged tree."""
    found = Census()
    tensors, storages, records = found.tensors, found.storages, found.records
    getter = _getter(root)
    if getter is None:
        if isinstance(root, StorageRef):
            storages.append(root)
        elif type(root) not in _ATOMS:
            records.append(root)
        return found
    if isinstance(root, TensorRef):
        tensors.append(root)
    elif isinstance(root, _RECORDS):
        records.append(root)
    seen: set[int] = {id(root)}
    memo = {} if memo is None else memo
    if limit >= 1:
        bulk = _bulk_tensors(root, seen, memo)
        if bulk is not None:
            tensors += bulk
            return found
    stack: list[tuple[int, Iterator[tuple[Any, Any]]]] = [(0, iter(getter(root)))]
    atoms, children, empty, tensor_type = _ATOMS, CHILDREN, EMPTY_HOOKS, TensorRef
    while stack:
        depth, items = stack[-1]
        for _, child in items:
            kind = type(child)
            if kind in atoms:
                continue
            if kind is tensor_type:
                tensors.append(child)
                hooks = child.hooks  # the shared empty marker by identity: its __bool__ is a Python call
                if ((hooks is not empty and hooks) or child.metadata is not ABSENT or child.param is not None) and id(
                    child
                ) not in seen:
                    seen.add(id(child))
                    stack.append((depth + 1, iter(_tensor_children(child))))
                    break
                continue
            if kind is StorageRef:
                storages.append(child)
                continue
            child_getter = children.get(kind) or _getter(child)
            if child_getter is None:
                if not isinstance(child, StorageRef):
                    records.append(child)
                else:
                    storages.append(child)
                continue
            if id(child) in seen:
                continue
            seen.add(id(child))
            if depth + 1 > limit:
                raise BadInputError(f"corrupt or hostile checkpoint: containers nested more than {limit} deep")
            if isinstance(child, TensorRef):
                tensors.append(child)
            elif isinstance(child, _RECORDS):
                records.append(child)
            elif depth + 2 <= limit:
                bulk = _bulk_tensors(child, seen, memo)
                if bulk is not None:
                    tensors += bulk
                    continue
            stack.append((depth + 1, iter(child_getter(child))))
            break
        else:
            stack.pop()
    return found


#: the types census takes in bulk: atoms, tensor records, and plain dicts of those
_BULK: frozenset[type] = _ATOMS | {TensorRef, dict}
_FLAT_TENSORS: frozenset[type] = _ATOMS | {TensorRef}
#: what a tensor record holds besides its view, and what a plain one (nothing to walk into) holds
_PLAIN_PARTS = attrgetter("hooks", "metadata", "param")
_PLAIN = (EMPTY_HOOKS, ABSENT, None)


def _bulk_tensors(node: Any, seen: set[int], memo: BulkMemo) -> list[TensorRef] | None:
    """The tensor records under a plain dict, list or tuple holding only atoms, tensor records
    and plain dicts of those (a state dict; an optimizer's ``{param_id: {"exp_avg": ...}}``),
    in walk order, taken in C loops; its dicts are marked seen. None when ``node`` is anything
    else -- a tensor with hooks, a dict reached twice... -- and the walk must go one by one."""
    known = memo.get(id(node))
    if known is not None:
        if not seen.isdisjoint(known[1]):
            return None
        seen.update(known[1])
        return known[0]
    found = _bulk_of(node)
    if found is None:
        return None
    tensors, ids = found
    if not seen.isdisjoint(ids):  # a dict the walk has entered already: one by one
        return None
    seen.update(ids)
    memo[id(node)] = found
    return tensors


def _bulk_of(node: Any) -> tuple[list[TensorRef], set[int]] | None:
    """:func:`_bulk_tensors`' look at ``node`` alone: its tensors and the ids of its dicts."""
    kind = type(node)
    values = list(node.values()) if kind is dict else list(node) if kind is list or kind is tuple else None
    if values is None:
        return None
    kinds = set(map(type, values))
    if not kinds <= _BULK:
        return None
    dicts: list[Any] = []
    if dict in kinds:
        if kinds - _ATOMS != {dict}:  # dicts beside tensors: walk order interleaves them
            return None
        dicts = [value for value in values if type(value) is dict]
        ids = set(map(id, dicts))
        if len(ids) != len(dicts):
            return None  # one reached twice: the walk counts its tensors once
        values = list(chain.from_iterable(map(dict.values, dicts)))
        kinds = set(map(type, values))
        if not kinds <= _FLAT_TENSORS:
            return None
    tensors = values if kinds == {TensorRef} else [value for value in values if type(value) is TensorRef]
    # one pass for the three attributes (a third of the time of three ``all(map(is_, ...))``):
    # each is compared to its plain value by identity first, and no record in a tree claims
    # equality with EMPTY_HOOKS, ABSENT or None without being it
    if countOf(map(_PLAIN_PARTS, tensors), _PLAIN) != len(tensors):
        return None  # a tensor with something to walk into
    return tensors, ids if dicts else set()


def check_nesting(root: Tree, limit: int = MAX_NESTING) -> None:
    """Raise :class:`BadInputError` if anything nests deeper than ``limit`` (cycles are fine)."""
    for _ in walk(root, limit=limit):
        pass


def check_extents(root: Tree, where: str = "") -> None:
    """Every tensor's bytes must lie inside its storage, and every storage inside its source.

    Called once the whole tree is final (the pickle is done and the readers know where every
    storage's bytes are), before anything is written: this is the one place that guards every
    writer against reading outside a record. Integer arithmetic is exact (no overflow).
    """
    prefix = f"{where}: " if where else ""
    checked: set[int] = set()
    for path, value in walk(root):
        if isinstance(value, StorageRef):
            if id(value) not in checked:
                _check_storage(value, prefix)
                checked.add(id(value))
            continue
        if type(value) is not TensorRef or id(value) in checked:
            continue  # one tensor object reached by many paths (memoized) is checked once
        checked.add(id(value))
        storage = value.storage
        if id(storage) not in checked:
            _check_storage(storage, prefix)
            checked.add(id(storage))
        itemsize = DTYPE_ITEMSIZE[value.dtype]
        if not all(-_INT64_LIMIT <= v < _INT64_LIMIT for v in (value.storage_offset, *value.shape, *value.stride)):
            # torch reads each as a C int64 ("Overflow when unpacking long long"); an empty tensor
            # at offset 2**62 is fine and is written as it is
            raise BadInputError(
                f"{prefix}corrupt tensor record at {format_path(path) or '(top level)'}: its storage offset, "
                "sizes or strides do not fit in 64 bits (torch refuses this file too)"
            )
        numel = 1
        for n in value.shape:
            numel *= n
        if numel * itemsize >= _INT64_LIMIT:  # torch: "numel: integer multiplication overflow"
            raise BadInputError(
                f"{prefix}corrupt tensor record at {format_path(path) or '(top level)'}: a tensor of shape "
                f"{list(value.shape)[:8]} has more elements than torch can count (it refuses this file too)"
            )
        if numel == 0:
            continue
        last = value.storage_offset + sum((n - 1) * s for n, s in zip(value.shape, value.stride))
        needed = (last + 1) * itemsize
        if needed > storage.nbytes:
            raise BadInputError(
                f"{prefix}corrupt tensor record at {format_path(path) or '(top level)'}: a {value.dtype} tensor "
                f"of shape {list(value.shape)[:8]} needs {needed} bytes but its storage {storage.key!r:.40} "
                f"holds {storage.nbytes}"
            )


_INT64_LIMIT = 1 << 63


def _check_storage(storage: StorageRef, prefix: str) -> None:
    size = getattr(storage.source, "size", None)
    if storage.source is None or size is None:
        raise BadInputError(f"{prefix}storage {storage.key!r:.40} is used but its data is missing: truncated")
    if storage.nbytes > size:
        raise BadInputError(
            f"{prefix}storage {storage.key!r:.40} declares {storage.nbytes} bytes but its record holds {size}: "
            "the file is truncated or corrupt"
        )


def children(value: Any) -> Iterator[tuple[Any, Any]]:
    """(key, child) pairs of a container, in order; nothing for leaves."""
    if isinstance(value, Mapping):
        yield from value.items()
    elif isinstance(value, (list, tuple)):
        yield from enumerate(value)


def _not_into_tensors(path: Path, value: Any) -> bool:
    return not isinstance(value, TensorRef)


def iter_tensors(root: Tree) -> Iterator[tuple[Path, TensorRef]]:
    """Every :class:`TensorRef` in the tree, with its path, including inside recorded calls."""
    for path, value in walk(root):
        if isinstance(value, TensorRef):
            yield path, value


def iter_storages(root: Tree) -> Iterator[StorageRef]:
    """Every distinct :class:`StorageRef` the tree uses, through tensors or directly."""
    seen: set[int] = set()
    for _, value in walk(root):
        storage = value.storage if isinstance(value, TensorRef) else value
        if isinstance(storage, StorageRef) and id(storage) not in seen:
            seen.add(id(storage))
            yield storage


#: the values :func:`substitute` never enters: atoms, and the records it keeps as they are
_NOT_ENTERED: frozenset[type] = _ATOMS | {TensorRef, StorageRef}
#: containers a substitution creates empty and fills afterwards, so cycles through them close
_MUTABLE = (dict, list, set, OpaqueObject)


def substitute(root: Tree, replacements: dict[int, Tree]) -> Tree:
    """A copy of ``root`` where every object whose ``id`` is in ``replacements`` is replaced.

    Only containers on the way to a replaced object are copied; everything else is shared
    with ``root`` (and nothing in ``root`` or in the replacement values is changed). Replacing
    by identity keeps pickle-level sharing intact: a state dict referenced from two places
    (``model`` and ``ema`` being the same object) is replaced in both, exactly as torch's
    in-place edits would change it in both. Cycles are kept: a dict that contains itself
    becomes a new dict that contains *itself* -- references to a replaced object are
    redirected everywhere, inside the replacement values too.

    How: one iterative pass collects the containers in post-order over the graph in which
    every reference to a replaced object already leads to its replacement, and marks "dirty"
    the ones that hold such a reference or a dirty container. Dirty mutable containers are
    made empty first, dirty tuples and records are then built children-first (a cycle always
    passes through a mutable container, which already exists), and the empty ones are filled.
    """
    if not replacements:
        return root

    def subst(value: Any) -> Any:
        return replacements.get(id(value), value)

    order: list[Any] = []
    finished: dict[int, bool] = {}
    dirty: set[int] = set()
    # (node, None) enters a node; (node, (holds a replaced object, its container children))
    # leaves it, once its children are done
    stack: list[tuple[Any, tuple[bool, list[Any]] | None]] = [(subst(root), None)]
    back_edges = False
    leaves, flat, replaced, get = (TensorRef, StorageRef), _NOT_ENTERED, replacements.keys(), replacements.get

    def holds_dirty(value: Any) -> bool:
        getter = _getter(value)
        return getter is not None and any(
            id(child) in replacements or id(subst(child)) in dirty for _, child in getter(value)
        )

    while stack:
        value, leaving = stack.pop()
        key = id(value)
        if leaving is not None:
            finished[key] = True
            order.append(value)
            direct, inner = leaving  # children are done (post-order), except along a cycle
            if direct or not dirty.isdisjoint(map(id, inner)):
                dirty.add(key)
            continue
        if key in finished:
            back_edges |= not finished[key]
            continue
        getter = _getter(value)
        if getter is None or isinstance(value, leaves):
            continue
        # the children in bulk (C loops): a state dict of tensors costs no Python step per tensor
        values = list(value.values()) if type(value) is dict else [child for _, child in getter(value)]
        direct = not replaced.isdisjoint(map(id, values))
        if direct:
            values = [get(id(child), child) for child in values]
        inner = [child for child in values if type(child) not in flat]
        if len(inner) > 1 and _all_flat(inner, flat, replaced):
            finished.update(dict.fromkeys(map(id, inner), True))  # clean, whatever else holds them
            inner = []
        if not inner:  # only atoms and records below: nothing in it can change but its own children
            finished[key] = True
            if direct:
                order.append(value)
                dirty.add(key)
            continue
        finished[key] = False
        stack.append((value, (direct, inner)))
        for child in inner:
            state = finished.get(id(child))
            if state is None:
                stack.append((child, None))
            elif not state:  # a container being worked on holds this one: a cycle
                back_edges = True
    while back_edges:  # news travel back along cycles: repeat until nothing changes
        back_edges = False
        for value in order:
            if id(value) not in dirty and holds_dirty(value):
                dirty.add(id(value))
                back_edges = True

    new: dict[int, Any] = {}

    def mapped(child: Any) -> Any:
        child = subst(child)
        return new.get(id(child), child)

    fill: list[tuple[Any, Any]] = []
    for value in order:
        if id(value) in dirty and isinstance(value, _MUTABLE):
            new[id(value)] = shell = _empty_like(value)
            fill.append((value, shell))
    for value in order:
        if id(value) in dirty and id(value) not in new:
            new[id(value)] = _rebuilt(value, mapped)
    for old, shell in fill:
        _fill(old, shell, mapped)
    return mapped(root)


def _all_flat(nodes: list[Any], flat: frozenset[type], replaced: Any) -> bool:
    """Whether ``nodes`` -- plain dicts, or plain lists and tuples -- hold only atoms and
    records, none of them replaced: then none of them can change, and :func:`substitute` need
    not enter them one by one (an optimizer state's 50 000 ``{"exp_avg": ...}`` dicts). The
    test runs in C loops over all their children at once."""
    kinds = set(map(type, nodes))
    if kinds == {dict}:
        grandchildren = list(chain.from_iterable(map(dict.values, nodes)))
    elif kinds <= {list, tuple}:
        grandchildren = list(chain.from_iterable(nodes))
    else:
        return False
    return set(map(type, grandchildren)) <= flat and bool(replaced.isdisjoint(map(id, grandchildren)))


def _empty_like(value: Any) -> Any:
    if isinstance(value, OpaqueObject):
        return OpaqueObject(value.global_, (), value.kind, None)
    return type(value)()


def _fill(old: Any, shell: Any, mapped: Callable[[Any], Any]) -> None:
    if isinstance(old, Mapping):
        for k, v in old.items():
            shell[k] = mapped(v)
        attrs = getattr(old, "__dict__", None)
        if attrs:
            shell.__dict__.update(mapped(attrs))
    elif isinstance(old, list):
        shell.extend(mapped(v) for v in old)
    elif isinstance(old, set):
        shell.update(mapped(v) for v in old)
    elif isinstance(old, OpaqueObject):
        shell.args = mapped(old.args)
        shell.kwargs = mapped(old.kwargs) if old.kwargs else old.kwargs
        shell.items = mapped(old.items)
        shell.dictitems = mapped(old.dictitems)
        shell.state = mapped(old.state) if old.state is not ABSENT else ABSENT


def _rebuilt(value: Any, mapped: Callable[[Any], Any]) -> Any:
    if isinstance(value, Reduce):
        state = mapped(value.state) if value.state is not ABSENT else ABSENT
        return Reduce(value.func, mapped(value.args), state)
    if isinstance(value, TensorRef):
        return value
    return type(value)(mapped(v) for v in value)


def copy_mapping(original: Mapping[_K, _V], items: Iterable[tuple[_K, _V]]) -> MutableMapping[_K, _V]:
    """A mapping of the same type as ``original`` with ``items``, keeping instance attributes
    such as the ``_metadata`` that ``Module.state_dict()`` attaches to its OrderedDict.
    ``original``'s type must be a mutable mapping that takes no arguments (a tree's are)."""
    copy = cast("MutableMapping[_K, _V]", type(original)())
    if type(copy) in (dict, OrderedDict):
        copy.update(items)  # one C loop (a subclass's own __setitem__ would be bypassed: those loop)
    else:
        for k, v in items:
            copy[k] = v
    attrs = getattr(original, "__dict__", None)
    if attrs:
        copy.__dict__.update(attrs)
    return copy
