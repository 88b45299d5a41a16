"""The chunk templates' tunable parameters, their legal values and the default config."""

from __future__ import annotations

from typing import Any

from ..config import GATE_CODES, Config, next_power_of_2

_COMMON: dict[str, tuple[Any, ...]] = {
    "BT": (16, 32, 64, 128),
    "BC": (16, 32, 64),
    "intra_BK": (32, 64, 128, 256),
    "intra_BV": (32, 64, 128, 256),
    "intra_num_warps": (1, 2, 4, 8),
    "intra_num_stages": (1, 2, 3),
    "h_BV": (16, 32, 64, 128),
    "h_num_warps": (1, 2, 4, 8, 16),
    "h_num_stages": (1, 2, 3, 4),
    "FUSE_OUTPUT": (False, True),
    "o_BK": (32, 64, 128, 256),
    "o_BV": (32, 64, 128, 256),
    "o_num_warps": (1, 2, 4, 8),
    "o_num_stages": (1, 2, 3, 4),
    "F32_DOT": ("ieee", "tf32"),
    # stage 1: every sub-chunk in registers ("blocks"; "blocks_split": A_qk in a pass of its own, fewer live
    # registers at BT / BC = 4), or one sub-chunk after the other through memory ("rows")
    "INTRA": ("blocks", "rows", "blocks_split"),
    # the diagonal blocks' (I + A)^-1 in the blocks/onepass variants: forward substitution ("subst", two cross-thread
    # reductions per row) or repeated squaring ("squaring", six float32 dots; BC = 16 only); "rows" substitutes
    "SOLVE": ("subst", "squaring"),
    "STATE_LAYOUT": ("kv", "vk"),
    # sequence-parallel state pass: segments of this many chunks (0: off, one program walks the whole sequence)
    "SEG_CHUNKS": (0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
    # its phase 2 (segment-starts): the state in registers with M_s whole per step ("regs"), or key tiles of M_s
    # and the state read back through memory every step ("tiles"); and that kernel's V tile
    "SEG_COMBINE": ("regs", "tiles"),
    "seg_BV": (16, 32, 64),
    # its phase 1 (transitions): column tile of the extended state [K, V + K] and warps (0: the state pass's h_BV,
    # h_num_warps). Wider tiles: fewer programs re-reading the same W and k rows
    "tr_BV": (0, 16, 32, 64, 128),
    "tr_num_warps": (0, 2, 4, 8),
    # how the state pass gets W = T (β ⊙ K ⊙ e^γ) and U = T (β ⊙ V): "stored" by stage 1 ([tokens, K] and [tokens, V]
    # per value head, with A_qk), or "recomputed" from the q, k, v tiles it loads anyway and the chunk's inverse T
    # ([tokens, BT], the only matrix stage 1 then writes): V_new = T (β ⊙ (V − e^γ ⊙ K S)) and A_qk = q kᵀ per chunk.
    # KDA's decays are per key channel: there stage 1 stores P = β ⊙ K ⊙ e^γ (W's operand, in W's place) and T, no U,
    # and the state pass forms V_new = T (β ⊙ V − P S)
    "WU": ("stored",),
    # the state pass's scale · A_qk = scale · q kᵀ ⊙ e^(γ_i − γ_j): "stored" by stage 1 ([tokens, BT]), or
    # "recomputed" per chunk from the q and k tiles it loads (one [BT, K] x [K, BT] dot and BT² exponentials per V
    # tile; fused output only). DeltaNet and Gated DeltaNet (KDA's decay is per key channel)
    "AQK": ("stored",),
    # the state pass's tiles of q, k, v / W, U, A_qk, T loaded through TMA tensor descriptors (and full chunks of the
    # output stored through one); where the shape does not allow it (K not a power of two, h_BV not dividing V,
    # unaligned inputs) the launcher keeps pointer loads
    "STATE_TMA": (False, True),
    # where the state pass stores each chunk's state and V_new (FUSE_OUTPUT off, for the output stage; the training
    # forward, for the backward): through TMA descriptors (one store per state tile, whole chunks of V_new), or by
    # pointers (False; the transposed "vk" tiles then go through a shared-memory layout change first); where the shape
    # does not allow it (K not a power of two, h_BV not dividing V) the launcher keeps pointer stores. sm_90a, Triton
    # 3.9, Gated DeltaNet D 128, "vk", h_BV 64, unfused: st.global 26 -> 18, bar.sync 43 -> 36, shared memory 26.8 ->
    # 47.3 KB (the stores' staging); not yet timed on a GPU
    "STATES_TMA": (False, True),
    # the state pass's chunk loop: "range" (the kernel's num_stages pipelines its loads), "specialized" (Triton's warp
    # specialisation, tl.range(warp_specialize=True): producer warps fetch the next chunk's tiles while consumer warps
    # compute this one's). tl.range(num_stages=...) alone compiles to the same PTX as "range" (Triton 3.6, sm_90a).
    # DeltaNet and Gated DeltaNet also have "gluon" (legal_params): the pass written in Gluon, warp-specialised by hand
    "STATE_LOOP": ("range", "specialized"),
    # a cap on the registers per thread of stage 1 and of the state pass (ptx .maxnreg; 0: none, ptxas takes up to
    # 255): fewer registers, more programs resident per SM to hide the loads' latency, at the price of spills
    # (sm_90a, Triton 3.6, D 128: Gated DeltaNet's stage 1 152 -> 128 registers with 16 bytes of spills, its state
    # pass 242 -> 168 with none, KDA's one-pass stage 1 255 -> 168 with 704 bytes; on an H100 at B8 T4096 none of
    # these was faster by more than 2%, and Gated DeltaNet's state pass at 168 was 14% slower)
    "intra_maxnreg": (0, 96, 128, 168),
    "h_maxnreg": (0, 128, 168),
}


def legal_params(gate: str) -> dict[str, tuple[Any, ...]]:
    """Every tunable parameter and all values the templates can be built with (``BC <= BT`` is also required)."""
    if gate not in GATE_CODES:
        raise ValueError(f"unknown gate mode {gate!r}")
    params = dict(_COMMON)
    if gate == "channel":
        params["SAFE_DIAG"] = (True, False)
        # KDA: every gate factor of a chunk from one pass over the key tiles, two exp's per element (1 or 2 sub-chunks)
        params["INTRA"] = (*params["INTRA"], "onepass")
        # onepass: the diagonal blocks' dots on bfloat16 operands (bfloat16 inputs only), as the off-diagonal ones
        params["DIAG_BF16"] = (False, True)
        # stage 1 stores P = β ⊙ K ⊙ e^γ and T instead of W and U: it reads no v and does no W / U products, the
        # state pass forms V_new = T (β ⊙ V − P S) from the v tile (one more [BT, BT] x [BT, h_BV] product per chunk)
        params["WU"] = ("stored", "recomputed")
    else:  # KDA's state pass reads the precomputed q~, k~ already
        # the state pass feeds q and k to the dots as loaded (no register pass over their tiles); the scale and the
        # scalar gate's factors act on the products and on V_new's token rows instead
        params["QK_DIRECT"] = (False, True)
        params["WU"] = ("stored", "recomputed")
        params["AQK"] = ("stored", "recomputed")
        # the state pass with the output in Gluon (kernels/chunk/state_ws.py, sm_90 only): a one-warp TMA loader
        # h_num_stages chunks ahead of the compute warpgroups (h_BV / 16 warps), every product a wgmma with its left
        # operand in registers (A_qk stored, or with AQK = "recomputed" formed in it by mma.sync); WU = "recomputed",
        # FUSE_OUTPUT, no segments, 16-bit inputs, K 64 or 128 (elsewhere the Triton pass runs the config)
        params["STATE_LOOP"] = (*params["STATE_LOOP"], "gluon")
        # its products issued asynchronously (True: the output's S qᵀ on the tensor cores while the chain's X is formed,
        # the output's second product and the state update together; three waits per chunk instead of five)
        params["h_OVERLAP"] = (True, False)
    if gate == "scalar":
        # the state pass's gate rows (γ and γ_C per chunk): "pipelined" (loads in the chunk they serve, which Triton's
        # pipeliner turns into cp.async through shared memory: per chunk a wait, a barrier and ~180 instructions of
        # per-row predicates at sm_90a), or "prefetched" (plain loads of chunk n + 1 issued in chunk n, carried in
        # registers: Gated DeltaNet D 128 "vk" WU recomputed + TMA, 809 -> 697 instructions in the loop)
        params["GATE_LOADS"] = ("pipelined", "prefetched")
        # the sequence-parallel pass's phase 1 (transitions): every segment's M_seg computed (False), or, where a bound
        # of its norm from the segment's gates, β and key norms shows it negligible (kernels.config.SEG_SKIP_LOG: the
        # result equal to rounding), stored as zeros without walking the segment (True): half of phase 1's tiles skip
        # their chain under strong decays; the bound's pass reads γ, β and, without the in-kernel l2norm, k (by wide
        # loads: per chunk it was as latency-bound as the chain it skips)
        params["SEG_DECAY"] = (False, True)
        # how each segment gets its entering state: phases 1 and 2 (the segments' transitions, then their starts in
        # sequence: "transitions", exact), or by burn-in ("burnin": phase 3 alone; each segment walks back from its start,
        # chunk by chunk, until a bound shows the transition from there negligible, below e^-104 as SEG_DECAY's, and starts its
        # walk there from a zero state, or from the sequence's start and initial state where none does: equal to the
        # full pass to rounding). Under strong decays a chunk or two of extra walk per segment instead of phase 1
        # (about twice the state pass's work); under weak ones a long walk: slower than "transitions"
        params["SEG_START"] = ("transitions", "burnin")
    return params


def default_config(K: int, V: int, gate: str) -> Config:
    """Correct for every supported shape (K, V <= 256) and for strong decays (exact KDA diagonal blocks)."""
    BK = next_power_of_2(K)
    # Shared-memory budgets checked by compiling for sm_90 (Triton 3.9): at K = 256 the state pass keeps one pipeline
    # stage (float32 W/k~ tiles would overflow smem). The blocks intra stage runs at the 255-register cap with small
    # spills at BT = 64 (ptxas); on the H200 it is still 1.4-2.1x faster than INTRA = "rows" there.
    cfg: Config = {
        "BT": 32,  # H200 searches (2026-11-29): BT = 32 won for all three gates at D = 64 and 128
        "BC": 16,
        "intra_BK": min(64, max(32, BK)),  # 64, or the padded head dim below it (the search spaces' tile rule)
        "intra_BV": min(64, max(32, next_power_of_2(V))),
        "intra_num_warps": 2,  # INTRA = "blocks": 16-row tiles, more warps only replicate them (H200: 1.6-3x slower)
        "intra_num_stages": 1,
        "h_BV": 32 if BK <= 128 else 16,
        "h_num_warps": 4 if BK <= 128 else 8,
        "h_num_stages": 2 if BK <= 128 else 1,
        "FUSE_OUTPUT": BK <= 128,  # the output inside the state pass: no chunk states in memory (same searches)
        "o_BK": 64,
        "o_BV": 64,
        "o_num_warps": 4,
        "o_num_stages": 2,
        "F32_DOT": "ieee",
        "INTRA": "blocks",
        "SOLVE": "subst",  # "squaring" not yet timed on a GPU (2026-12-01)
        "STATE_LAYOUT": "kv",  # "vk" is not yet timed on a GPU (2026-11-29): the searches will decide
        "SEG_CHUNKS": 0,  # the tuned configs turn it on where few long sequences under-fill the GPU
        # phase 2 with the state in registers: one product per segment, M_s's loads pipelined (sm_90 compile:
        # 100 registers, M_s by cp.async at num_stages 2); "tiles" waited on ~5 global round trips per segment (H200,
        # 2026-11-30: ~6 µs per segment)
        "SEG_COMBINE": "regs",
        "seg_BV": 32,  # 4 programs per value head at V = 128 (the "tiles" kernel's tile before it was a parameter)
        "tr_BV": 0,  # phase 1 as the state pass: h_BV, h_num_warps
        "tr_num_warps": 0,
    }
    cfg["WU"] = "stored"
    cfg["AQK"] = "stored"
    cfg["STATE_TMA"] = False
    cfg["STATES_TMA"] = False
    cfg["STATE_LOOP"] = "range"
    cfg["intra_maxnreg"] = 0
    cfg["h_maxnreg"] = 0
    if gate == "channel":
        cfg["SAFE_DIAG"] = True
        cfg["DIAG_BF16"] = False
    else:
        cfg["QK_DIRECT"] = False  # not yet timed on a GPU (2026-12-01)
        cfg["h_OVERLAP"] = True  # (STATE_LOOP = "gluon" only)
    if gate == "scalar":
        cfg["GATE_LOADS"] = "pipelined"  # "prefetched" not yet timed on a GPU
        # exact to rounding, and the H100 (commit 6690d18) measured it faster: B1 T32768 H16 0.918 -> 0.861 ms, Qwen3-Next's
        # B1 T32768 H16 HV32 phase 1 0.787 -> 0.623 ms (reports/h100/forward/seg_decay/)
        cfg["SEG_DECAY"] = True
        cfg["SEG_START"] = "transitions"  # "burnin" not yet timed on a GPU
    return cfg
