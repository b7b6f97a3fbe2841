"""Seed corpora and the allow-list table for the libFuzzer targets (run by run.sh).

- ``table.txt``: the reader's real allow-list table (``native_table()``), which the vm target
  compiles in, so the fuzzer explores the globals the reader really allows.
- ``seeds/vm``: every fixture's ``data.pkl``, pickles torch writes for assorted values, and the
  random programs of ``tests/pickle_programs.py`` (the differential fuzzer's generator); each
  prefixed with the target's flag byte (bit 0: a storage loader is present).
- ``seeds/zipdir``: the fixtures' zip files, cut to their last 64 KiB plus the first record
  (the directory is what the target reads; whole files would slow every run).
"""

from __future__ import annotations

import io
import random
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from ckptfix.pickling.reader import native_table  # noqa: E402


def main() -> None:
    (HERE / "table.txt").write_bytes(native_table())
    vm, zipdir = HERE / "seeds" / "vm", HERE / "seeds" / "zipdir"
    vm.mkdir(parents=True, exist_ok=True)
    zipdir.mkdir(parents=True, exist_ok=True)
    for path in sorted(ROOT.joinpath("fixtures").rglob("*")):
        if not path.is_file() or not zipfile.is_zipfile(path) or path.stat().st_size > 8 << 20:
            continue
        data = path.read_bytes()
        (zipdir / path.name).write_bytes(data if len(data) < 256 << 10 else data[-(64 << 10) :])
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith("data.pkl"):
                    (vm / f"{path.name}.pkl").write_bytes(b"\x01" + z.read(name))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        values = {
            "nested": {"a": [1, 2.5, None, True, "x", b"y"], "t": (1, (2, 3)), "big": 1 << 70},
            "tensors": {"w": torch.ones(2, 3), "v": torch.arange(6)[::2], "h": torch.zeros(1, dtype=torch.half)},
            "param": torch.nn.Parameter(torch.ones(2)),
            "shared": [torch.ones(4)[:2], torch.ones(4)[2:]],
        }
        for name, value in values.items():
            buffer = io.BytesIO()
            torch.save(value, buffer)
            with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
                (vm / f"torch_{name}.pkl").write_bytes(
                    b"\x01" + z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
                )
    from pickle_programs import programs

    for i, program in enumerate(programs(seed=1, count=200)):
        (vm / f"program_{i}.pkl").write_bytes(bytes([random.Random(i).getrandbits(1)]) + program)


if __name__ == "__main__":
    main()
