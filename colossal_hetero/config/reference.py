"""Render the config reference (docs/config.md) from the dataclasses themselves.

Field documentation is the string literal under each field of the config dataclasses
(schema.py and the section modules it imports, such as balancer.py), read with ``ast``;
``tests/unit/test_config_reference.py`` fails when docs/config.md is out of date. Regenerate:

    python -m colossal_hetero.config.reference > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
import typing
from typing import Any

from colossal_hetero.config import schema
from colossal_hetero.config.loader import to_dict


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass ``cls`` to the docstring written under it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("colossal_hetero.config.schema.", "")
    return text.replace("<class '", "").replace("'>", "")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(to_dict(field.default)).replace("'", '"')
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = to_dict(field.default_factory())  # type: ignore[misc]
        return "(section)" if isinstance(value, dict) and value else repr(value)
    return "required"


def _section(cls: type, path: str, lines: list[str], seen: set[str]) -> None:
    if path in seen:
        return
    seen.add(path)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    lines += [f"## `{path}`", "", " ".join((cls.__doc__ or "").split()), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested: list[tuple[type, str]] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        lines.append(
            f"| `{field.name}` | `{_type_name(hint)}` | `{_default(field)}` | "
            f"{docs.get(field.name, '')} |"
        )
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        for option in typing.get_args(hint) if union else (hint,):  # list[X] | Literal[...]
            for inner in (option, *typing.get_args(option)):
                if dataclasses.is_dataclass(inner):
                    suffix = "[]" if typing.get_origin(option) is list else ""
                    nested.append((inner, f"{path}.{field.name}{suffix}"))  # type: ignore[arg-type]
    lines.append("")
    for inner, inner_path in nested:
        _section(inner, inner_path, lines, seen)


def render_config_reference() -> str:
    """Markdown reference of every YAML key, in file order."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `colossal_hetero/config/schema.py` by "
        "`python -m colossal_hetero.config.reference`; a test keeps it current.",
        "A YAML run file has the top-level sections below. Unknown keys are errors that name",
        "their path; values are type-checked (`model.hf` values against the transformers",
        "config's defaults). A file must be UTF-8 and hold settings; a key given twice is an",
        "error. `colossal-hetero check CONFIG` runs every check a launch makes before its",
        "first collective (the model's shape from its transformers config, no weights; the",
        "memory of listed identical devices; the device kind; the output folders; the plan),",
        "and reports a mistake as one line naming the field, as `train` and each rank do.",
        "",
    ]
    seen: set[str] = set()
    for field in dataclasses.fields(schema.RunConfig):
        cls = typing.get_type_hints(schema.RunConfig)[field.name]
        _section(cls, field.name, lines, seen)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_config_reference(), end="")
