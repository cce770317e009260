"""Bench ranks start quiet: the known third-party notices (apex, TensorNVMe, bitsandbytes,
Colossal-AI's MoE ops) that importing Colossal-AI prints are filtered in every spawned rank,
also when the rank function's module, or an argument's, imports Colossal-AI (unpickling them
imports that module, so it must happen after the rank installs the filters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTICES = ("Please install apex", "tensornvme", "gemm_4bit_forward", "custom_fwd", "custom_bwd")
PARENT = """
from colossal_hetero.utils.quiet import quiet_third_party_warnings
quiet_third_party_warnings()
from colossal_hetero.bench.spawn import spawn_ranks
from tests.distributed.quiet_rank import Label, rank_name
print(spawn_ranks(rank_name, 2, label=Label("r")))
"""


def test_spawned_bench_ranks_print_no_third_party_notices():
    run = subprocess.run(
        [sys.executable, "-c", PARENT], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "['r0/2', 'r1/2']" in run.stdout
    printed = [notice for notice in NOTICES if notice in run.stderr]
    assert printed == [], run.stderr[-2000:]
