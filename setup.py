"""Build hook: compile the native core (``native/``, Rust) into the package when cargo is present.

Everything else about the package is in pyproject.toml. Without cargo -- or when the build
fails -- the install goes on with the pure-Python engine and says so on stderr; set
``CKPTFIX_REQUIRE_NATIVE=1`` to make a missing or failed build an error (CI does, so a broken
crate cannot land behind the fallback).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).parent
CRATE = ROOT / "native"
LIBRARY = {"darwin": "libckptfix_native.dylib", "win32": "ckptfix_native.dll"}.get(sys.platform, "libckptfix_native.so")


class build_native(build_ext):
    """Run ``cargo build --release --offline`` and put the library where ckptfix.native looks."""

    def get_ext_filename(self, fullname: str) -> str:
        # not a Python extension module: loaded with ctypes under its own name
        return os.path.join(*fullname.split(".")[:-1], LIBRARY)

    def build_extension(self, ext: Extension) -> None:
        required = os.environ.get("CKPTFIX_REQUIRE_NATIVE") == "1"
        cargo = shutil.which("cargo")
        if cargo is None or not (CRATE / "Cargo.toml").is_file():
            message = "cargo not found" if cargo is None else "no native/ sources"
            if required:
                raise SystemExit(f"ckptfix: CKPTFIX_REQUIRE_NATIVE=1 but {message}")
            print(f"ckptfix: {message}; installing the pure-Python engine only", file=sys.stderr)
            return
        target = Path(self.build_temp).resolve() / "cargo-target"
        command = [cargo, "build", "--release", "--offline", "--manifest-path", str(CRATE / "Cargo.toml")]
        done = subprocess.run(command, env={**os.environ, "CARGO_TARGET_DIR": str(target)}, check=False)
        if done.returncode != 0:
            if required:
                raise SystemExit("ckptfix: the native core did not build (see cargo's output above)")
            print("ckptfix: the native core did not build; installing the pure-Python engine only", file=sys.stderr)
            return
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target / "release" / LIBRARY, dest)


class bdist_wheel_any_python(bdist_wheel):
    """The library has no Python ABI (ctypes loads it): one wheel per platform, every Python 3."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    ext_modules=[Extension("ckptfix.native.libckptfix_native", sources=[])],
    cmdclass={"build_ext": build_native, "bdist_wheel": bdist_wheel_any_python},
)
