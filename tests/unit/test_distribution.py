"""The distribution's metadata: MIT in PEP 639 form with the license text shipped, a core
install without torch (torch is the ``[torch]`` extra), and ``--version`` from the installed
package's metadata with the source tree's ``__version__`` as the fallback."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pytest
from conftest import ROOT

import ckptfix
from ckptfix.cli import commands

#: the distribution's metadata: CI runs these in one pass (pyproject's engine_independent)
pytestmark = pytest.mark.engine_independent


def _pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_shipped_in_pep_639_form() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 The ckptfix authors" in text
    project = _pyproject()
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"]


def test_core_dependencies_have_no_torch() -> None:
    project = _pyproject()["project"]
    names = [d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]]
    assert names == ["click", "safetensors", "numpy"]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.6"]


def test_version_comes_from_the_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    assert commands.package_version() == version("ckptfix")  # what pip installed

    def no_metadata(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr("importlib.metadata.version", no_metadata)
    assert commands.package_version() == ckptfix.__version__  # a source tree without metadata
