"""Many small tensors: a training checkpoint of 50 000 parameters with Adam state (200 000 tensors).

    python bench/bench_many.py [--params 50000] [--runs 5] [--workdir bench/_work] [--engines]

Times `ckptfix strip-module` against `cp` and a plain torch script (torch.load -> strip ->
torch.save), and `ckptfix inspect` on its own, each as a separate process with its peak RSS.
Per-tensor cost dominates here (the file is ~60 MB), not bytes: this is the benchmark for the
unpickler, the emitter and the zip writer. `--params 250000` gives 1 M tensors.
`--engines` times the writing commands under both engines instead (CKPTFIX_ENGINE=python and
=native, interleaved): strip-module, strip-module --dtype bfloat16, convert of the state dict's
50 000 tensors from .safetensors to .pth, and from the checkpoint to one .safetensors file and to
HF shards; each conversion next to its torch peer in the same run (`--no-torch` leaves those out):
the strip script casting the state dict's floating tensors with `.to(torch.bfloat16)`,
torch.load + `safetensors.torch.save_file`, torch.load + `huggingface_hub.save_torch_state_dict`
with the same shard size.
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

#: the peers of the conversions `--engines` times: what a user would write with torch
TORCH_PEERS = {
    "strip-module --dtype bfloat16": """
import sys, torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
ckpt = torch.load(sys.argv[1], weights_only=True)
sd = ckpt["state_dict"]
consume_prefix_in_state_dict_if_present(sd, "module.")
for k, v in sd.items():
    if v.is_floating_point():
        sd[k] = v.to(torch.bfloat16)
torch.save(ckpt, sys.argv[2])
""",
    "convert --select state_dict -> .safetensors": """
import sys, torch
from safetensors.torch import save_file
save_file(torch.load(sys.argv[1], weights_only=True)["state_dict"], sys.argv[2], metadata={"format": "pt"})
""",
    "convert --select state_dict -> shards": """
import sys, torch
from huggingface_hub import save_torch_state_dict
sd = torch.load(sys.argv[1], weights_only=True)["state_dict"]
save_torch_state_dict(sd, sys.argv[2], max_shard_size=sys.argv[3])
""",
}

#: shard size of the shards benchmark: 4 shards of the 50 000 tensors (32 bytes each)
SHARD_SIZE = "500KB"


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


def engines(args: argparse.Namespace, src: Path, ckptfix: str, out: Path, label: str) -> None:
    """The writing commands under both engines, each with its torch peer (if any) in the same run."""
    flat = args.workdir / f"adam_{args.params}_state_dict.safetensors"
    if not flat.exists():
        subprocess.run([ckptfix, "convert", str(src), str(flat), "--select", "state_dict"], check=True)
    st_out = args.workdir / "many_out.safetensors"
    shards = args.workdir / "many_shards"
    # a fresh, empty folder each run (compare removes files, not folders; ckptfix refuses existing
    # shards; huggingface_hub's save_torch_state_dict needs the folder to exist)
    fresh = f'rm -rf {shards} && mkdir {shards} && exec "$@"'
    commands: dict[str, tuple[list[str], list[str] | None]] = {
        "strip-module": ([ckptfix, "strip-module", str(src), str(out)], None),
        "strip-module --dtype bfloat16": (
            [ckptfix, "strip-module", str(src), str(out), "--dtype", "bfloat16"],
            [sys.executable, "-c", TORCH_PEERS["strip-module --dtype bfloat16"], str(src), str(out)],
        ),
        "convert .safetensors -> .pth": ([ckptfix, "convert", str(flat), str(out)], None),
        "convert --select state_dict -> .safetensors": (
            [ckptfix, "convert", str(src), str(st_out), "--select", "state_dict"],
            [sys.executable, "-c", TORCH_PEERS["convert --select state_dict -> .safetensors"], str(src), str(st_out)],
        ),
        "convert --select state_dict -> shards": (
            ["sh", "-c", fresh, "sh", ckptfix, "convert", str(src), f"{shards}/", "--select", "state_dict"]
            + ["--max-shard-size", SHARD_SIZE],
            ["sh", "-c", fresh, "sh", sys.executable, "-c", TORCH_PEERS["convert --select state_dict -> shards"]]
            + [str(src), str(shards), SHARD_SIZE],
        ),
    }
    wanted = args.only.split(",") if args.only else list(commands)
    for name in wanted:
        command, peer = commands[name]
        contenders = {
            f"{name}, {engine} engine": ["env", f"CKPTFIX_ENGINE={engine}", *command] for engine in ("python", "native")
        }
        if peer and not args.no_torch:
            contenders[f"{name}, torch peer"] = peer
        compare(contenders, [out, st_out], args.runs, src, label, last_is_torch=bool(peer and not args.no_torch))
        print()
    shutil.rmtree(shards, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", action="store_true", help="the writing commands, python vs native engine")
    parser.add_argument("--no-torch", action="store_true", help="with --engines: leave the torch peers out")
    parser.add_argument("--only", help="with --engines: these commands only (comma-separated names)")
    args, src = adam_input(parser)
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    out = args.workdir / "many_out.pth"
    tensors = args.params * 4
    label = f"{args.params} parameters with Adam state ({tensors} tensors)"
    if args.engines:
        engines(args, src, ckptfix, out, label)
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
