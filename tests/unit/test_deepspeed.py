"""DeepSpeed folders read by ckptfix against what DeepSpeed itself gives, bitwise.

The checkpoints under fixtures/deepspeed/ come from real DeepSpeed 0.19 runs (2 and 3 gloo ranks,
ZeRO 0-3, fp32/fp16/bf16; fixtures/make_deepspeed_fixtures.py), each beside two references the
same run wrote: ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (``CASE.fp32.pth``) and
the engine's own module weights (``CASE.module.pth``, in the model's ``state_dict()`` order).
deepspeed is not needed here: only torch, to load the references.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from ckptfix.errors import BadInputError, UsageError
from ckptfix.fileio.ranges import FileRange, JoinedSource, OpenFiles, OutputStream, iter_chunks
from ckptfix.formats.checkpoint import read_checkpoint
from ckptfix.model.data import tensor_c_bytes
from ckptfix.model.dtypes import DTYPE_ITEMSIZE
from ckptfix.model.refs import TensorRef

DS = FIXTURES / "deepspeed"
CASES = sorted(p.name for p in DS.iterdir() if p.is_dir())
FP32_CASES = [c for c in CASES if (DS / f"{c}.fp32.pth").exists()]
#: ZeRO-1 records no frozen parameters: zero_to_fp32 leaves them out (ckptfix takes them from the module)
ZERO1_DROPPED = {"frozen.weight", "frozen.bias"}


def materialize(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The lazy state dict as torch tensors (bytes read through ckptfix), ties kept as one tensor."""
    out: dict[str, torch.Tensor] = {}
    made: dict[object, torch.Tensor] = {}
    with OpenFiles() as files:
        for key, ref in tree.items():
            view = (id(ref.storage), ref.storage_offset, ref.shape, ref.stride)  # tied: one view of one storage
            if view not in made:
                raw = bytearray(tensor_c_bytes(ref, files))
                assert len(raw) == ref.numel * DTYPE_ITEMSIZE[ref.dtype]
                flat = torch.frombuffer(raw, dtype=getattr(torch, ref.dtype)) if raw else torch.empty(0)
                made[view] = flat.reshape(ref.shape)
            out[key] = made[view]
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_fixtures_cover_the_matrix() -> None:
    """Every stage meets fp32, fp16 and bf16 and both world sizes across the set (the generator's cases)."""
    kinds = {tuple(c.split("_")) for c in CASES}
    assert {s for s, _, _ in kinds} == {"z0", "z1", "z2", "z3"}
    for stage in ("z1", "z2", "z3"):
        assert {d for s, d, _ in kinds if s == stage} == {"fp32", "fp16", "bf16"} or stage == "z1"
        assert {w for s, _, w in kinds if s == stage} == {"w2", "w3"}
    assert len(FP32_CASES) == len([c for c in CASES if not c.startswith("z0")])


@pytest.mark.parametrize("case", FP32_CASES)
def test_fp32_master_weights_equal_zero_to_fp32(case: str) -> None:
    ckpt = read_checkpoint(DS / case)
    assert ckpt.format == "deepspeed" and ckpt.deepspeed is not None and ckpt.deepspeed.weights == "fp32"
    got = materialize(ckpt.root)
    ref = torch.load(DS / f"{case}.fp32.pth", weights_only=True)
    model_order = list(torch.load(DS / f"{case}.module.pth", weights_only=True))
    assert list(got) == model_order  # the model's state_dict() order (zero_to_fp32 puts buffers first)
    assert set(got) - set(ref) == (ZERO1_DROPPED if case.startswith("z1") else set())
    for key, expected in ref.items():
        if key == "bn.num_batches_tracked":
            # zero_to_fp32 turns every buffer into float32; an integer buffer stays int64 here
            assert got[key].dtype == torch.int64 and expected.dtype == torch.float32
            assert got[key].item() == expected.item()
            continue
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        assert bits(got[key]) == bits(expected), key
    assert ref["head.weight"] is ref["emb.weight"] and got["head.weight"] is got["emb.weight"]  # the tie


@pytest.mark.parametrize("case", CASES)
def test_module_weights_equal_the_engines(case: str) -> None:
    """--weights module (ZeRO-0's only weights) is what the engine held at that step; ZeRO-3 its
    consolidated 16-bit state dict, which ckptfix rebuilds by rounding the fp32 partitions."""
    ckpt = read_checkpoint(DS / case, weights=None if case.startswith("z0") else "module")
    assert ckpt.deepspeed is not None and ckpt.deepspeed.weights == "module"
    got = materialize(ckpt.root)
    ref = torch.load(DS / f"{case}.module.pth", weights_only=True)
    assert list(got) == list(ref)
    for key, expected in ref.items():
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        assert bits(got[key]) == bits(expected), key
    assert got["head.weight"].data_ptr() == got["emb.weight"].data_ptr()


def test_inspect_facts() -> None:
    info = read_checkpoint(DS / "z2_fp16_w3").deepspeed
    assert info is not None
    assert (info.stage, info.world_size, info.dtype) == (2, 3, "float16")
    assert (info.tag, info.tags) == ("global_step2", ("global_step2",))
    # emb 55 + frozen 35+7 + bn 7+7 + mid 35+5 + head bias 11 (the tied head.weight counted once)
    assert (info.parameters, info.frozen_parameters, info.weights_available) == (162, 42, ("fp32", "module"))
    zero1 = read_checkpoint(DS / "z1_fp16_w2", weights="module").deepspeed  # frozen params it did not record
    assert zero1 is not None and (zero1.parameters, zero1.frozen_parameters) == (162, 42)
    zero0 = read_checkpoint(DS / "z0_bf16_w3").deepspeed
    assert zero0 is not None and (zero0.stage, zero0.weights_available, zero0.parameters) == (0, ("module",), 162)


def test_a_tag_folder_and_tags(tmp_path: Path) -> None:
    """The tag folder itself is an input; --tag picks a step; without latest the one tag is read."""
    run = tmp_path / "run"
    shutil.copytree(DS / "z2_bf16_w2", run)
    direct = read_checkpoint(run / "global_step2")
    assert direct.deepspeed is not None and direct.deepspeed.tag == "global_step2"
    shutil.copytree(run / "global_step2", run / "global_step1")
    assert read_checkpoint(run, tag="global_step1").deepspeed.tag == "global_step1"  # type: ignore[union-attr]
    assert read_checkpoint(run).deepspeed.tag == "global_step2"  # type: ignore[union-attr]  # latest
    (run / "latest").unlink()
    with pytest.raises(BadInputError, match=r"2 tag folders.*global_step1, global_step2"):
        read_checkpoint(run)
    with pytest.raises(BadInputError, match="not a folder"):
        read_checkpoint(run, tag="global_step9")
    with pytest.raises(UsageError, match="--tag and --weights choose"):
        read_checkpoint(DS / "z2_bf16_w2.module.pth", tag="global_step2")


def test_zero0_has_no_fp32_weights_to_choose() -> None:
    with pytest.raises(BadInputError, match=r"ZeRO-0 save .* keeps no named fp32 master weights"):
        read_checkpoint(DS / "z0_fp32_w2", weights="fp32")


# --------------------------------------------------------------------------------- streaming


def test_a_parameter_across_ranks_is_joined_ranges_and_the_rest_plain_ranges() -> None:
    """ZeRO-2 fp32 weights are byte ranges of the partition files: one range where a parameter
    lies in one rank's partition, joined ranges where it straddles two (nothing decoded)."""
    root = read_checkpoint(DS / "z2_fp32_w3").root
    kinds = {k: type(t.storage.source).__name__ for k, t in root.items()}
    assert kinds["emb.weight"] == "JoinedSource" and kinds["mid.bias"] == "FileRange"
    joined = root["emb.weight"].storage.source
    assert len(joined.pieces) == 2 and all("optim_states" in p.path for p in joined.pieces)
    zero3 = read_checkpoint(DS / "z3_bf16_w3").root
    assert len(zero3["emb.weight"].storage.source.pieces) == 3  # one partition per rank


def test_joined_source_streams_piece_by_piece(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"0123456789")
    b.write_bytes(b"abcdefghij")
    joined = JoinedSource.of((FileRange(str(a), 2, 3), FileRange(str(b), 5, 4)))
    assert joined.size == 7
    out = tmp_path / "out"
    with OpenFiles() as files:
        assert b"".join(iter_chunks(joined, files)) == b"234fghi" == joined.produce(files)
        with open(out, "wb") as f:
            stream = OutputStream(f)
            stream.copy(joined, files)
            crc = stream.copy(joined, files, want_crc=True)
            stream.flush()
    assert out.read_bytes() == b"234fghi" * 2
    import zlib

    assert crc == zlib.crc32(b"234fghi")
    with pytest.raises(ValueError):
        JoinedSource.of(())


# --------------------------------------------------------------------------------- hostile


def _copy(case: str, tmp_path: Path) -> Path:
    run = tmp_path / case
    shutil.copytree(DS / case, run)
    return run


def _rewrite(path: Path, edit: Any) -> None:
    """Rewrite one .pt of a save with ``edit(tree)`` applied, through ckptfix (DeepSpeed's
    classes kept as records: deepspeed need not be installed)."""
    ckpt = read_checkpoint(path, allow_globals=["deepspeed.*"])
    root = edit(ckpt.root)
    staged = path.with_suffix(".new")
    with open(staged, "wb") as f:
        ckpt.write(root, f)
    staged.replace(path)


def test_partition_sizes_that_lie(tmp_path: Path) -> None:
    run = _copy("z2_fp32_w3", tmp_path)
    optim = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    def shorten(root: Any) -> Any:
        groups = root["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = replace(groups[0], shape=(groups[0].shape[0] - 8,))
        return root

    _rewrite(optim, shorten)
    with pytest.raises(BadInputError, match=r"group 0's 2 parameters hold 90 elements.*the partition sizes lie"):
        read_checkpoint(run)


def test_zero3_partition_sizes_that_lie(tmp_path: Path) -> None:
    run = _copy("z3_fp32_w2", tmp_path)
    optim = run / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def shorten(root: Any) -> Any:
        groups = root["optimizer_state_dict"]["fp32_flat_groups"]
        storage = groups[1].args[2][0]
        groups[1] = torch_tensor_ref(storage, groups[1].args[2][2][0] - 1)
        return root

    _rewrite(optim, shorten)
    with pytest.raises(BadInputError, match=r"partitions differ in size.*the partition sizes lie"):
        read_checkpoint(run)


def torch_tensor_ref(storage: Any, numel: int) -> Any:
    from ckptfix.model.refs import TensorRef

    return TensorRef(storage, 0, (numel,), (1,), "float32")


def test_overlapping_fragments(tmp_path: Path) -> None:
    run = _copy("z2_fp32_w3", tmp_path)
    optim = run / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def alias(root: Any) -> Any:
        groups = root["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        first, second = groups
        groups[1] = replace(first, shape=second.shape)  # group 1's partition: group 0's bytes
        return root

    _rewrite(optim, alias)
    with pytest.raises(BadInputError, match="two flat partitions overlap"):
        read_checkpoint(run)


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt", r"ranks \[0, 2\]: rank\(s\) \[1\] missing"),
        ("zero_pp_rank_2_mp_rank_00_optim_states.pt", "the partitions say world size 3, but 2 optimizer partition"),
        ("mp_rank_00_model_states.pt", "no mp_rank_00_model_states.pt"),
    ],
)
def test_missing_ranks(tmp_path: Path, remove: str, message: str) -> None:
    run = _copy("z2_fp32_w3", tmp_path)
    (run / "global_step2" / remove).unlink()
    with pytest.raises(BadInputError, match=message):
        read_checkpoint(run)


def test_mismatched_world_sizes(tmp_path: Path) -> None:
    """A rank file from a 2-rank save dropped into a 3-rank one (same names, another run)."""
    run = _copy("z2_fp32_w3", tmp_path)
    other = DS / "z2_bf16_w2" / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    target = run / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    target.unlink()
    shutil.copy(other, target)
    with pytest.raises(BadInputError, match="different ZeRO stage or world size than rank 0's"):
        read_checkpoint(run)
    zero3 = _copy("z3_bf16_w3", tmp_path)
    (zero3 / "global_step2" / "zero_pp_rank_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(BadInputError, match="ZeRO-3 model states for 2 ranks, world size 3"):
        read_checkpoint(zero3)


@pytest.mark.parametrize("latest", ["../x", "..", "/etc", "a/../../b", "global_step2\x00", ""])
def test_latest_naming_outside(tmp_path: Path, latest: str) -> None:
    run = _copy("z2_bf16_w2", tmp_path)
    (tmp_path / "x").mkdir()
    (run / "latest").write_bytes(latest.encode())
    with pytest.raises(BadInputError, match=r"latest names .*not a folder name inside"):
        read_checkpoint(run)


def test_tensor_parallel_is_refused(tmp_path: Path) -> None:
    run = _copy("z2_bf16_w2", tmp_path)
    tag = run / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(BadInputError, match="tensor-parallel DeepSpeed checkpoint \\(model-parallel rank 1\\)"):
        read_checkpoint(run)


#: values of the wrong kind for every field the reader uses (the fuzz over 1,400 such edits of
#: every fixture file found only one crash, fixed; this keeps a sample of it)
_WRONG = [None, "x", [[]], {"a": 1}]
_FIELDS = [
    ("z2_fp16_w3", "mp_rank_00_model_states.pt", key)
    for key in ("module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params")
] + [
    ("z0_fp32_w2", "mp_rank_00_model_states.pt", "buffer_names"),
    ("z3_bf16_w3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_stage"),
    ("z3_bf16_w3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "partition_count"),
    ("z3_bf16_w3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "fp32_flat_groups"),
]


@pytest.mark.parametrize(("case", "name", "key"), _FIELDS)
def test_fields_of_the_wrong_kind_are_bad_input(tmp_path: Path, case: str, name: str, key: str) -> None:
    for value in _WRONG:
        run = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(DS / case, run)
        target = run / "global_step2" / name

        def put(root: Any, value: object = value) -> Any:
            (root["optimizer_state_dict"] if "optim" in name else root)[key] = value
            return root

        _rewrite(target, put)
        for weights in (None, "module") if "optim" not in name else (None,):
            # refused as bad input, or read (a field ZeRO-0 or this weight source does not use)
            with contextlib.suppress(BadInputError):
                root = read_checkpoint(run, weights=weights).root
                materialize({k: v for k, v in root.items() if isinstance(v, TensorRef)})
