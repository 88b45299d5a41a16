"""Fused-recurrent template against the float64 loop, under Triton's interpreter (float32 / float16)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from dtune.kernels import KERNELS
from dtune.kernels.reference import naive_recurrent, reference_with_options

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.options import Options
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


# ---- fla's in-kernel options applied by the kernel itself (one launch) -------------------------------------------

# id -> (problem, seq_lens, options as Options' keywords, the gate activation's form)
OPTION_CASES: dict[str, tuple[Shape, list[int] | None, dict[str, bool], str]] = {
    "every-option-kda-T9-HV4-K24-V40": (
        Shape(2, 9, 2, 4, 24, 40, 2, Gate.CHANNEL),
        None,
        {"l2": True, "gate": True, "beta": True, "neg": True, "vk": True},
        "softplus",
    ),
    "every-option-gdn-varlen-HV4-K32-V16": (
        Shape(1, 0, 2, 4, 32, 16, 4, Gate.SCALAR, True),
        [5, 0, 1, 11],
        {"l2": True, "gate": True, "beta": True, "neg": False, "vk": True},
        "softplus",
    ),
    "bounded-kda-T1-K64-V64": (
        Shape(3, 1, 1, 1, 64, 64, 3, Gate.CHANNEL),
        None,
        {"l2": False, "gate": True, "beta": False, "neg": False, "vk": False},
        "bounded",
    ),
    "bounded-kda-no-A-T4": (
        Shape(1, 4, 1, 2, 16, 16, 1, Gate.CHANNEL),
        None,
        {"l2": False, "gate": True, "beta": False, "neg": False, "vk": False},
        "bounded-no-A",
    ),
    "bounded-gdn-no-bias-T13": (
        Shape(1, 13, 1, 2, 16, 32, 1, Gate.SCALAR),
        None,
        {"l2": False, "gate": True, "beta": False, "neg": False, "vk": False},
        "bounded-no-bias",
    ),
    "l2norm-deltanet-T17-K48-V24": (
        Shape(2, 17, 1, 2, 48, 24, 2, Gate.NONE),
        None,
        {"l2": True, "gate": False, "beta": True, "neg": False, "vk": False},
        "",
    ),
    "state-v-first-kda-K16-V40": (
        Shape(1, 6, 1, 1, 16, 40, 1, Gate.CHANNEL),
        None,
        {"l2": False, "gate": False, "beta": False, "neg": False, "vk": True},
        "",
    ),
}


def _option_inputs(problem: Shape, seq_lens: list[int] | None, opt: dict[str, bool], form: str) -> dict[str, Any]:
    """Raw inputs as fla's layers pass them: unnormalised q and k, raw pre-activation gates and betas of both signs
    (large enough that softplus' and sigmoid's tails matter), ``A_log`` / ``dt_bias`` as the form asks."""
    x = make_inputs(problem, seed=23, seq_lens=seq_lens, initial_state=True, gate_min=-5.0)
    HV, K, gate = problem.HV, problem.K, problem.gate
    gen = torch.Generator().manual_seed(7)
    x["q"] = torch.randn(x["q"].shape, generator=gen) * 2.0
    x["k"] = torch.randn(x["k"].shape, generator=gen) * 2.0
    if opt["gate"]:
        x["g"] = torch.randn(x["g"].shape, generator=gen) * 3.0
    if opt["beta"]:
        x["beta"] = torch.randn(x["beta"].shape, generator=gen) * 3.0
    if opt["vk"]:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    gate_kw: dict[str, Any] = {}
    if opt["gate"]:
        per = HV * K if gate is Gate.CHANNEL else HV
        gate_kw = {"A_log": torch.randn(HV, generator=gen), "dt_bias": torch.randn(per, generator=gen)}
        if form.startswith("bounded"):
            gate_kw["lower_bound"] = -5.0
        if form == "bounded-no-A":
            gate_kw["A_log"] = None
        if form == "bounded-no-bias":
            gate_kw["dt_bias"] = None
    x["gate_kw"] = gate_kw
    return x


def _option_kw(opt: dict[str, bool]) -> dict[str, bool]:
    return {
        "use_qk_l2norm_in_kernel": opt["l2"],
        "use_gate_in_kernel": opt["gate"],
        "use_beta_sigmoid_in_kernel": opt["beta"],
        "allow_neg_eigval": opt["neg"],
        "state_v_first": opt["vk"],
    }


@pytest.mark.parametrize(("problem", "seq_lens", "opt", "form"), list(OPTION_CASES.values()), ids=list(OPTION_CASES))
def test_options_inside_the_kernel_match_the_reference(
    problem: Shape, seq_lens: list[int] | None, opt: dict[str, bool], form: str, no_option_passes: None
) -> None:
    """The options applied by the fused-recurrent kernel as it loads each token, against the float64 reference of
    the same call; no separate pass runs (each would raise here)."""
    x = _option_inputs(problem, seq_lens, opt, form)
    options = Options(**_option_kw(opt), **x["gate_kw"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, ht = ops.run_kernel(OPS[problem.gate], *args, **kw, options=options)
    o_ref, ht_ref = reference_with_options(*args, None, **kw, **_option_kw(opt), **x["gate_kw"])
    assert ht is not None and ht_ref is not None and ht.shape == x["initial_state"].shape == ht_ref.shape
    assert rel_err(o, o_ref) < 1e-5, rel_err(o, o_ref)
    assert rel_err(ht, ht_ref) < 1e-5, rel_err(ht, ht_ref)


def test_options_inside_the_kernel_equal_the_separate_passes() -> None:
    """The same call through the kernel's options and through the chunk ops' separate passes (``check_gate=True``
    takes those: the activated gate is checked) agree to float32 rounding."""
    problem, seq_lens, opt, form = OPTION_CASES["every-option-kda-T9-HV4-K24-V40"]
    x = _option_inputs(problem, seq_lens, opt, form)
    options = Options(**_option_kw(opt), **x["gate_kw"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    fused = ops.fused_recurrent_kda(*args, **kw, options=options)
    passes = ops.fused_recurrent_kda(*args, **kw, options=options, check_gate=True)
    for a, b in zip(fused, passes):
        assert a is not None and b is not None and rel_err(a, b) < 1e-5


def test_options_inside_the_kernel_are_checked_before_the_launch() -> None:
    problem, seq_lens, opt, form = OPTION_CASES["bounded-gdn-no-bias-T13"]
    x = _option_inputs(problem, seq_lens, opt, form)
    bad = Options(use_gate_in_kernel=True, A_log=torch.zeros(problem.HV + 1))
    with pytest.raises(ValueError, match=f"HV = {problem.HV}"):
        ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], options=bad)
    vk = Options(state_v_first=True)  # the initial state must then be [N, HV, V, K]
    with pytest.raises(ValueError, match="initial_state"):
        ops.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], options=vk
        )
