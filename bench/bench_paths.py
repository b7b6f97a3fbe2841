"""Many paths, few bytes: one tiny tensor memoized under a million paths (a 2 MB file, issue 22).

    python bench/bench_paths.py [--paths 1000000] [--runs 3] [--workdir bench/_work]

Times `ckptfix strip-module`, `diff` (the file against itself) and `convert --verify` as separate
processes, next to a plain torch script (torch.load -> torch.save). Every path costs a walk step,
an extent check and a comparison: the benchmark for per-path constants (a pair of tensors is
compared once however many paths reach it), not for bytes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from harness import compare

MAKE_SCRIPT = """
import sys, torch
t = torch.ones(2)
torch.save({"state_dict": {"module.w": t}, "many": [t] * int(sys.argv[2])}, sys.argv[1])
"""

TORCH_SCRIPT = """
import sys, torch
torch.save(torch.load(sys.argv[1], weights_only=True), sys.argv[2])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--paths", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src = args.workdir / f"paths_{args.paths}.pth"
    if not src.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", MAKE_SCRIPT, str(src), str(args.paths)], check=True)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    out = args.workdir / "paths_out.pth"
    compare(
        {
            "ckptfix strip-module": [ckptfix, "strip-module", str(src), str(out)],
            "ckptfix diff": [ckptfix, "diff", str(src), str(src)],
            "ckptfix convert --verify": [ckptfix, "convert", str(src), str(out), "--verify"],
            "torch.load -> torch.save": [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)],
        },
        [out],
        args.runs,
        src,
        f"one tensor under {args.paths} paths",
    )


if __name__ == "__main__":
    main()
