"""The one check that every config dataclass's ``__post_init__`` uses."""

from __future__ import annotations


def require(condition: bool, path: str, message: str) -> None:
    """Raise ``ValueError("<path>: <message>")`` unless ``condition``; the loader prefixes
    ``path`` with the section, so the user sees the field's full dotted name."""
    if not condition:
        raise ValueError(f"{path}: {message}")
