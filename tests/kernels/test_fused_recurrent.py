"""Fused-recurrent template against the float64 loop, under Triton's interpreter (float32 / float16)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from dtune.kernels import KERNELS
from dtune.kernels.reference import naive_recurrent

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err

OPS = {
    Gate.NONE: "fused_recurrent_delta_rule",
    Gate.SCALAR: "fused_recurrent_gated_delta_rule",
    Gate.CHANNEL: "fused_recurrent_kda",
}


def run(problem: Shape, x: dict[str, Any], config: dict[str, Any] | None = None, final: bool = True) -> tuple:
    return ops.run_kernel(
        OPS[problem.gate],
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        output_final_state=final,
        cu_seqlens=x["cu_seqlens"],
        config=config,
    )


def check(problem: Shape, x: dict[str, Any], config: dict[str, Any] | None = None, tol: float = 1e-5) -> None:
    o, s = run(problem, x, config)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o_ref, s_ref = naive_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert s is not None and s_ref is not None
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < tol, rel_err(o, o_ref)
    assert rel_err(s, s_ref) < tol, rel_err(s, s_ref)


# id -> (problem, seq_lens, initial_state)
CASES: dict[str, tuple[Shape, list[int] | None, bool]] = {}
for gate in Gate:
    CASES |= {
        f"T1-B3-H2-K64-V64-{gate.value}": (Shape(3, 1, 2, 2, 64, 64, 3, gate), None, True),
        f"T37-B2-H2-HV4-K24-V40-{gate.value}": (Shape(2, 37, 2, 4, 24, 40, 2, gate), None, True),
        f"T19-B1-H1-K128-V16-noh0-{gate.value}": (Shape(1, 19, 1, 1, 128, 16, 1, gate), None, False),
        f"T5-B1-H1-HV2-K16-V128-{gate.value}": (Shape(1, 5, 1, 2, 16, 128, 1, gate), None, True),
        f"varlen-1-9-0-14-H2-HV4-K32-V24-{gate.value}": (
            Shape(1, 0, 2, 4, 32, 24, 4, gate, True),
            [1, 9, 0, 14],
            True,
        ),
    }
CASES["T3-B1-H1-K256-V256-channel"] = (Shape(1, 3, 1, 1, 256, 256, 1, Gate.CHANNEL), None, True)


@pytest.mark.parametrize(("problem", "seq_lens", "h0"), list(CASES.values()), ids=list(CASES))
def test_default_config_matches_loop(problem: Shape, seq_lens: list[int] | None, h0: bool) -> None:
    x = make_inputs(problem, seed=11, seq_lens=seq_lens, initial_state=h0, gate_min=-5.0)
    check(problem, x)


@pytest.mark.parametrize("beta", [1e-3, 0.999], ids=["beta-near-0", "beta-near-1"])
@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_extreme_beta(gate: Gate, beta: float) -> None:
    p = Shape(2, 23, 1, 2, 32, 32, 2, gate)
    x = make_inputs(p, seed=5)
    x["beta"] = torch.full_like(x["beta"], beta)
    check(p, x)


def _sampled_configs(n: int, seed: int) -> list[dict[str, Any]]:
    legal = KERNELS["fused_recurrent_kda"].legal_params()
    rng = random.Random(seed)
    return [{name: rng.choice(values) for name, values in legal.items()} for _ in range(n)]


@pytest.mark.parametrize("config", _sampled_configs(8, seed=7), ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_sampled_configs_match_loop(gate: Gate, config: dict[str, Any]) -> None:
    """Any legal configuration is correct, not only the default (tiles wider and narrower than V)."""
    p = Shape(1, 0, 2, 4, 48, 72, 3, gate, True)
    x = make_inputs(p, seed=13, seq_lens=[7, 1, 12])
    check(p, x, config)


def test_float16_inputs() -> None:
    p = Shape(2, 33, 2, 2, 64, 32, 2, Gate.CHANNEL)
    x = make_inputs(p, seed=17, dtype=torch.float16)
    check(p, x, tol=3e-3)


def test_no_final_state_unless_asked() -> None:
    p = Shape(1, 4, 1, 1, 16, 16, 1, Gate.SCALAR)
    x = make_inputs(p, seed=19)
    o, s = run(p, x, final=False)
    assert s is None and torch.isfinite(o).all()


def test_state_carries_across_calls() -> None:
    """Decoding: T steps one call at a time, each feeding its final state to the next, against the float64 loop over
    all T tokens (outputs of every step and the last state); and a chunk prefill continued by decode steps."""
    p = Shape(2, 6, 2, 4, 32, 16, 2, Gate.CHANNEL)
    x = make_inputs(p, seed=23, gate_min=-5.0)
    o_ref, s_ref = naive_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True
    )
    assert s_ref is not None
    state = x["initial_state"]
    for t in range(p.T):
        step = {n: (x[n][:, t : t + 1] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in x}
        step["initial_state"] = state
        o_t, state = run(Shape(2, 1, 2, 4, 32, 16, 2, Gate.CHANNEL), step)
        assert rel_err(o_t[:, 0], o_ref[:, t]) < 1e-5, t
    assert rel_err(state, s_ref) < 1e-5
    # prefill the first 4 tokens chunkwise, then decode the last 2 from its state
    head = {n: (x[n][:, :4] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in x}
    _, state = ops.run_kernel(
        "chunk_kda", head["q"], head["k"], head["v"], head["g"], head["beta"],
        initial_state=x["initial_state"], output_final_state=True, config={"BT": 16, "BC": 16},
    )  # fmt: skip
    for t in (4, 5):
        step = {n: (x[n][:, t : t + 1] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in x}
        step["initial_state"] = state
        o_t, state = run(Shape(2, 1, 2, 4, 32, 16, 2, Gate.CHANNEL), step)
        assert rel_err(o_t[:, 0], o_ref[:, t]) < 1e-4, t
    assert rel_err(state, s_ref) < 1e-4
