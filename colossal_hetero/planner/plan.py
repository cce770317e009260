"""The Plan: what every rank executes, as a frozen, serialisable record; and its table.

A plan is pure data (strings, ints, floats, tuples), so YAML and JSON round trips are exact and
two ranks that planned from the same inputs hold equal plans.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

PLAN_VERSION = 1


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One layer's decision and its share of the predicted step."""

    name: str
    kind: str
    strategy: str
    """column, row, replicate or data (see ``spec.Strategy``)."""
    collective: str
    """padded or grouped: how this layer's uneven gathers and scatters run."""
    grad_sync: str
    """allreduce or sfb: how replicated weights get their data-parallel gradient; none for
    layers without parameters of their own."""
    residual: str | None
    """R or B: the residual stream's layout, for layers that open a residual branch."""
    input_layout: str
    """Layout of the activation arriving from the previous layer: input, R, B, F or P."""
    split: str | None
    """Which weight dimension ``widths`` splits: "out" (column), "in" (row, heads), or None."""
    widths: tuple[int, ...] | None
    """Per tensor-parallel rank, its width of the split dimension (heads * head_dim for
    attention); sums to the dimension."""
    time_s: float
    """Predicted seconds of this layer per step (forward, backward, communication)."""
    modules: tuple[str, ...] = ()
    """Hugging Face module names the layer covers."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete heterogeneous plan for one model on one cluster."""

    model: str
    tp_size: int
    dp_size: int
    batch_size: int
    """Samples per optimizer step, all groups together."""
    seq_len: int
    layers: tuple[LayerPlan, ...]
    group_samples: tuple[int, ...]
    """Samples per data-parallel group (device d is in group d // tp_size); sums to
    batch_size. With tp_size 1 these are the per-device batch shares."""
    batch_split: tuple[tuple[int, ...], ...]
    """Per group, samples per tensor-parallel rank for layers with the data strategy."""
    tp_ratios: tuple[float, ...]
    """The LP's continuous tensor-parallel shares the widths were rounded from."""
    widths: dict[str, tuple[int, ...]]
    """Per tensor-parallel rank, in the units of ``colossal_hetero.policies.widths``: "heads"
    (query heads), "ffn" (MLP intermediate features), "vocab" (vocabulary rows); only the
    dimensions some layer of the plan splits."""
    device_flops: tuple[float, ...]
    device_times: tuple[float, ...]
    """Predicted busy seconds per device: its own compute plus the collectives it joins."""
    step_time: float
    """Predicted seconds per step (bulk synchronous: each layer waits for its slowest device)."""
    even_step_time: float
    """Predicted seconds per step of stock Colossal-AI: default strategies, even split."""
    speedup: float
    """even_step_time / step_time."""
    iterations: int
    """Search/LP rounds of HAP's loop."""
    space: str
    """Strategy space searched: full, megatron or megatron_sfb (``search.Space``)."""
    version: int = PLAN_VERSION

    @property
    def num_devices(self) -> int:
        """tp_size * dp_size."""
        return self.tp_size * self.dp_size

    def device_samples(self, device: int) -> int:
        """Samples ``device`` processes in layers that are not data-parallel in-group."""
        return self.group_samples[device // self.tp_size]

    def layer(self, name: str) -> LayerPlan:
        """The plan of the layer called ``name``; KeyError if absent."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of lists, strings and numbers (YAML/JSON safe)."""
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_dict`; ValueError on missing, unknown or mistyped keys."""
        data = dict(data)
        if data.get("version", PLAN_VERSION) != PLAN_VERSION:
            raise ValueError(f"plan version {data['version']} is not {PLAN_VERSION}")
        layers = tuple(_build(LayerPlan, d, f"layers[{i}]") for i, d in enumerate(data["layers"]))
        data["layers"] = layers
        data["batch_split"] = tuple(tuple(int(v) for v in row) for row in data["batch_split"])
        data["widths"] = {k: tuple(int(v) for v in w) for k, w in data["widths"].items()}
        return _build(cls, data, "plan")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            if f.name in ("version", "modules"):
                continue
            raise ValueError(f"{path}.{f.name}: missing")
        value = data[f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def dump_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` as JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
    path = Path(path)
    data = plan.to_dict()
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n")
    elif path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        raise ValueError(f"{path}: plan files end in .json, .yaml or .yml")


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by :func:`dump_plan`."""
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else _yaml(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a plan")
    return Plan.from_dict(data)


def _yaml(text: str) -> Any:
    """``text`` parsed as YAML; a syntax error is one ``ValueError`` line with its place (a
    YAMLError's own text spans several lines)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ValueError(f"invalid YAML{where}: {problem}") from None


# -- the table ---------------------------------------------------------------------------------

_BLOCK = re.compile(r"\.(\d+)\.")
_DECISION_FIELDS = (
    "strategy",
    "collective",
    "grad_sync",
    "residual",
    "input_layout",
    "split",
    "widths",
)


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _merged_rows(plan: Plan) -> list[tuple[str, LayerPlan, int]]:
    """Layers of repeated blocks that decided alike, merged into one row each."""
    groups: dict[tuple, tuple[str, LayerPlan, list[int]]] = {}
    for layer in plan.layers:
        match = _BLOCK.search(layer.name)
        template = _BLOCK.sub(".{}.", layer.name, count=1) if match else layer.name
        decision = tuple(getattr(layer, f) for f in _DECISION_FIELDS)
        key = (template, *decision)
        entry = groups.setdefault(key, (template, layer, []))
        entry[2].append(int(match.group(1)) if match else -1)
    rows = []
    for template, layer, indices in groups.values():
        name = template.format(_ranges(indices)) if "{}" in template else template
        rows.append((name, layer, len(indices)))
    return rows


def format_plan(plan: Plan) -> str:
    """A readable table: header, one row per (merged) layer, one row per device."""
    ms = 1e3
    lines = [
        f"plan for {plan.model} on {plan.num_devices} devices (tp {plan.tp_size} x dp "
        f"{plan.dp_size}), batch {plan.batch_size} x {plan.seq_len} tokens, space {plan.space}",
        f"predicted step {plan.step_time * ms:.2f} ms, even split {plan.even_step_time * ms:.2f} "
        f"ms, speedup {plan.speedup:.2f}x ({plan.iterations} search/LP rounds)",
        "",
    ]
    rows = _merged_rows(plan)
    width = max(len("layer"), *(len(name) for name, _, _ in rows))
    lines.append(
        f"{'layer':<{width}}  {'strategy':<9} {'comm':<7} {'grad':<9} {'in':<5} "
        f"{'res':<3} {'ms each':>8}  widths per tp rank"
    )
    for name, layer, _ in rows:
        widths = "-" if layer.widths is None else f"{layer.split}: {list(layer.widths)}"
        lines.append(
            f"{name:<{width}}  {layer.strategy:<9} {layer.collective:<7} {layer.grad_sync:<9} "
            f"{layer.input_layout:<5} {layer.residual or '-':<3} {layer.time_s * ms:>8.3f}  "
            f"{widths}"
        )
    data = any(layer.strategy == "data" for layer in plan.layers)
    lines += [
        "",
        f"{'device':>6} {'group':>5} {'rank':>4} {'TFLOP/s':>8} {'samples':>7} "
        + (f"{'in-group':>8} " if data else "")
        + f"{'busy ms':>8} {'busy %':>6}",
    ]
    for d, (flops, busy) in enumerate(zip(plan.device_flops, plan.device_times, strict=True)):
        group, rank = divmod(d, plan.tp_size)
        in_group = f"{plan.batch_split[group][rank]:>8} " if data else ""
        share = 100 * busy / plan.step_time if plan.step_time else 0.0
        lines.append(
            f"{d:>6} {group:>5} {rank:>4} {flops / 1e12:>8.2f} {plan.group_samples[group]:>7} "
            f"{in_group}{busy * ms:>8.2f} {share:>6.1f}"
        )
    return "\n".join(lines)


# -- what runs, and the short table --------------------------------------------------------

WIDTH_KEY_OF_KIND = {
    "attention_qkv": "heads",
    "attention_core": "heads",
    "attention_out": "heads",
    "mlp_up": "ffn",
    "mlp_down": "ffn",
    "embedding": "vocab",
    "lm_head": "vocab",
    "loss": "vocab",
}
"""The width key that sizes each planner layer kind (``planner.spec.LayerKind`` values)."""


def with_widths(plan: Plan, widths: dict[str, tuple[int, ...]]) -> Plan:
    """``plan`` recording other per-rank ``widths`` (e.g. a user policy's), layers included.

    A layer's widths follow its key (heads for attention, ffn for the MLP, vocab for the
    embedding, head and loss) in its own units (heads * head_dim for attention). The predicted
    times stay those of the planned widths. Keys the plan does not split are added as given.
    """
    new = {key: tuple(int(v) for v in counts) for key, counts in widths.items()}
    layers = []
    for layer in plan.layers:
        key = WIDTH_KEY_OF_KIND.get(layer.kind)
        old = plan.widths.get(key) if key else None
        if layer.widths is None or key not in new or not old or sum(old) == 0:
            layers.append(layer)
            continue
        unit = sum(layer.widths) // sum(old)  # head_dim for attention, 1 elsewhere
        layers.append(replace(layer, widths=tuple(unit * c for c in new[key])))
    return replace(plan, widths={**plan.widths, **new}, layers=tuple(layers))


def format_plan_summary(plan: Plan) -> str:
    """A compact table (under 80 columns): per device its TFLOP/s, widths, samples and
    predicted busy time, with the predicted step and speedup over the even split."""
    ms = 1e3
    keys = [k for k in ("heads", "ffn", "vocab") if k in plan.widths]
    head = (
        f"plan: {plan.model}, tp {plan.tp_size} x dp {plan.dp_size}, batch "
        f"{plan.batch_size} x {plan.seq_len} tokens"
    )
    lines = [
        head,
        f"{'rank':>4} {'TFLOP/s':>8} " + "".join(f"{k:>7} " for k in keys) + "samples  busy ms",
    ]
    for d, (flops, busy) in enumerate(zip(plan.device_flops, plan.device_times, strict=True)):
        group, rank = divmod(d, plan.tp_size)
        cells = "".join(f"{plan.widths[k][rank]:>7} " for k in keys)
        samples = plan.group_samples[group]
        lines.append(f"{d:>4} {flops / 1e12:>8.4g} {cells}{samples:>7} {busy * ms:>8.2f}")
    lines.append(
        f"predicted step {plan.step_time * ms:.2f} ms, even split "
        f"{plan.even_step_time * ms:.2f} ms: {plan.speedup:.2f}x"
    )
    return "\n".join(lines)
