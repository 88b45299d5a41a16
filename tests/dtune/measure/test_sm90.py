"""The static sm_90a figures of a chunk stage (scripts/sm90_stats.py's library), compiled without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtune._env import child_env

CHILD = """
import json
from dtune.measure.sm90 import NoToolchain, stage_stats
try:
    print(json.dumps(stage_stats("scalar", "state", 64, "bf16", {"h_BV": 32})))
except NoToolchain as e:
    print("SKIP", e)
"""


def test_stage_stats_of_the_state_pass() -> None:
    # Compiled Triton and the interpreter do not mix in one process: compile in a child without TRITON_INTERPRET.
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(last)
    row = json.loads(last)
    assert row["regs"] > 0 and row["spills"] >= 0
    assert row["bar.sync"] > 0 and row["wgmma"] + row["mma.sync"] > 0  # a loop of tensor-core dots and barriers
    if "sass" in row:  # the loop's machine code: the gate's exponentials, the barriers and the wgmma dots in it
        assert row["sass"] > row["sass.ex2"] > 0 and row["sass.bar"] > 0 and row["sass.gmma"] > 0
