"""The backward gate (dtune.tune.gate_bwd, reached through dtune.tune.gate.gate for a chunk_*_bwd kernel): every
gradient of the training step against float64 autograd, at the tuned shape and on the packed varlen edge case.

Bugs are planted in the backward's launcher (dtune.kernels.chunk.backward.backward, which the autograd Function calls):
a gradient scaled by 1.05, an unwritten element, a bug only in variable-length batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from dtune.kernels.chunk import backward as chunk_bwd

from dtune.measure.grad import REFERENCE_MAX_BYTES, reference_bytes
from dtune.shape import Shape
from dtune.tune.gate import gate
from dtune.tune.gate_bwd import gate_shape
from dtune.tune.space import load_space

SHAPE = Shape(2, 20, 2, 2, 16, 16, 2)  # T not a multiple of the chunk
SMALL = {"BT": 16, "BC": 16}


def tolerance(kernel: str) -> float:
    return load_space(kernel).tolerance["fp32"]


def plant(monkeypatch: pytest.MonkeyPatch, bug: Callable[[dict[str, Any], Any], None]) -> None:
    """Wrap the backward launcher: ``bug(grads, cu_seqlens)`` edits its gradients in place."""
    real = chunk_bwd.backward

    def planted(*args: Any) -> dict[str, Any]:
        grads = real(*args)
        bug(grads, args[10])  # backward(do, dht, q, k, v, g, beta, gate, scale, initial_state, cu_seqlens, ...)
        return grads

    monkeypatch.setattr(chunk_bwd, "backward", planted)


@pytest.mark.parametrize("kernel", ["chunk_delta_rule_bwd", "chunk_gated_delta_rule_bwd", "chunk_kda_bwd"])
def test_right_gradients_pass(kernel: str) -> None:
    r = gate(kernel, SHAPE, torch.float32, "cpu", SMALL, tolerance(kernel), seed=3)
    assert r.passed, r.reason
    assert 0 < r.error_o < 1e-4 and 0 < r.error_s < 1e-4


@pytest.mark.parametrize(("name", "label"), [("k", "dk"), ("g", "dg")])
def test_a_gradient_off_by_five_percent_fails(monkeypatch: pytest.MonkeyPatch, name: str, label: str) -> None:
    kernel = "chunk_kda_bwd"
    plant(monkeypatch, lambda grads, cu: grads[name].mul_(1.05))
    r = gate(kernel, SHAPE, torch.float32, "cpu", SMALL, tolerance(kernel), seed=3)
    assert not r.passed and r.reason is not None
    assert r.reason.startswith(f"relative RMS error of {label}") and "exceeds the fp32 tolerance" in r.reason
    assert r.error_s > 0.04 and r.error_o < 1e-4  # the forward is right, the gradient is not


def test_an_unwritten_gradient_element_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, lambda grads, cu: grads["initial_state"].view(-1)[-1:].fill_(float("nan")))
    r = gate("chunk_delta_rule_bwd", SHAPE, torch.float32, "cpu", SMALL, 2e-3, seed=3)
    assert not r.passed and r.reason == "NaN/Inf in dh0 (unwritten elements or overflow)"


def test_the_varlen_edge_case_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    plant(monkeypatch, lambda grads, cu: grads["beta"].mul_(1.05) if cu is not None else None)
    r = gate("chunk_gated_delta_rule_bwd", SHAPE, torch.float32, "cpu", SMALL, 2e-3, seed=3)
    assert not r.passed and r.reason is not None
    assert r.reason.startswith("edge case (packed sequences of 1, 17, 150 tokens): relative RMS error of dbeta")


def test_reference_budget_shrinks_the_batch_on_a_gpu_only() -> None:
    big = Shape(8, 4096, 16, 16, 128, 128, 8)
    assert gate_shape(big, "cpu") == big
    small = gate_shape(big, "cuda")  # (no GPU needed: only the device's type is read)
    assert (small.B, small.N, small.T, small.H, small.K) == (2, 2, 4096, 16, 128)
    assert reference_bytes(big) > REFERENCE_MAX_BYTES >= reference_bytes(small)


@pytest.mark.parametrize(("times", "passes"), [(1.3, False), (1.0, True)], ids=["1.3x-worse", "same-level"])
def test_a_config_less_accurate_than_the_default_fails(
    monkeypatch: pytest.MonkeyPatch, times: float, passes: bool
) -> None:
    """dk carries noise of relative RMS 1e-3 (inside the 2e-3 tolerance), 1.3x that for every backward config but the
    default: the criterion (1.15x the default's error on the same inputs) fails it, and passes one at the same level."""
    real = chunk_bwd.backward

    def planted(*args: Any) -> dict[str, Any]:
        grads = real(*args)
        bwd_config, q, v = args[12], args[2], args[4]
        default = bwd_config == chunk_bwd.default_config(q.shape[-1], v.shape[-1], args[7])
        dk = grads["k"]
        gen = torch.Generator().manual_seed(dk.numel() + (0 if default else 1))
        noise = torch.randn(dk.shape, generator=gen, dtype=torch.float64)
        step = 1e-3 * (1.0 if default else times) * dk.double().norm() / noise.norm()
        grads["k"] = (dk.double() + step * noise).to(dk.dtype)
        return grads

    monkeypatch.setattr(chunk_bwd, "backward", planted)
    kernel = "chunk_kda_bwd"
    r = gate(kernel, SHAPE, torch.float32, "cpu", SMALL, tolerance(kernel), seed=3, max_vs_default=1.15)
    assert r.passed is passes, r.reason
    if not passes:
        assert r.reason is not None and r.reason.startswith("relative RMS error of dk")
        assert "the default config's" in r.reason
