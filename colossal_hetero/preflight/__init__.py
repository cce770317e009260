"""Checks of a run before any collective: the config against the world size, the model, the
planner's memory model and each feature's layout rules (pipeline, MoE, 2D).

It sits above ``config`` (which holds only the schema and the strict loader) and beside the
packages whose rules it applies, so none of them imports it back: no import cycle.
"""

from colossal_hetero.preflight.validate import (
    checked_hf_config,
    resolve_dp,
    validate_launch,
    validate_layout,
    validate_run,
)

__all__ = ["checked_hf_config", "resolve_dp", "validate_launch", "validate_layout", "validate_run"]
