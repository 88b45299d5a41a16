"""The gate must pass the real kernel and reject planted wrong ones (docs/DESIGN.md §3)."""

from __future__ import annotations

from typing import Any

import dtune.kernels.config as kernel_config
import dtune.kernels.fused_recurrent as fr
import pytest
import torch

from dtune.shape import Shape
from dtune.tune.gate import gate

PROBLEM = Shape(B=2, T=5, H=2, HV=4, K=16, V=32, N=2)
CONFIG = {"BV": 16, "num_warps": 1, "num_stages": 1}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
KDA = "fused_recurrent_kda"
real_forward = fr.forward


def no_correction_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """The slip the gate exists for: write β v instead of β (v − Sᵀk) (no prediction, no correction)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rep = HV // H
    qe, ke = q.double().repeat_interleave(rep, 2), k.double().repeat_interleave(rep, 2)
    S = h0.double().clone()
    o = torch.empty(B, T, HV, V, dtype=torch.float64)
    for t in range(T):
        if g is not None:
            d = g[:, t].double().exp()
            S = S * (d[..., None, None] if d.dim() == 2 else d[..., None])
        u = beta[:, t].double()[..., None] * v[:, t].double()  # missing: − Sᵀ k
        S = S + ke[:, t][..., :, None] * u[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qe[:, t] * scale, S)
    return o.to(v.dtype), S.float()


def half_written_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """Writes only the first half of each output row into a fresh output buffer."""
    o, s = real_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config)
    out = kernel_config.new_output(*o.shape, dtype=o.dtype, device=o.device)
    out[..., : o.shape[-1] // 2] = o[..., : o.shape[-1] // 2]
    return out, s


def zero_tail_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """Writes all but the last token into a zero-initialised buffer: no NaN, but wrong values."""
    o, s = real_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config)
    out = torch.zeros_like(o)
    out[:, :-1] = o[:, :-1]
    return out, s


def stale_state_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """Right output, but returns the initial state as the final state."""
    o, _ = real_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config)
    return o, h0.clone()


def varlen_only_wrong_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """Right on uniform batches, wrong on packed variable-length ones (a bug the tuned shape cannot show)."""
    o, s = real_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config)
    return (o * 1.05 if cu is not None else o), s


def noisy_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config):  # type: ignore[no-untyped-def]
    """Correct within tolerance, but never twice the same bits (a race's signature)."""
    o, s = real_forward(q, k, v, g, beta, gate_mode, scale, h0, output_final_state, cu, config)
    return o + 1e-7 * torch.randn_like(o), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", KDA])
def test_real_kernel_passes(kernel: str, dtype: torch.dtype) -> None:
    result = gate(kernel, PROBLEM, dtype, "cpu", CONFIG, TOL[dtype], seed=3, determinism=True)
    assert result.passed, result.reason
    assert result.reason is None and result.error_o < TOL[dtype] and result.error_s < TOL[dtype]


@pytest.mark.parametrize(
    ("planted", "match"),
    [
        (no_correction_forward, "relative RMS error"),
        (half_written_forward, "NaN/Inf in the output"),
        (zero_tail_forward, "relative RMS error"),
        (stale_state_forward, "relative RMS error"),
        (varlen_only_wrong_forward, "edge case (packed sequences of 1, 17, 150 tokens)"),
    ],
    ids=["no-correction", "half-written", "zero-tail", "stale-state", "varlen-only"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_planted_wrong_kernels_fail(
    monkeypatch: pytest.MonkeyPatch, planted: Any, match: str, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(kernel_config, "POISON_OUTPUTS", False)  # the gate must poison by itself
    monkeypatch.setattr(fr, "forward", planted)
    result = gate(KDA, PROBLEM, dtype, "cpu", CONFIG, TOL[dtype])
    assert not result.passed
    assert result.reason is not None and match in result.reason
    assert kernel_config.POISON_OUTPUTS is False  # restored after the gate


def test_determinism_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fr, "forward", noisy_forward)
    assert gate(KDA, PROBLEM, torch.float32, "cpu", CONFIG, 1e-4).passed
    result = gate(KDA, PROBLEM, torch.float32, "cpu", CONFIG, 1e-4, determinism=True)
    assert not result.passed and "not deterministic" in (result.reason or "")


def test_gate_draws_strong_decays(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def spy(q, k, v, g, beta, *rest):  # type: ignore[no-untyped-def]
        seen["g"] = g
        return real_forward(q, k, v, g, beta, *rest)

    monkeypatch.setattr(fr, "forward", spy)
    assert gate(KDA, PROBLEM, torch.float32, "cpu", CONFIG, 1e-4).passed
    assert float(seen["g"].min()) < -3.5  # gate_min = -5: strong decay present


def test_gate_poisons_outputs_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_config, "POISON_OUTPUTS", False)
    seen: list[bool] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kernel_config.POISON_OUTPUTS)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(fr, "forward", spy)
    assert gate(KDA, PROBLEM, torch.float32, "cpu", CONFIG, 1e-4, determinism=True).passed
    assert seen == [True, True, True]  # every gate launch (shape, edge case, rerun) runs with NaN-filled outputs
    assert kernel_config.POISON_OUTPUTS is False
