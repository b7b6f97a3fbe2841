"""Consolidate a DeepSpeed ZeRO-2 save into one safetensors file: ckptfix against ``zero_to_fp32.py``.

    pip install deepspeed   # 0.19; runs on the CPU with gloo
    python bench/bench_zero.py [--params-m 100] [--runs 5] [--stage 2] [--workdir bench/_work]

Makes (once) a real ZeRO-2 (or ``--stage``) save of a ~``params-m`` million parameter model: ``layers`` Linear
layers of 2048 x 2048 (+ bias) trained one step in fp32 on 2 gloo ranks (``save_checkpoint``: the
module weights, 2 optimizer partitions with the fp32 master weights and Adam's two moments; about
16 bytes per parameter on disk). Then times, as separate processes, interleaved:

* ``ckptfix convert RUN out.safetensors`` (the fp32 master weights, streamed from the partitions);
* ``python -m deepspeed.utils.zero_to_fp32 RUN OUTDIR --safe_serialization`` (DeepSpeed's own).

The largest tensor is 16 MiB whatever ``--params-m`` is, so the peak RSS of ckptfix should not
grow with the model (the claim ``--params-m 400`` checks); zero_to_fp32's grows with it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import compare

WIDTH = 2048

MAKE = r"""
import os, sys, warnings
import torch, torch.multiprocessing as mp

def run(rank, out, layers, port, stage):
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(1, WIDTH)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2]), "29655", int(sys.argv[3])), nprocs=2, join=True)
""".replace("WIDTH", str(WIDTH))


def make_save(run: Path, layers: int, stage: int = 2) -> None:
    marker = run / f".layers-{layers}"
    if marker.exists():
        return
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    script = run.parent / "make_zero_save.py"  # a file: spawned ranks re-import their main module
    script.write_text(MAKE)
    command = [sys.executable, str(script), str(run), str(layers), str(stage)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"making the DeepSpeed save failed:\n{done.stderr[-3000:]}")
    (run / "zero_to_fp32.py").unlink(missing_ok=True)
    marker.touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params-m", type=float, default=100)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage of the save")
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # zero_to_fp32 imports deepspeed, which looks for one
    layers = max(1, round(args.params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    run = args.workdir / f"zero{args.stage}_{layers}layers"
    make_save(run, layers, args.stage)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    out = args.workdir / "zero_out.safetensors"
    theirs = args.workdir / "zero_to_fp32_out"
    theirs.mkdir(exist_ok=True)
    size = sum(p.stat().st_size for p in run.rglob("*.pt"))
    print(f"save: {run} ({layers} layers, {size / 1e9:.2f} GB on disk)")
    compare(
        {
            "ckptfix convert": [ckptfix, "convert", str(run), str(out)],
            "zero_to_fp32.py": [
                sys.executable,
                "-m",
                "deepspeed.utils.zero_to_fp32",
                str(run),
                str(theirs),
                "--safe_serialization",
            ],
        },
        [out, theirs / "model.safetensors"],
        args.runs,
        next(run.rglob("*mp_rank_00_model_states.pt")),
        label=f"(a model-states file) of a ZeRO-{args.stage} save, 2 ranks, {layers} x Linear({WIDTH}, {WIDTH})",
    )


if __name__ == "__main__":
    main()
