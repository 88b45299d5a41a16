"""The chunk templates compile for a real GPU target (sm_90, Hopper) without a GPU.

Triton's interpreter runs the kernels' Python, not the compiler: APIs removed from compiled Triton, layouts the
backend rejects, or shared memory beyond the device only show up when compiling. Triton ships its PTX assembler,
so ``triton.compile`` for a ``GPUTarget`` runs on any machine. Pointers are declared 16-byte aligned, as Triton
specialises them at a real launch. Skipped where this Triton cannot build CUDA code.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from dtune.kernels import KERNELS

from tests.kernels import sm90_child

try:
    from dtune.measure.sm90 import H100_SMEM, NoToolchain, compile_sm90, ptxas_usage, stage_kernels
except ImportError:  # pragma: no cover
    pytest.skip("this Triton has no AOT compile API", allow_module_level=True)


STATES = {"STATE_LAYOUT": "vk", "h_BV": 64, "FUSE_OUTPUT": False, "STATES_TMA": True}
CASES: list[tuple[str, str, int, dict[str, Any], bool]] = [
    ("channel", "bf16", 128, {}, False),
    ("channel", "bf16", 256, {}, True),
    ("channel", "fp32", 64, {}, False),
    ("channel", "bf16", 128, {"SAFE_DIAG": False, "FUSE_OUTPUT": True}, False),
    ("scalar", "bf16", 128, {"BT": 128, "BC": 32, "intra_num_warps": 4}, True),
    ("scalar", "fp16", 64, {"FUSE_OUTPUT": True}, False),
    ("none", "bf16", 256, {}, False),
    ("channel", "bf16", 96, {"FUSE_OUTPUT": True}, True),
    ("none", "fp32", 128, {"BT": 32, "F32_DOT": "tf32"}, True),
    ("channel", "bf16", 128, {"INTRA": "rows"}, False),
    ("channel", "bf16", 64, {"INTRA": "rows", "BT": 128, "BC": 16}, True),
    ("scalar", "bf16", 128, {"INTRA": "rows", "BT": 32}, False),
    ("none", "fp16", 64, {"INTRA": "rows", "BC": 32}, True),
    # the transposed state pass: wgmma-sized (h_BV = 64 at 4 warps), K = 256 at 8 warps, unfused, float32
    ("scalar", "bf16", 128, {"STATE_LAYOUT": "vk", "h_BV": 64}, False),
    ("channel", "bf16", 128, {"STATE_LAYOUT": "vk", "h_BV": 64}, True),
    ("none", "bf16", 256, {"STATE_LAYOUT": "vk", "h_BV": 64, "h_num_warps": 8, "h_num_stages": 1}, False),
    ("channel", "fp32", 64, {"STATE_LAYOUT": "vk", "FUSE_OUTPUT": False}, True),
    # the unfused pass's chunk states and V_new stored through TMA descriptors (STATES_TMA): transposed at h_BV 64 with
    # the loads by TMA (the training forward's shape), and with pointer loads, varlen
    ("scalar", "bf16", 128, {**STATES, "STATE_TMA": True, "WU": "recomputed"}, False),
    ("none", "bf16", 128, {**STATES, "h_BV": 32}, True),
    # "blocks" with A_qk in its own pass: KDA at BT = 64 (4 sub-chunks), the scalar gate at 2
    ("channel", "bf16", 128, {"INTRA": "blocks_split", "BT": 64, "intra_BK": 32}, True),
    ("scalar", "fp16", 64, {"INTRA": "blocks_split"}, False),
    # the sequence-parallel state pass (segments): both layouts, fused and not, K = 256
    ("scalar", "bf16", 128, {"SEG_CHUNKS": 16, "STATE_LAYOUT": "vk", "h_BV": 64, "BT": 64}, False),
    ("channel", "bf16", 128, {"SEG_CHUNKS": 8, "FUSE_OUTPUT": False}, True),
    ("none", "bf16", 256, {"SEG_CHUNKS": 32, "h_BV": 16, "h_num_warps": 8, "h_num_stages": 1}, False),
    # phase 2 variants: the state in registers at seg_BV = 64 (8 warps), and key tiles through memory
    ("none", "bf16", 128, {"SEG_CHUNKS": 64, "seg_BV": 64}, False),
    ("channel", "fp32", 64, {"SEG_CHUNKS": 4, "SEG_COMBINE": "tiles", "seg_BV": 16}, True),
    # KDA's one-pass stage 1 (and the exact pass it hands flagged chunks to), the squaring inverse
    ("channel", "bf16", 128, {"INTRA": "onepass", "SOLVE": "squaring", "DIAG_BF16": True}, False),
    ("channel", "bf16", 128, {"INTRA": "onepass", "BT": 64, "BC": 32, "intra_BK": 32}, True),
    ("channel", "fp32", 64, {"INTRA": "onepass", "BT": 16, "SAFE_DIAG": False}, False),
    ("none", "bf16", 128, {"SOLVE": "squaring"}, True),
    ("scalar", "bf16", 128, {"SOLVE": "squaring", "BT": 64, "INTRA": "blocks_split"}, False),
    # phase 1 at a tile of its own (8 warps), q and k straight to the dots (fused and not)
    ("scalar", "bf16", 128, {"SEG_CHUNKS": 64, "STATE_LAYOUT": "vk", "tr_BV": 128, "tr_num_warps": 8}, False),
    ("scalar", "bf16", 128, {"SEG_CHUNKS": 64, "STATE_LAYOUT": "vk", "h_BV": 64, "QK_DIRECT": True}, False),
    ("none", "bf16", 128, {"QK_DIRECT": True, "FUSE_OUTPUT": False}, True),
    # V_new from stage 1's inverse T in the state pass (WU), A_qk too (AQK): pointer and TMA tiles, the
    # warp-specialised loop, BT = 64, 8 warps, the segmented pass, K not a power of two (TMA falls back), float32
    ("scalar", "bf16", 128, {"WU": "recomputed", "STATE_LAYOUT": "vk", "h_BV": 64, "h_num_stages": 3}, False),
    ("scalar", "bf16", 128, {"WU": "recomputed", "STATE_LAYOUT": "vk", "h_BV": 64, "STATE_TMA": True}, True),
    (
        "scalar",
        "bf16",
        128,
        {"WU": "recomputed", "STATE_LAYOUT": "vk", "h_BV": 64, "STATE_TMA": True, "STATE_LOOP": "specialized"},
        True,
    ),
    (
        "none",
        "bf16",
        128,
        {
            "WU": "recomputed",
            "AQK": "recomputed",
            "STATE_LAYOUT": "vk",
            "h_BV": 64,
            "h_num_warps": 8,
            "STATE_TMA": True,
        },
        False,
    ),
    (
        "scalar",
        "bf16",
        128,
        {
            "WU": "recomputed",
            "BT": 64,
            "STATE_LAYOUT": "vk",
            "h_BV": 64,
            "STATE_TMA": True,
            "SOLVE": "squaring",
            "intra_num_warps": 4,
        },
        True,
    ),
    (
        "scalar",
        "bf16",
        128,
        {
            "SEG_CHUNKS": 64,
            "WU": "recomputed",
            "STATE_LAYOUT": "vk",
            "h_BV": 64,
            "STATE_TMA": True,
            "STATE_LOOP": "specialized",
        },
        False,
    ),
    ("none", "bf16", 128, {"AQK": "recomputed", "h_BV": 64, "STATE_TMA": True, "STATE_LOOP": "specialized"}, True),
    ("scalar", "bf16", 96, {"WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True}, False),
    ("scalar", "fp32", 64, {"WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True, "F32_DOT": "tf32"}, True),
    # W, U stored: TMA tiles (KDA: q~, k~ too) and the warp-specialised loop
    (
        "channel",
        "bf16",
        128,
        {"INTRA": "onepass", "STATE_LAYOUT": "vk", "h_BV": 64, "STATE_TMA": True, "STATE_LOOP": "specialized"},
        True,
    ),
    ("none", "bf16", 128, {"STATE_LAYOUT": "vk", "h_BV": 64, "h_num_stages": 3, "STATE_TMA": True}, False),
    # the scalar gate's rows loaded a chunk ahead (GATE_LOADS): TMA tiles with V_new recomputed, the segmented pass
    (
        "scalar",
        "bf16",
        128,
        {
            "WU": "recomputed",
            "STATE_LAYOUT": "vk",
            "h_BV": 64,
            "h_num_stages": 3,
            "STATE_TMA": True,
            "GATE_LOADS": "prefetched",
        },
        True,
    ),
    ("scalar", "bf16", 128, {"SEG_CHUNKS": 64, "STATE_LAYOUT": "vk", "h_BV": 64, "GATE_LOADS": "prefetched"}, False),
    # stage 1 activating fla's raw gate (use_gate_in_kernel): KDA's three variants and the scalar gate's, softplus
    # with A_log and dt_bias (13), the bounded form without A_log (6) and with both (14)
    ("channel", "bf16", 128, {"GACT": 13}, False),
    ("channel", "bf16", 128, {"GACT": 6, "INTRA": "rows"}, True),
    ("channel", "bf16", 128, {"GACT": 14, "INTRA": "onepass", "SOLVE": "squaring", "DIAG_BF16": True}, False),
    (
        "scalar",
        "bf16",
        128,
        {"GACT": 13, "WU": "recomputed", "STATE_LAYOUT": "vk", "h_BV": 64, "QK_DIRECT": True},
        True,
    ),
    # the stages normalising q and k and activating beta (use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel)
    (
        "scalar",
        "bf16",
        128,
        {"L2NORM": True, "BETA_ACT": 1, "GACT": 13, "WU": "recomputed", "AQK": "recomputed", "STATE_TMA": True},
        True,
    ),
    ("none", "bf16", 128, {"L2NORM": True, "BETA_ACT": 2, "FUSE_OUTPUT": False, "INTRA": "rows"}, False),
    ("channel", "bf16", 128, {"L2NORM": True, "BETA_ACT": 1, "GACT": 13, "INTRA": "onepass"}, False),
    # register caps (intra_maxnreg, h_maxnreg): ptxas keeps every capped stage within its cap
    (
        "scalar",
        "bf16",
        128,
        {"intra_maxnreg": 128, "h_maxnreg": 168, "WU": "recomputed", "STATE_TMA": True, "SEG_CHUNKS": 8},
        False,
    ),
    ("channel", "bf16", 128, {"intra_maxnreg": 96, "h_maxnreg": 128, "INTRA": "onepass"}, True),
]


def compile_case(index: int) -> dict[str, Any]:
    """Compile every stage of CASES[index]; shared memory per stage (bytes), and for a stage under a register cap
    (``intra_maxnreg``, ``h_maxnreg``) ``[cap, registers ptxas gave it]`` under ``"<stage> registers"``."""
    gate, dtype, D, overrides, varlen = CASES[index]
    name = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}[gate]
    overrides = dict(overrides)
    # not config parameters: the call's in-kernel options
    gate_act, beta_act = int(overrides.pop("GACT", 0)), int(overrides.pop("BETA_ACT", 0))
    l2norm = bool(overrides.pop("L2NORM", False))
    cfg = KERNELS[name].check_config(D, D, overrides)
    smem: dict[str, Any] = {}
    caps = {"intra": cfg["intra_maxnreg"], "intra-exact": cfg["intra_maxnreg"]}
    caps |= {"state": cfg["h_maxnreg"], "transitions": cfg["h_maxnreg"]}
    kernels = stage_kernels(gate, dtype, D, D, cfg, varlen, gate_act, l2norm, beta_act)
    for stage, fn, ptrs, consts, warps, stages in kernels:
        compiled = compile_sm90(fn, ptrs, consts, warps, stages, caps.get(stage) or None)
        smem[stage] = int(compiled.metadata.shared)
        if caps.get(stage):
            smem[f"{stage} registers"] = [caps[stage], ptxas_usage(compiled.asm["ptx"])[0]]
    return smem


def case_ids() -> list[str]:
    return [
        f"{g}-{dt}-D{D}{'-varlen' if vl else ''}{''.join(f'-{k}{v}' for k, v in o.items())}"
        for g, dt, D, o, vl in CASES
    ]


@pytest.mark.parametrize("index", range(len(CASES)), ids=case_ids())
def test_stages_compile_for_sm90(index: int) -> None:
    # Compiled Triton and the interpreter do not mix in one process: compile in a child without TRITON_INTERPRET.
    smem = sm90_child.run(__file__, str(index))
    for stage, nbytes in smem.items():
        if stage.endswith(" registers"):
            cap, regs = nbytes
            assert regs <= cap, f"{stage}: {regs} under a cap of {cap}"
        else:
            assert nbytes <= H100_SMEM, f"{stage}: {nbytes} bytes of shared memory"


if __name__ == "__main__":
    try:
        print(json.dumps(compile_case(int(sys.argv[1]))))
    except NoToolchain as e:
        print(e)
        raise SystemExit(sm90_child.SKIP_CODE) from None
