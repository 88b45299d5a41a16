"""The chunk backward's kernels compile for a real GPU target (sm_90, Hopper) without a GPU, within its shared memory.

Same approach as test_chunk_compile.py (``triton.compile`` for a ``GPUTarget``, in a child process without
``TRITON_INTERPRET``). Run as a script, it prints registers and spills per stage (ptxas -v for sm_90a):
``python tests/kernels/test_chunk_bwd_compile.py --stats [GATE DTYPE D CONFIG_JSON]``. KDA's dq/dk stage with its key
tiles in one loop (``dqk_KLOOP``) is checked for spills too: its register budget is the tight one.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: this checkout's dtune, not an installed one
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import triton  # noqa: E402
from dtune.kernels.chunk import backward as chunk_bwd  # noqa: E402
from dtune.kernels.chunk.bwd_dqk import chunk_bwd_dqk_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_dv import chunk_bwd_dv_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_finish import chunk_bwd_finish_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_group import ROWS as GROUP_ROWS  # noqa: E402
from dtune.kernels.chunk.bwd_group import WARPS as GROUP_WARPS  # noqa: E402
from dtune.kernels.chunk.bwd_group import chunk_bwd_group_sum_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_reverse_dqk import chunk_bwd_reverse_dqk_tiled_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_segments import chunk_bwd_segment_ends_kernel  # noqa: E402
from dtune.kernels.chunk.bwd_state import ENDS_LAUNCH, ENDS_MAX_BV, chunk_bwd_state_kernel  # noqa: E402
from dtune.kernels.chunk.call import tile as _tile  # noqa: E402
from dtune.kernels.chunk.state import chunk_state_kernel  # noqa: E402
from dtune.kernels.config import GATE_CODES, next_power_of_2  # noqa: E402
from dtune.kernels.reference_bwd import GATE_FLOOR  # noqa: E402

from tests.kernels import sm90_child  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover
    pytest.skip("this Triton has no AOT compile API", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
SKIP_CODE = sm90_child.SKIP_CODE
H100_SMEM = 232448


def compile_sm90(fn: Any, args: dict[str, Any], num_warps: int, num_stages: int, maxnreg: int = 0) -> Any:
    """``args``: a type string for runtime arguments ("*bf16", "i32", "fp32"), else the constexpr value (not named:
    the argument's declared default, as a launch that omits it; None without one); ``maxnreg``: a register cap
    (0: none)."""
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        default = fn.params[i].default
        value = args.get(name, None if default is inspect.Parameter.empty else default)
        if isinstance(value, str) and (value.startswith(("*", "tensordesc")) or value in ("i32", "fp32")):
            sig[name] = value
        else:
            sig[name] = "constexpr"
            consts[(i,)] = value
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in args.items() if str(t).startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    try:
        options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
        return triton.compile(src, target=SM90, options=options)
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            print(f"cannot build CUDA code here: {e}")
            raise SystemExit(SKIP_CODE) from None
        raise


def bwd_stages(gate: str, dtype: str, K: int, V: int, cfg: dict[str, Any], varlen: bool) -> list[tuple]:
    """(name, kernel, args, warps, stages) of every backward stage, as backward() launches them (H = 2, HV = 4)."""
    G = GATE_CODES[gate]
    p, f32 = f"*{dtype}", "*fp32"
    prec = cfg["F32_DOT"] if dtype == "fp32" else "tf32"
    BT, BC = cfg["BT"], cfg["BC"]
    common = dict(H=2, HV=4, K=K, V=V, BT=BT, VARLEN=varlen, DOT_PREC=prec, T="i32", scale="fp32")
    table = {"chunk_info": "*i32"} if varlen else {}
    gated = {"g": f32} if G else {}
    NK = triton.cdiv(K, _tile(cfg["dqk_BK"], K))
    state = dict(common, q=p, k=p, w=p, aqk=p, do=p, dht=f32, dh0=f32, dh=p, dvn=p)
    state |= {"qg": p, "kg": p} if G == 2 else {}
    state |= {"gout": f32} if G else {}
    state |= {"cu_seqlens": "*i32", "chunk_offsets": "*i32"} if varlen else {}
    rev_dqk = bool(cfg.get("REVERSE_DQK")) and cfg["REVERSE_DV"] and cfg["FUSE_DV"]
    dh_BV = _tile(cfg["dh_BV"], V)
    tiled = rev_dqk and dh_BV < triton.next_power_of_2(V)  # (by value tiles, the adjoint in a scratch)
    dh_BV = _tile(triton.next_power_of_2(V), V) if rev_dqk and not tiled else dh_BV
    state |= dict(BK=_tile(triton.next_power_of_2(K), K), BV=dh_BV, GATE=G, USE_DHT=True)
    state |= dict(STORE_DH0=True, TRANS=cfg["dh_LAYOUT"] == "vk")
    rev_dv = cfg["REVERSE_DV"] and cfg["FUSE_DV"]
    if rev_dv:  # dVβ, dv and dβ's v part in the reverse pass
        state |= dict(DV=True, ai=p, v=p, beta=p, dv=p, dbeta_part=f32, SS="i32")
    # stage 1 storing T alone (fh_W: Wᵀ dV_new from K and dVβ) and no A_qk (fh_AQK: formed from q and k)
    w_rec, qk_rec = cfg.get("fh_W", "stored") != "stored", cfg.get("fh_AQK") == "recomputed"
    state |= dict(W_FROM_K=cfg.get("fh_W") == "recomputed", W_REBUILD=cfg.get("fh_W") == "rebuilt", QK_RE=qk_rec)
    state |= dict(X_ACC=cfg["dh_ACC"])
    if rev_dqk:  # dq, dk (per value head: float32, HV = 2H), dβ and the gate's gradient formed in the pass
        state |= dict(DQK=True, hbuf=p, vnew=p, graw=f32 if G else p, dq=f32, dk=f32, dg=f32 if G else p, dbeta=p)
        state |= {"FLOOR": GATE_FLOOR}
    if cfg.get("dh_TMA") and state["BK"] == K and V % dh_BV == 0:  # its tiles by TMA descriptors
        td = {"do_td": dh_BV, "q_td": K, "k_td": K} | ({} if w_rec else {"w_td": K}) | ({} if qk_rec else {"a_td": BT})
        td |= {"t_td": BT, "v_td": dh_BV} if rev_dv else {}
        state |= {n: f"tensordesc<{dtype}[{BT},{w}]>" for n, w in td.items()} | {"TMA": True}
        if rev_dqk:  # V_new and the chunk states too
            state |= {"vn_td": f"tensordesc<{dtype}[{BT},{dh_BV}]>", "h_td": f"tensordesc<{dtype}[{K},{dh_BV}]>"}
    seg = cfg["dh_SEG_CHUNKS"] > 0
    if cfg.get("dh_STORE_TMA") and state["BK"] == K and V % dh_BV == 0 and not rev_dqk:  # the adjoint's TMA store
        state |= {"xs_td": f"tensordesc<{dtype}[{K},{dh_BV}]>"}
    if seg:  # the sequence-parallel pass: phase 3 over the segment table (phase 1 and 2 below)
        state |= {"cu_seqlens": "*i32", "chunk_offsets": "*i32", "first": "*i32", "xend": f32}
        state |= dict(VARLEN=True, SEG=2, USE_DHT=False)
    dv_BV = _tile(cfg["dv_BV"], V)
    dv = dict(common, v=p, beta=p, ai=p, vnew=p, dvn=p, do=p, dv=p, dvb=p, daq=p, dak=p, dbeta_part=f32)
    dv |= table | dict(BV=dv_BV, NV=triton.cdiv(V, dv_BV))
    dqk_BV = _tile(cfg["dqk_BV"], V)
    fused = cfg["FUSE_DV"]
    dqk = dict(common, q=p, k=p, beta=p, hbuf=p, dh=p, do=p, vnew=p, dvb=p, dq=p, dk=p)
    dqk |= gated | table | {"dbeta_part": f32, "SLOT": "i32", "SS": "i32", "FLOOR": GATE_FLOOR}
    dqk |= {"ai": p, "v": p, "dv": p} if fused and not rev_dv else {}
    dqk |= {"DVB_GIVEN": rev_dv}
    dqk |= {"daq": p, "dak": p} if G == 2 or not fused else {}
    dqk |= {"dg": f32} if G else {}
    dqk |= dict(BC=cfg.get("dqk_BC", BC), BK=_tile(cfg["dqk_BK"], K), BV=dqk_BV, NV=triton.cdiv(V, dqk_BV), GATE=G)
    dqk |= dict(FUSED=fused, KLOOP=bool(cfg["dqk_KLOOP"]) and NK > 1, NK=NK, DA_DECAYED=cfg.get("dqk_DECAY") == "value")
    kloop_stores = dqk["KLOOP"] and not rev_dv
    if cfg.get("dqk_TMA") and fused and not kloop_stores and K % dqk["BK"] == 0 and V % dqk_BV == 0:
        tok, st = f"tensordesc<{dtype}[{BT},{dqk_BV}]>", f"tensordesc<{dtype}[{dqk['BK']},{dqk_BV}]>"
        dqk |= {"TMA": True, "do_td": tok, "vn_td": tok, "dvb_td": tok, "h_td": st, "x_td": st}
        dqk |= {"v_td": tok} if not rev_dv else {}
    out = [("state", chunk_bwd_state_kernel, state, cfg["dh_num_warps"], cfg["dh_num_stages"])]
    if seg:
        drop = ("dht", "dh0", "dh", "dvn", "xend", "DV", "v", "dv", "dbeta_part", "SS") + (
            () if w_rec else ("ai", "beta")
        )
        drop += ("TMA", "do_td", "q_td", "k_td", "w_td", "a_td", "t_td", "v_td")  # (phase 1 loads by pointers)
        tr = {n: t for n, t in state.items() if n not in drop} | {"ext": f32}
        out.append(("reverse-transitions", chunk_bwd_state_kernel, tr | dict(SEG=1, STORE_DH0=False), *out[0][3:]))
        ends = dict(ext=f32, dht=f32, xend=f32, dh0=f32, seq_segments="*i32", HV=4, K=K, V=V, DOT_PREC=prec)
        ends |= dict(BK=state["BK"], BV=min(dh_BV, ENDS_MAX_BV), USE_DHT=True, STORE_DH0=True)
        out.append(("segment-ends", chunk_bwd_segment_ends_kernel, ends, *ENDS_LAUNCH.values()))
    if not fused:
        out.append(("dv", chunk_bwd_dv_kernel, dv, cfg["dv_num_warps"], cfg["dv_num_stages"]))
    if rev_dqk:  # (no chunk-parallel stage)
        if tiled:  # the pass by value tiles: its own kernel (plain, or phase 3 of the segmented pass)
            tk = dict(common, q=p, k=p, w=p, aqk=p, do=p, dht=f32, dh0=f32, ai=p, v=p, beta=p, dv=p, hbuf=p, vnew=p)
            tk |= dict(graw=f32 if G else p, dq=f32, dk=f32, dg=f32 if G else p, dbeta=p, xs=f32, gout=f32)
            tk |= {"cu_seqlens": "*i32", "chunk_offsets": "*i32"} if varlen or seg else {}
            tk |= dict(BK=state["BK"], BV=dh_BV, NV=triton.cdiv(V, dh_BV), GATE=G, USE_DHT=not seg, STORE_DH0=True)
            tk |= dict(FLOOR=GATE_FLOOR, W_FROM_K=w_rec, QK_RE=qk_rec)
            tk |= {"VARLEN": True, "SEG": 2, "first": "*i32", "xend": f32} if seg else {}
            out[0] = ("state", chunk_bwd_reverse_dqk_tiled_kernel, tk, cfg["dh_num_warps"], cfg["dh_num_stages"])
        return out + _forward_stage(cfg, common, state["BK"], G, p, f32, varlen, qk_rec)
    out.append(("dqk", chunk_bwd_dqk_kernel, dqk, cfg["dqk_num_warps"], cfg["dqk_num_stages"]))
    fin = dict(HV=4, BT=BT, VARLEN=varlen, T="i32", SS="i32", dbeta_part=f32, dbeta=p, NSLOT=3, NKG=NK, GATE=G)
    fin |= table | {"FLOOR": GATE_FLOOR}
    fin |= {"g": f32, "dg_part": f32, "dg": f32} if G == 1 else {}
    out.append(("finish", chunk_bwd_finish_kernel, fin, 4, 1))
    # grouped value heads (HV = 2H here): dq, dk summed per key head
    group = dict(dq=f32, dk=f32, dq_out=p, dk_out=p, rows="i32", G=2, K=K, BK=next_power_of_2(K), BR=GROUP_ROWS)
    out.append(("group-sum", chunk_bwd_group_sum_kernel, group, GROUP_WARPS, 1))
    return out + _forward_stage(cfg, common, state["BK"], G, p, f32, varlen, qk_rec)


def _forward_stage(
    cfg: dict[str, Any], common: dict[str, Any], BK: int, G: int, p: str, f32: str, varlen: bool, qk_rec: bool
) -> list[tuple]:
    """With ``SAVE = "all"`` the forward under autograd: the fused state pass storing the chunk states too."""
    if cfg["SAVE"] != "all":
        return []
    fwd = dict(common, q=p, k=p, w=p, u=p, aqk=p, h0=f32, ht=f32, hbuf=p, vnew=p, o=p)
    fwd |= {"qg": p, "kg": p} if G == 2 else {}
    fwd |= {"gout": f32} if G else {}
    fwd |= {"bounds": "*i32", "chunk_offsets": "*i32"} if varlen else {}
    fwd |= dict(BK=BK, BV=_tile(cfg["fh_BV"] or 64, common["V"]), GATE=G, USE_H0=True, STORE_HT=True)
    fwd |= dict(FUSE_OUTPUT=True, TRANS=True, STORE_STATES=True)
    if cfg.get("fh_U") == "recomputed":  # V_new from T (and with fh_AQK, A_qk from q and k)
        fwd |= dict(RECOMPUTE=True, QK_RECOMPUTE=qk_rec, v=p, beta=p, ai=p)
    return [("fwd state+output", chunk_state_kernel, fwd, cfg["fh_num_warps"] or 4, cfg["fh_num_stages"] or 2)]


# the shipped B = 8 entries' reverse pass and dq/dk stage (DeltaNet, Gated DeltaNet)
_SHIP64 = {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "dh_num_stages": 1, "SAVE": "all"}
_SHIP64 |= {"REVERSE_DV": True, "dqk_BK": 128, "dqk_BV": 64}
CASES: list[tuple[str, str, int, dict[str, Any], bool]] = [
    ("channel", "bf16", 128, {}, False),
    ("scalar", "bf16", 128, {}, True),
    ("none", "bf16", 128, {}, False),
    ("channel", "bf16", 128, {"FUSE_DV": False}, False),
    ("channel", "bf16", 64, {"BT": 32, "BC": 32}, True),
    ("channel", "bf16", 128, {"BT": 64, "dqk_BK": 16}, False),  # four pairwise blocks (_block's 4-way split)
    ("scalar", "fp32", 64, {"BT": 32, "FUSE_DV": False}, False),
    ("none", "bf16", 256, {}, True),
    # the searches' first seeds at D = 128 (B = 8, T = 4096; B = 1, T = 32768: segmented reverse pass)
    ("none", "bf16", 128, {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 64, "dh_num_stages": 1}, False),
    ("scalar", "bf16", 128, {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "SAVE": "all"}, False),
    ("none", "bf16", 128, {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "REVERSE_DV": True}, False),
    ("channel", "bf16", 128, {"BT": 64, "dqk_BC": 64, "dqk_BK": 32, "REVERSE_DV": True, "dh_SEG_CHUNKS": 64}, True),
    ("scalar", "bf16", 128, {"BT": 64, "dh_BV": 32, "dh_num_stages": 2}, False),
    ("scalar", "bf16", 128, {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 64, "dh_SEG_CHUNKS": 64}, False),
    ("channel", "bf16", 128, {"BT": 64, "dqk_BC": 64, "dqk_BK": 32}, False),
    ("channel", "bf16", 128, {"BT": 64, "dqk_BK": 16, "dh_SEG_CHUNKS": 64}, True),
    ("none", "bf16", 64, {"BT": 64, "dh_LAYOUT": "vk", "dh_BV": 64, "dqk_BK": 64}, False),
    ("scalar", "fp32", 64, {"BT": 32, "dh_LAYOUT": "vk", "dh_SEG_CHUNKS": 8}, True),
    # stage 1 under autograd storing T alone, no A_qk (fh_U, fh_W, fh_AQK), as seeded (B = 8; B = 1 segmented)
    *[
        (
            gate,
            "bf16",
            128,
            {
                "BT": 64,
                "dh_LAYOUT": "vk",
                "dh_BV": 128,
                "dh_num_warps": 8,
                "dh_num_stages": 1,
                "SAVE": "all",
                "REVERSE_DV": True,
                "dqk_BK": 128,
                "dqk_BV": 64,
                "fh_U": "recomputed",
                "fh_W": "recomputed",
                "fh_AQK": "recomputed",
                **seg,
            },
            False,
        )
        for gate in ("none", "scalar")
        for seg in ({}, {"dh_SEG_CHUNKS": 64})
    ],
    # Gated DeltaNet's dq/dk stage with dA decayed by its value side (dqk_DECAY = "value"), as the H100's B = 8 entry,
    # and in its key loop
    ("scalar", "bf16", 128, {**_SHIP64, "dqk_num_stages": 3, "dqk_DECAY": "value"}, False),
    ("scalar", "bf16", 128, {**_SHIP64, "dqk_BK": 32, "dqk_KLOOP": True, "dqk_DECAY": "value"}, False),
    # the reverse pass's tiles by TMA descriptors (dh_TMA), as the shipped B = 8 entries run it; KDA's at BT 32
    ("none", "bf16", 128, {**_SHIP64, "dh_TMA": True, "fh_U": "recomputed", "fh_W": "recomputed"}, False),
    ("scalar", "bf16", 128, {**_SHIP64, "dh_TMA": True, "fh_U": "recomputed", "fh_W": "rebuilt"}, False),
    ("scalar", "bf16", 128, {**_SHIP64, "dh_TMA": True, "dh_SEG_CHUNKS": 64}, True),
    # ... and its adjoint stored by TMA (dh_STORE_TMA): transposed ("vk"), with and without the loads by TMA, segmented
    (
        "scalar",
        "bf16",
        128,
        {**_SHIP64, "dh_TMA": True, "dh_STORE_TMA": True, "fh_U": "recomputed", "fh_W": "recomputed"},
        False,
    ),
    ("none", "bf16", 128, {**_SHIP64, "dh_STORE_TMA": True, "fh_U": "recomputed", "fh_W": "recomputed"}, False),
    ("channel", "bf16", 128, {**_SHIP64, "dh_STORE_TMA": True, "dh_SEG_CHUNKS": 64}, True),
    (
        "channel",
        "bf16",
        128,
        {"dh_LAYOUT": "vk", "dh_BV": 128, "dh_num_warps": 8, "REVERSE_DV": True, "dh_TMA": True},
        False,
    ),
    # ... and the dq/dk stage's tiles by TMA descriptors (dqk_TMA): the shipped B = 8 entries', KDA's at 4 warps
    ("none", "bf16", 128, {**_SHIP64, "dqk_TMA": True, "dh_TMA": True}, False),
    ("scalar", "bf16", 128, {**_SHIP64, "dqk_TMA": True}, True),
    (
        "channel",
        "bf16",
        128,
        {"REVERSE_DV": True, "dqk_BV": 128, "dqk_num_warps": 4, "dqk_BC": 32, "dqk_TMA": True},
        False,
    ),
    ("channel", "bf16", 128, {"dqk_TMA": True, "dqk_BK": 32}, True),
    # KDA's dq/dk key tiles in one program per chunk (dqk_KLOOP), as seeded and in bwd_variants.py
    ("channel", "bf16", 128, {"SAVE": "none", "dqk_KLOOP": True, "dqk_BC": 32}, False),
    ("channel", "bf16", 128, {"SAVE": "none", "dqk_KLOOP": True, "dqk_BC": 32, "dqk_BK": 32}, True),
    # the dq/dk stage under a register cap (dqk_maxnreg): ptxas keeps it within the cap
    ("scalar", "bf16", 128, {**_SHIP64, "dqk_BK": 64, "dqk_maxnreg": 128}, False),
    ("none", "bf16", 128, {**_SHIP64, "dqk_num_warps": 4, "dqk_maxnreg": 168}, True),
]


def compile_case(index: int, stats: bool = False, only: str | None = None) -> dict[str, Any]:
    """Compile every backward stage of CASES[index] (or the stage ``only``): shared memory (and with ``stats``
    registers, spills); the dq/dk stage under a register cap (``dqk_maxnreg``) also ``[cap, registers ptxas gave
    it]`` under ``"dqk registers"``."""
    gate, dtype, D, overrides, varlen = CASES[index]
    cfg = chunk_bwd.check_config(D, D, gate, overrides)
    out: dict[str, Any] = {}
    for name, fn, args, warps, stages in bwd_stages(gate, dtype, D, D, cfg, varlen):
        if only is not None and name != only:
            continue
        cap = int(cfg["dqk_maxnreg"]) if name == "dqk" else 0
        k = compile_sm90(fn, args, warps, stages, cap)
        out[name] = int(k.metadata.shared)
        if cap:
            out[f"{name} registers"] = [cap, ptxas_usage(k.asm["ptx"])[0]]
        if stats:
            regs, spills = ptxas_usage(k.asm["ptx"])
            out[name] = {"smem": out[name], "regs": regs, "spills": spills}
    return out


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) from the ptxas Triton uses for sm_90a."""
    import re
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        cmd = [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.cubin"]
        err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", err), re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def case_ids() -> list[str]:
    return [
        f"{g}-{dt}-D{D}{'-varlen' if vl else ''}{''.join(f'-{k}{v}' for k, v in o.items())}"
        for g, dt, D, o, vl in CASES
    ]


@pytest.mark.parametrize("index", range(len(CASES)), ids=case_ids())
def test_backward_stages_compile_for_sm90(index: int) -> None:
    smem = sm90_child.run(__file__, str(index), timeout=600)
    for stage, nbytes in smem.items():
        if stage.endswith(" registers"):
            cap, regs = nbytes
            assert regs <= cap, f"{stage}: {regs} under a cap of {cap}"
        else:
            assert nbytes <= H100_SMEM, f"{stage}: {nbytes} bytes of shared memory"


KLOOP_CASES = [i for i, c in enumerate(CASES) if c[3].get("dqk_KLOOP") and c[0] == "channel"]


@pytest.mark.parametrize("index", KLOOP_CASES, ids=[case_ids()[i] for i in KLOOP_CASES])
def test_kda_key_loop_compiles_without_spills(index: int) -> None:
    """With the GPU machines' Triton (3.6; here: ``PYTHONPATH=/work/tri36``): spills are the compiler build's (Triton
    3.9 spills 16 bytes at dqk_BK = 32)."""
    if not triton.__version__.startswith("3.6"):
        pytest.skip(f"spill budgets are measured with Triton 3.6, this is {triton.__version__}")
    usage = sm90_child.run(__file__, "--dqk", str(index), timeout=600)["dqk"]
    assert usage["spills"] == 0, f"dq/dk stage: {usage}"


if __name__ == "__main__":
    if sys.argv[1] == "--dqk":
        print(json.dumps(compile_case(int(sys.argv[2]), stats=True, only="dqk")))
    elif sys.argv[1] == "--stats":
        if len(sys.argv) > 2:
            CASES[:] = [(sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]), False)]
        for i in range(len(CASES)):
            print(case_ids()[i], json.dumps(compile_case(i, stats=True)), flush=True)
    else:
        print(json.dumps(compile_case(int(sys.argv[1]))))
