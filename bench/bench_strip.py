"""Time `ckptfix strip-module` against `cp` and a plain torch script on one large checkpoint.

    python bench/bench_strip.py [--size-gb 1.2] [--runs 7] [--workdir bench/_work]
                                [--sync] [--engine auto|native|python|both] [--no-torch]

The page cache is warm for all contenders (the file was just written and every run reads it).
"""

from __future__ import annotations

import sys

from harness import compare, engines, setup

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
    contenders = {
        "cp": ["cp", str(src), str(out)],
        **engines(args, "ckptfix strip-module", [ckptfix, "strip-module", str(src), str(out)]),
    }
    if not args.no_torch:
        torch_run = [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)]
        contenders["torch.load -> consume_prefix -> torch.save"] = torch_run
    compare(contenders, [out], args.runs, src, sync=args.sync, last_is_torch=not args.no_torch)


if __name__ == "__main__":
    main()
