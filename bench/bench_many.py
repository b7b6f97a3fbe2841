"""Many small tensors: a training checkpoint of 50 000 parameters with Adam state (200 000 tensors).

    python bench/bench_many.py [--params 50000] [--runs 5] [--workdir bench/_work] [--engines]

Times `ckptfix strip-module` against `cp` and a plain torch script (torch.load -> strip ->
torch.save), and `ckptfix inspect` on its own, each as a separate process with its peak RSS.
Per-tensor cost dominates here (the file is ~60 MB), not bytes: this is the benchmark for the
unpickler, the emitter and the zip writer. `--params 250000` gives 1 M tensors.
`--engines` times the writing commands under both engines instead (CKPTFIX_ENGINE=python and
=native, interleaved): strip-module, strip-module --dtype bfloat16, and convert of the state
dict's 50 000 tensors from .safetensors to .pth.
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
n = int(sys.argv[2])
torch.manual_seed(0)
sd = {f"module.blocks.{i // 4}.layer{i % 4}.weight": torch.randn(8) for i in range(n)}
state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(8), "exp_avg_sq": torch.rand(8)} for i in range(n)}
opt = {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                         "amsgrad": False, "params": list(range(n))}]}
torch.save({"epoch": 3, "global_step": 1200, "state_dict": sd, "optimizer_states": [opt]}, sys.argv[1])
"""

TORCH_SCRIPT = """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
ckpt = torch.load(sys.argv[1], weights_only=True)
consume_prefix_in_state_dict_if_present(ckpt["state_dict"], "module.")
torch.save(ckpt, sys.argv[2])
"""


def adam_input(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path]:
    """The options every many-tensor benchmark takes (--params, --runs, --workdir, and the
    caller's own), and its input: the Adam checkpoint for --params, made by torch once."""
    parser.add_argument("--params", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    args = parser.parse_args()
    src = args.workdir / f"adam_{args.params}.pth"
    if not src.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", MAKE_SCRIPT, str(src), str(args.params)], check=True)
    return args, src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", action="store_true", help="the writing commands, python vs native engine")
    args, src = adam_input(parser)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    out = args.workdir / "many_out.pth"
    tensors = args.params * 4
    label = f"{args.params} parameters with Adam state ({tensors} tensors)"
    if args.engines:
        flat = args.workdir / f"adam_{args.params}_state_dict.safetensors"
        if not flat.exists():
            subprocess.run([ckptfix, "convert", str(src), str(flat), "--select", "state_dict"], check=True)
        commands = {
            "strip-module": [ckptfix, "strip-module", str(src), str(out)],
            "strip-module --dtype bfloat16": [ckptfix, "strip-module", str(src), str(out), "--dtype", "bfloat16"],
            "convert .safetensors -> .pth": [ckptfix, "convert", str(flat), str(out)],
        }
        contenders = {
            f"{name}, {engine} engine": ["env", f"CKPTFIX_ENGINE={engine}", *command]
            for name, command in commands.items()
            for engine in ("python", "native")
        }
        compare(contenders, [out], args.runs, src, label)
        return
    compare(
        {
            "cp": ["cp", str(src), str(out)],
            **{
                f"ckptfix {name}, {engine} engine": ["env", f"CKPTFIX_ENGINE={engine}", ckptfix, *command]
                for name, command in (
                    ("strip-module", ["strip-module", str(src), str(out)]),
                    ("inspect", ["inspect", str(src)]),
                )
                for engine in ("native", "python")
            },
            "torch.load -> consume_prefix -> torch.save": [sys.executable, "-c", TORCH_SCRIPT, str(src), str(out)],
        },
        [out],
        args.runs,
        src,
        label,
    )


if __name__ == "__main__":
    main()
