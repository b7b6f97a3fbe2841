"""The torch zip write phase alone, both engines, on bench_many.py's 200 000-tensor Adam checkpoint.

    python bench/bench_write.py [--params 50000] [--runs 5] [--workdir bench/_work]

In process: the checkpoint is read once (native engine) and its tree written again with
``write_torch_zip`` (compaction, the pickle, the records, the directory) under each engine in
turn, CPU seconds (user + system) and wall, medians of ``--runs``. The two engines' outputs are
compared byte for byte before anything is timed. Make the input first with bench_many.py (or
let this script make it).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

from bench_many import adam_input

from ckptfix import native
from ckptfix.formats.checkpoint import read_checkpoint


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _engine(name: str) -> None:
    os.environ["CKPTFIX_ENGINE"] = name
    native.library.cache_clear()


def main() -> None:
    args, src = adam_input(argparse.ArgumentParser(description=__doc__))
    _engine("native")
    ckpt = read_checkpoint(src)
    outputs = {engine: Path(args.workdir) / f"write_{engine}.pth" for engine in ("python", "native")}

    def write(engine: str) -> tuple[float, float]:
        _engine(engine)
        cpu, wall = _cpu(), time.perf_counter()
        with open(outputs[engine], "wb") as out:
            ckpt.write(ckpt.root, out)
        return _cpu() - cpu, time.perf_counter() - wall

    for engine in outputs:
        write(engine)
    if outputs["python"].read_bytes() != outputs["native"].read_bytes():
        raise SystemExit("the engines' outputs differ")
    results: dict[str, list[tuple[float, float]]] = {engine: [] for engine in outputs}
    for _ in range(args.runs):
        for engine in outputs:
            results[engine].append(write(engine))
    for path in outputs.values():
        path.unlink()
    print(f"input: {src.name}, {src.stat().st_size / 1e6:.0f} MB; {args.runs} runs each, interleaved, medians")
    print()
    print("| write_torch_zip | CPU (s) | wall (s) | all runs, CPU (s) |")
    print("|---|---|---|---|")
    for engine, runs in results.items():
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        print(f"| {engine} engine | {cpu:.3f} | {wall:.3f} | {', '.join(f'{r[0]:.2f}' for r in runs)} |")


if __name__ == "__main__":
    main()
