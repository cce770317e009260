"""Runtime straggler balancing inside tensor-parallel groups (issue 9, the control half).

Decide purely, agree once, act between steps:

- pure: ``detector`` (smoothed slowdown vector with hysteresis), ``replan`` (the planner at
  measured speeds, and whether the move pays), ``semi`` (the SEMI cost-benefit policy),
  ``window`` (the agreed reports), ``checks`` (config checks);
- runtime: ``agree`` (the one all_gather), ``controller`` (the step-seam controller and its
  decision log), ``wiring`` (built from a configured plugin).

Not wired yet: the in-layer ZERO-resizing and migration ops (``ops``, built separately) do
not act at runtime; SEMI's resize and migrate decisions are logged as not executable and the
best executable action (none or a re-plan) runs instead.
"""
