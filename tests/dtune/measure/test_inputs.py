"""dtune.measure.inputs: the gates a timed call runs on (strong decays by default, a model's on request)."""

from __future__ import annotations

import pytest
import torch

from dtune.measure.inputs import Workload, make_inputs, workload_inputs
from dtune.shape import Gate, Shape


def _gates(gate: Gate, decays: str, seed: int = 3) -> torch.Tensor:
    g = make_inputs(Shape(2, 512, 4, 16, 32, 32, 2, gate), seed=seed, decays=decays)["g"]
    assert g is not None and g.dtype == torch.float32
    return g


@pytest.mark.parametrize("gate", [Gate.SCALAR, Gate.CHANNEL])
def test_model_decays_are_a_layers_gates_weak_to_strong_by_head(gate: Gate) -> None:
    """fla's layers at initialisation: every log gate negative and finite, constant in distribution over the
    tokens, and the heads' mean decays spread from a few thousandths to about one a token (where the strong
    default's mean is near -2 everywhere)."""
    g = _gates(gate, "model")
    assert g.shape == ((2, 512, 16) if gate is Gate.SCALAR else (2, 512, 16, 32))
    assert torch.isfinite(g).all() and (g < 0).all()
    means = g.mean(dim=(0, 1)).reshape(16, -1).mean(-1)
    assert means.max() > -0.05 and means.min() < -0.3
    strong = _gates(gate, "strong")
    assert strong.mean() < -1.5 < g.mean()
    assert torch.equal(g, _gates(gate, "model"))  # seeded
    assert not torch.equal(g, _gates(gate, "model", seed=4))


def test_the_default_gates_are_the_strong_ones_and_the_workload_carries_its_decays() -> None:
    shape = Shape(1, 64, 2, 2, 16, 16, 1, Gate.SCALAR)
    assert torch.equal(make_inputs(shape, seed=1)["g"], make_inputs(shape, seed=1, decays="strong")["g"])
    x = workload_inputs(shape, torch.float32, "cpu", Workload(decays="model"), seed=1)
    assert torch.equal(x["g"], make_inputs(shape, seed=1, decays="model")["g"])


def test_unknown_decays_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown decays 'weak'"):
        make_inputs(Shape(1, 8, 1, 1, 16, 16, 1, Gate.SCALAR), decays="weak")
