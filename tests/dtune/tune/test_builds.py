"""A move in one stage rebuilds only that stage: Triton caches each launch's specialisation on disk, and every worker
of a search (compile pool and timing workers) shares the cache directory. Counted with dtune's compile listener."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtune._env import child_env
from dtune.tune.executor import Evaluator, device_env

CHILD = """
import json, sys
from dtune.measure.builds import watch_builds
from dtune.measure.sm90 import NoToolchain, compile_sm90, stage_kernels
from dtune.kernels import KERNELS

base = {"FUSE_OUTPUT": False, "BT": 16, "BC": 16, "intra_BK": 32, "intra_BV": 32, "h_BV": 16, "o_BK": 32, "o_BV": 32}
moves = [{}, {"h_num_warps": 2}, {"intra_num_warps": 1}, {"o_num_warps": 2}, {"BT": 32}, {}]
out = []
try:
    for move in moves:
        cfg = KERNELS["chunk_gated_delta_rule"].check_config(32, 32, {**base, **move})
        with watch_builds() as b:
            for name, fn, ptrs, consts, warps, stages in stage_kernels("scalar", "fp16", 32, 32, cfg, False):
                compile_sm90(fn, ptrs, consts, warps, stages)
        out.append({"built": b.built, "cached": len(b.cached), "known": b.known})
except NoToolchain as e:
    print("SKIP", e)
    sys.exit(0)
print(json.dumps(out))
"""


def test_a_stage_move_rebuilds_only_that_stage(tmp_path: Path) -> None:
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a cold cache of its own
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    if last.startswith("SKIP"):
        pytest.skip(last)
    first, state, intra, output, bt, again = json.loads(last)
    if not first["known"]:
        pytest.skip("this Triton has no compilation listener (Triton < 3.4)")
    assert sorted(first["built"]) == ["chunk_intra_blocks_kernel", "chunk_output_kernel", "chunk_state_kernel"]
    assert state["built"] == ["chunk_state_kernel"] and state["cached"] == 2
    assert intra["built"] == ["chunk_intra_blocks_kernel"] and intra["cached"] == 2
    assert output["built"] == ["chunk_output_kernel"] and output["cached"] == 2
    assert len(bt["built"]) == 3  # a coupling parameter (the chunk size) rebuilds every stage
    assert again["built"] == [] and again["cached"] == 3  # nothing twice


def test_compile_pool_and_timing_workers_share_one_environment(tmp_path: Path) -> None:
    """The pool builds into the same Triton cache the timing workers load from: same environment but the device."""
    env = {**child_env(), "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    ev = Evaluator(env, tmp_path, trial_timeout=5, compile_workers=2, devices=["0", "1"])
    try:
        assert ev.capacity == 4
        assert ev.pool is not None
        timer_envs = [w.env for w in ev.timers]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in timer_envs] == ["0", "1"]
        for e in [*timer_envs, *(w.env for w in ev.pool._all)]:
            assert e["TRITON_CACHE_DIR"] == env["TRITON_CACHE_DIR"]
            assert {k: v for k, v in e.items() if k != "CUDA_VISIBLE_DEVICES"} == {
                k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"
            }
    finally:
        ev.close()
    assert device_env({"A": "1"}, None) == {"A": "1"}
