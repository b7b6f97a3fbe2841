"""Choosing and loading the engine (ckptfix/native): CKPTFIX_ENGINE and CKPTFIX_NATIVE_LIB.

The native library is optional at install time, so what is tested here is the choice itself:
a typo never selects an engine, ``python`` never loads the library, ``native`` never falls
back in silence, and a library built for another ABI is not used.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import needs_native

from ckptfix import native
from ckptfix.errors import BadInputError, UsageError


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """library() is cached per process: clear it around each test (and restore the real one)."""
    native.library.cache_clear()
    yield
    monkeypatch.undo()
    native.library.cache_clear()


def test_a_misspelt_engine_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_ENGINE", "rust")
    with pytest.raises(UsageError, match="'rust' is not an engine"):
        native.engine()


def test_python_never_loads_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_ENGINE", "Python")
    monkeypatch.setenv("CKPTFIX_NATIVE_LIB", "/nonexistent/lib.so")
    assert native.library() is None
    assert native.engine() == "python"
    assert native.function("ckptfix_abi_version") is None


def test_native_without_a_library_refuses_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTFIX_NATIVE_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setenv("CKPTFIX_ENGINE", "native")
    with pytest.raises(UsageError, match="cannot be loaded"):
        native.library()
    native.library.cache_clear()
    monkeypatch.setenv("CKPTFIX_ENGINE", "auto")
    assert native.engine() == "python"


needs_library = needs_native


@needs_library
def test_a_library_for_another_abi_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    monkeypatch.setenv("CKPTFIX_ENGINE", "native")
    with pytest.raises(UsageError, match="stale build"):
        native.library()
    native.library.cache_clear()
    monkeypatch.setenv("CKPTFIX_ENGINE", "auto")
    assert native.library() is None


@needs_library
def test_inputs_of_every_buffer_kind_reach_the_library_unchanged() -> None:
    """Input hands bytes, writable and read-only buffers over by address, without a copy."""
    data = bytes(range(256)) * 3
    for kind in (bytes, bytearray, lambda b: memoryview(b), lambda b: memoryview(bytearray(b)).toreadonly()):
        source = kind(data)
        held = native.Input(source)
        assert held.length == len(data)
        assert ctypes.string_at(held.address, held.length) == data
    assert native.Input(b"").address is None


def test_call_maps_each_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """call(): Ok -> bytes, Unsupported -> None, BadInput -> BadInputError, Internal -> a bug."""

    def fake(status: int, text: bytes) -> object:
        keep = ctypes.create_string_buffer(text, len(text))

        def fn(out: object) -> int:
            buf = out._obj  # type: ignore[attr-defined]
            buf.ptr, buf.len = ctypes.addressof(keep), len(text)
            return status

        return fn

    monkeypatch.setenv("CKPTFIX_ENGINE", "python")  # nothing to free: the fake owns its bytes
    assert native.call(fake(native.OK, b"out")) == b"out"
    assert native.call(fake(native.UNSUPPORTED, b"")) is None
    with pytest.raises(BadInputError, match="lies about its length"):
        native.call(fake(native.BAD_INPUT, b"lies about its length"))
    with pytest.raises(RuntimeError, match="native engine bug"):
        native.call(fake(native.INTERNAL, b"native engine bug: x"))
