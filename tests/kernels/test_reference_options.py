"""The float64 references of fla's in-kernel options (kernels/reference.py): against fla's own torch references where
fla-core is installed, and against the plain references with the options applied by hand."""

from __future__ import annotations

import pytest
import torch
from dtune.kernels import reference as ref

from tests.conftest import rel_err

F64 = torch.float64


def _x(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64) * scale


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "lower-bound"])
def test_kda_gate_is_fla_s(lower_bound: float | None) -> None:
    gate = pytest.importorskip("fla.ops.kda.gate", reason="fla-core is not installed (pip install 'dtune[fla]')")
    g, A, b = _x(2, 5, 3, 8, scale=3), _x(3), _x(24)
    ours = ref.gate_from_raw(g, A, b, lower_bound)
    if lower_bound is None:
        theirs = gate.naive_kda_gate(g, A, b, output_dtype=F64)
    else:
        theirs = gate.naive_kda_lowerbound_gate(g, A, b, lower_bound, output_dtype=F64)
    assert rel_err(ours, theirs) < 1e-6  # fla's naive gates compute in float32


def test_gdn_gate_is_fla_s() -> None:
    gate = pytest.importorskip("fla.ops.gated_delta_rule.gate", reason="fla-core is not installed")
    g, A, b = _x(2, 5, 3, scale=3), _x(3), _x(3)
    assert rel_err(ref.gate_from_raw(g, A, b), gate.naive_gdn_gate(g, A, b, output_dtype=F64)) < 1e-6


def test_options_reference_is_fla_s_naive_kda_on_preprocessed_inputs() -> None:
    """Every option at once against fla's naive_recurrent_kda fed the inputs fla's kernels would compute."""
    naive = pytest.importorskip("fla.ops.kda.naive", reason="fla-core is not installed")
    gate = pytest.importorskip("fla.ops.kda.gate", reason="fla-core is not installed")
    torch.manual_seed(0)
    B, T, H, HV, K, V = 1, 13, 1, 2, 8, 12
    q, k, v = _x(B, T, H, K), _x(B, T, H, K), _x(B, T, HV, V)
    g, beta, A, b = _x(B, T, HV, K, scale=2), _x(B, T, HV, scale=2), _x(HV), _x(HV * K)
    h0 = _x(B, HV, V, K)  # state_v_first
    opts = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": A, "dt_bias": b,
            "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True, "state_v_first": True}  # fmt: skip
    o, ht = ref.reference_with_options(q, k, v, g, beta, None, h0, True, **opts)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    o2, ht2 = naive.naive_recurrent_kda(norm(q), norm(k), v, gate.naive_kda_gate(g, A, b, output_dtype=F64),
                                        2 * beta.sigmoid(), None, h0.transpose(-1, -2), True)  # fmt: skip
    assert rel_err(o, o2) < 1e-5 and rel_err(ht, ht2.transpose(-1, -2)) < 1e-5


def test_chunked_reference_with_options_matches_the_loop() -> None:
    torch.manual_seed(1)
    B, T, H, HV, K, V = 2, 37, 1, 2, 8, 8
    args = (_x(B, T, H, K), _x(B, T, H, K), _x(B, T, HV, V), _x(B, T, HV, scale=2), _x(B, T, HV))
    opts = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": _x(HV), "dt_bias": _x(HV),
            "use_beta_sigmoid_in_kernel": True}  # fmt: skip
    h0 = _x(B, HV, K, V)
    o, ht = ref.reference_with_options(*args, None, h0, True, **opts)
    o2, ht2 = ref.reference_with_options(*args, None, h0, True, **opts, chunked=True)
    assert ht is not None and ht2 is not None
    assert rel_err(o2, o) < 1e-10 and rel_err(ht2, ht) < 1e-10


def test_neg_eigval_needs_the_sigmoid() -> None:
    args = (_x(1, 3, 1, 8), _x(1, 3, 1, 8), _x(1, 3, 1, 8), None, _x(1, 3, 1))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        ref.reference_with_options(*args, allow_neg_eigval=True)
