"""fla's in-kernel options as separate passes (dtune.options): each against its float64 reference (values and
gradients), the checks that refuse what cannot apply, and the ops' ``options=`` keyword through a chunk kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtune.kernels import reference as ref

from dtune import ops
from dtune.options import Options, beta_activation, gate_activation, l2norm
from dtune.shape import Gate
from tests.conftest import rel_err

F64 = torch.float64


def every_option(A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None) -> Options:
    """What fla's KDA layer passes (with allow_neg_eigval on too)."""
    return Options(
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
        state_v_first=True,
    )


REF_OPTIONS = {
    "use_qk_l2norm_in_kernel": True,
    "use_gate_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "allow_neg_eigval": True,
    "state_v_first": True,
}


def _raw(*shape: int, scale: float = 3.0) -> torch.Tensor:
    """Raw pre-activation values of both signs, large enough that softplus' and sigmoid's tails matter."""
    return torch.randn(*shape, dtype=torch.float32) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2norm_matches_the_reference_and_keeps_the_dtype(dtype: torch.dtype) -> None:
    x = (_raw(2, 7, 3, 24) * 0.1).to(dtype)
    x[0, 0, 0] = 0  # a zero row: eps keeps it finite
    y = l2norm(x)
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    want = ref.l2_normalize(x.to(F64))
    assert rel_err(y, want) < (1e-6 if dtype == torch.float32 else 4e-3)
    assert torch.allclose(y.float().norm(dim=-1)[0, 1:], torch.ones(6, 3), atol=1e-2)


@pytest.mark.parametrize(
    ("gate", "lower_bound", "with_A", "with_bias"),
    [
        (Gate.SCALAR, None, True, True),
        (Gate.SCALAR, None, True, False),
        (Gate.CHANNEL, None, True, True),
        (Gate.CHANNEL, -5.0, True, True),
        (Gate.CHANNEL, -3.0, False, True),
        (Gate.SCALAR, -2.0, True, False),
    ],
    ids=["gdn", "gdn-nobias", "kda", "kda-lb", "kda-lb-noA", "gdn-lb"],
)
def test_gate_activation_matches_the_reference(
    gate: Gate, lower_bound: float | None, with_A: bool, with_bias: bool
) -> None:
    B, T, HV, K = 2, 9, 3, 8
    g = _raw(B, T, HV, K) if gate is Gate.CHANNEL else _raw(B, T, HV)
    g[0, 0] = 30.0  # above softplus' threshold (linear there, as fla's)
    A_log = torch.randn(HV) if with_A else None
    bias = (torch.randn(HV * K) if gate is Gate.CHANNEL else torch.randn(HV)) if with_bias else None
    out = gate_activation(g.bfloat16(), A_log, bias, lower_bound)
    assert out.dtype == torch.float32 and out.shape == g.shape
    f64 = [None if t is None else t.to(F64) for t in (A_log, bias)]
    want = ref.gate_from_raw(g.bfloat16().to(F64), f64[0], f64[1], lower_bound)
    assert rel_err(out, want) < 1e-6
    assert (out <= 0).all()
    if lower_bound is not None:
        assert (out >= lower_bound).all()


@pytest.mark.parametrize(
    ("gate", "lower_bound", "with_A", "with_bias"),
    [
        (Gate.SCALAR, None, True, True),
        (Gate.SCALAR, -2.0, False, True),
        (Gate.CHANNEL, None, True, False),
        (Gate.CHANNEL, -5.0, True, True),
        (Gate.CHANNEL, -3.0, False, False),
    ],
    ids=["gdn", "gdn-lb-noA", "kda-nobias", "kda-lb", "kda-lb-bare"],
)
def test_gate_gradients_match_float64_autograd(
    gate: Gate, lower_bound: float | None, with_A: bool, with_bias: bool
) -> None:
    """dg, dA_log and ddt_bias of the gate pass (its Triton backward: per-block partial sums) against float64."""
    torch.manual_seed(3)
    B, T, HV, K = 2, 70, 3, 8  # 140 rows: three row blocks, the last one partial
    leaves = {"g": _raw(B, T, HV, K) if gate is Gate.CHANNEL else _raw(B, T, HV)}
    if with_A:
        leaves["A_log"] = torch.randn(HV)
    if with_bias:
        leaves["dt_bias"] = torch.randn(HV * K if gate is Gate.CHANNEL else HV)
    w = torch.randn(leaves["g"].shape, dtype=F64)
    grads = {}
    for dtype in (torch.float32, F64):
        x = {n: t.to(dtype).requires_grad_() for n, t in leaves.items()}
        A, bias = x.get("A_log"), x.get("dt_bias")
        fn = gate_activation if dtype == torch.float32 else ref.gate_from_raw
        grads[dtype] = torch.autograd.grad((fn(x["g"], A, bias, lower_bound) * w.to(dtype)).sum(), list(x.values()))
    for name, a, b in zip(leaves, grads[torch.float32], grads[F64]):
        assert a.dtype == leaves[name].dtype
        assert rel_err(a, b) < 1e-5, f"d{name}: {rel_err(a, b):.3g}"


@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "neg-eigval"])
def test_beta_activation(neg: bool) -> None:
    b = _raw(2, 9, 3).bfloat16()
    out = beta_activation(b, neg)
    assert out.dtype == torch.float32
    assert rel_err(out, ref.beta_from_logits(b.to(F64), neg)) < 1e-6
    assert out.max() > 1.0 if neg else out.max() < 1.0


def test_options_gradients_match_float64_autograd() -> None:
    """Every input's gradient through the passes (A_log and dt_bias included) against float64 autograd."""
    torch.manual_seed(0)
    B, T, H, HV, K = 1, 6, 2, 4, 8
    leaves = {
        "q": torch.randn(B, T, H, K),
        "k": torch.randn(B, T, H, K),
        "g": _raw(B, T, HV, K),
        "beta": _raw(B, T, HV),
        "A_log": torch.randn(HV),
        "dt_bias": torch.randn(HV * K),
        "h0": torch.randn(B, HV, K, K),
    }

    def run(x: dict[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype == F64:
            q, k = ref.l2_normalize(x["q"]), ref.l2_normalize(x["k"])
            g = ref.gate_from_raw(x["g"], x["A_log"], x["dt_bias"], -5.0)
            beta = ref.beta_from_logits(x["beta"], True)
            h0 = x["h0"].transpose(-1, -2)
        else:
            opts = every_option(x["A_log"], x["dt_bias"], -5.0)
            q, k, g, beta, h0 = opts.apply(x["q"], x["k"], x["g"], x["beta"], x["h0"])
        assert g is not None and h0 is not None
        return [q, k, g, beta, h0]

    w = [torch.randn_like(t) for t in run(leaves, torch.float32)]
    grads = {}
    for dtype in (torch.float32, F64):
        x = {n: t.to(dtype).requires_grad_() for n, t in leaves.items()}
        loss = sum((o * wi.to(dtype)).sum() for o, wi in zip(run(x, dtype), w))
        grads[dtype] = torch.autograd.grad(loss, list(x.values()))
    for name, a, b in zip(leaves, grads[torch.float32], grads[F64]):
        assert rel_err(a, b) < 1e-5, f"d{name}: {rel_err(a, b):.3g}"


def test_state_v_first_transposes_both_states() -> None:
    opts = Options(state_v_first=True)
    h0 = torch.randn(2, 3, 8, 16)  # [N, HV, V, K]
    *_, h = opts.apply(torch.zeros(1), torch.zeros(1), None, torch.zeros(1), h0)
    assert h is not None and h.shape == (2, 3, 16, 8) and torch.equal(h, h0.transpose(-1, -2))
    ht = opts.final_state(torch.randn(2, 3, 16, 8))
    assert ht is not None and ht.shape == (2, 3, 8, 16) and ht.is_contiguous()


CHECKS: list[tuple[str, Options, Gate, str]] = [
    ("neg-eigval-without-sigmoid", Options(allow_neg_eigval=True), Gate.SCALAR, "allow_neg_eigval"),
    ("A_log-without-gate", Options(A_log=torch.zeros(4)), Gate.SCALAR, "used only with use_gate_in_kernel"),
    ("lower-bound-without-gate", Options(lower_bound=-5.0), Gate.CHANNEL, "used only with"),
    ("gate-for-deltanet", Options(use_gate_in_kernel=True, A_log=torch.zeros(4)), Gate.NONE, "DeltaNet has no gate"),
    ("gate-without-A_log", Options(use_gate_in_kernel=True), Gate.CHANNEL, "needs A_log"),
    ("A_log-numel", Options(use_gate_in_kernel=True, A_log=torch.zeros(3)), Gate.SCALAR, "HV = 4"),
    (
        "dt_bias-per-head-for-kda",
        Options(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)),
        Gate.CHANNEL,
        "HV \\* K = 32",
    ),
    ("positive-lower-bound", Options(use_gate_in_kernel=True, lower_bound=1.0), Gate.CHANNEL, "negative"),
]


@pytest.mark.parametrize(("name", "opts", "gate", "match"), CHECKS, ids=[c[0] for c in CHECKS])
def test_options_refuse_what_cannot_apply(name: str, opts: Options, gate: Gate, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        opts.check(gate, 4, 8)


def test_options_on_another_device_are_refused() -> None:
    opts = Options(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4))
    with pytest.raises(ValueError, match="A_log is on cpu, the inputs on meta"):
        opts.check(Gate.SCALAR, 4, 8, torch.device("meta"))
    opts.check(Gate.SCALAR, 4, 8, torch.device("cpu"))


def test_options_accept_fla_layer_calls() -> None:
    every_option(torch.zeros(4), torch.zeros(32), -5.0).check(Gate.CHANNEL, 4, 8)
    every_option(torch.zeros(4), torch.zeros(4), None).check(Gate.SCALAR, 4, 8)
    Options(use_gate_in_kernel=True, lower_bound=-5.0).check(Gate.CHANNEL, 4, 8)  # A_log may be None with a bound


def _inputs(gate: Gate, seq_lens: list[int] | None = None) -> dict[str, Any]:
    torch.manual_seed(1)
    B, T, H, HV, K, V = (1, sum(seq_lens), 1, 2, 16, 32) if seq_lens else (2, 21, 1, 2, 16, 32)
    N = len(seq_lens) if seq_lens else B
    x: dict[str, Any] = {
        "q": torch.randn(B, T, H, K),
        "k": torch.randn(B, T, H, K),
        "v": torch.randn(B, T, HV, V),
        "g": _raw(B, T, HV, K) if gate is Gate.CHANNEL else _raw(B, T, HV),
        "beta": _raw(B, T, HV),
        "initial_state": torch.randn(N, HV, V, K),  # state_v_first
        "A_log": torch.randn(HV),
        "dt_bias": torch.randn(HV * K if gate is Gate.CHANNEL else HV),
    }
    x["cu_seqlens"] = None if seq_lens is None else torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    return x


@pytest.mark.parametrize(
    ("kernel", "gate", "seq_lens"),
    [
        ("chunk_gated_delta_rule", Gate.SCALAR, None),
        ("chunk_kda", Gate.CHANNEL, [7, 0, 19]),
        ("fused_recurrent_kda", Gate.CHANNEL, None),
    ],
    ids=["chunk-gdn", "chunk-kda-varlen", "recurrent-kda"],
)
def test_ops_take_options(kernel: str, gate: Gate, seq_lens: list[int] | None) -> None:
    """``dtune.ops.<op>(..., options=Options(...))``: every option at once against the float64 reference."""
    x = _inputs(gate, seq_lens)
    lb = -5.0 if gate is Gate.CHANNEL else None
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    config = {"BT": 16} if kernel.startswith("chunk") else None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, ht = ops.run_kernel(kernel, *args, **kw, config=config, options=every_option(x["A_log"], x["dt_bias"], lb))
    gate_kw = {"A_log": x["A_log"], "dt_bias": x["dt_bias"], "lower_bound": lb}
    o_ref, ht_ref = ref.reference_with_options(*args, None, **kw, **REF_OPTIONS, **gate_kw)
    assert ht is not None and ht_ref is not None and ht.shape == x["initial_state"].shape
    assert rel_err(o, o_ref) < 1e-4 and rel_err(ht, ht_ref) < 1e-4


def test_ops_options_are_checked_before_any_pass() -> None:
    x = _inputs(Gate.SCALAR)
    with pytest.raises(ValueError, match="HV = 2"):
        ops.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], options=Options(use_gate_in_kernel=True, A_log=torch.zeros(3))
        )
