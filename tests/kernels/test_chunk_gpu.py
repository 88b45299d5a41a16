"""bf16 chunk kernels on a CUDA GPU against the float64 reference (``pytest -m gpu``, run by scripts/gpu_tests.sh).

Triton's interpreter computes ``tl.dot`` on bfloat16 operands wrongly, so bf16 is only checked here, compiled, at
sizes that exercise the real tiles: grouped value heads, K != V, T not a multiple of any chunk, T = 1, packed
sequences with an empty one, D = 256, strong decays; the shipped tuned configs (what the ops launch by default) and
each stage-1 / state-pass variant. The tolerance is the correctness gate's (the search space's bf16 tolerance).
Skipped, with the reason shown, where there is no CUDA GPU or the interpreter is on (CI).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dtune.kernels.reference import chunk_reference, reference_with_options

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.options import Options
from dtune.shape import Gate, Shape
from dtune.tune.space import load_space
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

CHUNK = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
# id -> (shape, seq_lens, config); config None: what the ops pick (the shipped tuned config, else the default)
CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any] | None]] = {}
for gate in Gate:
    tag = CHUNK[gate]
    CASES[f"{tag}-B2-T1000-H4-HV8-K128-V128-shipped"] = (Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, None)
    CASES[f"{tag}-B8-T4096-H16-K128-shipped"] = (Shape(8, 4096, 16, 16, 128, 128, 8, gate), None, None)
    CASES[f"{tag}-B4-T4096-H16-K64-shipped"] = (Shape(4, 4096, 16, 16, 64, 64, 4, gate), None, None)
    CASES[f"{tag}-B3-T1-H2-K128"] = (Shape(3, 1, 2, 2, 128, 128, 3, gate), None, None)
    CASES[f"{tag}-varlen-K96-V64"] = (Shape(1, 0, 2, 4, 96, 64, 5, gate, True), [1, 700, 0, 333, 64], None)
    CASES[f"{tag}-B1-T1023-K256"] = (Shape(1, 1023, 2, 2, 256, 256, 1, gate), None, None)
    for name, cfg in {
        "rows": {"INTRA": "rows", "BT": 64, "BC": 16},
        "vk": {"STATE_LAYOUT": "vk", "h_BV": 64},
        "unfused-BT64": {"BT": 64, "BC": 32, "FUSE_OUTPUT": False},
        # the chunk states and V_new stored through TMA descriptors for the output stage (STATES_TMA), transposed
        "unfused-states-tma-vk": {"FUSE_OUTPUT": False, "STATES_TMA": True, "STATE_LAYOUT": "vk", "h_BV": 64},
    }.items():
        CASES[f"{tag}-B2-T777-H4-HV8-K128-{name}"] = (Shape(2, 777, 4, 8, 128, 128, 2, gate), None, cfg)


@pytest.mark.parametrize(("shape", "seq_lens", "config"), list(CASES.values()), ids=list(CASES))
def test_bf16_chunk_matches_float64_reference(shape: Shape, seq_lens: list[int] | None, config: Any) -> None:
    kernel = CHUNK[shape.gate]
    tol = load_space(kernel).tolerance["bf16"]
    x = make_inputs(shape, torch.bfloat16, "cuda", seed=7, seq_lens=seq_lens, gate_min=-5.0)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    o, s = ops.run_kernel(kernel, *args, **kw, config=config)
    o_ref, s_ref = chunk_reference(*args, **kw, chunk_size=16)
    assert s is not None and s_ref is not None
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.3g} (tolerance {tol})"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.3g} (tolerance {tol})"


OPTION_CONFIGS: dict[str, dict[str, Any] | None] = {
    "shipped": None,
    "recomputed-vk-direct-tma": {
        "WU": "recomputed", "AQK": "recomputed", "FUSE_OUTPUT": True, "STATE_LAYOUT": "vk", "QK_DIRECT": True,
        "STATE_TMA": True, "h_BV": 64, "BT": 64, "BC": 16,
    },
    "unfused": {"FUSE_OUTPUT": False, "BT": 64, "BC": 16},
    # the state pass in Gluon (STATE_LOOP = "gluon", sm_90): the l2norm's factors and beta's sigmoid in it too
    "gluon": {
        "WU": "recomputed", "AQK": "stored", "FUSE_OUTPUT": True, "STATE_LAYOUT": "vk", "STATE_TMA": True, "h_BV": 64,
        "BT": 32, "BC": 16, "STATE_LOOP": "gluon",
    },
    "gluon-aqk": {
        "WU": "recomputed", "AQK": "recomputed", "FUSE_OUTPUT": True, "STATE_LAYOUT": "vk", "STATE_TMA": True,
        "h_BV": 64, "BT": 32, "BC": 16, "STATE_LOOP": "gluon",
    },
}  # fmt: skip
OPTION_CASES = [("chunk_gated_delta_rule", c) for c in OPTION_CONFIGS] + [
    ("chunk_kda", "shipped"), ("chunk_kda", "unfused"), ("chunk_delta_rule", "shipped"), ("chunk_delta_rule", "gluon"),
    ("chunk_delta_rule", "gluon-aqk"),
    ("fused_recurrent_kda", "shipped"), ("fused_recurrent_gated_delta_rule", "shipped"),
]  # fmt: skip


@pytest.mark.parametrize(("kernel", "config"), OPTION_CASES, ids=[f"{k}-{c}" for k, c in OPTION_CASES])
@pytest.mark.parametrize("bounded", [False, True], ids=["softplus", "bounded"])
def test_bf16_options_in_kernel_match_float64_reference(kernel: str, config: str, bounded: bool) -> None:
    """fla's layers' options on raw bf16 inputs (l2norm, the raw gate with A_log / dt_bias, beta's sigmoid), outside
    autograd: the chunk forward's stages apply them as they load their inputs (the shipped config and the state
    pass's variants), the fused-recurrent kernel token by token; against the float64 reference of the same call."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    B, T, H, HV, K, V = (2, 1000, 4, 8, 128, 128) if kernel.startswith("chunk") else (32, 1, 4, 8, 128, 128)
    kda = kernel.endswith("kda")
    gated = kernel != "chunk_delta_rule"

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)

    g = rnd(*((B, T, HV, K) if kda else (B, T, HV)), s=3.0) if gated else None
    args = (rnd(B, T, H, K, s=4.0), rnd(B, T, H, K, s=0.5), rnd(B, T, HV, V), g, rnd(B, T, HV, s=3.0))
    opts: dict[str, Any] = {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    if gated:
        opts |= {"use_gate_in_kernel": True, "A_log": torch.linspace(-1.0, 1.5, HV, device="cuda")}
        opts |= {"dt_bias": torch.randn(HV * K if kda else HV, device="cuda", generator=gen)}
        if bounded:
            opts["lower_bound"] = -5.0
    elif bounded:
        opts["allow_neg_eigval"] = True
    kw = {"initial_state": torch.randn(B, HV, K, V, device="cuda", generator=gen), "output_final_state": True}
    with torch.no_grad():
        o, s = ops.run_kernel(kernel, *args, **kw, config=OPTION_CONFIGS[config], options=Options(**opts))
    o_ref, s_ref = reference_with_options(*args, None, **kw, **opts)
    assert s is not None and s_ref is not None
    tol = load_space(kernel).tolerance["bf16"]
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.3g} (tolerance {tol})"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.3g} (tolerance {tol})"


# STATE_LOOP = "gluon": the state pass with the output written in Gluon, warp-specialised (kernels/chunk/state_ws.py)
GLUON = {
    "WU": "recomputed", "AQK": "stored", "FUSE_OUTPUT": True, "STATE_LAYOUT": "vk", "STATE_TMA": True, "BT": 32,
    "BC": 16, "h_BV": 64, "h_num_stages": 2, "STATE_LOOP": "gluon",
}  # fmt: skip
GLUON_CASES: dict[str, tuple[Shape, list[int] | None, dict[str, Any]]] = {}
for gate in (Gate.NONE, Gate.SCALAR):
    tag = CHUNK[gate]
    GLUON_CASES[f"{tag}-B2-T1000-H4-HV8"] = (Shape(2, 1000, 4, 8, 128, 128, 2, gate), None, {})
    GLUON_CASES[f"{tag}-B3-T1"] = (Shape(3, 1, 2, 2, 128, 128, 3, gate), None, {})
    GLUON_CASES[f"{tag}-varlen-K64-V128"] = (Shape(1, 0, 2, 4, 64, 128, 5, gate, True), [1, 700, 0, 333, 64], {})
    GLUON_CASES[f"{tag}-varlen-K64-V128-aqk"] = (
        Shape(1, 0, 2, 4, 64, 128, 5, gate, True),
        [1, 700, 0, 333, 64],
        {"AQK": "recomputed"},
    )
    GLUON_CASES[f"{tag}-B8-T4096-H16"] = (Shape(8, 4096, 16, 16, 128, 128, 8, gate), None, {})
    for name, cfg in {
        "BT64": {"BT": 64},
        "hBV128": {"h_BV": 128},
        "ring1": {"h_num_stages": 1},
        "ring3": {"h_num_stages": 3},
        "maxnreg128": {"h_maxnreg": 128},
        "serial": {"h_OVERLAP": False},
        "aqk": {"AQK": "recomputed"},
        "aqk-serial-maxnreg128": {"AQK": "recomputed", "h_OVERLAP": False, "h_maxnreg": 128},
        "aqk-BT64": {"AQK": "recomputed", "BT": 64},
    }.items():
        GLUON_CASES[f"{tag}-B2-T777-H4-HV8-{name}"] = (Shape(2, 777, 4, 8, 128, 128, 2, gate), None, cfg)


@pytest.mark.parametrize(("shape", "seq_lens", "extra"), list(GLUON_CASES.values()), ids=list(GLUON_CASES))
def test_gluon_state_pass_matches_float64_reference(
    shape: Shape, seq_lens: list[int] | None, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gluon pass runs (not the Triton one in its place) and matches the float64 reference as the Triton pass does,
    on strong decays, an initial state, grouped value heads, K != V, odd and empty sequences."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon state pass is sm_90 only")
    from dtune.kernels.chunk import state_ws

    launched: list[int] = []
    real = state_ws.launch_state_ws

    def spy(*a: Any) -> Any:
        launched.append(1)
        return real(*a)

    monkeypatch.setattr(state_ws, "launch_state_ws", spy)
    kernel = CHUNK[shape.gate]
    tol = load_space(kernel).tolerance["bf16"]
    x = make_inputs(shape, torch.bfloat16, "cuda", seed=11, seq_lens=seq_lens, gate_min=-5.0)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    cfg = {**GLUON, **extra}
    o, s = ops.run_kernel(kernel, *args, **kw, config=cfg)
    torch.cuda.synchronize()
    assert launched, "the Gluon state pass did not run"
    o_tr, s_tr = ops.run_kernel(kernel, *args, **kw, config={**cfg, "STATE_LOOP": "range"})
    o_ref, s_ref = chunk_reference(*args, **kw, chunk_size=16)
    assert s is not None and s_ref is not None and s_tr is not None
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < tol, f"output rel err {rel_err(o, o_ref):.3g} (tolerance {tol})"
    assert rel_err(s, s_ref) < tol, f"final state rel err {rel_err(s, s_ref):.3g} (tolerance {tol})"
    # the same algebra as the Triton pass: no further from the reference than it, give or take bf16 rounding
    assert rel_err(o, o_ref) < 1.5 * rel_err(o_tr, o_ref) + 1e-3
    assert rel_err(s, s_ref) < 1.5 * rel_err(s_tr, s_ref) + 1e-3
