"""Replay the vm target's corpus through both engines (what libFuzzer cannot check itself).

The libFuzzer target only proves the native VM never panics; the corpus it grows is the
coverage-rich set of inputs, so it is also the best differential test input there is. Each input
(flag byte stripped: bit 0 = a storage loader is present) goes through ``restricted_load`` on both
engines, with the comparison of tests/unit/test_native_vm.py (same tree, end offset and globals,
or the same error class). Inputs where the engines differ are copied to ``artifacts/vm-diff/``.

    .venv/bin/python native/fuzz/replay.py [corpus folder...]
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit")]
os.environ["CKPTFIX_ENGINE"] = "native"

import test_native_vm as t  # noqa: E402


def main() -> None:
    folders = [Path(a) for a in sys.argv[1:]] or [HERE / "corpus" / "vm", HERE / "seeds" / "vm"]
    engines = t.Engines()
    differ = HERE / "artifacts" / "vm-diff"
    found = 0
    for folder in folders:
        for path in sorted(folder.iterdir()):
            raw = path.read_bytes()
            flag, data = (raw[0], raw[1:]) if raw else (1, raw)
            loader = t.Loader if flag & 1 else (lambda: None)
            try:
                engines.check(data, loader)
            except AssertionError as exc:
                found += 1
                differ.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, differ / path.name)
                print(f"{path.name}: {str(exc)[:300]}")
    print(f"{engines.inputs} inputs, {engines.native_read} read by the native VM, {found} differ")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
