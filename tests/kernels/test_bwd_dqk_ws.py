"""The Gluon dq/dk stage (``dqk_LOOP = "gluon"``, kernels/chunk/bwd_dqk_ws.py) without a GPU: which calls it serves and
why not the others, that the Triton stage runs those (the interpreter's included: Gluon has none), that the backward
hands it what the Triton stage would read and fill, and that it compiles for sm_90a as warp-specialised wgmma code.
Its numbers on a GPU: tests/kernels/test_chunk_bwd_gpu.py (``-k gluon_dqk``)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
import torch
from dtune.kernels.chunk import bwd_dqk_ws
from dtune.kernels.chunk.backward import check_config

from dtune.measure.grad import op_step, with_output_grads
from dtune.measure.inputs import make_inputs
from dtune.shape import Gate, Shape
from tests.conftest import rel_err
from tests.kernels import sm90_child

HOPPER = (9, 0)
OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule"}
GLUON = {"BT": 64, "REVERSE_DV": True, "dqk_LOOP": "gluon", "dqk_BK": 128, "dqk_BV": 64, "SAVE": "all"}


def _why(capability: Any = HOPPER, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> str | None:
    """why_not for a Gated DeltaNet call at K = V = 128, chunks of 64, with ``kw`` over it."""
    args: dict[str, Any] = dict(
        device=torch.device("cpu"), gate=1, dtype=dtype, inputs=(torch.zeros(64, 8, dtype=dtype),), K=128, V=128,
        BT=64, BK=128, BV=64, config=dict(GLUON), fused=True, dvb_given=True, kloop=False, capability=capability,
    )  # fmt: skip
    config = kw.pop("config", {})
    args.update(kw)
    args["config"] = {**args["config"], **config}
    return bwd_dqk_ws.why_not(**args)


def test_serves_deltanet_and_gated_deltanet_on_sm90() -> None:
    assert _why() is None
    assert _why(gate=0) is None
    assert _why(BV=128, config={"dqk_num_stages": 1}) is None
    assert _why(dtype=torch.float16, K=64, BK=64) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"capability": None}, "not an sm_90 GPU"),  # the CPU (and the interpreter)
        ({"capability": (8, 0)}, "not an sm_90 GPU"),
        ({"capability": (10, 0)}, "not an sm_90 GPU"),
        ({"gate": 2}, "KDA"),
        ({"dtype": torch.float32}, "bf16"),
        ({"inputs": (torch.zeros(64, 8, dtype=torch.float32),)}, "bf16"),
        ({"fused": False}, "FUSE_DV"),
        ({"dvb_given": False}, "REVERSE_DV"),
        ({"kloop": True}, "KLOOP"),
        ({"BT": 32}, "BT not 64"),
        ({"K": 96, "BK": 96}, "K not 64 or 128"),
        ({"BK": 64}, "dqk_BK not K"),
        ({"BV": 32}, "dqk_BV"),
        ({"V": 96}, "dqk_BV"),
        ({"inputs": (torch.zeros(0, 8, dtype=torch.bfloat16),)}, "no tokens"),
        ({"inputs": (torch.zeros(64, 8, dtype=torch.bfloat16)[:, 1:],)}, "16-byte"),
        ({"config": {"dqk_num_stages": 0}}, "dqk_num_stages"),
        ({"BV": 128, "config": {"dqk_num_stages": 2}}, "shared memory"),
    ],
)
def test_refuses_what_it_cannot_compute(kwargs: dict[str, Any], reason: str) -> None:
    why = _why(**kwargs)
    assert why is not None and reason in why, why


def test_is_a_legal_dqk_loop_of_deltanet_and_gated_deltanet_only() -> None:
    for gate in ("none", "scalar"):
        assert check_config(128, 128, gate, {"dqk_LOOP": "gluon"})["dqk_LOOP"] == "gluon"
        assert check_config(128, 128, gate, {})["dqk_LOOP"] == "range"
    with pytest.raises(ValueError, match="dqk_LOOP"):
        check_config(128, 128, "channel", {"dqk_LOOP": "gluon"})


@pytest.mark.parametrize("gate", list(OPS), ids=[g.value for g in OPS])
def test_the_training_step_runs_the_triton_stage_where_gluon_cannot(
    gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the interpreter a training step asking for the Gluon dq/dk stage gets the Triton one's gradients, exactly,
    without touching the Gluon launcher."""

    def boom(**kw: Any) -> Any:
        raise AssertionError("the Gluon dq/dk stage was launched off sm_90")

    monkeypatch.setattr(bwd_dqk_ws, "launch_dqk_ws", boom)
    x = make_inputs(Shape(2, 45, 2, 4, 32, 32, 2, gate), torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {**GLUON, "BT": 32, "BC": 16, "dqk_BK": 32, "dqk_BV": 16}
    got = op_step(OPS[gate], x, bwd, None)()
    want = op_step(OPS[gate], x, {**bwd, "dqk_LOOP": "range"}, None)()
    assert rel_err(got.o, want.o) == 0
    for name, grad in got.grads.items():
        assert (grad is None) == (want.grads[name] is None), name
        if grad is not None:
            assert rel_err(grad, want.grads[name]) == 0, name


@pytest.mark.parametrize("gate", list(OPS), ids=[g.value for g in OPS])
def test_the_backward_dispatches_to_gluon_where_it_serves(gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where why_not says yes (here: pretended), the backward hands its dq/dk stage to the Gluon launcher with the
    buffers the Triton stage would read and fill: dβ's k part in the slot after the value tiles', Gated DeltaNet's dγ
    partials (none for DeltaNet), the chunks and value heads to walk."""

    class Launched(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake(**kw: Any) -> None:
        seen.update(kw)
        raise Launched

    monkeypatch.setattr(bwd_dqk_ws, "why_not", lambda **_: None)
    monkeypatch.setattr(bwd_dqk_ws, "launch_dqk_ws", fake)
    x = make_inputs(Shape(2, 45, 2, 4, 32, 32, 2, gate), torch.float32, "cpu", seed=5, gate_min=-5.0)
    x = with_output_grads({**x, "scale": 32**-0.5, "output_final_state": True})
    bwd = {**GLUON, "BT": 32, "BC": 16, "dqk_BK": 32, "dqk_BV": 16, "dh_BV": 16}
    with pytest.raises(Launched):
        op_step(OPS[gate], x, bwd, None)()
    assert seen["GATE"] == (1 if gate is Gate.SCALAR else 0) and seen["BV"] == 16 and seen["HV"] == 4
    assert seen["slot"] == 2  # (two value tiles of 16: their v-part slots first)
    assert seen["NC"] == 2 * 2 and seen["varlen"] is False  # (two sequences of two chunks of 32)
    assert (seen["dg"] is None) == (gate is Gate.NONE)
    assert seen["dvb"] is not None and seen["hbuf"] is not None and seen["dh"] is not None


# compiled for sm_90a in a child process without TRITON_INTERPRET (compiled Triton and the interpreter do not mix)
COMPILE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("scalar", {}),
    ("none", {}),
    ("scalar", {"dqk_num_stages": 1}),
    ("none", {"dqk_BV": 128, "dqk_num_stages": 1}),
]


def compile_case(index: int) -> dict[str, Any]:
    from dtune.measure.sm90 import compile_dqk_ws, ptxas_usage

    gate, extra = COMPILE_CASES[index]
    cfg = {**GLUON, **extra}
    compiled = compile_dqk_ws(gate, "bf16", 128, 128, cfg)
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    patterns = ("wgmma.mma_async", "setmaxnreg", "cp.async.bulk.tensor")
    count = {p: len(re.findall(p, ptx)) for p in patterns}
    return {"shared": int(compiled.metadata.shared), "regs": regs, "spills": spills, "count": count, "cfg": cfg}


@pytest.mark.parametrize("index", range(len(COMPILE_CASES)), ids=[f"{g}-{sorted(e.items())}" for g, e in COMPILE_CASES])
def test_compiles_for_sm90a_as_warp_specialised_wgmma(index: int) -> None:
    from dtune.measure.sm90 import H100_SMEM

    r = sm90_child.run(__file__, str(index))
    K, BT, BV = 128, 64, r["cfg"]["dqk_BV"]
    # per value tile five products over its BV channels (dq̃, dk̃, dKβ, both dA), then k kᵀ over K and the four
    # pairwise products over BT, 16 per instruction
    assert r["count"]["wgmma.mma_async"] == (K // BV) * 5 * BV // 16 + K // 16 + 4 * BT // 16
    assert r["count"]["setmaxnreg"] > 0, "no register split between the partitions: not warp-specialised"
    assert r["count"]["cp.async.bulk.tensor"] >= 7, "the tiles are not TMA loads"
    assert r["shared"] <= H100_SMEM


if __name__ == "__main__":
    from dtune.measure.sm90 import NoToolchain

    try:
        print(json.dumps(compile_case(int(sys.argv[1]))))
    except NoToolchain as e:
        print(e)
        raise SystemExit(sm90_child.SKIP_CODE) from None
