"""Runtime straggler balancing inside tensor-parallel groups (issue 9, the control half).

Decide purely, agree once, act between steps:

- pure: ``detector`` (smoothed slowdown vector with hysteresis), ``replan`` (the planner at
  measured speeds, and whether the move pays), ``semi`` (the SEMI cost-benefit policy),
  ``window`` (the agreed reports), ``checks`` (config checks), ``inlayer`` (which straggler
  ZERO-resizes or migrates how much);
- runtime: ``agree`` (the one all_gather), ``controller`` (the step-seam controller and its
  decision log), ``actuator`` (attaches the in-layer plan's ``ops`` to every resizable
  layer), ``wiring`` (built from a configured plugin).
"""
