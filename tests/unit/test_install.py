"""The lean install list (scripts/requirements-lean.txt) stays in step with what it serves:
pyproject.toml's dependencies and test extra, colossalai's declared dependencies, and the
pinned set in constraints.txt."""

from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line (PEP 503)."""
    name = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_lean_list_covers_the_package_and_only_adds_colossalai_dependencies():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lean = {_name(line) for line in _lines(ROOT / "scripts" / "requirements-lean.txt")}
    ours = {_name(r) for r in project["dependencies"]} | {
        _name(r) for r in project["optional-dependencies"]["test"]
    }
    assert "colossalai" in ours
    assert ours - {"colossalai"} <= lean, ours - lean
    colossalai = {_name(r) for r in requires("colossalai") or []}
    assert lean - ours <= colossalai, lean - ours - colossalai  # nothing foreign slips in
    assert {"torch", "transformers", "peft", "galore-torch"} <= lean  # imported at boost


def test_every_lean_package_is_pinned():
    pinned = {_name(line): line for line in _lines(ROOT / "constraints.txt")}
    lean = [_name(line) for line in _lines(ROOT / "scripts" / "requirements-lean.txt")]
    assert all("==" in pinned.get(name, "") for name in lean), set(lean) - set(pinned)
    assert "==" in pinned["colossalai"] and "colossal-hetero" not in pinned
