"""What the package declares about itself (``make test-wheel`` builds the
sdist and wheel and runs the torch-free tests from the installed wheel):
the license, and the pytest plugin's import without pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_string_with_its_file():
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) the dcp_optim authors." in text
    # PEP 639's string form needs setuptools 77; torch stays out of the
    # isolated build environment
    requires = _pyproject()["build-system"]["requires"]
    assert requires == ["setuptools>=77"]


def test_testing_plugin_says_it_needs_pytest():
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "try:\n"
        "    import dcp_optim.testing\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "dcp_optim.testing is a pytest plugin and needs pytest" in proc.stdout
