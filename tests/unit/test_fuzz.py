"""Fuzzing the library: mutated, truncated and spliced real checkpoints through the reader, the
scanner and the writer, in process (the command line's fuzz: tests/cli/test_fuzz_cli.py).
Set CKPTFIX_FUZZ_FAST for more (or fewer) than 10 000 inputs (CI's two passes, one per engine,
take 5 000 different ones each: tests/conftest.py ``fuzz_share``).
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

from conftest import fuzz_seed, fuzz_share
from strategies import SEEDS

# --------------------------------------------------------------------------- the fast fuzzer

#: this pass's inputs: all 10 000 in a single run, 5 000 in each of CI's two passes (different ones)
FAST_EXAMPLES = fuzz_share(int(os.environ.get("CKPTFIX_FUZZ_FAST", "10000")))


def _mutate(rng: random.Random, data: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        at = rng.randrange(len(data))
        op = rng.randrange(6)
        if op == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[at:]
        elif op == 2:
            other = rng.choice(SEEDS)
            start = rng.randrange(len(other))
            data[at:] = other[start : start + rng.randint(1, 4096)]
        elif op == 3:
            data[at:at] = rng.randbytes(rng.randint(1, 64))
        elif op == 4:
            del data[at : at + rng.randint(1, 256)]
        else:
            chunk = rng.randbytes(rng.randint(1, 16))
            data[at : at + len(chunk)] = chunk
    return data


def _output_globals(zip_bytes: bytes) -> set[str]:
    """Every global the written data.pkl names, read with pickletools (not with our own VM)."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as z:
        pickle_bytes = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    names: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(pickle_bytes):
        if op.name in ("GLOBAL", "INST"):
            names.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            names.add(".".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return {n.replace("__builtin__.", "builtins.") for n in names}


def test_ten_thousand_mutations_read_scan_and_write_cleanly(tmp_path: Path) -> None:
    """Mutated real files through the reader, the scanner and the writer, in process: every
    failure is a CkptfixError (exit 3 in the CLI) -- never another exception (exit 5), never
    a hang -- and every tree that reads is written as a pickle whose globals are all on the
    allow-list (checked with pickletools, independently of ckptfix's own VM)."""
    import signal

    from ckptfix.analysis.scan import scan_path
    from ckptfix.errors import CkptfixError
    from ckptfix.formats.checkpoint import read_checkpoint
    from ckptfix.formats.torchzip import write_torch_zip
    from ckptfix.pickling.reader import PYTHON_GLOBALS, TORCH_GLOBALS

    allowed = TORCH_GLOBALS | PYTHON_GLOBALS
    rng = random.Random(fuzz_seed(20261123))
    src, dest = tmp_path / "in.pth", tmp_path / "out.pth"

    def too_slow(*_: object) -> None:
        raise TimeoutError("one input took over 5 s of CPU time: a hang")

    previous = signal.signal(signal.SIGPROF, too_slow)  # CPU time: a busy machine is no hang
    outcomes = {"read": 0, "refused": 0}
    try:
        for case in range(FAST_EXAMPLES):
            data = bytes(_mutate(rng, bytearray(rng.choice(SEEDS))))
            # a new file each time: truncating and rewriting one makes ext4 flush it (auto_da_alloc), 10x slower
            src.unlink(missing_ok=True)
            src.write_bytes(data)
            signal.setitimer(signal.ITIMER_PROF, 5)
            try:
                scan_path(src)  # never raises: errors are in its result
                try:
                    ckpt = read_checkpoint(src)
                except CkptfixError:
                    outcomes["refused"] += 1
                    continue
                outcomes["read"] += 1
                if ckpt.format == "torch-zip":
                    try:
                        dest.unlink(missing_ok=True)
                        with open(dest, "wb") as out:
                            write_torch_zip(ckpt.root, out, source=ckpt.archive)
                    except CkptfixError:
                        continue  # e.g. a storage that turned out short while copying
                    extra = _output_globals(dest.read_bytes()) - allowed
                    assert not extra, f"case {case}: output names {extra}"
            except (CkptfixError, AssertionError):
                raise
            except Exception as exc:  # an exit 5 in the CLI: keep the input to reproduce it
                keep = tmp_path / f"case{case}.bin"
                keep.write_bytes(data)
                raise AssertionError(f"case {case}: {type(exc).__name__}: {exc} (input kept in {keep})") from exc
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
    finally:
        signal.signal(signal.SIGPROF, previous)
    assert outcomes["read"] > FAST_EXAMPLES // 100 and outcomes["refused"] > FAST_EXAMPLES // 100, outcomes
