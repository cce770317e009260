"""Hugging Face models to 2D tensor parallelism: the checks and the conversion the plugin calls.

``check_config_2d`` (the layout) and ``check_model_2d`` (the model and block sizes) are pure
and raise one ValueError naming the field, identically on every rank, before any collective.
``convert_to_2d`` then builds the mesh from the plugin's TP group (collective over the world)
and converts the model in place.

Block sizes come from the plan when it carries them (``plan.tp2d``: a mapping or object with
any of ``batch_sizes`` (samples per mesh row), ``head_counts``, ``ffn_sizes`` and
``vocab_sizes`` (per mesh column) and ``placement`` ({global rank: (i, j)}) or
``placement_of`` (the planner's ``Tp2dPlan``: positions by rank order in every TP group));
otherwise even.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from colossal_hetero.tp2d.gpt2 import GPT2Shares, check_gpt2
from colossal_hetero.tp2d.hf_gpt2 import GPT2LMHeadModel2D, with_batch
from colossal_hetero.tp2d.hf_llama import LlamaForCausalLM2D, check_llama
from colossal_hetero.tp2d.hf_vit import ViTForImageClassification2D, check_vit
from colossal_hetero.tp2d.layout import even_sizes, mesh_side
from colossal_hetero.tp2d.mesh import Mesh2D

SUPPORTED_2D = ("gpt2", "llama", "vit")
"""``model_type`` values ``parallel.tp_mode: 2d`` converts."""


def check_config_2d(parallel: Any) -> int:
    """The layout parts 2D supports; returns q. ValueError naming the ``parallel`` field."""
    q = mesh_side(parallel.tp)
    unsupported = {
        "pp": (parallel.pp, 1),
        "zero_stage": (parallel.zero_stage, 0),
        "max_norm": (parallel.max_norm, 0.0),
    }
    for name, (value, allowed) in unsupported.items():
        if value != allowed:
            raise ValueError(
                f"parallel.{name}: {value} is not supported with parallel.tp_mode 2d "
                f"(needs {allowed})"
            )
    return q


def _given(plan: Any) -> Callable[[str], Any]:
    sizes = getattr(plan, "tp2d", None) if plan is not None else None

    def given(name: str) -> Any:
        if sizes is None:
            return None
        value = sizes.get(name) if isinstance(sizes, Mapping) else getattr(sizes, name, None)
        return value() if callable(value) else value  # e.g. Resizable2D.placement()

    return given


def check_model_2d(hf_config: Any, q: int, plan: Any = None) -> Any:
    """The block sizes of ``hf_config`` on a q x q mesh (the plan's, else even).

    ValueError naming the field: an unsupported model, sizes that do not fit.
    """
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED_2D:
        raise ValueError(
            f"model.arch: parallel.tp_mode 2d supports {list(SUPPORTED_2D)}, got {kind!r}"
        )
    shares = _shares(hf_config, q, _given(plan))
    if kind == "gpt2":
        check_gpt2(hf_config, with_batch(shares, q), q)
    elif kind == "llama":
        check_llama(hf_config, q, shares)
    else:
        check_vit(hf_config)
    return shares


_FIELDS = {
    "gpt2": ("n_head", "n_inner"),
    "llama": ("num_attention_heads", "intermediate_size"),
    "vit": ("num_attention_heads", "intermediate_size"),
}


def _shares(config: Any, q: int, given: Callable[[str], Any]) -> GPT2Shares:
    """Block sizes on a q x q mesh: ``given(name)`` (the plan's, or None) where set, else even
    heads, MLP widths in proportion to the heads, even vocabulary blocks; ValueError naming the
    ``model.hf`` field when the even layout needs a divisibility it lacks."""
    heads_field, ffn_field = _FIELDS[config.model_type]
    total_heads = config.num_attention_heads
    heads = given("head_counts")
    if heads is None:
        if total_heads % q:
            raise ValueError(
                f"model.hf.{heads_field}: {total_heads} heads do not split evenly over the {q} "
                f"mesh columns of parallel.tp_mode 2d (tp = {q * q}); give the plan's head_counts"
            )
        heads = even_sizes(total_heads, q)
    ffn_total = getattr(config, ffn_field, None) or 4 * config.hidden_size
    ffn = given("ffn_sizes")
    if ffn is None:  # proportional to the heads, as the hidden width is
        if any(ffn_total * a % total_heads for a in heads):
            raise ValueError(
                f"model.hf.{ffn_field}: the MLP width {ffn_total} does not split over the mesh "
                f"columns in proportion to the heads {list(heads)}"
            )
        ffn = tuple(ffn_total * a // total_heads for a in heads)
    classes = config.num_labels if config.model_type == "vit" else config.vocab_size
    vocab = given("vocab_sizes") or even_sizes(classes, q)
    batch = given("batch_sizes") or ()
    return GPT2Shares(tuple(batch), tuple(heads), tuple(ffn), tuple(vocab))


def convert_to_2d(model: nn.Module, tp_group: Any, plan: Any = None) -> nn.Module:
    """``model`` converted in place to 2D over ``tp_group``'s ranks (a new root module).

    Collective over the world (the mesh's groups); every rank calls it with its own TP group.
    The checks run first, on every rank, before any collective.
    """
    q = mesh_side(dist.get_world_size(tp_group))
    shares = check_model_2d(model.config, q, plan)
    placement = _given(plan)("placement")
    if placement is None:  # a planner-written Tp2dPlan places by rank order in every group
        placement = getattr(getattr(plan, "tp2d", None), "placement_of", None)
    mesh = Mesh2D.from_tp_group(tp_group, placement)
    kinds = {"gpt2": GPT2LMHeadModel2D, "llama": LlamaForCausalLM2D}
    return kinds.get(model.config.model_type, ViTForImageClassification2D)(model, mesh, shares)
