"""The Gluon reverse state pass (``dh_LOOP = "gluon"``, kernels/chunk/bwd_state_ws.py) without a GPU: which calls it
serves and why not the others, that the Triton pass runs those (the interpreter's included: Gluon has none), and that
it compiles for sm_90a as warp-specialised wgmma code. Its numbers on a GPU: tests/kernels/test_chunk_bwd_gpu.py
(``-k gluon_reverse``)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
import torch
from dtune.kernels.chunk import bwd_state_ws
from dtune.kernels.chunk.backward import check_config

from dtune.measure.grad import op_step, with_output_grads
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err
from tests.kernels import sm90_child

HOPPER = (9, 0)
OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule"}
GLUON = {"BT": 64, "REVERSE_DV": True, "fh_U": "recomputed", "fh_W": "recomputed", "dh_LOOP": "gluon", "dh_BV": 64}


def _why(capability: Any = HOPPER, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> str | None:
    """why_not for a Gated DeltaNet call at K = V = 128, chunks of 64, with ``kw`` over it."""
    args: dict[str, Any] = dict(
        device=torch.device("cpu"), gate=1, dtype=dtype, inputs=(torch.zeros(64, 8, dtype=dtype),), K=128, V=128,
        BT=64, BV=64, config=dict(GLUON), segmented=False, dv_work=True, dqk_work=False, w_rebuild=False,
        qk_re=False, w_read=False, capability=capability,
    )  # fmt: skip
    config = kw.pop("config", {})
    args.update(kw)
    args["config"] = {**args["config"], **config}
    return bwd_state_ws.why_not(**args)


def test_serves_deltanet_and_gated_deltanet_on_sm90() -> None:
    assert _why() is None
    assert _why(gate=0) is None
    assert _why(BV=128, config={"dh_num_stages": 1}) is None
    assert _why(dtype=torch.float16, K=64) is None
    assert _why(qk_re=True, BT=32) is None
    assert _why(w_read=True, config={"dh_num_stages": 1}) is None
    # the sequence-parallel pass: its phase 3 (each segment's walk from its end adjoint)
    assert _why(segmented=True, config={"dh_SEG_CHUNKS": 16}) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"capability": None}, "not an sm_90 GPU"),  # the CPU (and the interpreter)
        ({"capability": (8, 0)}, "not an sm_90 GPU"),
        ({"capability": (10, 0)}, "not an sm_90 GPU"),
        ({"gate": 2}, "KDA"),
        ({"dtype": torch.float32}, "bf16"),
        ({"inputs": (torch.zeros(64, 8, dtype=torch.float32),)}, "bf16"),
        ({"dv_work": False}, "REVERSE_DV"),
        ({"dqk_work": True}, "REVERSE_DQK"),
        ({"w_rebuild": True}, "rebuilt"),
        ({"config": {"fh_U": "stored"}}, "fh_U"),
        ({"segmented": True, "config": {"dh_SEG_START": "burnin"}}, "burn-in"),
        ({"K": 96}, "K not 64 or 128"),
        ({"BT": 16}, "BT not 32 or 64"),
        ({"BV": 32}, "dh_BV"),
        ({"V": 96}, "dh_BV"),
        ({"inputs": (torch.zeros(0, 8, dtype=torch.bfloat16),)}, "no tokens"),
        ({"inputs": (torch.zeros(64, 8, dtype=torch.bfloat16)[:, 1:],)}, "16-byte"),
        ({"config": {"dh_num_stages": 0}}, "dh_num_stages"),
        ({"BV": 128, "w_read": True, "config": {"dh_num_stages": 3}}, "shared memory"),
    ],
)
def test_refuses_what_it_cannot_compute(kwargs: dict[str, Any], reason: str) -> None:
    why = _why(**kwargs)
    assert why is not None and reason in why, why


def test_is_a_legal_reverse_loop_of_deltanet_and_gated_deltanet_only() -> None:
    for gate in ("none", "scalar"):
        cfg = check_config(128, 128, gate, {"dh_LOOP": "gluon", "dh_maxnreg": 128})
        assert cfg["dh_LOOP"] == "gluon" and cfg["dh_maxnreg"] == 128
        assert check_config(128, 128, gate, {})["dh_LOOP"] == "range"
    with pytest.raises(ValueError, match="dh_LOOP"):
        check_config(128, 128, "channel", {"dh_LOOP": "gluon"})


@pytest.mark.parametrize("gate", list(OPS), ids=[g.value for g in OPS])
@pytest.mark.parametrize("extra", [{}, {"fh_W": "stored"}, {"fh_AQK": "recomputed"}], ids=["w-from-k", "w", "aqk"])
def test_the_training_step_runs_the_triton_pass_where_gluon_cannot(
    gate: Gate, extra: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the interpreter a training step asking for the Gluon reverse pass gets the Triton one's gradients,
    exactly, without touching the Gluon launcher."""

    def boom(**kw: Any) -> Any:
        raise AssertionError("the Gluon reverse pass was launched off sm_90")

    monkeypatch.setattr(bwd_state_ws, "launch_reverse_ws", boom)
    shape = Shape(2, 45, 2, 4, 32, 32, 2, gate)
    x = make_inputs(shape, torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {**GLUON, "BT": 32, "BC": 16, "dh_BV": 16, "dh_LAYOUT": "vk", "SAVE": "all", **extra}
    got = op_step(OPS[gate], x, {**bwd, "dh_maxnreg": 128}, None)()
    want = op_step(OPS[gate], x, {**bwd, "dh_LOOP": "range"}, None)()
    assert rel_err(got.o, want.o) == 0
    for name, grad in got.grads.items():
        assert (grad is None) == (want.grads[name] is None), name
        if grad is not None:
            assert rel_err(grad, want.grads[name]) == 0, name


@pytest.mark.parametrize(
    ("extra", "w_read", "qk_re"),
    [({}, False, False), ({"fh_W": "stored"}, True, False), ({"fh_AQK": "recomputed"}, False, True)],
    ids=["w-from-k", "w", "aqk"],
)
def test_the_reverse_pass_dispatches_to_gluon_where_it_serves(
    extra: dict[str, Any], w_read: bool, qk_re: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where why_not says yes (here: pretended), the backward hands its reverse pass to the Gluon launcher with how
    to form W's product and A_qk, the value tile and the buffers the Triton pass would fill."""

    class Launched(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake(**kw: Any) -> None:
        seen.update(kw)
        raise Launched

    monkeypatch.setattr(bwd_state_ws, "why_not", lambda **_: None)
    monkeypatch.setattr(bwd_state_ws, "launch_reverse_ws", fake)
    x = make_inputs(Shape(2, 45, 2, 4, 32, 32, 2, Gate.SCALAR), torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {**GLUON, "BT": 32, "BC": 16, "dh_BV": 16, "dh_LAYOUT": "vk", "SAVE": "all", **extra}
    with pytest.raises(Launched):
        op_step("chunk_gated_delta_rule", x, bwd, None)()
    assert seen["GATE"] == 1 and seen["BV"] == 16 and seen["BT"] == 32
    assert seen["w_read"] == w_read and seen["qk_re"] == qk_re
    assert seen["dh0"] is not None and seen["dht"] is not None and len(seen["dv_work"]) == 5


def test_phase_3_of_the_sequence_parallel_pass_goes_to_gluon(monkeypatch: pytest.MonkeyPatch) -> None:
    """With segments (dh_SEG_CHUNKS) phases 1 and 2 stay Triton's and phase 3 is handed to the Gluon pass: the
    segment table's bounds and chunks, each segment's end adjoint and the sequence it starts (for dh0), no dht."""

    class Launched(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake(**kw: Any) -> None:
        seen.update(kw)
        raise Launched

    monkeypatch.setattr(bwd_state_ws, "why_not", lambda **_: None)
    monkeypatch.setattr(bwd_state_ws, "launch_reverse_ws", fake)
    x = make_inputs(Shape(1, 300, 2, 4, 32, 32, 1, Gate.SCALAR), torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {**GLUON, "BT": 32, "BC": 16, "dh_BV": 16, "dh_LAYOUT": "vk", "SAVE": "all", "dh_SEG_CHUNKS": 2}
    with pytest.raises(Launched):
        op_step("chunk_gated_delta_rule", x, bwd, None)()
    assert seen["dht"] is None and seen["N"] == 5  # (300 tokens: 10 chunks of 32, segments of 2 chunks)
    assert seen["seg"]["SEG"] is True and seen["seg"]["xend"].shape == (5, 4, 32, 32)
    assert seen["seg"]["first"].tolist() == [0, -1, -1, -1, -1]
    assert seen["cu_seqlens"].tolist() == [0, 64, 128, 192, 256, 300]


# compiled for sm_90a in a child process without TRITON_INTERPRET (compiled Triton and the interpreter do not mix)
COMPILE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("scalar", {}),
    ("none", {}),
    ("scalar", {"dh_BV": 128}),
    ("none", {"dh_BV": 128, "dh_num_stages": 1}),
    ("scalar", {"dh_maxnreg": 128, "dh_num_stages": 1}),
    ("scalar", {"fh_W": "stored", "dh_num_stages": 1}),
    ("scalar", {"fh_AQK": "recomputed"}),
    ("none", {"fh_AQK": "recomputed", "dh_num_stages": 3}),
    # phase 3 of the sequence-parallel pass
    ("scalar", {"dh_SEG_CHUNKS": 16, "SEG": True}),
]


# the cases that compile without spills with Triton 3.6 (the GPU machines') and 3.9 (CI): no cap, W from k, A_qk read
SPILL_FREE = {0, 1, 2, 8}


def compile_case(index: int) -> dict[str, Any]:
    from dtune.measure.sm90 import compile_reverse_ws, ptxas_usage

    gate, extra = COMPILE_CASES[index]
    extra = dict(extra)
    seg = extra.pop("SEG", False)
    cfg = {**GLUON, "SAVE": "all", **extra}
    qk_re, w_read = cfg.get("fh_AQK") == "recomputed", cfg["fh_W"] == "stored"
    compiled = compile_reverse_ws(gate, "bf16", 128, 128, cfg, QK_RE=qk_re, W_READ=w_read, SEG=seg)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    stores = r"cp\.async\.bulk\.tensor\.\dd\.global"  # (TMA stores: shared to global)
    patterns = ("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor", "mma.sync", stores)
    count = {p: len(re.findall(p, ptx)) for p in patterns}
    count["tma stores"] = count.pop(patterns[-1])
    flags = {"qk_re": qk_re, "w_read": w_read}
    return {"shared": int(compiled.metadata.shared), "regs": regs, "spills": spills, "count": count, "cfg": cfg} | flags


@pytest.mark.parametrize("index", range(len(COMPILE_CASES)), ids=[f"{g}-{sorted(e.items())}" for g, e in COMPILE_CASES])
def test_compiles_for_sm90a_as_warp_specialised_wgmma(index: int) -> None:
    from dtune.measure.sm90 import H100_SMEM

    r = sm90_child.run(__file__, str(index))
    K, BT = 128, r["cfg"]["BT"]
    # per chunk: Xᵀ kᵀ reduces over K; dOᵀ A_qk, (dOᵀ ⊙ f) q, dV_newᵀ T and the last product (W or k) over BT, 16 per
    # instruction (with A_qk formed in the pass, A_qk and dOᵀ A_qk are mma.sync: one wgmma product fewer)
    assert r["count"]["wgmma.mma_async"] == K // 16 + (3 if r["qk_re"] else 4) * BT // 16
    assert (r["count"]["mma.sync"] > 0) == r["qk_re"]
    assert r["count"]["setmaxnreg"] > 0, "no register split between the partitions: not warp-specialised"
    # dO, q, k, T, v (+ A_qk, + W) by TMA loads, the chunk's adjoint by one TMA store
    loads = 5 + (0 if r["qk_re"] else 1) + (1 if r["w_read"] else 0)
    assert r["count"]["cp.async.bulk.tensor"] - r["count"]["tma stores"] >= loads, "the tiles are not TMA loads"
    assert r["count"]["tma stores"] == 1
    assert r["shared"] <= H100_SMEM
    if r["cfg"].get("dh_maxnreg"):
        assert r["regs"] <= r["cfg"]["dh_maxnreg"]
    if index in SPILL_FREE:  # (a tile kept alive through the chain's loop showed here as 312-520 bytes of spills)
        assert r["spills"] == 0, f"{r['spills']} bytes of spills"


if __name__ == "__main__":
    from dtune.measure.sm90 import NoToolchain

    try:
        print(json.dumps(compile_case(int(sys.argv[1]))))
    except NoToolchain as e:
        print(e)
        raise SystemExit(sm90_child.SKIP_CODE) from None
