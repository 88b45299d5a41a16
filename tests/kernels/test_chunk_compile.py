"""The chunk templates compile for a real GPU target (sm_90, Hopper) without a GPU.

Triton's interpreter runs the kernels' Python, not the compiler: APIs removed from compiled Triton, layouts the
backend rejects, or shared memory beyond the device only show up when compiling. Triton ships its PTX assembler,
so ``triton.compile`` for a ``GPUTarget`` runs on any machine. Pointers are declared 16-byte aligned, as Triton
specialises them at a real launch. Skipped where this Triton cannot build CUDA code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import triton
from dtune.kernels import KERNELS
from dtune.kernels.chunk import GATE_CODES
from dtune.kernels.chunk.call import tile
from dtune.kernels.chunk.intra import chunk_intra_kernel
from dtune.kernels.chunk.intra_blocks import chunk_intra_blocks_kernel
from dtune.kernels.chunk.output import chunk_output_kernel
from dtune.kernels.chunk.segments import BKJ_COMBINE, BV_COMBINE, chunk_segment_starts_kernel
from dtune.kernels.chunk.state import chunk_state_kernel

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover
    pytest.skip("this Triton has no AOT compile API", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
SKIP_CODE = 77


class _NoToolchain(RuntimeError):
    pass


H100_SMEM = 232448  # bytes of shared memory per block on sm_90


def compile_sm90(fn: Any, ptrs: dict[str, str], constexprs: dict[str, Any], num_warps: int, num_stages: int) -> Any:
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name == "scale":
            sig[name] = "fp32"
        elif name == "T":
            sig[name] = "i32"
        else:  # constexprs, and pointers the launch passes as None
            sig[name] = "constexpr"
            consts[(i,)] = constexprs.get(name)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=SM90, options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:  # no CUDA toolchain in this Triton build
        if "ptxas" in str(e).lower():
            raise _NoToolchain(f"cannot build CUDA code here: {e}") from None
        raise


def stage_kernels(gate: str, dtype: str, K: int, V: int, cfg: dict[str, Any], varlen: bool) -> list[tuple]:
    """(name, kernel, pointer args with their dtypes, constexprs, warps, stages) of every stage, as plan() launches
    (with ``SEG_CHUNKS``: the segmented state pass's three launches)."""
    G = GATE_CODES[gate]
    p = f"*{dtype}"
    f32 = "*fp32"
    prec = cfg["F32_DOT"] if dtype == "fp32" else "tf32"
    BT, BC, fuse = cfg["BT"], cfg["BC"], cfg["FUSE_OUTPUT"]
    gated = {"g": f32, "gout": f32} if G else {}
    chan = {"qg": p, "kg": p} if G == 2 else {}
    table = {"chunk_info": "*i32"} if varlen else {}
    i_BK, i_BV = tile(cfg["intra_BK"], K), tile(cfg["intra_BV"], V)
    safe = cfg.get("SAFE_DIAG", True)
    diag = {"DIAG": int(G == 2 and safe)}  # both variants: 1 = dot and flag, then the exact second pass (2)
    intra = (
        "intra",
        chunk_intra_kernel if cfg["INTRA"] == "rows" else chunk_intra_blocks_kernel,
        {"q": p, "k": p, "v": p, "beta": p, "w": p, "u": p, "aqk": p, **gated, **chan, **table}
        | ({"flags": "*i32"} if G == 2 and safe else {}),
        dict(H=2, HV=4, K=K, V=V, BT=BT, BC=BC, BK=i_BK, BV=i_BV, GATE=G, NB=BT // BC, NK=triton.cdiv(K, i_BK))
        | dict(NV=triton.cdiv(V, i_BV), VARLEN=varlen, DOT_PREC=prec)
        | diag
        | ({"SPLIT_QK": cfg["INTRA"] == "blocks_split"} if cfg["INTRA"] != "rows" else {}),
        cfg["intra_num_warps"],
        cfg["intra_num_stages"],
    )
    state_ptrs = {"q": p, "k": p, "w": p, "u": p, "aqk": p, "h0": f32, "ht": f32, "o": p, **chan}
    state_ptrs |= {"gout": f32} if G else {}
    state_ptrs |= {} if fuse else {"hbuf": p, "vnew": p}
    seg = cfg.get("SEG_CHUNKS", 0) > 0
    state_ptrs |= {"bounds": "*i32", "chunk_offsets": "*i32"} if varlen or seg else {}
    state_ptrs |= {"seg_last": "*i32"} if seg else {}
    state = (
        "state",
        chunk_state_kernel,
        state_ptrs,
        dict(
            H=2,
            HV=4,
            K=K,
            V=V,
            BT=BT,
            BK=tile(triton.next_power_of_2(K), K),
            BV=tile(cfg["h_BV"], V),
            GATE=G,
            USE_H0=True,
        )
        | dict(STORE_HT=True, VARLEN=varlen or seg, FUSE_OUTPUT=fuse, DOT_PREC=prec, TRANS=cfg["STATE_LAYOUT"] == "vk")
        | dict(SEG=2 if seg else 0),
        cfg["h_num_warps"],
        cfg["h_num_stages"],
    )
    out = [intra, state]
    if seg:  # phase 1 (the state kernel's transition mode) and phase 2 (the segments' entering states)
        trans_ptrs = {n: t for n, t in state_ptrs.items() if n not in ("q", "aqk", "h0", "ht", "o", "hbuf", "vnew")}
        consts = state[3] | dict(USE_H0=False, STORE_HT=False, FUSE_OUTPUT=False, SEG=1)
        out.append(("transitions", chunk_state_kernel, trans_ptrs | {"ext": f32}, consts, state[4], state[5]))
        BK = tile(triton.next_power_of_2(K), K)
        starts = dict(HV=4, K=K, V=V, BK=BK, BKJ=min(BKJ_COMBINE, BK), BV=tile(BV_COMBINE, V), USE_H0=True)
        out.append(
            (
                "segment-starts",
                chunk_segment_starts_kernel,
                {"ext": f32, "h0": f32, "starts": f32, "ht": f32, "seq_segments": "*i32"},
                starts | dict(STORE_HT=True, DOT_PREC=prec),
                4,
                1,
            )
        )
    if diag.get("DIAG") == 1:  # the guarded KDA diagonal's second pass (exact loop, flagged chunks only)
        out.append(("intra-exact", intra[1], intra[2], intra[3] | {"DIAG": 2}, intra[4], intra[5]))
    if not fuse:
        o_BK = tile(cfg["o_BK"], K)
        out_ptrs = {"q": p, "aqk": p, "hbuf": p, "vnew": p, "o": p, **table}
        out_ptrs |= {"gout": f32} if G else {}
        out_ptrs |= {"qg": p} if G == 2 else {}
        out.append(
            (
                "output",
                chunk_output_kernel,
                out_ptrs,
                dict(H=2, HV=4, K=K, V=V, BT=BT, BK=o_BK, BV=tile(cfg["o_BV"], V), NK=triton.cdiv(K, o_BK), GATE=G)
                | dict(VARLEN=varlen, DOT_PREC=prec),
                cfg["o_num_warps"],
                cfg["o_num_stages"],
            )
        )
    return out


CASES: list[tuple[str, str, int, dict[str, Any], bool]] = [
    ("channel", "bf16", 128, {}, False),
    ("channel", "bf16", 256, {}, True),
    ("channel", "fp32", 64, {}, False),
    ("channel", "bf16", 128, {"SAFE_DIAG": False, "FUSE_OUTPUT": True}, False),
    ("scalar", "bf16", 128, {"BT": 128, "BC": 32, "intra_num_warps": 8}, True),
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
    # "blocks" with A_qk in its own pass: KDA at BT = 64 (4 sub-chunks), the scalar gate at 2
    ("channel", "bf16", 128, {"INTRA": "blocks_split", "BT": 64, "intra_BK": 32}, True),
    ("scalar", "fp16", 64, {"INTRA": "blocks_split"}, False),
    # the sequence-parallel state pass (segments): both layouts, fused and not, K = 256
    ("scalar", "bf16", 128, {"SEG_CHUNKS": 16, "STATE_LAYOUT": "vk", "h_BV": 64, "BT": 64}, False),
    ("channel", "bf16", 128, {"SEG_CHUNKS": 8, "FUSE_OUTPUT": False}, True),
    ("none", "bf16", 256, {"SEG_CHUNKS": 32, "h_BV": 16, "h_num_warps": 8, "h_num_stages": 1}, False),
]


def compile_case(index: int) -> dict[str, int]:
    """Compile every stage of CASES[index]; shared memory per stage (bytes)."""
    gate, dtype, D, overrides, varlen = CASES[index]
    name = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}[gate]
    cfg = KERNELS[name].check_config(D, D, overrides)
    smem = {}
    for stage, fn, ptrs, consts, warps, stages in stage_kernels(gate, dtype, D, D, cfg, varlen):
        smem[stage] = int(compile_sm90(fn, ptrs, consts, warps, stages).metadata.shared)
    return smem


def case_ids() -> list[str]:
    return [
        f"{g}-{dt}-D{D}{'-varlen' if vl else ''}{''.join(f'-{k}{v}' for k, v in o.items())}"
        for g, dt, D, o, vl in CASES
    ]


@pytest.mark.parametrize("index", range(len(CASES)), ids=case_ids())
def test_stages_compile_for_sm90(index: int) -> None:
    # Compiled Triton and the interpreter do not mix in one process: compile in a child without TRITON_INTERPRET.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__, str(index)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode == SKIP_CODE:
        pytest.skip(proc.stdout.strip()[-500:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    smem = json.loads(proc.stdout.strip().splitlines()[-1])
    for stage, nbytes in smem.items():
        assert nbytes <= H100_SMEM, f"{stage}: {nbytes} bytes of shared memory"


if __name__ == "__main__":
    try:
        print(json.dumps(compile_case(int(sys.argv[1]))))
    except _NoToolchain as e:
        print(e)
        raise SystemExit(SKIP_CODE) from None
