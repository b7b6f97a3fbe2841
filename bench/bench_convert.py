"""Time `ckptfix convert x.pth x.safetensors` against `cp` and safetensors' own torch path.

    python bench/bench_convert.py [--size-gb 1.2] [--runs 7] [--workdir bench/_work]
                                  [--sync] [--engine auto|native|python|both] [--no-torch]

The torch contender is what users write: ``save_file(torch.load(path))``. Also times the
way back (safetensors -> .pth). The page cache is warm for all contenders.
"""

from __future__ import annotations

import subprocess
import sys

from harness import compare, engines, setup

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
    args, src, ckptfix = setup(__doc__)
    st, back = args.workdir / "out.safetensors", args.workdir / "back.pth"
    for title, (a, b, ours, theirs, script) in {
        ".pth -> .safetensors": (src, st, "ckptfix convert", "save_file(torch.load(...))", TO_ST),
        ".safetensors -> .pth": (st, back, "ckptfix convert", "torch.save(load_file(...))", TO_PTH),
    }.items():
        if a == st:
            subprocess.run([ckptfix, "convert", str(src), str(st)], check=True, capture_output=True)
        print(f"## {title}\n")
        contenders = {"cp": ["cp", str(a), str(b)], **engines(args, ours, [ckptfix, "convert", str(a), str(b)])}
        if not args.no_torch:
            contenders[theirs] = [sys.executable, "-c", script, str(a), str(b)]
        compare(contenders, [b], args.runs, a, sync=args.sync, last_is_torch=not args.no_torch)
        print()
    st.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
