"""Write a DCP folder from a .pth: ckptfix's torch-free writer against torch's ``dcp.save``.

    python bench/bench_dcp.py [--size-gb 1.2] [--runs 5] [--workdir bench/_work]

The input is the harness's checkpoint (200 float32 tensors, ``module.`` keys). Contenders, each
its own process, interleaved, the output folder removed before each run:

* ``cp`` of the input file (the floor: the bytes must be written once);
* ``ckptfix convert IN OUT/ --format dcp`` (one file) and ``--dcp-files 4`` (cut by rows for 4);
* torch: ``torch.load(IN, mmap=True, weights_only=True)`` then
  ``torch.distributed.checkpoint.save(..., no_dist=True)`` (what ckptfix did before issue 24).
"""

from __future__ import annotations

import shutil
import statistics
import sys

from harness import Run, setup, timed

TORCH = r"""
import sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
state = torch.load(sys.argv[1], mmap=True, weights_only=True)
dcp.save(state, checkpoint_id=sys.argv[2], no_dist=True)
"""


def main() -> None:
    args, src, ckptfix = setup(__doc__)
    out = args.workdir / "dcp_out"
    copy = args.workdir / "copy.pth"
    to_dcp = [ckptfix, "convert", str(src), str(out), "--format", "dcp"]
    contenders = {
        "cp": ["cp", str(src), str(copy)],
        "ckptfix --format dcp": to_dcp,
        "ckptfix --format dcp --dcp-files 4": [*to_dcp, "--dcp-files", "4"],
        "torch.load(mmap) + dcp.save": [sys.executable, "-c", TORCH, str(src), str(out)],
    }
    results: dict[str, list[Run]] = {name: [] for name in contenders}
    for _ in range(args.runs):
        for name, cmd in contenders.items():
            shutil.rmtree(out, ignore_errors=True)
            copy.unlink(missing_ok=True)
            results[name].append(timed(cmd))
    shutil.rmtree(out, ignore_errors=True)
    copy.unlink(missing_ok=True)
    print(f"input: {src.stat().st_size / 1e9:.2f} GB, 200 float32 tensors; {args.runs} runs each, interleaved")
    print()
    print("| command | median wall (s) | all runs (s) | median CPU (s) | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        walls = [r.wall for r in runs]
        print(
            f"| {name} | {statistics.median(walls):.2f} | {', '.join(f'{t:.2f}' for t in walls)} "
            f"| {statistics.median(r.cpu for r in runs):.2f} | {max(r.rss for r in runs) / 2**20:.0f} |"
        )


if __name__ == "__main__":
    main()
