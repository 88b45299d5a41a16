"""fla's in-kernel options inside the chunk forward (outside autograd): stage 1 activates the raw gate as it loads it
(every stage-1 variant, both gates, both activation forms); every stage that loads q, k or beta applies the l2norm and
beta's sigmoid (every stage-1 variant, both state layouts, stored and recomputed W / U / A_qk, the separate output
stage, the sequence-parallel pass). Against the float64 reference of the same call, with the separate passes made to
raise."""

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
def test_stage_one_activates_the_raw_gate(case: tuple[Any, ...], no_option_passes: None) -> None:
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


# id -> (kernel, B, T, H, HV, K, V, seq_lens, config, with the gate activation)
QK_CASES: dict[str, tuple[str, int, int, int, int, int, int, list[int] | None, dict[str, Any], bool]] = {
    "gdn-rows-T37-K24": ("chunk_gated_delta_rule", 2, 37, 1, 2, 24, 16, None, {"BT": 16, "INTRA": "rows"}, True),
    "gdn-blocks-unfused-varlen-K48": (
        "chunk_gated_delta_rule", 1, 0, 2, 4, 48, 16, [19, 0, 1, 30],
        {"BT": 32, "BC": 16, "INTRA": "blocks", "FUSE_OUTPUT": False, "o_BK": 32, "intra_BK": 32}, True,
    ),
    "gdn-recomputed-kv": (
        "chunk_gated_delta_rule", 2, 45, 1, 2, 16, 32, None,
        {"BT": 32, "BC": 16, "WU": "recomputed", "AQK": "recomputed", "FUSE_OUTPUT": True}, True,
    ),
    "gdn-recomputed-vk-qk-direct": (
        "chunk_gated_delta_rule", 1, 50, 1, 1, 32, 16, None,
        {"BT": 16, "WU": "recomputed", "STATE_LAYOUT": "vk", "QK_DIRECT": True, "FUSE_OUTPUT": True}, False,
    ),
    "gdn-qk-direct-vk": (
        "chunk_gated_delta_rule", 2, 33, 2, 2, 16, 16, None, {"BT": 16, "QK_DIRECT": True, "STATE_LAYOUT": "vk"}, False,
    ),
    "gdn-segmented-T70": (
        "chunk_gated_delta_rule", 1, 70, 1, 2, 16, 16, None, {"BT": 16, "SEG_CHUNKS": 2}, True,
    ),
    # burn-in with k normalised in the kernel (its bound's key norms taken as 1)
    "gdn-segmented-T70-burnin": (
        "chunk_gated_delta_rule", 1, 70, 1, 2, 16, 16, None, {"BT": 16, "SEG_CHUNKS": 2, "SEG_START": "burnin"}, True,
    ),
    # the decay-driven skip of phase 1 with k normalised in the kernel (the bound's key norms taken as 1)
    "gdn-segmented-T70-decay-skip": (
        "chunk_gated_delta_rule", 1, 70, 1, 2, 16, 16, None, {"BT": 16, "SEG_CHUNKS": 2, "SEG_DECAY": True}, True,
    ),
    "dn-blocks-split-K24": (
        "chunk_delta_rule", 2, 29, 1, 2, 24, 16, None, {"BT": 32, "BC": 16, "INTRA": "blocks_split"}, False,
    ),
    "dn-rows-unfused-K40": (
        "chunk_delta_rule", 1, 40, 2, 2, 40, 16, None,
        {"BT": 16, "INTRA": "rows", "FUSE_OUTPUT": False, "o_BK": 32, "intra_BK": 32}, False,
    ),
    "dn-recomputed-vk-segmented": (
        "chunk_delta_rule", 1, 70, 1, 1, 16, 16, None,
        {"BT": 16, "WU": "recomputed", "AQK": "recomputed", "STATE_LAYOUT": "vk", "SEG_CHUNKS": 2}, False,
    ),
    "kda-rows-T29-K24": ("chunk_kda", 2, 29, 1, 2, 24, 16, None, {"BT": 16, "INTRA": "rows"}, True),
    "kda-blocks-split-varlen": (
        "chunk_kda", 1, 0, 1, 2, 32, 16, [33, 0, 7], {"BT": 32, "BC": 16, "INTRA": "blocks_split"}, True,
    ),
    "kda-blocks-unfused-BT64": (
        "chunk_kda", 1, 40, 2, 2, 16, 32, None, {"BT": 64, "BC": 16, "INTRA": "blocks", "FUSE_OUTPUT": False}, False,
    ),
    "kda-onepass-K48": (
        "chunk_kda", 2, 23, 1, 2, 48, 16, None, {"BT": 32, "BC": 16, "INTRA": "onepass", "intra_BK": 32}, True,
    ),
}  # fmt: skip


def _qk_inputs(case: tuple[Any, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_inputs` with q and k far from unit rows (norms ~0.5 to ~10, a different scale per token) and beta raw,
    of both signs; without the gate activation, log gates down to −6 per token."""
    kernel, B, T, H, HV, K, V, seq_lens, config, with_gate = case
    x, gate = _inputs((kernel, B, T, H, HV, K, V, seq_lens, config, "softplus"))
    gen = torch.Generator().manual_seed(11)
    for name in ("q", "k"):
        rows = x[name].shape[:-1]
        x[name] = torch.randn(*x[name].shape, generator=gen) * (0.1 + 2.0 * torch.rand(*rows, 1, generator=gen))
    x["beta"] = torch.randn(x["beta"].shape, generator=gen) * 3.0
    if kernel == "chunk_delta_rule":
        x["g"] = None
    elif not with_gate:
        x["g"] = -6.0 * torch.rand(x["g"].shape, generator=gen)
    return x, gate if with_gate and x["g"] is not None else {}


@pytest.mark.parametrize("case", list(QK_CASES.values()), ids=list(QK_CASES))
def test_stages_apply_the_l2norm_and_beta_sigmoid(case: tuple[Any, ...], no_option_passes: None) -> None:
    """``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel`` with ``allow_neg_eigval`` (and the gate where the
    case has it) with no separate pass: every stage that loads q, k or beta applies them."""
    kernel, config = case[0], case[8]
    x, gate = _qk_inputs(case)
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    flags = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True}
    flags |= {"use_gate_in_kernel": True} if gate else {}
    o, ht = ops.run_kernel(kernel, *args, **kw, config=config, options=Options(**flags, **gate))
    o_ref, ht_ref = reference_with_options(*args, None, **kw, **flags, **gate)
    assert ht is not None and ht_ref is not None
    assert rel_err(o, o_ref) < 1e-4, rel_err(o, o_ref)
    assert rel_err(ht, ht_ref) < 1e-4, rel_err(ht, ht_ref)


def test_with_every_option_no_pass_runs(no_option_passes: None) -> None:
    """fla's KDA layer's options at once (l2norm, gate, beta's sigmoid ×2, the [V, K] state): every one inside the
    stages, the states transposed around the call, the final state in the caller's layout."""
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


@pytest.fixture
def l2norm_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of the l2norm pass (``dtune.options.l2norm``), recorded as it runs: empty when the kernels normalised
    q and k themselves."""
    import dtune.options as options_module

    calls: list[str] = []
    real = options_module.l2norm

    def counted(x: torch.Tensor, *a: Any) -> torch.Tensor:
        calls.append("l2norm")
        return real(x, *a)

    monkeypatch.setattr(options_module, "l2norm", counted)
    return calls


@pytest.mark.parametrize("kernel", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_calls_longer_than_the_kernels_pay_for_take_the_passes(
    kernel: str, monkeypatch: pytest.MonkeyPatch, l2norm_calls: list[str]
) -> None:
    """Above ``IN_KERNEL_MAX_TOKENS`` tokens a call (chunk) or ``IN_KERNEL_MAX_SEQ_LEN`` a sequence (fused recurrent;
    a packed batch counts its average) the options run as the passes, where they measured faster; the result is the
    same. The limits are lowered here to the test's sizes."""
    import dtune.options as options_module

    monkeypatch.setattr(options_module, "IN_KERNEL_MAX_TOKENS", 40)
    monkeypatch.setattr(options_module, "IN_KERNEL_MAX_SEQ_LEN", 20)
    x, _ = _qk_inputs(QK_CASES["gdn-rows-T37-K24"])  # B 2, T 37: 74 tokens, 37 a sequence
    args = (x["q"], x["k"], x["v"], -torch.rand_like(x["g"]), x["beta"])
    options = Options(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    kw = {"initial_state": x["initial_state"], "output_final_state": True}
    o, ht = ops.run_kernel(kernel, *args, **kw, options=options)
    assert l2norm_calls == ["l2norm", "l2norm"]
    o_ref, ht_ref = reference_with_options(
        *args, None, **kw, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True
    )
    assert ht is not None and ht_ref is not None
    assert rel_err(o, o_ref) < 1e-4 and rel_err(ht, ht_ref) < 1e-4
    l2norm_calls.clear()
    short = tuple(a[:, :9] for a in args)  # 18 tokens, 9 a sequence: inside the kernels
    ops.run_kernel(kernel, *short, **kw, options=options)
    assert l2norm_calls == []


def test_kda_takes_the_passes_from_a_shorter_call(monkeypatch: pytest.MonkeyPatch, l2norm_calls: list[str]) -> None:
    """KDA's chunk forward does more in-kernel work per token than Gated DeltaNet's: its limit is lower (measured:
    :data:`dtune.options.IN_KERNEL_MAX_TOKENS_KDA`); a call between the two limits runs KDA's options as passes and
    Gated DeltaNet's in the kernels (the op's own call, limits lowered to the test's sizes), the fused-recurrent rule
    is per sequence whatever the gate."""
    import dtune.options as options_module
    from dtune.options import IN_KERNEL_MAX_SEQ_LEN, IN_KERNEL_MAX_TOKENS, IN_KERNEL_MAX_TOKENS_KDA, in_kernel_pays

    options = Options(use_qk_l2norm_in_kernel=True)
    for case, passes in (("gdn-rows-T37-K24", False), ("kda-rows-T29-K24", True)):  # 74 and 58 tokens
        x, _ = _qk_inputs(QK_CASES[case])
        op = getattr(ops, QK_CASES[case][0])
        l2norm_calls.clear()
        with monkeypatch.context() as m:  # limits at the test's sizes for the call only: the checks below use the real
            m.setattr(options_module, "IN_KERNEL_MAX_TOKENS", 100)
            m.setattr(options_module, "IN_KERNEL_MAX_TOKENS_KDA", 40)
            op(x["q"], x["k"], x["v"], -torch.rand_like(x["g"]), x["beta"], options=options)
        assert l2norm_calls == (["l2norm", "l2norm"] if passes else []), case

    between = (IN_KERNEL_MAX_TOKENS_KDA + IN_KERNEL_MAX_TOKENS) // 2
    assert IN_KERNEL_MAX_TOKENS_KDA < between < IN_KERNEL_MAX_TOKENS
    assert in_kernel_pays("chunk", between, between, "scalar") and in_kernel_pays("chunk", between, between, "none")
    assert not in_kernel_pays("chunk", between, between, "channel")
    assert in_kernel_pays("chunk", IN_KERNEL_MAX_TOKENS_KDA, 1.0, "channel")
    for gate in ("none", "scalar", "channel"):
        assert in_kernel_pays("fused_recurrent", 10**6, IN_KERNEL_MAX_SEQ_LEN, gate)
        assert not in_kernel_pays("fused_recurrent", 10, IN_KERNEL_MAX_SEQ_LEN + 1, gate)
