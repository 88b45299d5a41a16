"""Chunkwise templates of the delta-rule family (DeltaNet, Gated DeltaNet, KDA): the forward in three stages.

Math: docs/DESIGN.md §1 (chunk of ``C = BT`` tokens, WY/UT representation). Pipeline (each stage one Triton kernel):

1. ``intra`` (one program per chunk × value head, fully parallel): the gate's cumulative sum inside the chunk,
   ``A_kk`` and ``A_qk`` in row blocks of ``BC`` rows (sub-chunks), the triangular solve (``BC × BC`` diagonal
   blocks inverted by forward substitution), and the outputs W ``[tokens, HV, K]``, U ``[tokens, HV, V]``,
   ``A_qk`` ``[tokens, HV, BT]`` (scale folded in); for KDA also ``q̃ = scale·q·exp(γ)``, ``k̃ = k·exp(γ_C − γ)``
   ``[tokens, HV, K]`` and ``exp(γ_C)`` ``[chunks, HV, K]`` (float32); for Gated DeltaNet ``γ`` ``[tokens, HV]``
   (float32). Intermediates are stored in the inputs' dtype (float32 stays float32). Two variants (``INTRA``):
   ``"blocks"`` (:mod:`.intra_blocks`, default) keeps all ``BT / BC`` in {1, 2, 4} blocks in registers at once
   and inverts them together (no read-back, no barrier); ``"rows"`` (:mod:`.intra`) walks the blocks one after
   the other, block forward substitution on W and U through memory (any ``BT / BC``, fewer live registers).
2. ``state`` (:mod:`.state`, one program per sequence × value head × ``h_BV`` value channels, sequential over
   the sequence's chunks): ``V_new = U − W S``, ``S ← diag(exp(γ_C)) S + k̃ᵀ V_new`` with S in float32
   registers. Unfused it stores each chunk-start state (inputs' dtype) and ``V_new``; with ``FUSE_OUTPUT`` it
   also computes the output itself (no per-chunk states in memory, more work on the sequential pass).
   ``STATE_LAYOUT``: the state tile as ``[K, h_BV]`` (``"kv"``) or transposed, ``[h_BV, K]`` (``"vk"``: the
   state and ``V_new`` become the dots' left operands, which Hopper's wgmma can take from registers).
3. ``output`` (:mod:`.output`, only without ``FUSE_OUTPUT``; chunk × V tile × value head, fully parallel):
   ``O = q̃ S_c + A_qk V_new``.

Variable length (``cu_seqlens``): the chunk table (start, end of every chunk of every sequence, each sequence
starting its own chunks at its own offset) is built on the host; empty sequences have no chunks (their
final state is their initial state).

Tunable parameters (``legal_params``): ``BT`` chunk size; ``BC`` sub-chunk rows (``BC <= BT``, else
ValueError); ``INTRA`` the stage-1 variant (``"blocks"`` needs ``BT / BC <= 4``, else ValueError);
``SAFE_DIAG`` (KDA only) the diagonal-block guard; ``STATE_LAYOUT`` the state pass's tile layout;
``intra_BK``/``intra_BV`` key/value tiles of stage 1, ``h_BV`` value tile of the state pass, ``o_BK``/``o_BV``
tiles of the output stage (tiles larger than the head dimension are clipped to it); ``*_num_warps`` and
``*_num_stages`` per stage; ``FUSE_OUTPUT``; ``F32_DOT``, the precision of tensor-core dots on float32 inputs
(``"ieee"`` exact, ``"tf32"`` faster, ~1e-3 relative error; ignored for 16-bit inputs, whose dots run on their
own dtype).

NUMERICS (where a configuration is unsafe):

* No configuration ever forms ``exp(γ_i)·exp(−γ_j)`` across a chunk. Gated DeltaNet builds the ``[C, C]``
  decay ``exp(γ_i − γ_j)`` directly (masked before the exp): safe at every ``BT``. KDA off-diagonal blocks use
  a reference point between the row block and the column block (the row block's first row, or the last row
  before it): both factors ≤ 1, safe at every ``BT``/``BC``.
* KDA diagonal blocks (``BC × BC``, rows and columns in the same sub-chunk): one dot around the block's middle
  row ``m``, factors ``exp(γ_i − γ_m)`` and ``exp(γ_m − γ_j)`` in float32 — finite and exact to rounding while the
  block's half span ``max_d max(γ_first − γ_m, γ_m − γ_last)`` (at most about ``BC/2 · max|g|``) stays below ~88.
  ``SAFE_DIAG = True`` (default): where a block's half span exceeds 80, the element-wise loop
  ``Σ_d k_i k_j exp(min(γ_i − γ_j, 0))`` over its ``BC`` columns is used instead — ``INTRA = "rows"``: that block
  (per key tile) in place; ``INTRA = "blocks"``: the whole chunk, in a second launch that skips unflagged chunks.
  SAFE FOR EVERY GATE, and as fast as the dot whenever decays are moderate (half span ≤ 80: e.g. ``BC = 16``
  with per-step log gates ≥ −10, ``BC = 32`` with gates ≥ −5; the second launch then only costs its ~µs of
  early exits).
  ``SAFE_DIAG = False``: always the dot. UNSAFE when some ``|γ_i − γ_m|`` reaches ~88 (float32 exp overflows at
  88.7): at most about ``BC/2 · max|g|``, i.e. ``BC = 64`` once per-step log gates go below about −2.8, ``BC = 32``
  below about −5.5 (16 consecutive such steps), ``BC = 16`` below about −11. When unsafe, a factor is ``inf`` and
  the affected rows become inf/NaN, which propagates to the output: the correctness gate's NaN/Inf check rejects
  it (never a silently small error: an underflowing factor only drops contributions below ``exp(−80)``
  relative). The search space excludes ``SAFE_DIAG = False`` with ``BC = 64``.
* 16-bit inputs: the intermediates (W, U, A_qk, q̃, k̃, chunk states, V_new) are rounded to the inputs'
  dtype, as in flash-linear-attention; float16 inputs additionally need ``|v|`` and the state small enough for
  float16's range (the chunk states are stored in float16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from ..config import Config, new_output, next_power_of_2
from .intra import chunk_intra_kernel
from .intra_blocks import chunk_intra_blocks_kernel
from .output import chunk_output_kernel
from .state import chunk_state_kernel

GATE_CODES = {"none": 0, "scalar": 1, "channel": 2}

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
    "INTRA": ("blocks", "rows"),
    "STATE_LAYOUT": ("kv", "vk"),
}


def legal_params(gate: str) -> dict[str, tuple[Any, ...]]:
    """Every tunable parameter and all values the templates can be built with (``BC <= BT`` is also required)."""
    if gate not in GATE_CODES:
        raise ValueError(f"unknown gate mode {gate!r}")
    params = dict(_COMMON)
    if gate == "channel":
        params["SAFE_DIAG"] = (True, False)
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
        "STATE_LAYOUT": "kv",  # "vk" is not yet timed on a GPU (2026-11-29): the searches will decide
    }
    if gate == "channel":
        cfg["SAFE_DIAG"] = True
    return cfg


@dataclass
class Stage:
    """One kernel launch of the pipeline, for the profiler: ``run()`` launches it and returns the compiled kernel."""

    name: str
    run: Callable[[], Any]
    flops: float
    bytes: float


def _tile(choice: int, dim: int) -> int:
    """A tile of at most ``choice`` channels, at least 16 (tl.dot's minimum), no larger than the padded dim."""
    return max(16, min(choice, next_power_of_2(dim)))


def _chunk_table(cu_seqlens: torch.Tensor, BT: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunk_info int32 [NC, 2] = (first token, sequence end), chunk_offsets int32 [N + 1], NC)."""
    offs = cu_seqlens.detach().to("cpu", torch.int64)
    lens = offs[1:] - offs[:-1]
    counts = (lens + BT - 1) // BT
    chunk_offsets = torch.zeros(offs.numel(), dtype=torch.int64)
    torch.cumsum(counts, 0, out=chunk_offsets[1:])
    NC = int(chunk_offsets[-1])
    seq = torch.repeat_interleave(torch.arange(lens.numel()), counts)
    idx = torch.arange(NC) - chunk_offsets[seq]
    info = torch.stack([offs[seq] + idx * BT, offs[seq + 1]], 1)
    return (
        info.to(torch.int32).to(device, non_blocking=True),
        chunk_offsets.to(torch.int32).to(device, non_blocking=True),
        NC,
    )


def plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    gate: str,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    config: Config,
) -> tuple[list[Stage], tuple[torch.Tensor, torch.Tensor | None]]:
    """Allocate every buffer and return the stages (run in order) and the outputs ``(o, final_state)`` they fill."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT, BC = config["BT"], config["BC"]
    if BC > BT:
        raise ValueError(f"chunk config: BC={BC} must be <= BT={BT}")
    if config["INTRA"] == "blocks" and BT // BC not in (1, 2, 4):
        raise ValueError(f"chunk config: INTRA='blocks' holds 1, 2 or 4 sub-chunks, got BT={BT}, BC={BC}")
    GATE = GATE_CODES[gate]
    dev = q.device
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dt = torch.promote_types(q.dtype, v.dtype)
    dot_prec = config["F32_DOT"] if dt == torch.float32 else "tf32"
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    g = None if g is None else g.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    varlen = cu_seqlens is not None
    chunk_info: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None
    if cu_seqlens is not None:
        chunk_info, chunk_offsets, NC = _chunk_table(cu_seqlens, BT, dev)
    else:
        NC = B * triton.cdiv(T, BT)
    tokens = B * T
    fuse = bool(config["FUSE_OUTPUT"])

    # new_output NaN-fills when the correctness gate poisons outputs: the intermediates too, so that an element
    # a stage fails to write and a later stage reads shows up as NaN.
    o = new_output(B, T, HV, V, dtype=v.dtype, device=dev)
    ht = new_output(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    w = new_output(tokens, HV, K, dtype=dt, device=dev)
    u = new_output(tokens, HV, V, dtype=dt, device=dev)
    aqk = new_output(tokens, HV, BT, dtype=dt, device=dev)
    qg = kg = None
    if GATE == 2:
        qg = new_output(tokens, HV, K, dtype=dt, device=dev)
        kg = new_output(tokens, HV, K, dtype=dt, device=dev)
        gout = new_output(max(NC, 1), HV, K, dtype=torch.float32, device=dev)
    elif GATE == 1:
        gout = new_output(tokens, HV, dtype=torch.float32, device=dev)
    else:
        gout = None
    hbuf = None if fuse else new_output(max(NC, 1), HV, K, V, dtype=dt, device=dev)
    vnew = None if fuse else new_output(tokens, HV, V, dtype=dt, device=dev)

    isz, osz = q.element_size(), torch.empty((), dtype=dt).element_size()
    gsz = 0 if g is None else g.element_size() * (K if GATE == 2 else 1)
    ta = tokens * HV  # token-heads

    i_BK, i_BV = _tile(config["intra_BK"], K), _tile(config["intra_BV"], V)
    intra_grid = (NC, HV)
    safe_diag = bool(config.get("SAFE_DIAG", True))
    two_pass = GATE == 2 and safe_diag and config["INTRA"] == "blocks"  # "rows" guards each block in place
    flags = torch.empty(max(NC, 1) * HV, dtype=torch.int32, device=dev) if two_pass else None
    intra_args = (q, k, v, g, beta, w, u, aqk, qg, kg, gout, chunk_info, flags, scale, T)
    intra_kw: dict[str, Any] = dict(
        H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=i_BK, BV=i_BV, GATE=GATE, NB=BT // BC,
        NK=triton.cdiv(K, i_BK), NV=triton.cdiv(V, i_BV), VARLEN=varlen, DOT_PREC=dot_prec,
        num_warps=config["intra_num_warps"], num_stages=config["intra_num_stages"],
    )  # fmt: skip

    def run_intra() -> Any:
        if NC == 0:
            return None
        if config["INTRA"] == "blocks":
            first = chunk_intra_blocks_kernel[intra_grid](*intra_args, DIAG=1 if two_pass else 0, **intra_kw)
            if two_pass:  # redo, exactly, the chunks the first pass flagged (the others return at once)
                chunk_intra_blocks_kernel[intra_grid](*intra_args, DIAG=2, **intra_kw)
            return first
        rows_args = (*intra_args[:12], scale, T)  # the same arguments, without the flags
        return chunk_intra_kernel[intra_grid](*rows_args, SAFE_DIAG=safe_diag, **intra_kw)

    h_BK, h_BV = _tile(next_power_of_2(K), K), _tile(config["h_BV"], V)
    state_grid = (triton.cdiv(V, h_BV), N * HV)

    def run_state() -> Any:
        return chunk_state_kernel[state_grid](
            q,
            k,
            w,
            u,
            aqk,
            qg,
            kg,
            gout,
            h0,
            ht,
            hbuf,
            vnew,
            o,
            cu_seqlens,
            chunk_offsets,
            scale,
            T,
            H=H,
            HV=HV,
            K=K,
            V=V,
            BT=BT,
            BK=h_BK,
            BV=h_BV,
            GATE=GATE,
            USE_H0=h0 is not None,
            STORE_HT=output_final_state,
            VARLEN=varlen,
            FUSE_OUTPUT=fuse,
            DOT_PREC=dot_prec,
            TRANS=config["STATE_LAYOUT"] == "vk",
            num_warps=config["h_num_warps"],
            num_stages=config["h_num_stages"],
        )

    o_BK, o_BV = _tile(config["o_BK"], K), _tile(config["o_BV"], V)
    out_grid = (NC, triton.cdiv(V, o_BV), HV)

    def run_output() -> Any:
        if NC == 0:
            return None
        return chunk_output_kernel[out_grid](
            q,
            aqk,
            qg,
            gout,
            hbuf,
            vnew,
            o,
            chunk_info,
            scale,
            T,
            H=H,
            HV=HV,
            K=K,
            V=V,
            BT=BT,
            BK=o_BK,
            BV=o_BV,
            NK=triton.cdiv(K, o_BK),
            GATE=GATE,
            VARLEN=varlen,
            DOT_PREC=dot_prec,
            num_warps=config["o_num_warps"],
            num_stages=config["o_num_stages"],
        )

    # Nominal FLOPs (useful, triangular work) and compulsory bytes per stage.
    C = BT
    qk_read = 2 * tokens * H * K * isz
    gate_out = {0: 0, 1: ta * 4, 2: 2 * ta * K * osz + NC * HV * K * 4}[GATE]
    intra_flops = ta * (3 * C * K + C * V + C * C / 3)
    intra_bytes = qk_read + ta * (V * isz + isz + gsz) + ta * (K + V + C) * osz + gate_out
    state_in = ta * (K + V) * osz + (ta * 2 * K * osz if GATE == 2 else qk_read + (ta * 4 if GATE == 1 else 0))
    state_flops = ta * 4 * K * V
    state_bytes = state_in + (N * HV * K * V * 4 * ((h0 is not None) + output_final_state))
    out_flops = ta * (2 * K * V + C * V)
    if fuse:
        state_flops += out_flops
        state_bytes += ta * (C * osz + V * v.element_size())
    else:
        state_bytes += NC * HV * K * V * osz + ta * V * osz
    stages = [
        Stage("intra", run_intra, float(intra_flops), float(intra_bytes)),
        Stage("state+output" if fuse else "state", run_state, float(state_flops), float(state_bytes)),
    ]
    if not fuse:
        q_out = ta * K * osz if GATE == 2 else qk_read / 2 + (ta * 4 if GATE == 1 else 0)
        out_bytes = q_out + NC * HV * K * V * osz + ta * (C + V) * osz + ta * V * v.element_size()
        stages.append(Stage("output", run_output, float(out_flops), float(out_bytes)))
    return stages, (o, ht)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    gate: str,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    config: Config,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the pipeline on validated inputs with a checked, complete config; same contract as fused_recurrent."""
    stages, outputs = plan(q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, config)
    for stage in stages:
        stage.run()
    return outputs


__all__ = ["Stage", "default_config", "forward", "legal_params", "plan"]
