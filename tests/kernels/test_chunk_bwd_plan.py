"""The training step as named stages (``plan_step``): the launches the op's step makes, each runnable alone.

The stage-wise search times one stage of a backward config by itself (``dtune.measure.harness.op_stages``), so the
plan must launch what the step launches, in the same order, on the same inputs: run in order, its outputs and
gradients equal the op's training step's, exactly (the same kernels on the same buffers' values, float32 under the
interpreter); run again stage by stage, alone and in any order after that first run, they stay equal. Buffers are
NaN-poisoned (tests/conftest.py): a stage the plan forgot leaves NaN where the step has numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtune.kernels import get_kernel
from dtune.kernels.chunk.backward import plan_step

from dtune.measure.grad import op_step, with_output_grads
from dtune.measure.harness import op_run, op_stages
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from dtune.tune.space import load_space

OP = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
BT16 = {"BT": 16, "BC": 16, "dh_BV": 16, "dqk_BK": 16, "dqk_BV": 16}
FWD = {"BT": 16, "BC": 16}

# (bwd config, forward config, varlen sequence lengths, the stage names the plan must give)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], list[int] | None, list[str]]] = {
    "all": (
        {**BT16, "SAVE": "all"},
        FWD,
        None,
        ["fwd-intra", "fwd-state", "reverse", "dqk", "finish", "group-sum"],
    ),
    "intra-reverse-dv": (
        {**BT16, "SAVE": "intra", "REVERSE_DV": True, "dh_LAYOUT": "vk"},
        FWD,
        None,
        ["fwd-intra", "fwd-state", "re-state", "reverse", "dqk", "finish", "group-sum"],
    ),
    "none-unfused": (
        {**BT16, "SAVE": "none", "FUSE_DV": False},
        FWD,
        None,
        ["forward", "re-intra", "re-state", "reverse", "dv", "dqk", "finish", "group-sum"],
    ),
    # the sequence-parallel forward (segment starts kept by "intra") and reverse pass, on a packed batch
    "intra-segmented-varlen": (
        {**BT16, "SAVE": "intra", "dh_SEG_CHUNKS": 2},
        {**FWD, "SEG_CHUNKS": 1, "FUSE_OUTPUT": True},
        [33, 0, 20, 50],
        ["fwd-intra", "fwd-state", "re-state", "reverse", "dqk", "finish", "group-sum"],
    ),
    # the dq/dk and finish stages' work inside the reverse pass (DeltaNet, Gated DeltaNet): no stage after it but the
    # group sum
    "intra-reverse-dqk": (
        {**BT16, "SAVE": "intra", "REVERSE_DV": True, "REVERSE_DQK": True, "dh_LAYOUT": "vk"},
        FWD,
        None,
        ["fwd-intra", "fwd-state", "re-state", "reverse", "group-sum"],
    ),
}
SCALAR_ONLY = {"intra-reverse-dqk"}  # (KDA's backward has no REVERSE_DQK)
PLANS = [
    pytest.param(gate, *case, id=f"{name}-{gate.value}")
    for name, case in CASES.items()
    for gate in Gate
    if not (name in SCALAR_ONLY and gate is Gate.CHANNEL)
]


def _inputs(gate: Gate, seq_lens: list[int] | None) -> tuple[Shape, dict[str, Any]]:
    varlen = seq_lens is not None
    shape = Shape(1 if varlen else 2, 0 if varlen else 37, 2, 4, 16, 32, 4 if varlen else 2, gate, varlen)
    x = make_inputs(shape, seed=3, seq_lens=seq_lens, initial_state=True)
    return shape, with_output_grads({**x, "output_final_state": True})


def _same(got: tuple[Any, Any, dict[str, Any]], want: Any) -> None:
    o, ht, grads = got
    assert torch.equal(o, want.o) and torch.equal(ht, want.final_state)
    for name, w in want.grads.items():
        if w is None:
            assert grads[name] is None, name
        else:
            assert grads[name] is not None and torch.equal(grads[name], w), name


@pytest.mark.parametrize(("gate", "bwd", "fwd", "seq_lens", "names"), PLANS)
def test_plan_launches_the_step(
    gate: Gate, bwd: dict[str, Any], fwd: dict[str, Any], seq_lens: list[int] | None, names: list[str]
) -> None:
    op = OP[gate]
    shape, x = _inputs(gate, seq_lens)
    fwd_full = get_kernel(op).check_config(shape.K, shape.V, fwd)
    bwd_full = get_kernel(op + "_bwd").check_config(shape.K, shape.V, bwd)
    want = op_step(op, x, bwd_full, fwd_full)()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], gate.value, shape.K**-0.5, x["initial_state"], True)
    stages, outputs = plan_step(*args, x["cu_seqlens"], fwd_full, bwd_full, x["do"], x["dht"])
    assert [st.name for st in stages] == names
    # the search space's stage map claims every launch (the plain forward of SAVE "none" is the forward config's)
    space = load_space(op + "_bwd")
    claimed = {launch for st in space.stages.stages for launch in st.launches}
    assert [n for n in names if n not in claimed] == (["forward"] if "forward" in names else [])
    for st in stages:
        st.run()
    _same(outputs(), want)
    for st in reversed(stages):  # each alone, on what the others left
        st.run()
    _same(outputs(), want)
    for st in stages:
        st.run()
    _same(outputs(), want)


def test_backward_kernel_stages_are_its_steps() -> None:
    """``op_stages`` of a backward kernel: its training step's stages (the op's forward config), not one call."""
    shape = Shape(1, 20, 2, 4, 16, 16, 1, Gate.SCALAR)
    run = op_run("chunk_gated_delta_rule_bwd", shape, torch.float32, "cpu")
    cfg = get_kernel("chunk_gated_delta_rule_bwd").check_config(16, 16, {**BT16, "SAVE": "intra"})
    names = [st.name for st in op_stages(run, cfg)]
    assert names == ["fwd-intra", "fwd-state", "re-state", "reverse", "dqk", "finish", "group-sum"]
