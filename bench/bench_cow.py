"""Copy-on-write speed (issue 14): the same commands on an XFS (reflink) loop mount and on the
ordinary file system, side by side in one run.

    sudo python bench/bench_cow.py [--size-gb 1.2] [--runs 5] [--workdir bench/_work] [--no-xfs]

(Byte-compile the package first if your environment sets PYTHONDONTWRITEBYTECODE, as a pip
install does anyway: ``python -m compileall -q ckptfix``; recompiling it costs every run ~50 ms,
which is most of a command's time on a copy-on-write file system.)

Contenders on each file system: ``cp --reflink=auto`` of the .pth (the yardstick), ckptfix
``strip-module``, ``convert`` .pth -> .safetensors and .safetensors -> .pth. Each round runs every
contender once, in turn, as its own process, with its output removed and the disk synced
beforehand (outside the timing: no run pays for freeing or overwriting the last one's file, or
competes with its writeback); the ratio to ``cp`` is
taken within each round and the medians are printed, with the bytes of each output that share
blocks with the input (FIEMAP). The XFS file system is made in a sparse image file in the
workdir and loop-mounted (root, ``mkfs.xfs`` from xfsprogs); it is unmounted and deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import make_checkpoint, timed

from ckptfix.fileio.extents import shared_bytes


@contextmanager
def xfs_mount(workdir: Path, size_gb: float, *, wanted: bool = True) -> Iterator[Path | None]:
    """A fresh XFS with reflink in a sparse image in ``workdir``, loop-mounted; None (with a
    reason printed) where that cannot be done here."""
    if not wanted:
        yield None
        return
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        print("XFS: skipped (needs root and mkfs.xfs: apt-get install xfsprogs)")
        yield None
        return
    image = workdir / "xfs.img"
    mount = Path(tempfile.mkdtemp(prefix="ckptfix-xfs-"))
    with open(image, "wb") as f:
        f.truncate(int(size_gb * 2**30))
    subprocess.run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if mounted.returncode:
        print(f"XFS: skipped (cannot loop-mount: {mounted.stderr.strip()})")
        image.unlink()
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        image.unlink()
        mount.rmdir()


def contenders(folder: Path, ckptfix: str) -> dict[str, tuple[list[str], Path]]:
    pth, st = folder / "ddp_large.pth", folder / "ddp_large.safetensors"
    return {
        "cp --reflink=auto (.pth)": (["cp", "--reflink=auto", str(pth), str(folder / "cp.pth")], folder / "cp.pth"),
        "ckptfix strip-module": ([ckptfix, "strip-module", str(pth), str(folder / "out.pth")], folder / "out.pth"),
        "ckptfix convert .pth -> .safetensors": (
            [ckptfix, "convert", str(pth), str(folder / "out.safetensors")],
            folder / "out.safetensors",
        ),
        "ckptfix convert .safetensors -> .pth": (
            [ckptfix, "convert", str(st), str(folder / "back.pth")],
            folder / "back.pth",
        ),
    }


def prepare(folder: Path, source: Path, ckptfix: str) -> None:
    """The .pth input (copied from ``source``) and its .safetensors twin, in ``folder``."""
    pth, st = folder / "ddp_large.pth", folder / "ddp_large.safetensors"
    if not pth.exists():
        subprocess.run(["cp", "--reflink=never", str(source), str(pth)], check=True)
    if not st.exists():
        subprocess.run([ckptfix, "convert", str(pth), str(st)], check=True, stdout=subprocess.DEVNULL)
    os.sync()  # inputs on disk: what the runs measure is the outputs' writing


def measure(folder: Path, ckptfix: str, runs: int) -> list[str]:
    """Table rows: median wall, median ratio to cp (per round), shared bytes of the last output."""
    table = contenders(folder, ckptfix)
    walls: dict[str, list[float]] = {name: [] for name in table}
    cpus: dict[str, list[float]] = {name: [] for name in table}
    shared: dict[str, int | None] = {}
    for _ in range(runs):
        for name, (cmd, out) in table.items():
            out.unlink(missing_ok=True)
            os.sync()  # no writeback of an earlier run's output competes with this one
            wall, cpu, _ = timed(cmd)
            walls[name].append(wall)
            cpus[name].append(cpu)
    for name, (_, out) in table.items():
        with open(out, "rb") as f:
            shared[name] = shared_bytes(f.fileno())
        out.unlink()
    base = walls[next(iter(table))]
    rows = []
    for name, times in walls.items():
        ratio = statistics.median(t / b for t, b in zip(times, base))
        count = shared[name]
        share = "unknown" if count is None else f"{count / 1e9:.2f} GB"
        rows.append(
            f"| {name} | {statistics.median(times):.3f} | {', '.join(f'{t:.2f}' for t in times)} "
            f"| {ratio:.2f}x | {statistics.median(cpus[name]):.3f} | {share} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    parser.add_argument("--no-xfs", action="store_true", help="only the ordinary file system")
    args = parser.parse_args()
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e .)")
    source = args.workdir / "ddp_large.pth"
    make_checkpoint(source, args.size_gb)
    ordinary = args.workdir
    fs_type = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(ordinary)], capture_output=True, text=True)
    print(f"input: {source.stat().st_size / 1e9:.2f} GB, 200 float32 tensors; {args.runs} rounds")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    results: dict[str, list[str]] = {}
    prepare(ordinary, source, ckptfix)
    with xfs_mount(args.workdir, max(8.0, 6 * args.size_gb), wanted=not args.no_xfs) as xfs:
        here = f"{fs_type.stdout.strip() or 'file system'} ({ordinary})"
        places = [(here, ordinary)] + ([("xfs, reflink (loop mount)", xfs)] if xfs else [])
        if xfs:
            prepare(xfs, source, ckptfix)
        for label, folder in places:
            results[label] = measure(folder, ckptfix, args.runs)
    for label, rows in results.items():
        print(f"\n{label}\n")
        print("| command | median wall (s) | all runs (s) | vs cp (median of pairs) | median CPU (s) | shared |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
