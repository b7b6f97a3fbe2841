"""Pickles made to disagree: a seeded generator of globals, frames (honest, short, long, nested,
empty, in any protocol), memo juggling and text opcodes, so that payloads really occur where
readers differ. Used by tests/unit/test_pickle_semantics.py and tests/unit/test_fuzz_oracle.py,
which hand them to CPython itself (tests/oracle.py) and to ckptfix's scan.

Everything generated is safe to hand to CPython's C unpickler behind the oracle's stand-ins:
memo indices stay small (its memo is an array) and nothing nests deeply.
"""

from __future__ import annotations

import random
import struct

from hostile import g, su, u

#: what the programs name: dangerous, allowed, Python 2 spellings, names that do not exist
NAMES = (
    ("posix", "system"),
    ("builtins", "eval"),
    ("os", "getcwd"),
    ("subprocess", "Popen"),
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "FloatStorage"),
    ("__builtin__", "set"),
    ("commands", "getoutput"),
    ("copy_reg", "_reconstructor"),
    ("os", "no_such_name"),
)

_INT_TEXTS = (b"010", b"0x10", b"01", b"00", b" 7", b"-3", b"+1", b"1_0", b"0b11", b"99999999999999999999", b"0o7")
_FLOAT_TEXTS = (b"1.5", b"-0.0", b"1e-500", b"inf", b".5", b"5.", b"1e5")


def frame(size: int) -> bytes:
    return b"\x95" + struct.pack("<Q", size)


def _statement(rng: random.Random, memo: list[int]) -> bytes:
    """Opcodes that leave the stack as they found it (what they resolve is what matters)."""
    module, name = rng.choice(NAMES)
    kind = rng.randrange(12)
    if kind == 0:
        return g(module, name) + b"0"
    if kind == 1:
        return su(module) + su(name) + b"\x93" + b"0"
    if kind == 2:  # memoize a global, use it later
        index = len(memo)
        memo.append(index)
        return g(module, name) + b"\x94" + b"0"
    if kind == 3 and memo:
        return b"h" + bytes([rng.choice(memo)]) + b"0"
    if kind == 4:  # a call of a global
        return g(module, name) + su("x") + b"\x85R0"
    if kind == 5:
        return b"I" + rng.choice(_INT_TEXTS) + b"\n0"
    if kind == 6:
        return b"F" + rng.choice(_FLOAT_TEXTS) + b"\n0"
    if kind == 7:
        text = "".join(rng.choice("abcdef\x8c\x95c\n") for _ in range(rng.randrange(12)))
        return (su(text) if rng.random() < 0.5 else u(text)) + b"0"
    if kind == 8:
        raw = rng.randbytes(rng.randrange(10))
        return b"C" + bytes([len(raw)]) + raw + b"0"
    if kind == 9:
        return b"(" + g(module, name) + b"K\x01" + b"1"  # MARK ... POP_MARK
    if kind == 10:
        return b"N2" + b"00"  # DUP
    return b"\x8a\x01\x05" + b"0"  # LONG1


def program(rng: random.Random) -> bytes:
    """One pickle: statements, cut into frames at arbitrary places (inside arguments too),
    whose declared sizes are sometimes short, long, nested or empty."""
    memo: list[int] = []
    body = b"".join(_statement(rng, memo) for _ in range(rng.randrange(1, 9)))
    body += rng.choice([b"}.", b"N.", b"N}.", b"(}.", b"}2."])
    out = [b"\x80" + bytes([rng.choice((2, 4, 4, 5))])]
    pos = 0
    while pos < len(body):
        size = rng.randrange(1, max(2, len(body) - pos + 1))
        chunk = body[pos : pos + size]
        pos += size
        roll = rng.random()
        if roll < 0.15:
            out.append(chunk)  # no frame
            continue
        declared = len(chunk)
        if roll < 0.55:
            declared = max(0, declared + rng.choice((-3, -2, -1, 1, 2, 5)))
        elif roll < 0.6:
            out.append(frame(0))
        elif roll < 0.7 and len(chunk) > 2:  # a frame inside the frame
            cut = rng.randrange(1, len(chunk))
            inner = chunk[cut:]
            chunk = chunk[:cut] + frame(len(inner) + rng.choice((0, 0, 1, 4))) + inner
            declared = len(chunk) + rng.choice((0, -2, 3))
        out.append(frame(max(0, declared)) + chunk)
    return b"".join(out)


def programs(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    return [program(rng) for _ in range(count)]
