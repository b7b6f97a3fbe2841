"""Adversarial review findings (DCP reader, refusal hints, "nothing to change" copies, record keys).

Each test asserts the behaviour ckptfix promises for hostile input -- one stderr line and exit 3,
no output, no hang, bounded memory, nothing unchecked carried into an output. Each failed
before its fix (strict xfails while the review ran; the markers went with the fixes).
"""

from __future__ import annotations

import io
import pickle
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import deadline, invoke_cli

import ckptfix

_EVIL = b'cos\nsystem\n(S"touch /tmp/ckptfix-review-pwned"\ntR.'


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _dcp(folder: Path, entries: dict[str, Any], planner: dict[str, Any] | None = None) -> Path:
    """A DCP folder: fqn -> ("bytes", item) or ("tensor", dtype, shape, [(offsets, sizes, item)])."""
    # imported here, not at the top: torch.distributed.checkpoint takes seconds to import, and
    # every pytest worker imports every test module to collect it
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir()
    blob = bytearray()
    described: dict[str, Any] = {}
    stored: dict[Any, Any] = {}
    for fqn, entry in entries.items():
        if entry[0] == "bytes":
            described[fqn] = BytesStorageMetadata()
            stored[MetadataIndex(fqn, None, None)] = _StorageInfo("d.distcp", len(blob), len(entry[1]))
            blob += entry[1]
            continue
        _, dtype, shape, chunks = entry
        metas = []
        for i, (offsets, sizes, item) in enumerate(chunks):
            metas.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            stored[MetadataIndex(fqn, torch.Size(offsets), i)] = _StorageInfo("d.distcp", len(blob), len(item))
            blob += item
        described[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), metas)
    (folder / "d.distcp").write_bytes(bytes(blob))
    paths = planner if planner is not None else {k: tuple(k.split(".")) for k in entries}
    metadata = Metadata(state_dict_metadata=described, planner_data=paths, storage_data=stored)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder


def _refused(result: Any) -> None:
    assert result.returncode == 3, (result.returncode, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# -- 1. DCP reader -----------------------------------------------------------------------------


def test_dcp_stride0_chunks_expand_without_bound(tmp_path: Path) -> None:
    # an 8 KB folder whose 2 chunks are torch.zeros(1).expand(...) views: at (16384, 32768) each,
    # convert allocates 2x4 GiB (np.zeros + tobytes) and writes a 4 GiB .pth; under ulimit -v it
    # dies with exit 5 (BufferError). DCP saves chunks dense: a chunk whose storage holds fewer
    # bytes than its elements must be refused, as --max-expand bounds safetensors.
    piece = _saved(torch.zeros(1).expand(512, 2048))
    folder = _dcp(
        tmp_path / "dcp",
        {"w": ("tensor", torch.float32, (1024, 2048), [((0, 0), (512, 2048), piece), ((512, 0), (512, 2048), piece)])},
    )
    out = tmp_path / "o.pth"
    _refused(invoke_cli("convert", folder, out))
    assert not out.exists()


def test_dcp_sparse_list_index_is_refused(tmp_path: Path) -> None:
    # planner path ("a", 65536) makes a 65537-element list of None; 1000 such entries sharing one
    # item (72 KB of metadata, paths ("a", k*65536)) took 1.5 GB RSS for inspect/convert. torch's
    # flatten only makes dense lists: an index with holes before it is corrupt metadata.
    folder = _dcp(tmp_path / "dcp", {"k": ("bytes", _saved(7))}, planner={"k": ("a", 65536)})
    _refused(invoke_cli("inspect", folder))


def test_dcp_many_chunks_in_one_row_do_not_hang(tmp_path: Path) -> None:
    # shape (1, N) in N chunks of (1, 1), every chunk pointing at one stored item: N=8000 (725 KB)
    # takes 20 s, N=65536 (MAX_CHUNKS) about 15 minutes
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    n = 8000
    item = _saved(torch.zeros(1, 1))
    folder = _dcp(tmp_path / "dcp", {"w": ("tensor", torch.float32, (1, 1), [((0, 0), (1, 1), item)])})
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    info = next(iter(metadata.storage_data.values()))
    metadata.storage_data = {MetadataIndex("w", torch.Size((0, i)), i): info for i in range(n)}
    chunks = [ChunkStorageMetadata(torch.Size((0, i)), torch.Size((1, 1))) for i in range(n)]
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(
        TensorProperties(torch.float32), torch.Size((1, n)), chunks
    )
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    result = invoke_cli("inspect", folder, timeout=6)
    assert result.returncode in (0, 3), result.stderr


def test_dcp_planner_paths_that_collide_are_refused(tmp_path: Path) -> None:
    # planner_data["rep"] = ("model",) replaces the whole "model" state dict by one tensor (inspect
    # shows "model: tensor float32 [3]", exit 0); ("model", "w") silently replaces model.w
    t = _saved(torch.ones(3))
    folder = _dcp(
        tmp_path / "dcp",
        {
            "model.w": ("tensor", torch.float32, (3,), [((0,), (3,), t)]),
            "rep": ("tensor", torch.float32, (3,), [((0,), (3,), t)]),
        },
        planner={"model.w": ("model", "w"), "rep": ("model",)},
    )
    out = tmp_path / "o.pth"
    _refused(invoke_cli("convert", folder, out))
    assert not out.exists()


# -- 3. refusal hints ---------------------------------------------------------------------------


def _pth_calling(tmp_path: Path, module: str, name: str) -> Path:
    arg = b"import os; os.system('touch /tmp/ckptfix-review-pwned')"
    pkl = b"\x80\x02}q\x00X\x01\x00\x00\x00xc" + f"{module}\n{name}\n".encode()
    pkl += b"X" + len(arg).to_bytes(4, "little") + arg + b"\x85Rs."
    return _replace_data_pkl(tmp_path / "g.pth", pkl)


def _replace_data_pkl(path: Path, data: bytes, extra: dict[str, bytes] | None = None) -> Path:
    source = zipfile.ZipFile(io.BytesIO(_saved({"w": torch.zeros(2), "b": torch.ones(3)})))
    with zipfile.ZipFile(path, "w") as z:
        for info in source.infolist():
            z.writestr(info, data if info.filename.endswith("data.pkl") and data else source.read(info))
        for name, value in (extra or {}).items():
            z.writestr(name, value)
    return path


@pytest.mark.parametrize(
    "full",
    [
        "timeit.timeit",
        "_posixsubprocess.fork_exec",
        "cProfile.run",
        "pdb.run",
        "torch.hub.load",
        "torch.ops.load_library",
        "torch.utils.cpp_extension.load_inline",
        "_ctypes.dlopen",
        "asyncio.create_subprocess_shell",
    ],
)
def test_refusal_hint_never_offers_to_keep_code_execution(tmp_path: Path, full: str) -> None:
    module, name = full.rsplit(".", 1)
    result = invoke_cli("inspect", _pth_calling(tmp_path, module, name))
    _refused(result)
    assert "--allow-global" not in result.stderr and "--unsafe-load" not in result.stderr, result.stderr


def test_every_refused_second_pass_does_not_hang(tmp_path: Path) -> None:
    # a refused global first (the reader stops at once), then a K-element list in the memo passed
    # to M calls: the recording pass walks it per call. K=M=20000 (180 KB) took 61 s; 1.8 MB ~ 100 min
    k = m = 12000
    pkl = b"\x80\x02cevil\nthing\n0]q\x00(" + b"K\x00" * k + b"e0cbuiltins\nlen\nq\x010"
    pkl += b"h\x01h\x00\x85R0" * m + b"}."
    src = _replace_data_pkl(tmp_path / "q.pth", pkl)
    # the library's default read is strict: the reader stops at evil.thing, and the second pass
    # lists everything (the commands read it as an inert record, and the pickle pops it)
    started = time.process_time()  # CPU time: a busy machine stretches wall time, not work
    with deadline(120, "the strict read"), pytest.raises(ckptfix.UnsafeInputError, match=r"evil\.thing"):
        ckptfix.read_checkpoint(src)
    assert time.process_time() - started < 6


# -- 4. "nothing to change" still writes OUT: a byte copy ------------------------------------------


@pytest.mark.parametrize("how", ["extra-record", "unreferenced-storage", "after-data.pkl-stop", "after-the-zip"])
def test_unchanged_output_carries_no_unchecked_bytes(tmp_path: Path, how: str) -> None:
    src = tmp_path / "in.pth"
    if how == "extra-record":
        _replace_data_pkl(src, b"", {"archive/payload.bin": _EVIL})
    elif how == "unreferenced-storage":
        _replace_data_pkl(src, b"", {"archive/data/99": _EVIL})
    elif how == "after-data.pkl-stop":
        plain = zipfile.ZipFile(io.BytesIO(_saved({"w": torch.zeros(2), "b": torch.ones(3)})))
        _replace_data_pkl(src, plain.read("archive/data.pkl") + _EVIL)
    else:
        src.write_bytes(_saved({"w": torch.zeros(2), "b": torch.ones(3)}) + _EVIL)
    out = tmp_path / "out.pth"
    result = invoke_cli("strip-module", src, out)  # nothing starts with "module.": OUT is a byte copy
    assert result.returncode in (0, 3), result.stderr
    if out.exists():
        assert b"os\nsystem" not in out.read_bytes()  # the normal writer (convert) drops them all


# -- records as dict keys (allowed by ReaderHooks.check_key since the DCP reader) ------------------


def test_diff_tells_global_keys_from_string_keys(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    torch.save({"model": {torch.float32: torch.zeros(2), "torch.float32": torch.ones(2)}}, a)
    torch.save({"model": {"torch.float32": torch.ones(2)}}, b)
    result = invoke_cli("diff", a, b)  # prints "equal: 1 tensors and every other value match", exit 0
    assert result.returncode != 0 and "equal" not in result.stdout, result.stdout
