"""YAML <-> config dataclasses, strictly: unknown keys and wrong types are errors naming their path.

    >>> load_config("configs/demo.yaml").parallel.tp
    2

A field error reads ``parallel.tp_size: unknown key (did you mean 'tp'?)`` or
``cluster.devices[2].speed: must be > 0, got 0``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from colossal_hetero.config.schema import RunConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A user error in a configuration, carrying the dotted path of the offending field."""


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML file into a validated ``RunConfig``.

    Raises:
        ConfigError: the file is empty, not UTF-8, not valid YAML, repeats a key, is not a
            mapping, a key or value is wrong (the message names the file or the field), or
            the file cannot be read.
    """
    data = read_yaml(path)
    if data is None:
        raise ConfigError(f"{path}: the file holds no settings (an empty config is refused)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return from_dict(RunConfig, data)


def read_yaml(path: str | Path) -> Any:
    """The plain data of a YAML file, read strictly: UTF-8, valid syntax, no repeated key.

    Raises:
        ConfigError: one line naming the file and the line, or the repeated key's path; or
            the file cannot be read (missing, a folder, no permission).
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})"
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _refuse_repeated_keys(node, "")
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark, context = error.problem_mark or error.context_mark, error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = error.problem or error.context or "unreadable"
        if error.context and context and context is not mark:
            problem += f" ({error.context} from line {context.line + 1})"
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(error).split())}") from None


def _refuse_repeated_keys(node: yaml.Node, path: str) -> None:
    """Walk a composed YAML tree; a mapping that names a key twice is an error (PyYAML would
    silently keep the last value)."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, f"{path}[{i}]")
    elif isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            key_path = _join(path, key)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"{key_path}: key given twice (again at line {line})")
            seen.add(key)
            _refuse_repeated_keys(value_node, key_path)


def _closest(key: str, names: list[str]) -> str | None:
    """The known name a mistyped ``key`` most likely meant, or None.

    Colossal-AI's plugins spell sizes ``tp_size``, ``pp_size``, ``ep_size``; ours are ``tp``,
    ``pp``, ``ep``, which string similarity alone would not pick (``tp_mode`` is closer).
    """
    stem = key.removesuffix("_size")
    if stem != key and stem in names:
        return stem
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.4)
    return close[0] if close else None


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data, recursively and strictly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        key_path = _join(path, str(key))
        if key not in names:
            close = _closest(str(key), names)
            hint = f" (did you mean '{close}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{key_path}: unknown key{hint}")
        kwargs[key] = _convert(hints[key], value, key_path)
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field is missing
        raise ConfigError(f"{path or cls.__name__}: {error}") from None
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(_join(path, str(error))) from None


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        literals = [a for a in inner if typing.get_origin(a) is typing.Literal]
        if isinstance(value, str) and literals:  # e.g. a list or the word from_cluster
            return _convert(literals[0], value, path)
        return _convert(inner[0], value, path)
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{path}: must be one of {choices}, got {_show(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        return [_convert(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)  # type: ignore[arg-type]
    return _scalar(hint, value, path)


def _scalar(hint: Any, value: Any, path: str) -> Any:
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {_show(value)}")
    if not isinstance(value, hint):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {_show(value)}")
    return value


def to_dict(config: Any) -> Any:
    """Plain-data form of a config dataclass (what YAML would hold)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, list):
        return [to_dict(item) for item in config]
    if isinstance(config, dict):
        return {key: to_dict(item) for key, item in config.items()}
    return config


def dump_config(config: Any) -> str:
    """YAML text that ``load_config`` turns back into an equal config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"
