"""The torch-layout pickle emitter in process: Python engine against native, same tree, same run.

    python bench/bench_emit.py [--params 50000] [--runs 5] [--workdir bench/_work]

Reads the many-small-tensors checkpoint (bench_many.py makes it), strips ``module.`` and
compacts as strip-module does, then times ``writer.dumps_python`` (the reference) and
``writer.dumps`` with the native engine (CPU seconds of this process, best and median of
``--runs``), after checking that both wrote the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

from bench_many import adam_input

from ckptfix.formats.torchzip import compact_storages, read_torch_zip
from ckptfix.native import emit as native_emit
from ckptfix.pickling import writer
from ckptfix.transforms.prefix import strip_prefix


def main() -> None:
    args, src = adam_input(argparse.ArgumentParser(description=__doc__))
    if not native_emit.available():
        sys.exit("the native engine is not loaded (build it: pip install -e ., or set CKPTFIX_NATIVE_LIB)")
    gc.disable()  # as the pipeline runs (collector_paused)
    with open(src, "rb") as f:
        root, _ = read_torch_zip(str(src), f, os.path.getsize(src), set())
    root = strip_prefix(root, "module.").root
    root, _ = compact_storages(root)
    python, native = writer.dumps_python(root), writer.dumps(root)
    assert bytes(python.data) == bytes(native.data) and python.storages == native.storages
    times: dict[str, list[float]] = {"python": [], "native": []}
    for _ in range(args.runs):
        for name, emit in (("python", writer.dumps_python), ("native", writer.dumps)):
            start = time.process_time()
            emit(root)
            times[name].append(time.process_time() - start)
    print(
        f"{src.name}: data.pkl {len(python.data)} bytes, {len(python.storages)} storages; CPU s over {args.runs} runs"
    )
    for name, runs in times.items():
        print(f"{name}: best {min(runs):.3f}, median {statistics.median(runs):.3f}")
    print(f"native/python (medians): {statistics.median(times['native']) / statistics.median(times['python']):.3f}")


if __name__ == "__main__":
    main()
