"""Packaging (issue 18, item 7): the xla / tpu extras pin torch to the release torch-xla was built against."""
from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, dict[str, str]]:
    """{extra: {package name (extras stripped): version spec}} from pyproject.toml."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    parsed = {}
    for extra, requirements in project["optional-dependencies"].items():
        parsed[extra] = {}
        for req in requirements:
            name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)", req).groups()
            parsed[extra][name.lower().replace("_", "-")] = spec
    return parsed


@pytest.mark.parametrize("extra", ["xla", "tpu"])
def test_xla_extras_pin_torch_to_the_torch_xla_release(extra):
    pins = _extras()[extra]
    torch_pin, xla_pin = pins.get("torch", ""), pins.get("torch-xla", "")
    assert torch_pin.startswith("==") and xla_pin.startswith("=="), f"[{extra}] must pin both exactly: {pins}"
    # torch-xla X.Y.Z is built against torch X.Y.Z: the same release, not merely compatible specifiers
    assert torch_pin == xla_pin, f"[{extra}] torch {torch_pin} vs torch-xla {xla_pin}"


def test_tpu_extra_brings_libtpu_at_the_version_torch_xla_names():
    pins = _extras()
    assert pins["tpu"].get("libtpu", "").startswith("=="), "the tpu extra must bring libtpu, pinned"
    assert pins["xla"]["torch"] == pins["tpu"]["torch"]
    try:
        installed = importlib.metadata.version("torch-xla")
    except importlib.metadata.PackageNotFoundError:
        return  # the pins above still agree with each other; nothing installed to compare with
    if pins["tpu"]["torch-xla"] != f"=={installed}":
        return  # another torch-xla release is installed: its metadata says nothing about our pin
    wanted = [r for r in importlib.metadata.requires("torch-xla") or [] if r.startswith("libtpu")]
    assert wanted and pins["tpu"]["libtpu"] in wanted[0], f"torch-xla {installed} asks for {wanted}"
