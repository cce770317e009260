"""Shaped mode (``emulation.network.mode: shaped``): ranks on real, tc-shaped links.

``topology`` and ``tc`` are pure (names, addresses, rates, command lines); ``netns`` builds and
removes a run's namespaces; ``launcher`` starts ranks inside them as torchrun would;
``controller`` applies step-scheduled preemptions (``tc change``, tenant bursts); ``tenant`` is
the standard-library script that makes the competing traffic.
"""

from colossal_hetero.emulation.shaped.controller import STEP_DIR_ENV, StepReporter, report_step
from colossal_hetero.emulation.shaped.netns import check_shaped_support, cleanup_leftovers
from colossal_hetero.emulation.shaped.topology import PREFIX_ROOT

__all__ = [
    "PREFIX_ROOT",
    "STEP_DIR_ENV",
    "StepReporter",
    "check_shaped_support",
    "cleanup_leftovers",
    "report_step",
]
