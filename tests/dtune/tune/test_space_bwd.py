"""The backward search spaces (search_spaces/chunk_*_bwd.toml) load with dtune.space against the backward templates.

The backward kernels are not registered in dtune.kernels yet, so the loader's kernel lookup is pointed at a stand-in
spec with the backward's legal parameters; everything else is the real loader (schema, constraints, seeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from dtune.kernels.chunk import backward as chunk_bwd

import dtune.tune.space
from dtune.gpu import get_profile
from dtune.tune.space import load_space

GATES = {"chunk_delta_rule_bwd": "none", "chunk_gated_delta_rule_bwd": "scalar", "chunk_kda_bwd": "channel"}


@dataclass(frozen=True)
class BwdSpec:
    name: str
    gate: str

    def legal_params(self) -> dict[str, tuple[Any, ...]]:
        return chunk_bwd.legal_params(self.gate)


@pytest.fixture
def bwd_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    real = dtune.tune.space.get_kernel

    def lookup(name: str) -> Any:
        return BwdSpec(name, GATES[name]) if name in GATES else real(name)

    monkeypatch.setattr(dtune.tune.space, "get_kernel", lookup)


@pytest.mark.parametrize("kernel", list(GATES))
def test_backward_spaces_load_and_admit_the_default(kernel: str, bwd_kernels: None) -> None:
    gate = GATES[kernel]
    space = load_space(kernel)
    assert space.kernel == kernel and space.size() > 1
    assert ("di_BK" in space.params) == (gate == "channel")
    for gpu in ("h100", "h200"):
        limits = get_profile(gpu).constraint_fields()
        for shape in space.shapes.shapes():
            default = chunk_bwd.default_config(shape.K, shape.V, gate)
            assert space.violations(default, shape, limits) == [], (gpu, shape.key)
    for seed in space.seeds:  # seeds are legal backward configs (over the default)
        chunk_bwd.check_config(128, 128, gate, seed)
