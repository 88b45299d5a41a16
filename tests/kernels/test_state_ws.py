"""The Gluon state pass (``STATE_LOOP = "gluon"``, kernels/chunk/state_ws.py) without a GPU: which calls it serves
and why not the others, that the Triton pass runs those (the interpreter's included: Gluon has none), and that it
compiles for sm_90a as warp-specialised wgmma code. Its numbers on a GPU: tests/kernels/test_chunk_gpu.py."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
import torch
from dtune.kernels import KERNELS
from dtune.kernels.chunk import state_ws
from dtune.kernels.chunk.call import prepare_call
from dtune.kernels.options import InKernel

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err
from tests.kernels import sm90_child

GLUON = {
    "WU": "recomputed", "AQK": "stored", "FUSE_OUTPUT": True, "STATE_LAYOUT": "vk", "STATE_TMA": True, "BT": 32,
    "BC": 16, "h_BV": 64, "h_num_stages": 2, "STATE_LOOP": "gluon",
}  # fmt: skip
OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule"}


def _call(
    gate: Gate = Gate.SCALAR,
    config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    K: int = 128,
    V: int = 128,
    in_kernel: InKernel | None = None,
) -> Any:
    shape = Shape(2, 40, 2, 4, K, V, 2, gate)
    x = make_inputs(shape, dtype, "cpu", seed=3)
    kernel = OPS[gate]
    cfg = KERNELS[kernel].check_config(K, V, {**GLUON, **(config or {})})
    return prepare_call(
        x["q"], x["k"], x["v"], x["g"], x["beta"], KERNELS[kernel].gate, 0.1, x["initial_state"], True, None, cfg,
        in_kernel=in_kernel or InKernel(),
    )  # fmt: skip


HOPPER = (9, 0)


def test_serves_deltanet_and_gated_deltanet_on_sm90() -> None:
    assert state_ws.why_not(_call(Gate.SCALAR), HOPPER) is None
    assert state_ws.why_not(_call(Gate.NONE), HOPPER) is None
    assert state_ws.why_not(_call(Gate.SCALAR, {"h_BV": 128, "BT": 64, "h_num_stages": 3}), HOPPER) is None
    assert state_ws.why_not(_call(Gate.SCALAR, dtype=torch.float16, K=64), HOPPER) is None
    # fla's in-kernel l2norm of q and k (Qwen3-Next) and beta's sigmoid: applied as the pass loads its factors
    assert state_ws.why_not(_call(Gate.SCALAR, in_kernel=InKernel(l2norm=True, beta_sigmoid=1)), HOPPER) is None
    assert state_ws.why_not(_call(Gate.NONE, in_kernel=InKernel(l2norm=True, beta_sigmoid=2)), HOPPER) is None
    # A_qk formed in the pass (stage 1 reads no q)
    assert state_ws.why_not(_call(Gate.SCALAR, {"AQK": "recomputed"}), HOPPER) is None


@pytest.mark.parametrize(
    ("kwargs", "capability", "reason"),
    [
        ({}, None, "not an sm_90 GPU"),  # the CPU (and the interpreter)
        ({}, (8, 0), "not an sm_90 GPU"),
        ({}, (10, 0), "not an sm_90 GPU"),
        ({"dtype": torch.float32}, HOPPER, "bf16"),
        ({"config": {"WU": "stored"}}, HOPPER, "recomputed"),
        ({"config": {"FUSE_OUTPUT": False}}, HOPPER, "FUSE_OUTPUT"),
        ({"config": {"SEG_CHUNKS": 1}}, HOPPER, "sequence-parallel"),
        ({"K": 96, "V": 96}, HOPPER, "K not 64 or 128"),
        ({"K": 256}, HOPPER, "K not 64 or 128"),
        ({"config": {"BT": 16}}, HOPPER, "BT not 32 or 64"),
        ({"config": {"h_BV": 32}}, HOPPER, "h_BV"),
        ({"V": 96}, HOPPER, "h_BV"),
    ],
)
def test_refuses_what_it_cannot_compute(kwargs: dict[str, Any], capability: Any, reason: str) -> None:
    why = state_ws.why_not(_call(**kwargs), capability)
    assert why is not None and reason in why


def test_kda_is_not_served() -> None:
    x = make_inputs(Shape(1, 40, 2, 2, 64, 64, 1, Gate.CHANNEL), torch.bfloat16, "cpu", seed=3)
    cfg = KERNELS["chunk_kda"].check_config(64, 64, {"WU": "recomputed", "FUSE_OUTPUT": True, "h_BV": 64})
    call = prepare_call(x["q"], x["k"], x["v"], x["g"], x["beta"], "channel", 0.1, None, True, None, cfg)
    assert "KDA" in (state_ws.why_not(call, HOPPER) or "")


def test_is_a_legal_state_loop_of_deltanet_and_gated_deltanet_only() -> None:
    for kernel in OPS.values():
        KERNELS[kernel].check_config(128, 128, {"STATE_LOOP": "gluon"})
    with pytest.raises(ValueError, match="STATE_LOOP"):
        KERNELS["chunk_kda"].check_config(128, 128, {"STATE_LOOP": "gluon"})


@pytest.mark.parametrize("gate", list(OPS), ids=[g.value for g in OPS])
def test_the_triton_pass_runs_it_where_gluon_cannot(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter (no sm_90) a Gluon config computes what the same config's Triton pass does, exactly,
    without touching the Gluon launcher."""

    def boom(*a: Any) -> Any:
        raise AssertionError("the Gluon pass was launched off sm_90")

    monkeypatch.setattr(state_ws, "launch_state_ws", boom)
    x = make_inputs(Shape(2, 45, 2, 4, 32, 32, 2, gate), torch.float32, "cpu", seed=5, gate_min=-5.0)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = {"initial_state": x["initial_state"], "output_final_state": True}
    cfg = {**GLUON, "h_BV": 16}
    o, s = ops.run_kernel(OPS[gate], *args, **kw, config=cfg)
    o_tr, s_tr = ops.run_kernel(OPS[gate], *args, **kw, config={**cfg, "STATE_LOOP": "range"})
    assert s is not None and s_tr is not None
    assert rel_err(o, o_tr) == 0 and rel_err(s, s_tr) == 0


def test_the_training_forward_takes_it_from_fh_loop() -> None:
    """``fh_LOOP = "gluon"``: the forward under autograd runs the Gluon pass (its tiles by TMA, under ``fh_maxnreg``);
    ``"range"`` keeps Triton's, without a register cap that was the forward's Gluon pass's."""
    from dtune.kernels.chunk.backward import check_config, training_forward_config

    fwd = KERNELS["chunk_gated_delta_rule"].check_config(128, 128, {**GLUON, "h_maxnreg": 128})
    bwd = check_config(128, 128, "scalar", {"fh_LOOP": "gluon", "fh_U": "recomputed", "fh_maxnreg": 128})
    cfg = training_forward_config(fwd, bwd, "scalar")
    assert cfg["STATE_LOOP"] == "gluon" and cfg["STATE_TMA"] and cfg["h_maxnreg"] == 128 and cfg["WU"] == "recomputed"
    cfg = training_forward_config(fwd, check_config(128, 128, "scalar", {}), "scalar")
    assert cfg["STATE_LOOP"] == "range" and cfg["h_maxnreg"] == 0
    with pytest.raises(ValueError, match="fh_LOOP"):
        check_config(128, 128, "channel", {"fh_LOOP": "gluon"})


@pytest.mark.parametrize("gate", list(OPS), ids=[g.value for g in OPS])
def test_the_training_step_runs_the_triton_pass_where_gluon_cannot(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter a training step asking for the Gluon pass (``fh_LOOP``) gets the Triton one's gradients,
    exactly, without touching the Gluon launcher."""
    from dtune.measure.grad import op_step, with_output_grads

    def boom(*a: Any) -> Any:
        raise AssertionError("the Gluon pass was launched off sm_90")

    monkeypatch.setattr(state_ws, "launch_state_ws", boom)
    shape = Shape(2, 45, 2, 4, 32, 32, 2, gate)
    x = make_inputs(shape, torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {"BT": 32, "BC": 16, "fh_U": "recomputed", "fh_BV": 16, "SAVE": "all"}
    got = op_step(OPS[gate], x, {**bwd, "fh_LOOP": "gluon", "fh_maxnreg": 128}, None)()
    want = op_step(OPS[gate], x, bwd, None)()
    assert rel_err(got.o, want.o) == 0
    for name, grad in got.grads.items():
        assert (grad is None) == (want.grads[name] is None), name
        if grad is not None:
            assert rel_err(grad, want.grads[name]) == 0, name


# compiled for sm_90a in a child process without TRITON_INTERPRET (compiled Triton and the interpreter do not mix)
COMPILE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("scalar", {}),
    ("none", {}),
    ("scalar", {"h_num_stages": 3}),
    ("scalar", {"h_BV": 128}),
    ("none", {"BT": 64}),
    ("scalar", {"h_maxnreg": 128}),
    ("scalar", {"h_OVERLAP": False}),
    ("scalar", {"L2NORM": True, "BETA_ACT": 1}),
    ("none", {"L2NORM": True, "BETA_ACT": 2, "h_OVERLAP": False}),
    ("scalar", {"AQK": "recomputed"}),
    ("none", {"AQK": "recomputed", "L2NORM": True}),
    # the training forward's: its chunk states and V_new stored by TMA
    ("scalar", {"STORE_STATES": True, "h_maxnreg": 128}),
    ("scalar", {"AQK": "recomputed", "h_maxnreg": 128}),
]


# the cases that compile without spills with Triton 3.6 (the GPU machines') and 3.9 (CI): the plain pass, at value tiles
# of 128, at two programs per SM (h_maxnreg 128) with A_qk read or formed in the pass
SPILL_FREE = {0, 3, 5, 9, 12}


def compile_case(index: int) -> dict[str, Any]:
    from dtune.measure.sm90 import compile_state_ws, ptxas_usage

    gate, extra = COMPILE_CASES[index]
    options = {k: extra.pop(k) for k in ("L2NORM", "BETA_ACT", "STORE_STATES") if k in extra}  # (constexprs)
    cfg = {**GLUON, **extra}
    options["QK_RE"] = cfg.get("AQK") == "recomputed"
    compiled = compile_state_ws(gate, "bf16", 128, 128, cfg, **options)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    stores = r"cp\.async\.bulk\.tensor\.\dd\.global"  # (TMA stores: shared to global)
    patterns = ("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor", "mma.sync", stores)
    count = {p: len(re.findall(p, ptx)) for p in patterns}
    count["tma stores"] = count.pop(patterns[-1])
    count["store_states"] = int(bool(options.get("STORE_STATES")))
    return {"shared": int(compiled.metadata.shared), "regs": regs, "spills": spills, "count": count, "cfg": cfg}


@pytest.mark.parametrize("index", range(len(COMPILE_CASES)), ids=[f"{g}-{sorted(e.items())}" for g, e in COMPILE_CASES])
def test_compiles_for_sm90a_as_warp_specialised_wgmma(index: int) -> None:
    from dtune.measure.sm90 import H100_SMEM

    r = sm90_child.run(__file__, str(index))
    cfg, K, BT = r["cfg"], 128, r["cfg"]["BT"]
    # per chunk: (K S)ᵀ and Sᵀ qᵀ reduce over K, V_newᵀ, V_newᵀ A_qkᵀ and the state update over BT, 16 per instruction
    # (with A_qk formed in the pass, A_qkᵀ and V_newᵀ A_qkᵀ are mma.sync: one wgmma product fewer)
    qk_re = cfg.get("AQK") == "recomputed"
    assert r["count"]["wgmma.mma_async"] == 2 * K // 16 + (2 if qk_re else 3) * BT // 16
    assert (r["count"]["mma.sync"] > 0) == qk_re
    assert r["count"]["setmaxnreg"] > 0, "no register split between the partitions: not warp-specialised"
    assert r["count"]["cp.async.bulk.tensor"] >= (4 if qk_re else 5), "the tiles are not TMA loads"
    # the training forward's chunk states and V_new: two TMA stores per chunk, none otherwise
    assert r["count"]["tma stores"] == (2 if r["count"]["store_states"] else 0)
    assert r["shared"] <= H100_SMEM
    if cfg.get("h_maxnreg"):
        assert r["regs"] <= cfg["h_maxnreg"]
    # (ptxas's allocation moves with Triton's version: 0-152 bytes of spills with 3.6 and 3.9 for these cases)
    assert r["spills"] <= 256, f"{r['spills']} bytes of spills"
    if index in SPILL_FREE:  # (the final state's offsets kept alive through the loop: 120-360 bytes of spills here)
        assert r["spills"] == 0, f"{r['spills']} bytes of spills"


if __name__ == "__main__":
    from dtune.measure.sm90 import NoToolchain

    try:
        print(json.dumps(compile_case(int(sys.argv[1]))))
    except NoToolchain as e:
        print(e)
        raise SystemExit(sm90_child.SKIP_CODE) from None
