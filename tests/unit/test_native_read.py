"""The native read of a torch zip against the Python engine's: the same tree, or the same message.

On the native engine ``read_torch_zip`` resolves every storage at once over the VM's columns
(``torchzip._ZipStorages.many``), has the VM compute each tensor's extent and the tree's nesting
bound (native/src/vm_checks.rs) and skips ``check_extents``' walk when all of it passes; both
engines check record names over one joined string (``torchzip._names_pass`` and friends). Each
fast path declines to the reference wherever it is not sure, so the results must be the Python
engine's exactly: here on hostile zips (lying sizes, missing, compressed and shared records,
extents out of range or overflowing, deep nesting) and mutants of real fixtures, comparing trees
(types, values, sharing, storage sources) or messages -- and checking that the fast paths really
ran on the clean inputs (a fast path that always declined would pass the comparison).
"""

from __future__ import annotations

import random
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hostile
import pytest
from conftest import needs_native
from test_native_vm import canon, mutants

from ckptfix import native
from ckptfix.errors import BadInputError, UnsafeInputError
from ckptfix.fileio.ziparchive import ZipDirectory
from ckptfix.formats import torchzip
from ckptfix.model.walk import iter_storages
from ckptfix.native import vm as native_vm

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(autouse=True, scope="module")
def native_engine() -> Iterator[None]:
    """Both engines are compared whatever CKPTFIX_ENGINE says: load the library here."""
    caches = (native.library, native_vm._load_function, native_vm._read_function, native_vm._extents_function)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTFIX_ENGINE", "native")
        for cache in caches:
            cache.cache_clear()
        yield
    for cache in caches:
        cache.cache_clear()


class Reads:
    """``read_torch_zip`` on either engine, noting which paths the native one took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bulk = 0  # storages resolved at once
        self.walked = 0  # check_extents ran
        real_many, real_check = torchzip._ZipStorages.many, torchzip.check_extents

        def many(loader: Any, *args: Any) -> Any:
            found = real_many(loader, *args)
            self.bulk += found is not None
            return found

        def check_extents(*args: Any) -> None:
            self.walked += 1
            real_check(*args)

        monkeypatch.setattr(torchzip._ZipStorages, "many", many)
        monkeypatch.setattr(torchzip, "check_extents", check_extents)
        self.monkeypatch = monkeypatch

    def read(self, path: Path, native_engine: bool) -> Any:
        with self.monkeypatch.context() as patch:
            if not native_engine:  # the Python VM, the per-id loader and check_extents
                patch.setattr(native_vm, "load", lambda *args: None)
            try:
                with open(path, "rb") as f:
                    root, _ = torchzip.read_torch_zip(str(path), f, path.stat().st_size, set())
            except (BadInputError, UnsafeInputError) as exc:
                return (type(exc).__name__, str(exc))
        return ("ok", canon(root), [(s.key, s.source) for s in iter_storages(root)])

    def same(self, path: Path) -> Any:
        """Both engines' results, asserted equal; the native one's."""
        got = self.read(path, True)
        assert got == self.read(path, False), path
        return got


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    return Reads(monkeypatch)


def zip_file(path: Path, payload: bytes, records: dict[str, bytes], deflated: tuple[str, ...] = ()) -> Path:
    """A torch-layout zip: ``payload`` as data.pkl and ``records`` as data/<key>."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data, zipfile.ZIP_DEFLATED if key in deflated else zipfile.ZIP_STORED)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
    return path


def two(first: bytes, second: bytes) -> bytes:
    """``{"sd": {"module.w": first}, "x": second}``"""
    return hostile.ckpt(second, weight=first)


LONG = hostile.g("torch", "LongStorage")
UNTYPED = hostile.g("torch.storage", "UntypedStorage")
T = hostile.tensor
V3 = hostile.tensor_v3
P = hostile.pid
B16 = {"0": bytes(16)}

#: (payload, records, deflated records, whether the native fast paths run all the way)
CASES: list[tuple[bytes, dict[str, bytes], tuple[str, ...], bool]] = [
    (hostile.ckpt(), B16, (), True),
    (hostile.ckpt(), {"0": bytes(12)}, (), False),  # the record is shorter than the id declares
    (hostile.ckpt(), {"0": bytes(20)}, (), False),  # ... or longer
    (hostile.ckpt(), {}, (), False),  # missing
    (hostile.ckpt(), {"1": bytes(16)}, (), False),  # another key
    (hostile.ckpt(), B16, ("0",), False),  # compressed: the per-id loader checks its inflation
    (hostile.ckpt(weight=T(P(cls=hostile.g("torch.storage", "TypedStorage")))), B16, (), False),
    (two(T(), T(P("0", 4))), B16, (), True),  # one storage, two tensors: shared
    (two(T(), T(P("0", 2))), B16, (), False),  # a later use declaring another size (torch ignores it)
    (two(T(P("0", 2), size=(2,)), T(P("0", 1, LONG), size=(1,))), {"0": bytes(8)}, (), False),  # two classes
    (two(T(P("0", 0), size=(0,)), T(P("0", 0), size=(0,))), {"0": b""}, (), True),  # empty: one storage each
    (two(T(P("0", 0), size=(0,)), T(P("0", 4))), {"0": b""}, (), False),
    (two(T(), T(P("1", 2), size=(2,))), {"0": bytes(16), "1": bytes(8)}, (), True),
    (two(T(P("1", 4)), T()), {"0": bytes(16), "1": bytes(16)}, (), True),  # records in another order
    (two(T(P("1", 4)), T()), {"0": bytes(16), "1": bytes(12)}, (), False),
    (hostile.ckpt(weight=T(offset=1)), B16, (), False),  # one element past the end
    (hostile.ckpt(weight=T(offset=3, size=(1,))), B16, (), True),  # the last element
    (hostile.ckpt(weight=T(size=(2, 3), stride=(3, 1))), B16, (), False),
    (hostile.ckpt(weight=T(size=(2, 2), stride=(1, 2))), B16, (), True),  # transposed
    (hostile.ckpt(weight=T(size=(4, 4), stride=(0, 1))), B16, (), True),  # overlapping (expanded)
    (hostile.ckpt(weight=T(size=(2**62, 4), stride=(1, 1))), B16, (), False),  # more elements than torch counts
    (hostile.ckpt(weight=T(size=(2**61,), stride=(0,))), B16, (), False),  # 2**63 bytes exactly
    (hostile.ckpt(weight=T(size=(2**30, 2**30, 2), stride=(0, 0, 0))), B16, (), False),  # the same in BININTs
    (hostile.ckpt(weight=T(size=(2**30, 2**30, 1), stride=(0, 0, 0))), B16, (), True),  # 2**62 bytes
    (hostile.ckpt(weight=T(size=(2**60,), stride=(0,))), B16, (), True),  # 2**62 bytes, all the same 4
    (hostile.ckpt(weight=T(size=(2**60,), stride=(1,))), B16, (), False),  # fits the count, not the storage
    (hostile.ckpt(weight=T(size=(2,), stride=(2**62,))), B16, (), False),  # an extent past 2**63
    (hostile.ckpt(weight=T(offset=2**40, size=(0,))), B16, (), True),  # no elements: any offset
    (hostile.ckpt(weight=T(offset=2**62, size=(3, 0), stride=(2**62, 1))), B16, (), True),
    (hostile.ckpt(weight=T(stride=(-1,))), B16, (), False),  # the Python VM's
    (hostile.ckpt(weight=hostile.tensor_v3(P("0", 16, UNTYPED), hostile.g("torch", "float32"))), B16, (), True),
    (hostile.ckpt(weight=hostile.tensor_v3(P("0", 16, UNTYPED), hostile.g("torch", "float64"))), B16, (), False),
    (hostile.ckpt(weight=V3(P("0", 16, UNTYPED), hostile.g("torch", "int8"), size=(16,))), B16, (), True),
    (
        hostile.ckpt(
            weight=hostile.g("torch._utils", "_rebuild_parameter")
            + b"("
            + T(size=(5,))
            + b"\x88"
            + hostile.HOOKS
            + b"tR"
        ),
        B16,
        (),
        False,
    ),
    (hostile.ckpt(T(offset=100) + b"0" + hostile.n(1)), B16, (), False),  # a bad tensor the tree drops
    (hostile.ckpt(weight=T(metadata=hostile.items(("t", T(offset=13))))), B16, (), False),  # in metadata
    (hostile.ckpt(hostile.u("s") + P() + b"\x86"), B16, (), True),  # a storage on its own
]


@needs_native
def test_hostile_zips_read_the_same_on_both_engines(reads: Reads, tmp_path: Path) -> None:
    results = []
    for i, (payload, records, deflated, fast) in enumerate(CASES):
        reads.bulk = reads.walked = 0
        got = reads.same(zip_file(tmp_path / f"{i}.pth", payload, records, deflated))
        native_only = (reads.bulk, reads.walked - 1)  # the Python engine's read walks once
        assert (native_only == (1, 0)) == fast, (i, got, native_only)
        results.append(got[0])
    assert sum(fast for *_, fast in CASES) >= 12 and results.count("ok") >= 15 and results.count("BadInputError") >= 12


@needs_native
def test_nesting_at_the_limit_reads_the_same(reads: Reads, tmp_path: Path) -> None:
    """Lists nested around MAX_NESTING, beside a tensor, in tensor metadata and under an
    OrderedDict's ``_metadata``: the VM's bound says "fine" or lets the walk decide."""
    walked = []
    for depths, place in (((1000, 1001), "beside"), ((997, 998), "metadata"), ((998, 999), "attrs")):
        for depth in depths:  # the last depth the walk accepts, and the first it refuses
            nest = b"]" * depth + b"a" * (depth - 1)
            payload = {
                "beside": hostile.ckpt(nest),
                "metadata": hostile.ckpt(weight=T(metadata=hostile.items(("m", nest)))),
                "attrs": hostile.ckpt(hostile.HOOKS + b"}(" + hostile.u("_metadata") + nest + b"ub"),
            }[place]
            reads.walked = 0
            got = reads.same(zip_file(tmp_path / f"{depth}-{place}.pth", payload, B16))
            walked.append((depth, place, got[0], reads.walked))
    # the VM's bound is exact on these: the accepted depth reads natively to the end (the
    # Python engine's read alone walks), the next one is refused by both, with the walk's message
    assert [(got, n) for _, _, got, n in walked] == [("ok", 1), ("BadInputError", 2)] * 3, walked


@needs_native
def test_mutated_fixtures_read_the_same(reads: Reads, tmp_path: Path) -> None:
    """Real checkpoints with their data.pkl mutated or a storage record cut short."""
    rng = random.Random(2611)
    bases = []
    for path in sorted(FIXTURES.glob("*.pth")):
        if not zipfile.is_zipfile(path):
            continue
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            if not any(n.endswith("/data.pkl") for n in names) or any("/code/" in n for n in names):
                continue
            folder = next(n for n in names if n.endswith("/data.pkl"))[: -len("data.pkl")]
            records = {n[len(folder) + 5 :]: z.read(n) for n in names if n.startswith(folder + "data/")}
            bases.append((z.read(folder + "data.pkl"), records))
    assert len(bases) >= 5
    count = 0
    for payload, records in bases:
        reads.bulk = 0
        reads.same(zip_file(tmp_path / "base.pth", payload, records))
        assert reads.bulk == 1  # a real checkpoint resolves at once
        for mutant in mutants(rng, payload, 12):
            reads.same(zip_file(tmp_path / f"m{count}.pth", mutant, records))
            count += 1
        for _ in range(3):
            cut = dict(records)
            key = rng.choice(sorted(cut))
            cut[key] = cut[key][: rng.randrange(len(cut[key]) + 1)]
            if rng.random() < 0.3:
                del cut[key]
            reads.same(zip_file(tmp_path / f"c{count}.pth", payload, cut))
            count += 1
    assert count >= 75


def directory(names: list[str]) -> ZipDirectory:
    records = ZipDirectory()
    for i, name in enumerate(names):
        records.add(name, 64 * i, 1, 1, 0, 0, 64 * i)
    return records


def outcome(fn: Any, *args: Any) -> Any:
    try:
        result = fn(*args)
    except BadInputError as exc:
        return ("bad", str(exc))
    return ("ok", list(result) if isinstance(result, ZipDirectory) else result)


def test_record_names_are_checked_as_name_by_name() -> None:
    """The all-at-once name checks (one joined string) against the per-name reference."""
    base = ["archive/data.pkl", "archive/byteorder", "archive/version", "archive/.data/serialization_id"]
    base += [f"archive/data/{i}" for i in range(5)]
    variants = [
        [],
        ["x"],
        ["a/data.pkl", "b/data.pkl"],
        ["a/data.pkl", "b/data.pkl", "a/x.pkl"],
        ["archive/DATA.PKL", "archive/data/0"],
        ["archive/constants.pkl", "archive/code/x.py", "archive/data.pkl"],
        ["archive/data.pkl", "other/data/0"],
        ["archive/data.pkl", "archive"],
        ["archive/data.pkl", "archivex/data/0"],
        ["arch/ive/data.pkl", "arch/ive/data/0"],
        ["archive/data.pkl", "archive/data/\u00e9", "archive/Data/1"],
        ["archive/data.pkl", "archive/extra.PKL"],
        ["archive/data.pkl", "archive/BYTEORDER"],
        ["archive/data.pkl", "archive/.DATA/version"],
        ["archive/data.pkl", "archive/Notes.txt", "archive/model.pth"],
        ["weights.pth"],
        ["archive/data.pkl", "archive/a\x00b"],
    ]
    rng = random.Random(5)
    for _ in range(300):
        names = list(base)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(names))
            op = rng.randrange(5)
            if op == 0:
                names[i] = names[i].upper()
            elif op == 1:
                names[i] = names[i] + rng.choice([".pkl", ".PKL", "/", "\u0130", ".pt"])
            elif op == 2:
                names[i] = rng.choice(["other/", "", "archive/x/"]) + names[i].split("/", 1)[-1]
            elif op == 3:
                names.append(rng.choice(["archive/data.pkl", "archive/code/m.py", "archive/constants.pkl"]))
            else:
                del names[i]
        variants.append(list(dict.fromkeys(names)))
    fast = 0
    for names in [base, *variants]:
        records = directory(names)
        want = outcome(torchzip._check_names_each, records, "f")
        assert outcome(torchzip.check_record_names, records, "f") == want, names
        fast += torchzip._names_pass(records)
        if names:
            assert outcome(torchzip.split_archive_names, records, "f") == outcome(torchzip._split_each, records, "f")
            try:
                split = torchzip._split_each(records, "f")
            except BadInputError:
                split = records
            archive = torchzip.TorchZipArchive("f", "archive", split, None)
            assert archive.dropped == torchzip._dropped_each(split), names
    assert torchzip._names_pass(directory(base)) and fast > 50, fast
