"""Static resources of the chunk stages compiled for sm_90a (Hopper) on any machine, no GPU needed.

Triton ships its PTX assembler, so ``triton.compile`` for a ``GPUTarget`` runs without a GPU: shared memory per
stage (:func:`stage_kernels` + :func:`compile_sm90`, what ``plan()`` would launch), and in the PTX of a stage's
main loop the tensor-core instructions, shared-memory traffic and barriers, with registers and spills from ptxas
(:func:`stage_stats`; the source of the "kv" vs "vk" state-pass table in reports/h200/NOTES.md).
"""

from __future__ import annotations

import glob
import inspect
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dtune.kernels import KERNELS
from dtune.kernels.chunk.call import tile as _tile
from dtune.kernels.chunk.intra import chunk_intra_kernel
from dtune.kernels.chunk.intra_blocks import chunk_intra_blocks_kernel
from dtune.kernels.chunk.intra_kda import chunk_intra_onepass_kernel
from dtune.kernels.chunk.output import chunk_output_kernel
from dtune.kernels.chunk.segments import segment_starts_spec
from dtune.kernels.chunk.state import chunk_state_kernel, loop_options, transitions_tile
from dtune.kernels.config import GATE_CODES

SM90 = GPUTarget("cuda", 90, 32)
OPS = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}
PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "st.shared": r"st\.shared|stmatrix",
    "ld.shared": r"ld\.shared|ldmatrix",
    "bar.sync": r"bar\.sync",
    "cp.async": r"cp\.async\.c[ag]",
    "ld.global": r"ld\.global",
    "ex2": r"ex2\.approx",
}


class NoToolchain(RuntimeError):
    """This Triton build cannot make CUDA code (no ptxas)."""


H100_SMEM = 232448  # bytes of shared memory per block on sm_90


def compile_sm90(
    fn: Any,
    ptrs: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
) -> Any:
    """``triton.compile`` of one JIT function for sm_90 (pointers 16-byte aligned, as a real launch specialises
    them; ``scale`` fp32, ``T`` i32, every other argument a constexpr, its declared default where ``constexprs``
    does not name it, else None); ``lower_bound`` fp32 too; ``maxnreg``: a register cap (a config's
    ``*_maxnreg``); NoToolchain where no ptxas is shipped."""
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
        elif name in ("scale", "lower_bound"):
            sig[name] = "fp32"
        elif name == "T":
            sig[name] = "i32"
        else:  # constexprs (a launch's defaults where not given), and pointers the launch passes as None
            sig[name] = "constexpr"
            default = fn.params[i].default
            consts[(i,)] = constexprs.get(name, None if default is inspect.Parameter.empty else default)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in ptrs.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return _compile(src, options)


def _compile(src: Any, options: dict[str, Any]) -> Any:
    """``triton.compile`` for sm_90; NoToolchain where this Triton build has no ptxas."""
    try:
        return triton.compile(src, target=SM90, options=options)
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            raise NoToolchain(f"cannot build CUDA code here: {e}") from None
        raise


def _gate_act_ptrs(gate_act: int, raw: str) -> dict[str, str]:
    """Stage 1's pointers with the gate activation: the raw gate in the inputs' dtype, A_log and dt_bias (float32) as
    ``gate_act`` has them."""
    ptrs = {"g": raw}
    if (gate_act // 4) % 2:
        ptrs["dt_bias"] = "*fp32"
    if (gate_act // 8) % 2:
        ptrs["A_log"] = "*fp32"
    return ptrs


def stage_kernels(
    gate: str,
    dtype: str,
    K: int,
    V: int,
    cfg: dict[str, Any],
    varlen: bool,
    gate_act: int = 0,
    l2norm: bool = False,
    beta_act: int = 0,
) -> list[tuple]:
    """(name, kernel, pointer args with their dtypes, constexprs, warps, stages) of every stage, as plan() launches
    (with ``SEG_CHUNKS``: the segmented state pass's three launches). ``gate_act``: stage 1 activating a raw gate of
    ``dtype`` (fla's ``use_gate_in_kernel``, ``InKernel.gate_code``; 0: none); ``l2norm``, ``beta_act``: the stages
    normalising q and k and activating beta (``InKernel.chunk_args``)."""
    opts = ({"L2NORM": True} if l2norm else {}) | ({"BETA_ACT": beta_act} if beta_act else {})
    G = GATE_CODES[gate]
    rnorm = {"rq": "*fp32", "rk": "*fp32"} if l2norm and G != 2 else {}  # the row factors stage 1 stores
    p = f"*{dtype}"
    f32 = "*fp32"
    prec = cfg["F32_DOT"] if dtype == "fp32" else "tf32"
    BT, BC, fuse = cfg["BT"], cfg["BC"], cfg["FUSE_OUTPUT"]
    gated = {"g": f32, "gout": f32} if G else {}
    chan = {"qg": p, "kg": p} if G == 2 else {}
    table = {"chunk_info": "*i32"} if varlen else {}
    i_BK, i_BV = _tile(cfg["intra_BK"], K), _tile(cfg["intra_BV"], V)
    safe = cfg.get("SAFE_DIAG", True)
    diag = {"DIAG": int(G == 2 and safe)}  # both variants: 1 = dot and flag, then the exact second pass (2)
    intra_fn = {"rows": chunk_intra_kernel, "onepass": chunk_intra_onepass_kernel}.get(
        cfg["INTRA"], chunk_intra_blocks_kernel
    )
    recompute = cfg.get("WU", "stored") == "recomputed"
    recompute_qk = cfg.get("AQK", "stored") == "recomputed"
    intra = (
        "intra",
        intra_fn,
        {"q": p, "k": p, "v": p, "beta": p, "w": p, "u": p, "aqk": p, **gated, **chan, **table}
        | ({"ai": p} if recompute else {})
        | ({"flags": "*i32"} if G == 2 and safe else {})
        | (_gate_act_ptrs(gate_act, p) if G and gate_act else {})
        | rnorm,
        dict(H=2, HV=4, K=K, V=V, BT=BT, BC=BC, BK=i_BK, BV=i_BV, GATE=G, NB=BT // BC, NK=triton.cdiv(K, i_BK))
        | dict(NV=triton.cdiv(V, i_BV), VARLEN=varlen, DOT_PREC=prec)
        | diag
        | ({"SPLIT_QK": cfg["INTRA"] == "blocks_split"} if cfg["INTRA"] in ("blocks", "blocks_split") else {})
        | {"SOLVE": int(cfg["SOLVE"] == "squaring"), "DIAG_LOWP": bool(cfg.get("DIAG_BF16")) and dtype == "bf16"}
        | ({"STORE_AI": True} if recompute else {})
        | {"WU_OUT": not recompute, "QK_OUT": not recompute_qk}
        | ({"GACT": gate_act} if gate_act else {})
        | opts,
        cfg["intra_num_warps"],
        cfg["intra_num_stages"],
    )
    state_ptrs = {"q": p, "k": p, "w": p, "u": p, "aqk": p, "h0": f32, "ht": f32, "o": p, **chan}
    state_ptrs |= {"gout": f32} if G else {}
    state_ptrs |= rnorm
    state_ptrs |= {} if fuse else {"hbuf": p, "vnew": p}
    seg = cfg.get("SEG_CHUNKS", 0) > 0
    state_ptrs |= {"bounds": "*i32", "chunk_offsets": "*i32"} if varlen or seg else {}
    state_ptrs |= {"seg_last": "*i32"} if seg else {}
    if recompute:  # V_new from v, beta and T (KDA: and P = β ⊙ K ⊙ e^γ, in W's buffer)
        unread = ("u",) if G == 2 else ("w", "u")
        state_ptrs = {n: t for n, t in state_ptrs.items() if n not in unread} | {"v": p, "beta": p, "ai": p}
    if recompute_qk:  # A_qk from q and k
        state_ptrs = {n: t for n, t in state_ptrs.items() if n != "aqk"}
    h_BV = _tile(cfg["h_BV"], V)
    tma = bool(cfg.get("STATE_TMA")) and _tile(triton.next_power_of_2(K), K) == K and V % h_BV == 0
    if tma:  # the launcher's descriptors (kernels.chunk.state.descriptors): [BT, K] and [BT, h_BV] rows
        desc = {n: f"tensordesc<{dtype}[{BT},{w}]>" for n, w in (("q_td", K), ("k_td", K), ("o_td", h_BV))}
        more = [("v_td", h_BV), ("t_td", BT)] if recompute else [("w_td", K), ("u_td", h_BV)]
        more += [("w_td", K)] if recompute and G == 2 else []
        more += [] if recompute_qk else [("a_td", BT)]
        state_ptrs |= desc | {n: f"tensordesc<{dtype}[{BT},{w}]>" for n, w in more}
    if not fuse and cfg.get("STATES_TMA") and _tile(triton.next_power_of_2(K), K) == K and V % h_BV == 0:
        # the chunk states' and V_new's store descriptors (kernels.chunk.state.state_store_descriptors)
        state_ptrs |= {"hs_td": f"tensordesc<{dtype}[{K},{h_BV}]>", "vn_td": f"tensordesc<{dtype}[{BT},{h_BV}]>"}
    burnin = seg and cfg.get("SEG_START", "transitions") == "burnin"
    if burnin:  # phase 3 alone: the segments' sequences, the bound's beta and k
        state_ptrs |= {"seg_seq": "*i32", "seq_first": "*i32", "beta": p, "k": p}
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
            BK=_tile(triton.next_power_of_2(K), K),
            BV=_tile(cfg["h_BV"], V),
            GATE=G,
            USE_H0=True,
        )
        | dict(STORE_HT=True, VARLEN=varlen or seg, FUSE_OUTPUT=fuse, DOT_PREC=prec, TRANS=cfg["STATE_LAYOUT"] == "vk")
        | dict(SEG=2 if seg else 0, QK_DIRECT=bool(cfg.get("QK_DIRECT", False)), RECOMPUTE=recompute, TMA=tma)
        | dict(QK_RECOMPUTE=recompute_qk, GATE_PREFETCH=cfg.get("GATE_LOADS", "pipelined") == "prefetched")
        | (loop_options(cfg, tma, G) if not burnin else {"LOOP_STAGES": None, "LOOP_WS": False, "BURNIN": True})
        | opts,
        cfg["h_num_warps"],
        cfg["h_num_stages"],
    )
    out = [intra, state]
    if seg and not burnin:  # phase 1 (the state kernel's transition mode) and phase 2 (the segments' entering states)
        drop = ("q", "aqk", "h0", "ht", "o", "hbuf", "vnew")
        trans_ptrs = {n: t for n, t in state_ptrs.items() if n not in drop and not n.endswith("_td")}
        tr_BV, tr_launch = transitions_tile(cfg, K, V)
        consts = state[3] | dict(USE_H0=False, STORE_HT=False, FUSE_OUTPUT=False, SEG=1, BV=tr_BV, TMA=False)
        consts |= loop_options(cfg, False, G)  # pointer tiles (the launcher builds no descriptors for phase 1)
        if cfg.get("SEG_DECAY"):  # the bound's pass reads beta (and k)
            consts |= dict(SEG_DECAY=True)
            trans_ptrs |= {"beta": p}
        tr = ("transitions", chunk_state_kernel, trans_ptrs | {"ext": f32}, consts)
        out.append((*tr, tr_launch["num_warps"], tr_launch["num_stages"]))
        fn, opts = segment_starts_spec(cfg, K, V)
        warps, n_stages = opts.pop("num_warps"), opts.pop("num_stages")
        out.append(
            (
                "segment-starts",
                fn,
                {"ext": f32, "h0": f32, "starts": f32, "ht": f32, "seq_segments": "*i32"},
                dict(HV=4, K=K, V=V, USE_H0=True, STORE_HT=True, DOT_PREC=prec) | opts,
                warps,
                n_stages,
            )
        )
    if diag.get("DIAG") == 1:  # the guarded KDA diagonal's second pass (exact loop, flagged chunks only)
        exact = (
            (intra[1], intra[3])
            if cfg["INTRA"] != "onepass"
            else (chunk_intra_blocks_kernel, intra[3] | {"SPLIT_QK": False})
        )
        out.append(("intra-exact", exact[0], intra[2], exact[1] | {"DIAG": 2}, intra[4], intra[5]))
    if not fuse:
        o_BK = _tile(cfg["o_BK"], K)
        out_ptrs = {"q": p, "aqk": p, "hbuf": p, "vnew": p, "o": p, **table}
        out_ptrs |= {"gout": f32} if G else {}
        out_ptrs |= {"qg": p} if G == 2 else {}
        out_ptrs |= {"rq": f32} if rnorm else {}
        out.append(
            (
                "output",
                chunk_output_kernel,
                out_ptrs,
                dict(H=2, HV=4, K=K, V=V, BT=BT, BK=o_BK, BV=_tile(cfg["o_BV"], V), NK=triton.cdiv(K, o_BK), GATE=G)
                | dict(VARLEN=varlen, DOT_PREC=prec)
                | ({"L2NORM": True} if l2norm else {}),
                cfg["o_num_warps"],
                cfg["o_num_stages"],
            )
        )
    return out


def loop_body(ptx: str) -> str:
    """The longest backward-branch region of the PTX (the chunk loop of the state pass; the key loop elsewhere)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line.strip()))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    return "\n".join(lines[best[0] : best[1] + 1])


def _ptxas() -> str:
    try:  # the ptxas Triton itself uses for sm_90 (Triton >= 3.4 ships a second one for new targets)
        from triton.backends.nvidia.compiler import get_ptxas

        return str(get_ptxas(90).path)
    except ImportError:  # older Triton: the one ptxas it ships
        return sorted(glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas*")))[0]


def _assemble(ptx: str, d: str) -> tuple[Path, str]:
    """(the cubin, ptxas -v's report) of ``ptx`` for sm_90a, in the folder ``d``."""
    src, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
    src.write_text(ptx)
    cmd = [_ptxas(), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(cubin)]
    return cubin, subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the kernel, from ptxas -v for sm_90a."""
    with tempfile.TemporaryDirectory() as d:
        out = _assemble(ptx, d)[1]
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


SASS_PATTERNS = {"sass.ex2": r"MUFU\.EX2", "sass.ldgsts": r"LDGSTS", "sass.bar": r"BAR\.SYNC", "sass.gmma": r"HGMMA"}


def sass_loop(ptx: str) -> dict[str, int]:
    """The machine code ptxas makes of ``ptx`` (sm_90a, disassembled by the cuobjdump Triton ships): instructions in
    the body of the longest conditional backward branch (the chunk loop of the state pass; waits on barriers branch
    back unconditionally), and of them :data:`SASS_PATTERNS`. Empty where this Triton ships no cuobjdump."""
    cuobjdump = Path(_ptxas()).parent / "cuobjdump"
    if not cuobjdump.is_file():
        return {}
    with tempfile.TemporaryDirectory() as d:
        cubin = _assemble(ptx, d)[0]
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = (0, -1)
    for addr, text in code:
        m = re.match(r"@!?U?P\w+\s+BRA\s+0x([0-9a-f]+)", text.strip())
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    body = [text for addr, text in code if best[0] <= addr <= best[1]]
    return {"sass": len(body)} | {n: sum(bool(re.search(p, t)) for t in body) for n, p in SASS_PATTERNS.items()}


def stage_stats(gate: str, stage: str, dim: int, dtype: str, overrides: dict[str, Any]) -> dict[str, int]:
    """Instruction counts in the main loop of one stage's PTX (:data:`PATTERNS`), registers and spill bytes, and the
    loop's machine instructions (:func:`sass_loop`)."""
    cfg = KERNELS[OPS[gate]].check_config(dim, dim, overrides)
    stages = {s[0]: s for s in stage_kernels(gate, dtype, dim, dim, cfg, False)}
    if stage not in stages:
        raise ValueError(f"no stage {stage!r} in this config (stages: {', '.join(stages)})")
    _, fn, ptrs, consts, warps, n_stages = stages[stage]
    ptx = compile_sm90(fn, ptrs, consts, warps, n_stages).asm["ptx"]
    body = loop_body(ptx)
    counts = {name: len(re.findall(p, body)) for name, p in PATTERNS.items()}
    regs, spills = ptxas_usage(ptx)
    return {**counts, "regs": regs, "spills": spills, **sass_loop(ptx)}


def compile_state_ws(
    gate: str,
    dtype: str,
    K: int,
    V: int,
    config: dict[str, Any],
    H: int = 16,
    HV: int = 16,
    varlen: bool = True,
    **constexprs: Any,
) -> Any:
    """The Gluon state pass (``STATE_LOOP = "gluon"``, kernels/chunk/state_ws.py) of ``config`` compiled for sm_90a,
    as :func:`compile_sm90` does the Triton stages: its TMA descriptors' types built from block shapes."""
    from dtune.kernels.chunk.state_ws import chunk_state_ws_kernel

    cfg = KERNELS[OPS[gate]].check_config(K, V, config)
    BT, BV = int(cfg["BT"]), int(cfg["h_BV"])
    blocks = {"k_desc": [BT, K], "q_desc": [BT, K], "v_desc": [BT, BV], "t_desc": [BT, BT], "a_desc": [BT, BT]}
    ptrs = {"gout": "*fp32", "beta": f"*{dtype}", "h0": "*fp32", "ht": "*fp32", "o": f"*{dtype}", "bounds": "*i64"}
    if constexprs.get("L2NORM"):
        ptrs |= {"rq": "*fp32", "rk": "*fp32"}
    if constexprs.get("STORE_STATES"):  # the training forward's: the chunk states and V_new stored by TMA
        ptrs |= {"vnew": f"*{dtype}", "chunk_offsets": "*i64"}
        blocks |= {"hs_desc": [K, BV], "vn_desc": [BT, BV]}
    consts = {
        "H": H, "HV": HV, "K": K, "V": V, "BT": BT, "BV": BV, "GATE": {"none": 0, "scalar": 1}[gate], "USE_H0": True,
        "STORE_HT": True, "VARLEN": varlen, "NUM_BUF": int(cfg["h_num_stages"]), "LOADER_REGS": 40,
        "num_warps": BV // 16,
    } | constexprs  # fmt: skip
    return _compile_gluon(chunk_state_ws_kernel, dtype, blocks, ptrs, consts, BV // 16, int(cfg["h_maxnreg"]))


def compile_reverse_ws(
    gate: str,
    dtype: str,
    K: int,
    V: int,
    config: dict[str, Any],
    H: int = 16,
    HV: int = 16,
    varlen: bool = True,
    **constexprs: Any,
) -> Any:
    """The Gluon reverse state pass (``dh_LOOP = "gluon"``, kernels/chunk/bwd_state_ws.py) of the backward config
    ``config`` (over the backward's default) compiled for sm_90a; ``constexprs``: ``QK_RE``, ``W_READ``."""
    from dtune.kernels.chunk.backward import check_config
    from dtune.kernels.chunk.bwd_state_ws import chunk_bwd_state_ws_kernel

    cfg = check_config(K, V, gate, config)
    BT, BV = int(cfg["BT"]), int(cfg["dh_BV"])
    blocks = {
        "do_desc": [BT, BV], "q_desc": [BT, K], "k_desc": [BT, K], "t_desc": [BT, BT], "v_desc": [BT, BV],
        "a_desc": [BT, BT], "w_desc": [BT, K], "xs_desc": [K, BV],
    }  # fmt: skip
    ptrs = {
        "gout": "*fp32", "beta": f"*{dtype}", "dht": "*fp32", "dh0": "*fp32", "dv": f"*{dtype}", "dvn": f"*{dtype}",
        "dbeta_part": "*fp32", "bounds": "*i64", "chunk_offsets": "*i64",
    }  # fmt: skip
    if constexprs.get("SEG"):  # phase 3 of the sequence-parallel pass: the segments' end adjoints, their sequences
        ptrs |= {"xend": "*fp32", "first": "*i32"}
    consts = {
        "H": H, "HV": HV, "K": K, "V": V, "BT": BT, "BV": BV, "GATE": {"none": 0, "scalar": 1}[gate], "USE_DHT": True,
        "STORE_DH0": True, "VARLEN": varlen, "NUM_BUF": int(cfg["dh_num_stages"]), "LOADER_REGS": 40,
        "num_warps": BV // 16,
    } | constexprs  # fmt: skip
    return _compile_gluon(chunk_bwd_state_ws_kernel, dtype, blocks, ptrs, consts, BV // 16, int(cfg["dh_maxnreg"]))


def compile_dqk_ws(
    gate: str,
    dtype: str,
    K: int,
    V: int,
    config: dict[str, Any],
    H: int = 16,
    HV: int = 16,
    varlen: bool = True,
) -> Any:
    """The Gluon dq/dk stage (``dqk_LOOP = "gluon"``, kernels/chunk/bwd_dqk_ws.py) of the backward config ``config``
    (over the backward's default) compiled for sm_90a."""
    from dtune.kernels.chunk.backward import check_config
    from dtune.kernels.chunk.bwd_dqk_ws import BT_GLUON, COMPUTE_WARPS, chunk_bwd_dqk_ws_kernel

    cfg = check_config(K, V, gate, config)
    BT, BV = BT_GLUON, int(cfg["dqk_BV"])
    blocks = {
        "q_desc": [BT, K], "k_desc": [BT, K], "do_desc": [BT, BV], "vn_desc": [BT, BV], "dvb_desc": [BT, BV],
        "h_desc": [K, BV], "x_desc": [K, BV],
    }  # fmt: skip
    ptrs = {
        "g": f"*{dtype}", "beta": f"*{dtype}", "dq": f"*{dtype}", "dk": f"*{dtype}", "dg": "*fp32",
        "dbeta_part": "*fp32", "chunk_info": "*i64",
    }  # fmt: skip
    consts = {
        "H": H, "HV": HV, "K": K, "V": V, "BT": BT, "BV": BV, "NUM_BUF": int(cfg["dqk_num_stages"]),
        "GATE": {"none": 0, "scalar": 1}[gate], "VARLEN": varlen, "FLOOR": -20.0, "LOADER_REGS": 40,
        "num_warps": COMPUTE_WARPS,
    }  # fmt: skip
    return _compile_gluon(chunk_bwd_dqk_ws_kernel, dtype, blocks, ptrs, consts, COMPUTE_WARPS, 0)


def _compile_gluon(
    fn: Any,
    dtype: str,
    blocks: dict[str, list[int]],
    ptrs: dict[str, str],
    consts: dict[str, Any],
    num_warps: int,
    maxnreg: int,
) -> Any:
    """A Gluon kernel compiled for sm_90a: TMA descriptors' types from ``blocks`` (the inputs' ``dtype``), pointers
    16-byte aligned, ``scale`` fp32, ``T`` and ``SS`` i32, every other argument a constexpr (``consts``, else its
    default)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import native_specialize_impl

    from dtune.kernels.chunk.state_ws import tma_descriptor

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def desc_type(block: list[int]) -> str:
        base = torch.empty(256 * 256, dtype=tdt)  # (a CPU tensor stands for the device's: only its type is read)
        d = tma_descriptor(base, 256, 256, block)
        return str(native_specialize_impl(type(d), d, False, True, True)[0])

    sig: dict[str, str] = {}
    values: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in blocks:
            sig[name] = desc_type(blocks[name])
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name in ("scale", "T", "SS", "SLOT", "n_items"):
            sig[name] = "fp32" if name == "scale" else "i32"
        else:  # (a constexpr the launch leaves at its default: that default)
            sig[name], values[(i,)] = "constexpr", consts.get(name, fn.params[i].default)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return _compile(GluonASTSource(fn, sig, values, attrs), options)
