"""Time `ckptfix convert x.pth x.safetensors` against `cp` and safetensors' own torch path.

    python bench/bench_convert.py [--size-gb 1.2] [--runs 7] [--workdir bench/_work]

The torch contender is what users write: ``save_file(torch.load(path))``. Also times the
way back (safetensors -> .pth). The page cache is warm for all contenders.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from harness import compare, make_checkpoint

TO_ST = """
import sys, torch
from safetensors.torch import save_file
save_file(torch.load(sys.argv[1], weights_only=True), sys.argv[2])
"""
TO_PTH = """
import sys, torch
from safetensors.torch import load_file
torch.save(load_file(sys.argv[1]), sys.argv[2])
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src = args.workdir / "ddp_large.pth"
    st, back = args.workdir / "out.safetensors", args.workdir / "back.pth"
    make_checkpoint(src, args.size_gb)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    print("## .pth -> .safetensors\n")
    compare(
        {
            "cp": ["cp", str(src), str(st)],
            "ckptfix convert": [ckptfix, "convert", str(src), str(st)],
            "save_file(torch.load(...))": [sys.executable, "-c", TO_ST, str(src), str(st)],
        },
        [st], args.runs, src,
    )
    subprocess.run([ckptfix, "convert", str(src), str(st)], check=True, capture_output=True)
    print("\n## .safetensors -> .pth\n")
    compare(
        {
            "cp": ["cp", str(st), str(back)],
            "ckptfix convert": [ckptfix, "convert", str(st), str(back)],
            "torch.save(load_file(...))": [sys.executable, "-c", TO_PTH, str(st), str(back)],
        },
        [back], args.runs, st,
    )
    st.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
