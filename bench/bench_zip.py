"""The zip container in both engines, on bench_many.py's 200 000-tensor Adam checkpoint.

    python bench/bench_zip.py [--params 50000] [--runs 5] [--workdir bench/_work]

In-process, CPU seconds (user + system) and wall: reading the directory (``read_directory``:
end records, ~200 000 entries, names, local headers, overlaps) with the Python reference and
with the native reader; writing every record again as the writer's small-record path does
(``ZipWriter.add_small`` for each, then ``close``: local headers, padding, descriptors,
central directory, end records) with each engine. Then whole commands, as processes,
``ckptfix inspect`` and ``ckptfix strip-module`` under CKPTFIX_ENGINE=python and =native,
interleaved. Make the input first with bench_many.py (or let this script make it).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from bench_many import adam_input
from harness import timed

from ckptfix import native
from ckptfix.fileio import ziparchive


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median (CPU, wall) seconds of ``runs`` calls."""
    cpus, walls = [], []
    for _ in range(runs):
        cpu, wall = _cpu(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu() - cpu)
    return statistics.median(cpus), statistics.median(walls)


def main() -> None:
    args, src = adam_input(argparse.ArgumentParser(description=__doc__))
    os.environ["CKPTFIX_ENGINE"] = "native"
    native.library.cache_clear()
    size = src.stat().st_size

    def read_python() -> ziparchive.ZipDirectory:
        with open(src, "rb") as f:
            return ziparchive.read_directory_python(f, size, str(src))

    def read_native() -> ziparchive.ZipDirectory:
        with open(src, "rb") as f:
            return ziparchive.read_directory(f, size, str(src))

    records = read_native()
    assert records.columns() == read_python().columns()
    with open(src, "rb") as f:
        blobs = []
        for name in records:
            record = records[name]
            f.seek(record.data_offset)
            blobs.append((name.split("/", 1)[1], f.read(record.compressed_size), record.crc))

    def write(use_native: bool) -> Callable[[], None]:
        def run() -> None:
            with tempfile.TemporaryFile(dir=args.workdir) as out:
                writer = ziparchive.ZipWriter(out, "archive")
                writer._native = use_native
                for name, data, crc in blobs:
                    writer.add_small(name, data, crc)
                writer.close()

        return run

    print(f"input: {src.name}, {size / 1e6:.0f} MB, {len(records)} records; {args.runs} runs each, medians")
    print()
    print("| in-process step | engine | CPU (s) | wall (s) |")
    print("|---|---|---|---|")
    for step, fns in (
        ("read_directory", {"python": read_python, "native": read_native}),
        (f"write {len(blobs)} small records + directory", {"python": write(False), "native": write(True)}),
    ):
        for engine, fn in fns.items():
            cpu, wall = _measure(fn, args.runs)
            print(f"| {step} | {engine} | {cpu:.3f} | {wall:.3f} |")
    print()
    ckptfix = [sys.executable, "-m", "ckptfix"]
    out = args.workdir / "zip_out.pth"
    commands = {
        f"{what} ({engine})": (engine, [*ckptfix, *argv])
        for what, argv in (("inspect", ["inspect", str(src)]), ("strip-module", ["strip-module", str(src), str(out)]))
        for engine in ("python", "native")
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, (engine, cmd) in commands.items():
            out.unlink(missing_ok=True)
            os.environ["CKPTFIX_ENGINE"] = engine
            run = timed(cmd)
            results[name].append((run.cpu, run.wall))
    out.unlink(missing_ok=True)
    print("| command | CPU (s), median | wall (s), median | all runs, wall (s) |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        print(f"| ckptfix {name} | {cpu:.2f} | {wall:.2f} | {', '.join(f'{r[1]:.2f}' for r in runs)} |")


if __name__ == "__main__":
    main()
