"""Differential fuzzing against CPython itself (issue 22): thousands of pickles per run -- generated
programs (globals, frames, memo juggling, text opcodes: tests/pickle_programs.py) and mutated real
``data.pkl`` files with globals spliced in -- are read by CPython's C unpickler as torch reads
``data.pkl`` (the oracle, in batches) and by ckptfix's scan. Asserted for every input: every
global CPython resolved is one scan names (canonical names), and scan calls the pickle dangerous
whenever CPython resolved a dangerous global. Set CKPTFIX_FUZZ_ORACLE for more (or fewer) inputs.
"""

from __future__ import annotations

import io
import os
import random
import zipfile

import pytest
from hostile import g, su
from oracle import canonical, dangerous_names, pickle_views
from pickle_programs import NAMES, programs
from strategies import SEEDS

from ckptfix.analysis.scan import scan_pickles

#: CPython's unpickler against scan, which never asks which engine runs: CI runs this in one pass
pytestmark = pytest.mark.engine_independent

INPUTS = int(os.environ.get("CKPTFIX_FUZZ_ORACLE", "2400"))


def _real_pickles() -> list[bytes]:
    found = []
    for seed in SEEDS:
        if seed[:2] == b"PK":
            with zipfile.ZipFile(io.BytesIO(seed)) as z:
                found += [z.read(name) for name in z.namelist() if name.endswith("data.pkl")]
    return found


def mutated(rng: random.Random, real: list[bytes], count: int) -> list[bytes]:
    """Real data.pkl files, each with a global (and a call of it) spliced in at an opcode-agnostic
    place, then flipped, cut, duplicated or overwritten a little."""
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(real))
        module, name = rng.choice(NAMES)
        at = rng.randrange(2, len(data))
        splice = rng.choice(
            [g(module, name) + b"0", g(module, name) + su("x") + b"\x85R0", su(module) + su(name) + b"\x930"]
        )
        data[at:at] = splice
        for _ in range(rng.randrange(3)):
            at = rng.randrange(len(data))
            op = rng.randrange(4)
            if op == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[at : at + rng.randrange(1, 16)]
            elif op == 2:
                data[at:at] = data[at : at + rng.randrange(1, 32)]
            else:
                data[at] = rng.choice(b"0123\x85\x86\x87\x93\x94\x95()}]qhrjcRNt.")
        out.append(bytes(data))
    return out


def test_scan_agrees_with_cpython_on_thousands_of_pickles() -> None:
    rng = random.Random(20261124)
    pickles = programs(rng.randrange(1 << 30), INPUTS // 2) + mutated(rng, _real_pickles(), INPUTS - INPUTS // 2)
    disagreements, payloads = [], 0
    for data, view in zip(pickles, pickle_views(pickles), strict=True):
        found, _ = scan_pickles(data, "fuzz")
        names = [f.name for f in found]
        dangerous = dangerous_names(view.globals)
        payloads += bool(dangerous)
        missed = canonical(view.globals) - canonical(names)
        if missed or (dangerous and not any(f.verdict == "dangerous" for f in found)):
            disagreements.append((data, view.globals, names))
    assert not disagreements, f"{len(disagreements)} of {len(pickles)}; first: {disagreements[0]!r:.2000}"
    assert len(pickles) >= 2000 or INPUTS < 2000
    assert payloads > len(pickles) // 10, payloads  # the inputs do reach payloads
