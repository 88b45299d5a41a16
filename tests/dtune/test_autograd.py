"""How dtune.ops routes calls that need gradients: chunk ops through their autograd Function, the fused-recurrent
ops to a clear error, everything else (no grad needed) to the plain forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dtune.autograd
from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape

CHUNK = {Gate.NONE: ops.chunk_delta_rule, Gate.SCALAR: ops.chunk_gated_delta_rule, Gate.CHANNEL: ops.chunk_kda}
RECURRENT = {
    Gate.NONE: ops.fused_recurrent_delta_rule,
    Gate.SCALAR: ops.fused_recurrent_gated_delta_rule,
    Gate.CHANNEL: ops.fused_recurrent_kda,
}
SMALL = {"BT": 16, "BC": 16}


def inputs(gate: Gate, T: int = 9) -> dict[str, Any]:
    return make_inputs(Shape(1, T, 1, 1, 16, 16, 1, gate), seed=1)


def call(fn: Any, gate: Gate, x: dict[str, Any], **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    gated = (x["g"],) if gate is not Gate.NONE else ()
    return fn(x["q"], x["k"], x["v"], *gated, x["beta"], initial_state=x["initial_state"], **kw)


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_fused_recurrent_refuses_inputs_that_need_grad(gate: Gate) -> None:
    x = inputs(gate)
    x["v"] = x["v"].requires_grad_()
    name = RECURRENT[gate].__name__
    chunk = name.replace("fused_recurrent_", "chunk_")
    with pytest.raises(NotImplementedError, match=f"{name} has no backward.*{chunk}"):
        call(RECURRENT[gate], gate, x)
    with torch.no_grad():  # inference on the same tensors is fine
        o, _ = call(RECURRENT[gate], gate, x)
    assert o.grad_fn is None


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_no_grad_needed_runs_the_plain_forward(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the autograd path ran although no input requires grad")

    monkeypatch.setattr(ops, "chunk_with_grad", fail)
    x = inputs(gate)
    o, s = call(CHUNK[gate], gate, x, output_final_state=True, config=SMALL)
    assert o.grad_fn is None and s is not None
    x["q"] = x["q"].requires_grad_()
    with torch.no_grad():
        o, _ = call(CHUNK[gate], gate, x, config=SMALL)
    assert o.grad_fn is None


@pytest.mark.parametrize("gate", list(Gate), ids=[g.value for g in Gate])
def test_chunk_op_is_differentiable(gate: Gate) -> None:
    """Only v and the initial state require grad: their gradients come back (v's dtype, float32 state), the
    others stay None; the loss reads only the final state (the output's gradient is materialised as zeros)."""
    x = inputs(gate)
    x["v"] = x["v"].requires_grad_()
    x["initial_state"] = x["initial_state"].requires_grad_()
    o, s = call(CHUNK[gate], gate, x, output_final_state=True, bwd_config=SMALL)
    assert o.grad_fn is not None and s is not None
    s.square().sum().backward()
    assert x["v"].grad is not None and x["v"].grad.dtype == x["v"].dtype
    assert x["initial_state"].grad is not None and x["initial_state"].grad.dtype == torch.float32
    assert torch.isfinite(x["v"].grad).all() and x["v"].grad.abs().sum() > 0
    assert x["q"].grad is None and x["beta"].grad is None


def test_backward_without_final_state() -> None:
    x = inputs(Gate.SCALAR)
    x["g"] = x["g"].requires_grad_()
    o, s = call(CHUNK[Gate.SCALAR], Gate.SCALAR, x, bwd_config=SMALL)
    assert s is None
    o.sum().backward()
    assert x["g"].grad is not None and x["g"].grad.shape == x["g"].shape


def test_backward_config_is_checked_before_anything_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    x = inputs(Gate.CHANNEL)
    x["k"] = x["k"].requires_grad_()
    with pytest.raises(ValueError, match="chunk_kda_bwd: unknown parameter"):
        call(CHUNK[Gate.CHANNEL], Gate.CHANNEL, x, bwd_config={"nope": 1})
    with pytest.raises(ValueError, match="BC <= BT"):
        call(CHUNK[Gate.CHANNEL], Gate.CHANNEL, x, bwd_config={"BT": 16, "BC": 32})
    with torch.no_grad(), pytest.raises(ValueError, match="dv_BV"):  # checked even when no backward will run
        call(CHUNK[Gate.CHANNEL], Gate.CHANNEL, x, bwd_config={"dv_BV": 3})


def test_needs_grad() -> None:
    t = torch.zeros(2, requires_grad=True)
    assert dtune.autograd.needs_grad(None, torch.zeros(2), t)
    assert not dtune.autograd.needs_grad(None, torch.zeros(2))
    with torch.no_grad():
        assert not dtune.autograd.needs_grad(t)


def test_a_backward_kernel_is_not_an_op() -> None:
    x = inputs(Gate.CHANNEL)
    with pytest.raises(ValueError, match="chunk_kda_bwd is the backward of chunk_kda: call chunk_kda"):
        ops.run_kernel("chunk_kda_bwd", x["q"], x["k"], x["v"], x["g"], x["beta"])
