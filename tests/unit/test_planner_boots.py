"""Plans that boot: every plan the planner returns passes the resizable layers' own width
validation (the checks ``ResizablePolicy.resolve`` runs when sharding), over random speeds,
models (grouped-query attention included), TP and DP sizes. Pure: no process group.

The distributed half (a handful of such plans boot and train one step) is in
tests/distributed/test_planned_boot.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from colossal_hetero.config import ModelConfig
from colossal_hetero.models import build_hf_config
from colossal_hetero.planner import ClusterSpec, model_spec_from_hf, search_plan
from colossal_hetero.planner.search import Space
from colossal_hetero.policies import (
    ResizableBertForMaskedLMPolicy,
    ResizableGPT2LMHeadPolicy,
    ResizableLlamaForCausalLMPolicy,
)
from colossal_hetero.policies.widths import resolve_widths

_POLICY = {
    "gpt2": ResizableGPT2LMHeadPolicy,
    "llama": ResizableLlamaForCausalLMPolicy,
    "bert": ResizableBertForMaskedLMPolicy,
}


def _random_model(rng: np.random.Generator) -> ModelConfig:
    arch: Any = str(rng.choice(["gpt2", "llama", "llama", "bert"]))
    heads = int(rng.choice([2, 3, 4, 6, 8, 12]))
    head_dim = int(rng.choice([4, 8]))
    width, ffn = heads * head_dim, int(rng.integers(8, 200))
    vocab = int(rng.integers(40, 300))
    if arch == "gpt2":
        hf = {"n_layer": 2, "n_embd": width, "n_head": heads, "n_inner": ffn}
        hf |= {"vocab_size": vocab, "n_positions": 64}
    else:
        hf = {"num_hidden_layers": 2, "hidden_size": width, "num_attention_heads": heads}
        hf |= {"intermediate_size": ffn, "vocab_size": vocab, "max_position_embeddings": 64}
    if arch == "llama":  # grouped-query attention: any divisor of the heads as KV heads
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        hf["num_key_value_heads"] = int(rng.choice(divisors))
    return ModelConfig(arch=arch, hf=hf)


def _layers_accept(arch: str, hf_config, widths: dict, tp: int) -> dict:
    """The resizable policy's own check of ``widths`` (totals, units, minimums)."""
    policy = _POLICY[arch](widths)
    policy.model = cast(Any, SimpleNamespace(config=hf_config))  # what the width methods read
    return resolve_widths(
        widths, policy.width_totals(), tp, units=policy.width_units(), min_width=policy.min_widths()
    )


def test_every_returned_plan_passes_the_layers_width_checks():
    rng = np.random.default_rng(8)
    planned = refused = headless = 0
    for _ in range(120):
        model = _random_model(rng)
        hf_config = build_hf_config(model)
        tp, dp = int(rng.choice([2, 3, 4])), int(rng.choice([1, 1, 2]))
        speeds = rng.uniform(0.05, 1.0, tp * dp)
        if rng.random() < 0.3:
            speeds[int(rng.integers(speeds.size))] = 0.02  # a very slow rank
        spec = model_spec_from_hf(hf_config, batch_size=4 * dp, seq_len=16)
        cluster = ClusterSpec.from_relative(list(speeds))
        kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        try:
            plan = search_plan(cluster, spec, tp_size=tp, space=Space.MEGATRON)
        except ValueError as error:
            # The only refusal here: fewer key/value heads than ranks, named as such.
            assert tp > kv, error
            word = "attention" if kv == hf_config.num_attention_heads else "key/value"
            assert f"exceeds its {kv} {word} heads" in str(error)
            refused += 1
            continue
        resolved = _layers_accept(model.arch, hf_config, plan.widths, tp)
        assert {k: tuple(v) for k, v in plan.widths.items()} == {
            k: resolved[k] for k in plan.widths
        }
        group = hf_config.num_attention_heads // kv
        # BERT keeps one key/value group per rank; GPT-2 and Llama may give a rank none
        floor = group if model.arch == "bert" else 0
        assert min(plan.widths["heads"]) >= floor
        headless += min(plan.widths["heads"]) == 0
        planned += 1
    assert planned >= 60 and refused >= 10  # the seeded loop covers both outcomes
    assert headless >= 5  # and plans with a rank of no heads


@pytest.mark.parametrize("speeds", [[1.0, 0.6, 0.3], [1.0, 1.0, 0.1]])
def test_issue_cases_llama_six_heads_three_groups_at_tp3(speeds):
    """The cases that failed at boot with heads [4, 2, 0] and [3, 3, 0] when Llama needed a
    group per rank: such plans now pass the layers' checks (policies/zero_heads.py runs the
    rank with none), and the slowest rank gets the fewest heads."""
    hf = {"num_hidden_layers": 2, "hidden_size": 48, "intermediate_size": 64}
    hf |= {"num_attention_heads": 6, "num_key_value_heads": 3, "max_position_embeddings": 32}
    model = ModelConfig(arch="llama", hf=hf)
    hf_config = build_hf_config(model)
    spec = model_spec_from_hf(hf_config, batch_size=4, seq_len=32)
    plan = search_plan(ClusterSpec.from_relative(speeds), spec, tp_size=3, space=Space.MEGATRON)
    heads = plan.widths["heads"]
    assert sum(heads) == 6 and all(h % 2 == 0 for h in heads) and heads[2] == min(heads)
    _layers_accept("llama", hf_config, plan.widths, 3)
    assert plan.widths["ffn"][0] > plan.widths["ffn"][2]  # the other dims stay uneven


def test_gqa_error_names_key_value_and_attention_heads():
    hf = {"num_hidden_layers": 1, "hidden_size": 48, "intermediate_size": 64}
    hf |= {"num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 32}
    spec = model_spec_from_hf(build_hf_config(ModelConfig(arch="llama", hf=hf)), 4, 16)
    with pytest.raises(ValueError) as caught:
        search_plan(ClusterSpec.from_relative([1, 0.6, 0.3]), spec, tp_size=3)
    message = str(caught.value)
    assert "exceeds its 2 key/value heads (6 attention heads in 2 groups" in message
    assert "its 2 attention heads" not in message


def _package_imports(root: Path) -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its modules import (top-level and lazy imports)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        package = parts[0].removesuffix(".py") if len(parts) > 1 else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] == "colossal_hetero" and len(bits) > 1 and package:
                    if bits[1] != package and (root / bits[1]).is_dir():
                        graph.setdefault(package, set()).add(bits[1])
    return graph


def test_no_import_cycles_between_packages():
    """Dependencies between colossal_hetero's subpackages run one way (config at the bottom,
    the plugin and the CLI at the top): a cycle is listed as the path that closes it."""
    graph = _package_imports(Path(__file__).resolve().parents[2] / "colossal_hetero")
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in path and len(path) < len(graph):
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []
    assert "preflight" not in graph.get("planner", set())  # the pure planner never validates
    assert graph.get("config", set()) == set()  # schema and loader import no other package
