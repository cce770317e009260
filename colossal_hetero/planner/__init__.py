"""Heterogeneity-aware planning (HAP-style): strategies, uneven widths and batch shares.

Pure Python on numpy/scipy: no torch (but for the fx reader), no torch.distributed, so every
rank can plan locally and get the same plan. Pipeline::

    ClusterSpec + ModelSpec --search_plan--> Plan --dump_plan/format_plan--> YAML/JSON, table

Modules: ``spec`` (inputs), ``hf`` (ModelSpec from transformers configs), ``fx`` and
``fx_ops`` (ModelSpec from a torch.fx trace of any model; they import torch, so
``model_spec_from_fx`` loads on first use and importing the package stays torch-free), ``cost``
(cost model), ``affine`` (the rows the cost model emits), ``lp`` (share LP), ``rounding`` (integer
widths),
``search`` (A* and brute force), ``shares`` (LP step and rounding of a program), ``loop``
(HAP's search/LP alternation), ``plan`` (the Plan record, files and table).
"""

from typing import Any

from colossal_hetero.planner.hf import model_spec_from_hf
from colossal_hetero.planner.loop import plan_for_run, search_plan
from colossal_hetero.planner.plan import LayerPlan, Plan, dump_plan, format_plan, load_plan
from colossal_hetero.planner.rounding import round_widths
from colossal_hetero.planner.search import Space
from colossal_hetero.planner.spec import (
    REFERENCE_FLOPS,
    ClusterSpec,
    LayerKind,
    LayerSpec,
    Mesh,
    ModelSpec,
    ShardDim,
    Strategy,
)

__all__ = [
    "REFERENCE_FLOPS",
    "ClusterSpec",
    "LayerKind",
    "LayerPlan",
    "LayerSpec",
    "Mesh",
    "ModelSpec",
    "Plan",
    "ShardDim",
    "Space",
    "Strategy",
    "dump_plan",
    "format_plan",
    "load_plan",
    "model_spec_from_fx",
    "model_spec_from_hf",
    "plan_for_run",
    "round_widths",
    "search_plan",
]


def __getattr__(name: str) -> Any:
    if name == "model_spec_from_fx":  # imports torch: only when asked for
        from colossal_hetero.planner.fx import model_spec_from_fx

        return model_spec_from_fx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
