"""fla's ``use_gate_in_kernel`` inside the chunk forward: stage 1 activates the raw gate as it loads it (every stage-1
variant, both gates, both activation forms), against the float64 reference of the same call, with the separate gate
pass made to raise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtune.kernels.reference import reference_with_options

from dtune import ops
from dtune.options import Options
from tests.conftest import rel_err

# id -> (kernel, B, T, H, HV, K, V, seq_lens, config, form)
CASES: dict[str, tuple[str, int, int, int, int, int, int, list[int] | None, dict[str, Any], str]] = {
    "gdn-rows-T37-K24": ("chunk_gated_delta_rule", 2, 37, 1, 2, 24, 16, None, {"BT": 16, "INTRA": "rows"}, "softplus"),
    "gdn-blocks-varlen": (
        "chunk_gated_delta_rule", 1, 0, 2, 4, 32, 16, [19, 0, 1, 30], {"BT": 32, "BC": 16, "INTRA": "blocks"},
        "softplus",
    ),
    "gdn-blocks-wu-recomputed-bounded": (
        "chunk_gated_delta_rule", 2, 45, 1, 1, 16, 32, None,
        {"BT": 32, "BC": 16, "INTRA": "blocks", "WU": "recomputed", "AQK": "recomputed", "FUSE_OUTPUT": True},
        "bounded",
    ),
    "gdn-segmented-T70": (
        "chunk_gated_delta_rule", 1, 70, 1, 2, 16, 16, None, {"BT": 16, "SEG_CHUNKS": 2}, "softplus",
    ),
    "kda-rows-T29-K24": ("chunk_kda", 2, 29, 1, 2, 24, 16, None, {"BT": 16, "INTRA": "rows"}, "softplus"),
    "kda-blocks-split-varlen": (
        "chunk_kda", 1, 0, 1, 2, 32, 16, [33, 0, 7], {"BT": 32, "BC": 16, "INTRA": "blocks_split"}, "bounded",
    ),
    "kda-blocks-bounded-no-A": (
        "chunk_kda", 1, 40, 2, 2, 16, 32, None, {"BT": 64, "BC": 16, "INTRA": "blocks"}, "bounded-no-A",
    ),
    "kda-onepass-no-bias": (
        "chunk_kda", 2, 23, 1, 2, 32, 16, None, {"BT": 32, "BC": 16, "INTRA": "onepass"}, "softplus-no-bias",
    ),
}  # fmt: skip


def _inputs(case: tuple[Any, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Raw gates of both signs (large enough that softplus' and sigmoid's tails matter) and ``A_log`` up to ~2.5, so
    that some heads decay by 10-30 per token (the guarded KDA diagonal's exact second pass runs)."""
    kernel, B, T, H, HV, K, V, seq_lens, _, form = case
    gen = torch.Generator().manual_seed(5)
    T = sum(seq_lens) if seq_lens else T
    kda = kernel == "chunk_kda"
    x: dict[str, Any] = {
        "q": torch.randn(B, T, H, K, generator=gen),
        "k": torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(B, T, HV, V, generator=gen),
        "g": torch.randn((B, T, HV, K) if kda else (B, T, HV), generator=gen) * 3.0,
        "beta": torch.rand(B, T, HV, generator=gen),
    }
    N = len(seq_lens) if seq_lens else B
    x["initial_state"] = torch.randn(N, HV, K, V, generator=gen)
    x["cu_seqlens"] = None if seq_lens is None else torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    gate: dict[str, Any] = {
        "A_log": torch.linspace(-1.0, 2.5, HV),
        "dt_bias": torch.randn(HV * K if kda else HV, generator=gen),
    }
    if form.startswith("bounded"):
        gate["lower_bound"] = -5.0
    if form == "bounded-no-A":
        gate["A_log"] = None
    if form == "softplus-no-bias":
        gate["dt_bias"] = None
    return x, gate


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_stage_one_activates_the_raw_gate(case: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    import dtune.options as options_module

    def no_pass(*_: Any, **__: Any) -> None:
        raise AssertionError("the separate gate pass ran")

    monkeypatch.setattr(options_module, "gate_activation", no_pass)
    kernel, config = case[0], case[8]
    x, gate = _inputs(case)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    options = Options(use_gate_in_kernel=True, **gate)
    o, ht = ops.run_kernel(kernel, *args, **kw, config=config, options=options)
    o_ref, ht_ref = reference_with_options(*args, None, **kw, use_gate_in_kernel=True, **gate)
    assert ht is not None and ht_ref is not None
    assert rel_err(o, o_ref) < 1e-4, rel_err(o, o_ref)
    assert rel_err(ht, ht_ref) < 1e-4, rel_err(ht, ht_ref)


def test_with_every_option_the_others_stay_passes() -> None:
    """fla's KDA layer's options at once (l2norm, gate, beta's sigmoid, the [V, K] state): the gate in stage 1, the
    rest as passes, the final state in the caller's layout."""
    case = CASES["kda-rows-T29-K24"]
    x, gate = _inputs(case)
    x["beta"] = x["beta"] * 6.0 - 3.0  # raw, both signs
    h0 = x["initial_state"].transpose(-1, -2).contiguous()  # [N, HV, V, K]
    names = ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first")
    flags = dict.fromkeys(names, True)
    options = Options(use_gate_in_kernel=True, **flags, **gate)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, ht = ops.chunk_kda(*args, initial_state=h0, output_final_state=True, config=case[8], options=options)
    o_ref, ht_ref = reference_with_options(
        *args, None, h0, True, use_gate_in_kernel=True, **flags, **gate
    )  # fmt: skip
    assert ht is not None and ht_ref is not None and ht.shape == h0.shape
    assert rel_err(o, o_ref) < 1e-4 and rel_err(ht, ht_ref) < 1e-4


def test_under_autograd_the_gate_is_a_pass_with_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``A_log`` requiring grad (a layer's parameter) the call takes the separate gate pass, whose backward gives
    dA_log and ddt_bias; under ``torch.no_grad()`` the same call does not."""
    import dtune.options as options_module

    calls: list[int] = []
    real = options_module.gate_activation

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(options_module, "gate_activation", counted)
    case = CASES["gdn-rows-T37-K24"]
    x, gate = _inputs(case)
    gate["A_log"].requires_grad_()
    options = Options(use_gate_in_kernel=True, **gate)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.no_grad():
        ops.chunk_gated_delta_rule(*args, config=case[8], options=options)
    assert calls == []
    o, _ = ops.chunk_gated_delta_rule(*args, config=case[8], options=options)
    assert calls == [1]
    (dA,) = torch.autograd.grad(o.sum(), [gate["A_log"]])
    assert dA.abs().sum() > 0
