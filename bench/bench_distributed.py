"""One conversion split over processes by output shard: ``torchrun --nproc-per-node N -m ckptfix
convert IN OUT/ --distributed`` for N = 1, 2, 4, next to the plain single-process command.

    python bench/bench_distributed.py [--size-gb 1.2] [--shard-size 100MB] [--runs 3] [--workdir bench/_work]

Input: bench/harness.py's checkpoint (200 float32 tensors, ``module.`` keys), converted to
safetensors shards with the prefix stripped. Each contender is its own process tree, interleaved;
the output folder is removed before each run. Every output is checked to be byte for byte the
single process's.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Run, make_checkpoint, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src = args.workdir / "ddp_large.pth"
    make_checkpoint(src, args.size_gb)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    torchrun = shutil.which("torchrun") or sys.exit("torchrun is not installed (it comes with torch)")
    os.environ["OMP_NUM_THREADS"] = "1"
    common = ["convert", str(src), "--strip-prefix", "module.", "--max-shard-size", args.shard_size]
    outs: dict[str, Path] = {}
    contenders: dict[str, list[str]] = {}
    plain = "ckptfix convert (one process)"
    outs[plain] = args.workdir / "shards_plain"
    contenders[plain] = [ckptfix, *common[:2], f"{outs[plain]}/", *common[2:]]
    for n in (1, 2, 4):
        name = f"torchrun x{n} --distributed"
        outs[name] = args.workdir / f"shards_x{n}"
        launch = [torchrun, "--standalone", "--nproc-per-node", str(n), "-m", "ckptfix"]
        contenders[name] = [*launch, *common[:2], f"{outs[name]}/", *common[2:], "--distributed"]
    results: dict[str, list[Run]] = {name: [] for name in contenders}
    for _ in range(args.runs):
        for name, cmd in contenders.items():
            shutil.rmtree(outs[name], ignore_errors=True)
            results[name].append(timed(cmd))
    reference = outs[plain]
    for name, out in outs.items():
        names = sorted(p.name for p in reference.iterdir())
        same = names == sorted(p.name for p in out.iterdir()) and all(
            filecmp.cmp(reference / n, out / n, shallow=False) for n in names
        )
        if not same:
            sys.exit(f"{name}: the output differs from one process's")
    shards = len(list(reference.glob("*.safetensors")))
    base = statistics.median(r.wall for r in results[plain])
    print(f"input: {src.stat().st_size / 1e9:.2f} GB, 200 float32 tensors -> {shards} shards of <= {args.shard_size}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {args.runs} runs")
    print()
    print("| command | median wall (s) | all runs (s) | vs one process | CPU (s), all processes |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        times = [r.wall for r in runs]
        median = statistics.median(times)
        cpu = statistics.median(r.cpu for r in runs)
        print(f"| {name} | {median:.2f} | {', '.join(f'{t:.2f}' for t in times)} | {median / base:.2f}x | {cpu:.2f} |")
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
