"""Time `ckptfix strip-module` against `cp` and a plain torch script on one large checkpoint.

    python bench/bench_strip.py [--size-gb 1.2] [--runs 7] [--workdir bench/_work]

The page cache is warm for all contenders (the file was just written and every run reads it).
"""

from __future__ import annotations

import sys

from harness import compare, setup

TORCH_SCRIPT = """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
sd = torch.load(sys.argv[1], weights_only=True)
consume_prefix_in_state_dict_if_present(sd, "module.")
torch.save(sd, sys.argv[2])
"""


def main() -> None:
    args, src, ckptfix = setup(__doc__)
    out = args.workdir / "out.pth"
    compare(
        {
            "cp": ["cp", str(src), str(out)],
            "ckptfix strip-module": [ckptfix, "strip-module", str(src), str(out)],
            "torch.load -> consume_prefix -> torch.save": [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)],
        },
        [out],
        args.runs,
        src,
    )


if __name__ == "__main__":
    main()
