"""The package's metadata: one version, written in the workspace's Cargo.toml."""

import tomllib
from pathlib import Path

import powerinfer_rs

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_the_workspaces():
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert powerinfer_rs.__version__ == cargo["workspace"]["package"]["version"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
