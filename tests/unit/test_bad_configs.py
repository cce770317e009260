"""Bad configs, table-driven: each file in bad_configs/ holds one mistake and, in its
``# expect:`` header (or a ``<stem>.expect`` sidecar), a fragment of the one line it must give.

`check`, `plan` and `train` run in-process and must each print that same single line and
exit 2; `train` must refuse before it starts torchrun. A few cases then go through the real
``torchrun -m colossal_hetero.train`` path on 2 ranks: one line per rank, no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from colossal_hetero import cli
from colossal_hetero.utils.device import cuda_device_count

BAD = Path(__file__).resolve().parent / "bad_configs"
CASES = sorted(BAD.glob("*.yaml"))
PREFIX = "colossal-hetero: config error: "


def expected_fragment(path: Path) -> str:
    sidecar = path.with_suffix(".expect")
    if sidecar.exists():
        return sidecar.read_text().strip()
    header = path.read_bytes().split(b"\n", 1)[0].decode("ascii")
    assert header.startswith("# expect: "), f"{path.name}: no '# expect:' header"
    return header.removeprefix("# expect: ").strip()


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    status = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == 2 and len(lines) == 1 and not captured.out, (status, captured)
    return lines[0]


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_config_is_one_line_naming_the_field(path, capsys, monkeypatch):
    monkeypatch.chdir(BAD)  # relative paths in the configs (plan files, folders) resolve here
    launched: list[object] = []
    monkeypatch.setattr(cli, "launch", lambda *args: launched.append(args) or 0)
    fragment = expected_fragment(path)
    line = _one_line(["check", path.name], capsys)
    assert line.startswith(PREFIX) and fragment in line, line
    assert _one_line(["train", path.name], capsys) == line
    assert not launched, "train launched torchrun for a config that check refuses"
    if "plan.path" not in fragment:  # `plan` refuses plan files by design (it makes plans)
        assert _one_line(["plan", path.name], capsys) == line


def test_every_case_has_a_fragment():
    assert len(CASES) >= 20
    assert all(expected_fragment(path) for path in CASES)


# The torchrun cases, one per stage of the checks: reading the YAML, the model and its memory
# (the last check of validate_run), and the host (cuda_without_gpus, run as 2 ranks).
TORCHRUN_CASES = ("yaml_syntax.yaml", "memory_too_small_identical.yaml")


@pytest.mark.dist
def test_torchrun_ranks_print_one_line_each_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cases = {name: (name, expected_fragment(BAD / name)) for name in TORCHRUN_CASES}
    if cuda_device_count() < 2:  # the cuda case as 2 ranks (the file's 64 fail the layout)
        two_ranks = tmp_path / "cuda_2_ranks.yaml"
        text = (BAD / "cuda_without_gpus.yaml").read_text()
        two_ranks.write_text(text.replace("dp: 64", "dp: 0"))
        fragment = expected_fragment(BAD / "cuda_without_gpus.yaml")
        cases["cuda"] = (str(two_ranks), re.sub("needs 64 GPUs", "needs 2 GPUs", fragment))
    for name, (path, fragment) in cases.items():
        command = cli.launch_command(path, nproc=2)
        result = subprocess.run(
            command, cwd=BAD, env=env, capture_output=True, text=True, timeout=180
        )
        assert result.returncode != 0, name
        ours = [line for line in result.stderr.splitlines() if PREFIX in line]
        for rank in (0, 1):
            mine = [line for line in ours if line.startswith(f"[rank {rank}] {PREFIX}")]
            assert len(mine) == 1 and fragment in mine[0], (name, result.stderr[-3000:])
        assert len(ours) == 2, (name, ours)
        # torchrun reports a failed child with a traceback of its own launcher; before that
        # report, and anywhere in our package, there is none.
        ranks_part = result.stderr.split("failed (exitcode")[0]
        assert "Traceback" not in ranks_part, (name, ranks_part[-3000:])
        assert "colossal_hetero/" not in result.stderr, (name, result.stderr[-3000:])
