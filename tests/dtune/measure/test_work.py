"""The FLOP/byte model against the anchors' numbers (docs/anchors/fla-0.6.0_h200.md) and the floor arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from dtune.measure import work as roofline
from dtune.shape import Gate, Shape


def prob(B: int, T: int, H: int, D: int, gate: Gate) -> Shape:
    return Shape(B=B, T=T, H=H, HV=H, K=D, V=D, N=B, gate=gate)


def test_chunk_kda_matches_anchor() -> None:
    # fla chunk_kda D=128 T=4096 (B=8, H=16) ran 1.811 ms: "~52 TFLOP/s nominal and ~445 GB/s compulsory".
    w = roofline.work("chunk_kda", prob(8, 4096, 16, 128, Gate.CHANNEL), torch.bfloat16)
    assert w.flops == 32768 * 16 * (2 * 64 * (3 * 128 + 2 * 128) + 6 * 128 * 128)
    assert w.bytes == 32768 * 16 * (2 * 4 * 128 + 2 + 4 * 128)
    assert w.tflops(1.811) == pytest.approx(52.2, abs=0.1)
    assert w.gbs(1.811) == pytest.approx(445, abs=1)


@pytest.mark.parametrize(
    "gate, g_bytes", [(Gate.NONE, 0), (Gate.SCALAR, 4), (Gate.CHANNEL, 4 * 64)], ids=["dn", "gdn", "kda"]
)
def test_gate_bytes(gate: Gate, g_bytes: int) -> None:
    w = roofline.work("chunk_x", prob(2, 128, 4, 64, gate), torch.bfloat16)
    assert w.bytes == 256 * 4 * (2 * 4 * 64 + 2 + g_bytes)


def test_grouped_value_heads_count_value_side_per_hv() -> None:
    p = Shape(B=1, T=10, H=2, HV=4, K=32, V=16, N=1, gate=Gate.NONE)
    assert roofline.io_bytes(p, torch.float32) == 10 * (2 * 2 * 32 * 4 + 2 * 4 * 16 * 4 + 4 * 4)
    assert roofline.chunk_flops(p) == 10 * 4 * (2 * 64 * (3 * 32 + 2 * 16) + 6 * 32 * 16)


def test_decode_state_traffic_matches_anchor() -> None:
    # fused_recurrent_delta_rule D=128 B=32 H=16: 0.089 ms, 752 GB/s of state (8·K·V bytes per head per step).
    p = prob(32, 1, 16, 128, Gate.NONE)
    w = roofline.work("fused_recurrent_delta_rule", p, torch.bfloat16, initial_state=True, final_state=True)
    state = 8 * 32 * 16 * 128 * 128
    assert w.bytes == state + 32 * 16 * (4 * 128 * 2 + 2)
    assert state / (0.089e-3) / 1e9 == pytest.approx(754, abs=2)
    assert w.flops == 32 * 16 * 6 * 128 * 128
    gated = roofline.recurrent_flops(prob(32, 1, 16, 128, Gate.SCALAR))
    assert gated == 32 * 16 * 7 * 128 * 128


def test_roofs_floor_bound_and_describe() -> None:
    roofs = roofline.Roofs(gbs=4000.0, tflops=700.0, source="test")
    assert roofs.ridge == pytest.approx(175.0)
    mem = roofline.Work(flops=1e9, bytes=4e9)  # 1 ms of bytes, ~0.0014 ms of FLOPs
    assert roofs.floor_ms(mem) == pytest.approx(1.0)
    assert roofs.bound(mem) == "memory"
    assert roofline.describe(3.1, mem, roofs) == "3.1× floor, memory-bound"
    comp = roofline.Work(flops=7e11, bytes=1e6)
    assert roofs.bound(comp) == "compute"
    assert roofs.floor_ms(comp) == pytest.approx(1.0)
    assert roofline.describe(2.0, comp, roofs) == "2.0× floor, compute-bound"
    assert roofline.describe(1.0, comp, None) == ""
    assert roofs.attainable_tflops(10.0) == pytest.approx(40.0)
    assert roofs.attainable_tflops(1000.0) == 700.0


def test_roofs_from_ceilings_and_profile() -> None:
    r = roofline.Roofs.from_ceilings({"copy_gbs": 4249.0, "bf16_tflops": 700.0})
    assert (r.gbs, r.tflops, r.source) == (4249.0, 700.0, "measured")
    r = roofline.Roofs.from_profile({"key": "h200", "hbm_gbs": 4800, "bf16_tflops": 989})
    assert (r.gbs, r.tflops, r.source) == (4800.0, 989.0, "profile:h200")
    assert math.isinf(roofline.Work(1.0, 0.0).intensity)


def test_backward_kernel_work_is_the_training_step() -> None:
    p = prob(8, 4096, 16, 128, Gate.CHANNEL)
    fwd = roofline.work("chunk_kda", p, torch.bfloat16, True, True)
    step = roofline.work("chunk_kda_bwd", p, torch.bfloat16, True, True)
    assert step.flops == fwd.flops + 8 * 4096 * 16 * (8 * 64 * 256 + 12 * 128 * 128)
    # read q, k, v, do (bf16), beta (bf16), g (fp32); write dq, dk, dv, dbeta, dg; read dht and write dh0 (fp32)
    per_token_head = 4 * 128 * 2 + 2 + 128 * 4 + 3 * 128 * 2 + 2 + 128 * 4
    grads = 32768 * 16 * per_token_head + 2 * 8 * 16 * 128 * 128 * 4
    assert roofline.grad_bytes(p, torch.bfloat16, True, True) == grads
    assert step.bytes == fwd.bytes + grads


def test_backward_stage_floors_follow_the_pipeline() -> None:
    from dtune.kernels import chunk
    from dtune.kernels.chunk import backward as chunk_bwd
    from dtune.kernels.chunk import bwd_dqk, bwd_dv, bwd_finish, bwd_state

    p = prob(8, 4096, 16, 128, Gate.CHANNEL)
    fwd = chunk.default_config(128, 128, "channel")

    def stages(**over: object) -> list[roofline.StageWork]:
        return roofline.backward_stages(p, torch.bfloat16, fwd, chunk_bwd.check_config(128, 128, "channel", over))

    default = stages()
    names = [s.kernel for s in default]
    assert names == [
        "chunk_intra_blocks_kernel", "chunk_state_kernel", "chunk_state_kernel", "chunk_bwd_state_kernel",
        "chunk_bwd_dqk_kernel", "chunk_bwd_finish_kernel",
    ]  # fmt: skip
    launched = {k.fn.__name__ for k in (bwd_dqk.chunk_bwd_dqk_kernel, bwd_dv.chunk_bwd_dv_kernel)}
    launched |= {bwd_finish.chunk_bwd_finish_kernel.fn.__name__, bwd_state.chunk_bwd_state_kernel.fn.__name__}
    assert {n for n in names if "bwd" in n} <= launched  # the names a profiler reports
    total = sum(s.work.bytes for s in default)
    unfused = stages(FUSE_DV=False)
    assert "chunk_bwd_dv_kernel" in [s.kernel for s in unfused] and sum(s.work.bytes for s in unfused) > total
    saved = stages(SAVE="all")  # no re-run: the fused forward pass stores the chunk states and V_new too
    assert [s.kernel for s in saved].count("chunk_state_kernel") == 1
    assert "chunk_output_kernel" not in {s.kernel for s in saved}
    unfused_fwd = roofline.backward_stages(
        p, torch.bfloat16, {**fwd, "FUSE_OUTPUT": False}, chunk_bwd.check_config(128, 128, "channel", {"SAVE": "all"})
    )
    assert "chunk_output_kernel" in {s.kernel for s in unfused_fwd}
    assert sum(s.work.bytes for s in stages(BT=64)) < total  # half the chunk states
    # fh_INTRA = "onepass": stage 1's floor goes to the kernel that launches it, the same work as the blocks kernel's
    from dtune.kernels.chunk import intra_kda

    one = stages(fh_INTRA="onepass", SAVE="none")
    assert [s.kernel for s in one].count(intra_kda.chunk_intra_onepass_kernel.fn.__name__) == 2  # the forward, re-run
    assert "chunk_intra_blocks_kernel" not in {s.kernel for s in one}
    assert sum(s.work.bytes for s in one) == sum(s.work.bytes for s in stages(SAVE="none"))

    def dqk(**over: object) -> roofline.Work:
        return next(s.work for s in stages(**over) if s.kernel == "chunk_bwd_dqk_kernel")

    # dqk_KLOOP: the value side (3 [C, C] x [C, V] products per token, KDA's dA copy) once per chunk, not per key tile
    tiles, loop = dqk(dqk_BK=32), dqk(dqk_BK=32, dqk_KLOOP=True)
    ta, C = 8 * 4096 * 16, 32
    assert tiles.flops - loop.flops == ta * 2 * 3 * 3 * C * 128
    assert tiles.bytes - loop.bytes == 3 * 2 * ta * C * 2 - ta * 128 * 2  # three dA copies fewer, dVβ stored
    assert dqk(dqk_BK=128, dqk_KLOOP=True) == dqk(dqk_BK=128)  # one key tile: nothing to loop over
    whole = roofline.work("chunk_kda_bwd", p, torch.bfloat16, True, True)
    assert total > whole.bytes  # the pipeline's intermediates on top of the compulsory bytes


def test_stage_one_storing_less_moves_fewer_bytes() -> None:
    """fh_U, fh_W, fh_AQK (DeltaNet, Gated DeltaNet): each intermediate stage 1 does not store is one [tokens, HV, ·]
    write less in stage 1 and one read less where it was read (the state pass, the reverse pass)."""
    from dtune.kernels import chunk
    from dtune.kernels.chunk import backward as chunk_bwd

    p = prob(8, 4096, 16, 128, Gate.SCALAR)
    fwd = chunk.default_config(128, 128, "scalar")
    base = {"BT": 64, "BC": 16, "SAVE": "all", "REVERSE_DV": True}

    def by_name(**over: object) -> dict[str, roofline.Work]:
        cfg = chunk_bwd.check_config(128, 128, "scalar", {**base, **over})
        return {s.name: s.work for s in roofline.backward_stages(p, torch.bfloat16, fwd, cfg)}

    ta, e, C, K = 8 * 4096 * 16, 2, 64, 128
    no_u = by_name(fh_U="recomputed")
    no_w = by_name(fh_U="recomputed", fh_W="recomputed")
    t_only = by_name(fh_U="recomputed", fh_W="recomputed", fh_AQK="recomputed")
    intra = "fwd intra (W, U, A_qk, T)"
    rev = "bwd reverse state pass"
    assert no_u[intra].bytes - no_w[intra].bytes == ta * K * e  # W not written ...
    assert no_u[rev].bytes - no_w[rev].bytes == ta * K * e  # ... nor read
    assert no_w[intra].bytes - t_only[intra].bytes == ta * C * e  # A_qk not written ...
    assert no_w[rev].bytes - t_only[rev].bytes == ta * C * e  # ... nor read by the reverse pass
    assert t_only[rev].flops - no_w[rev].flops == ta * 2 * C * K  # ... formed there instead


def test_dq_dk_in_the_reverse_pass_moves_fewer_bytes() -> None:
    """REVERSE_DQK: no dq/dk or finish stage; the step moves at least the adjoints' round trip (X stored, then read)
    and the dq/dk stage's re-reads of dO, V_new and dVβ less, and does the same FLOPs."""
    from dtune.kernels import chunk
    from dtune.kernels.chunk import backward as chunk_bwd

    p = prob(8, 4096, 16, 128, Gate.SCALAR)
    fwd = chunk.default_config(128, 128, "scalar")
    base = {"BT": 64, "BC": 16, "SAVE": "all", "REVERSE_DV": True, "dqk_BK": 128, "dh_BV": 128}

    def stages(**over: object) -> dict[str, roofline.Work]:
        cfg = chunk_bwd.check_config(128, 128, "scalar", {**base, **over})
        return {s.name: s.work for s in roofline.backward_stages(p, torch.bfloat16, fwd, cfg)}

    staged, fused = stages(), stages(REVERSE_DQK=True)
    assert "bwd dq/dk (dVβ given)" in staged and "bwd finish (dβ)" in staged
    assert [n for n in fused if n not in staged] == ["bwd reverse state pass + dq/dk"]
    assert not {"bwd dq/dk (dVβ given)", "bwd finish (dβ)", "bwd reverse state pass"} & set(fused)
    ta, e, S = 8 * 4096 * 16, 2, 8 * 64 * 16 * 128 * 128 * 2
    saved = sum(w.bytes for w in staged.values()) - sum(w.bytes for w in fused.values())
    assert saved >= 2 * S + 3 * ta * 128 * e
    assert sum(w.flops for w in fused.values()) == sum(w.flops for w in staged.values())


def test_grouped_value_heads_add_one_group_sum_launch() -> None:
    """HV = G·H: one more launch, the group sum, reading dq and dk per value head in float32 once and writing them per
    key head in the inputs' dtype (with REVERSE_DQK too); none where HV = H."""
    from dtune.kernels import chunk
    from dtune.kernels.chunk import backward as chunk_bwd

    fwd = chunk.default_config(128, 128, "scalar")
    cfg = chunk_bwd.check_config(128, 128, "scalar", {"BT": 64, "BC": 16, "SAVE": "all", "REVERSE_DV": True})
    grouped = Shape(1, 8192, 16, 32, 128, 128, 1, Gate.SCALAR)
    name = "bwd group sum (dq, dk)"
    for c in (cfg, {**cfg, "REVERSE_DQK": True, "dh_BV": 128}):
        stages = {s.name: s for s in roofline.backward_stages(grouped, torch.bfloat16, fwd, c)}
        assert stages[name].kernel == "chunk_bwd_group_sum_kernel"
        assert stages[name].work.bytes == 2 * 8192 * 128 * (32 * 4 + 16 * 2) and stages[name].work.flops == 0
    plain = roofline.backward_stages(prob(1, 8192, 16, 128, Gate.SCALAR), torch.bfloat16, fwd, cfg)
    assert name not in {s.name for s in plain}
    # dqk_GROUP = "input": the partials in bf16, half their bytes written by the dq/dk stage and read by the group sum
    f32 = {s.name: s.work.bytes for s in roofline.backward_stages(grouped, torch.bfloat16, fwd, cfg)}
    bf16 = {
        s.name: s.work.bytes
        for s in roofline.backward_stages(grouped, torch.bfloat16, fwd, {**cfg, "dqk_GROUP": "input"})
    }
    half = 2 * 8192 * 32 * 128 * 2  # dq and dk, [tokens, HV, K], 2 bytes less each element
    assert f32[name] - bf16[name] == half and f32["bwd dq/dk (dVβ given)"] - bf16["bwd dq/dk (dVβ given)"] == half
