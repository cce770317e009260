"""docs/config.md is generated from the dataclasses and must match them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from colossal_hetero.config import schema
from colossal_hetero.config.reference import field_docs, render_config_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_md_is_current():
    assert DOC.read_text() == render_config_reference(), (
        "docs/config.md is stale: python -m colossal_hetero.config.reference > docs/config.md"
    )


def test_every_field_is_documented():
    for cls in vars(schema).values():
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
            assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"
