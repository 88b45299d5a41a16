"""benchmarks/code_ab.py: trees copied per revision (the working tree as it is), every tree timed and compared with
the first one's outputs, the table's ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.benchmarks.conftest import BENCHMARKS, load_script

ROOT = BENCHMARKS.parent


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    return load_script("code_ab")


def test_build_copies_each_revision_and_the_working_tree(ab: ModuleType, tmp_path: Path) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    trees = ab.build(tmp_path, ["HEAD", "."])
    assert [t.name for t in trees] == ["0-HEAD", "1-worktree"]
    for tree in trees:
        for part in ab.PACKAGE:
            assert (tree / part).is_dir(), (tree, part)
    here = (ROOT / "kernels" / "chunk" / "bwd_local.py").read_text()
    assert (trees[1] / "kernels" / "chunk" / "bwd_local.py").read_text() == here
    assert ab.trees_in(tmp_path) == trees
    with pytest.raises(SystemExit, match="at least two"):
        ab.build(tmp_path / "x", ["HEAD"])


def test_a_training_step_gives_its_output_state_and_gradients_in_a_fixed_order(ab: ModuleType) -> None:
    o, s, g1, g2 = (torch.full((1,), float(i)) for i in range(4))
    assert [t.item() for t in ab.tensors((o, s, {"v": g2, "q": g1, "g": None}))] == [0.0, 1.0, 2.0, 3.0]
    assert [t.item() for t in ab.tensors((o, None))] == [0.0]


def test_table_ratios_against_the_first_tree(ab: ModuleType) -> None:
    k = "chunk_delta_rule_bwd"
    rows = [
        {"tree": "0-a", k: 9.0, "round": 0},
        {"tree": "1-b", k: 9.0, f"{k}_diff": 1e-6, "round": 0},
        {"tree": "0-a", k: 2.0, "round": 1},
        {"tree": "1-b", k: 1.0, "round": 1},
        {"tree": "0-a", k: 2.2, "round": 2},
        {"tree": "1-b", k: 1.1, "round": 2},
    ]
    lines = ab.table(rows, [k])
    a, b = lines[1].split(), lines[2].split()
    assert a[1] == "0-a" and float(a[2]) == pytest.approx(2.1) and float(a[4]) == pytest.approx(1.0)
    assert b[1] == "1-b" and float(b[2]) == pytest.approx(1.05) and float(b[4]) == pytest.approx(2.0)
    assert float(b[5]) == pytest.approx(1e-6)


def test_run_under_the_interpreter(ab: ModuleType, tmp_path: Path) -> None:
    """The whole job on a tiny shape: both trees are timed, the second compared with the first (same code: equal)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    ab.build(tmp_path / "t", [".", "."])
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    args = [sys.executable, str(BENCHMARKS / "code_ab.py"), "run", str(tmp_path / "t"), "--interpret",
            "--kernels", "chunk_delta_rule_bwd", "--shape", "1,20,1,16", "--rounds", "1"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.splitlines()[-2:]
    assert [ln.split()[1] for ln in table] == ["0-worktree", "1-worktree"], done.stdout
    assert float(table[1].split()[5]) == 0.0
