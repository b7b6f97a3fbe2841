"""Time `ckptfix strip-module` against `cp` and a plain torch script on one large checkpoint.

    python bench/bench_strip.py [--size-gb 1.2] [--runs 7] [--workdir bench/_work]

The page cache is warm for all contenders (the file was just written and every run reads it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from harness import compare, make_checkpoint

TORCH_SCRIPT = """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
sd = torch.load(sys.argv[1], weights_only=True)
consume_prefix_in_state_dict_if_present(sd, "module.")
torch.save(sd, sys.argv[2])
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src, out = args.workdir / "ddp_large.pth", args.workdir / "out.pth"
    make_checkpoint(src, args.size_gb)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    compare(
        {
            "cp": ["cp", str(src), str(out)],
            "ckptfix strip-module": [ckptfix, "strip-module", str(src), str(out)],
            "torch.load -> consume_prefix -> torch.save": [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)],
        },
        [out], args.runs, src,
    )


if __name__ == "__main__":
    main()
