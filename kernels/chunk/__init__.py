"""Chunkwise templates of the delta-rule family (DeltaNet, Gated DeltaNet, KDA): the forward in three stages.

Math: docs/DESIGN.md §1 (chunk of ``C = BT`` tokens, WY/UT representation). Pipeline (each stage one Triton kernel):

1. ``intra`` (one program per chunk × value head, fully parallel): the gate's cumulative sum inside the chunk,
   ``A_kk`` and ``A_qk`` in row blocks of ``BC`` rows (sub-chunks), the triangular solve (``BC × BC`` diagonal
   blocks inverted by forward substitution), and the outputs W ``[tokens, HV, K]``, U ``[tokens, HV, V]``,
   ``A_qk`` ``[tokens, HV, BT]`` (scale folded in); for KDA also ``q̃ = scale·q·exp(γ)``, ``k̃ = k·exp(γ_C − γ)``
   ``[tokens, HV, K]`` and ``exp(γ_C)`` ``[chunks, HV, K]`` (float32); for Gated DeltaNet ``γ`` ``[tokens, HV]``
   (float32). Intermediates are stored in the inputs' dtype (float32 stays float32). Variants (``INTRA``):
   ``"blocks"`` (:mod:`.intra_blocks`, default) keeps all ``BT / BC`` in {1, 2, 4} blocks in registers at once
   and inverts them together (no read-back, no barrier); ``"blocks_split"`` the same with ``A_qk`` computed in a
   pass of its own after W and U (fewer live registers at 4 blocks, more loads); ``"rows"`` (:mod:`.intra`) walks
   the blocks one after the other, block forward substitution on W and U through memory (any ``BT / BC``);
   ``"onepass"`` (:mod:`.intra_kda`, KDA only, ``BT / BC`` in {1, 2}) builds every gate factor of a chunk in one
   pass over the key tiles from two exponentials per element (``"blocks"`` loads each gate element up to four
   times, sums it three times and takes five exponentials), W's operand through the W buffer. ``SOLVE``: the
   diagonal blocks' inverse by forward substitution or, at ``BC = 16``, by repeated squaring (six float32 dots).
2. ``state`` (:mod:`.state`, one program per sequence × value head × ``h_BV`` value channels, sequential over
   the sequence's chunks): ``V_new = U − W S``, ``S ← diag(exp(γ_C)) S + k̃ᵀ V_new`` with S in float32
   registers. Unfused it stores each chunk-start state (inputs' dtype) and ``V_new``; with ``FUSE_OUTPUT`` it
   also computes the output itself (no per-chunk states in memory, more work on the sequential pass).
   ``STATE_LAYOUT``: the state tile as ``[K, h_BV]`` (``"kv"``) or transposed, ``[h_BV, K]`` (``"vk"``: the
   state and ``V_new`` become the dots' left operands, which Hopper's wgmma can take from registers).
3. ``output`` (:mod:`.output`, only without ``FUSE_OUTPUT``; chunk × V tile × value head, fully parallel):
   ``O = q̃ S_c + A_qk V_new``.

What stage 1 hands the state pass (DeltaNet, Gated DeltaNet; fused output): ``WU = "stored"`` W and U as above;
``WU = "recomputed"``: only the chunk's inverse ``T = (I + A_kk)⁻¹`` (``[tokens, HV, BT]``, zeros right of the
diagonal; stage 1 then reads no v and does no W/U products), and the state pass forms ``V_new = T (β ⊙ (V − e^γ ⊙
K S))`` from the v and k tiles it loads anyway (W S = T (β ⊙ e^γ ⊙ K) S: one more ``[BT, BT] × [BT, h_BV]`` product
per chunk). ``AQK = "recomputed"``: ``scale · A_qk = scale · q kᵀ ⊙ e^(γ_i − γ_j)`` (causal) per chunk in the state
pass, from its q and k tiles (stage 1 reads no q). Both take q and k to the dots as loaded (``QK_DIRECT``'s algebra).
Bytes at B = 8, T = 4096, H = 16, D = 128, bf16 (:mod:`.cost`): 1.43 GB stored, 0.97 with W/U recomputed, 0.76 with
A_qk too (the compulsory q, k, v, o, gates and states: ~0.55 GB). KDA's ``WU = "recomputed"``: its per-channel
decays need ``P = β ⊙ K ⊙ e^γ`` ([tokens, K], stored by stage 1 in W's place) beside T, and no U; the state pass forms
``V_new = T (β ⊙ V − P S)``; its A_qk (per-channel) stays stored.

The state pass's loads: ``STATE_TMA`` tiles through TMA tensor descriptors (2-D token-major views, a chunk of rows by
one head's columns; built on the host per call), where the shape allows it (K a power of two, ``h_BV`` dividing V,
16-byte aligned inputs), else pointers; rows past a sequence's end then hold the next sequence's tokens, which the
kernel keeps out of V_new (so nothing of them reaches the output or the state). ``STATE_LOOP``: ``"range"`` (the
kernel's ``num_stages`` pipelines the loop's loads) or ``"specialized"`` (Triton's warp specialisation: producer warps
load chunk n + 1 while consumers compute chunk n; Triton 3.6 splits only the TMA, ``"vk"``, 4-warp, A_qk-stored loop:
elsewhere it runs as ``"range"``). Triton's interpreter ignores the loop attribute and runs the descriptors' loads.
``GATE_LOADS`` (Gated DeltaNet): the scalar gate's rows of a chunk loaded in the chunk they serve (``"pipelined"``:
Triton's pipeliner copies them through shared memory) or one chunk ahead into registers (``"prefetched"``; sm_90a,
Triton 3.6, the B8 config: 820 against 700 instructions per chunk of the loop).

Sequence-parallel state pass (``SEG_CHUNKS > 0``, for few long sequences, where ``N · HV · V / h_BV`` programs
cannot fill the GPU): each sequence is cut into segments of ``SEG_CHUNKS`` chunks. Phase 1 (``transitions``, the
state kernel in a mode of its own, parallel over segments): each segment's affine map ``S_end = M S_start + N``.
Phase 2 (``segment-starts``, :mod:`.segments`, sequential over the few segments of a sequence): every segment's
true entering state. Phase 3: the ordinary state pass (and fused output) per segment from that state. Exact (the
same chunk algebra), about ``(2V + K) / V`` times the state pass's work for ``SEG_CHUNKS``-fold parallelism;
Gated DeltaNet's ``SEG_DECAY`` skips, in phase 1, the transitions a bound of their norm shows negligible
(:func:`.common.transition_negligible`, equal to rounding): about ``2`` times the state pass's work under strong decays.

Layout of the package: :mod:`.pipeline` orchestrates (``plan``, ``forward``, ``forward_with_intermediates``);
:mod:`.call` prepares a call once (config checks, contiguous inputs, :mod:`.tables` built from one host copy of
``cu_seqlens``); :mod:`.buffers` allocates; each stage file holds its kernel and its launcher; :mod:`.common`
holds the Triton helpers the stage kernels share; :mod:`.cost` the work model; :mod:`.params` the parameters.

Variable length (``cu_seqlens``): the chunk table (start, end of every chunk of every sequence, each sequence
starting its own chunks at its own offset) is built on the host, once per call; empty sequences have no chunks
(their final state is their initial state).

Gates: log gates are clamped at −20 per step when loaded (``common.GATE_FLOOR``): a gate of −inf (a full forget)
gives the reference's result (the ``exp(−20)`` a clamped step lets through is below float32 rounding), and every
path stays finite. NaN is not clamped (``common.floor_gate``): it reaches the outputs, as in the recurrence; a
positive gate is computed as the recurrence says (the exact diagonal blocks too).

Tunable parameters (``legal_params``): ``BT`` chunk size; ``BC`` sub-chunk rows (``BC <= BT``, else
ValueError); ``INTRA`` the stage-1 variant (``"blocks"`` needs ``BT / BC <= 4``, else ValueError);
``SAFE_DIAG`` (KDA only) the diagonal-block guard; ``STATE_LAYOUT`` the state pass's tile layout;
``SEG_CHUNKS`` the segment length of the sequence-parallel state pass (0: off), ``SEG_COMBINE`` its phase-2
kernel (``"regs"``: the state in registers, one tensor-core product per segment; ``"tiles"``: key tiles through
memory) and ``seg_BV`` that kernel's V tile; ``tr_BV``/``tr_num_warps`` phase 1's column tile and warps (0: the
state pass's); ``QK_DIRECT`` (DeltaNet, Gated DeltaNet) q and k go to the state pass's dots as loaded, the scale
and the scalar gate's factors act on the products and on ``V_new``'s token rows (``k̃ᵀ V_new = kᵀ (exp(γ_C − γ)
⊙ V_new)``, ``q̃ S = exp(γ) ⊙ (scale · q S)``);
``WU`` (``AQK``: DeltaNet, Gated DeltaNet) what stage 1 stores (``"recomputed"`` needs ``INTRA = "blocks"``, or KDA's
``"onepass"``, and for A_qk ``"blocks"`` or ``"blocks_split"``, and ``FUSE_OUTPUT``, else ValueError); ``STATE_TMA``, ``STATE_LOOP`` the
state pass's loads and loop; ``intra_BK``/``intra_BV`` key/value tiles of stage 1, ``h_BV`` value tile of the state pass, ``o_BK``/``o_BV``
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
  relative). The search space excludes ``SAFE_DIAG = False`` with ``BC = 64``. Full forgets (gates of −inf,
  clamped to −20) count 20 nats each: isolated ones are safe at ``BC = 16``, a key channel that forgets at every
  token is not (its half span is ``BC/2 · 20``) — only ``SAFE_DIAG = True`` is exact for every gate.
* 16-bit inputs: the intermediates (W, U, A_qk, q̃, k̃, chunk states, V_new; with ``WU = "recomputed"`` T and
  ``β ⊙ (V − e^γ ⊙ K S)``) are rounded to the inputs' dtype, as in flash-linear-attention; float16 inputs additionally need ``|v|`` and the state small enough for
  float16's range (the chunk states are stored in float16).
"""

from __future__ import annotations

from ..config import GATE_CODES
from .buffers import Intermediates, Outputs
from .call import ChunkCall, prepare_call
from .params import default_config, legal_params
from .pipeline import ForwardResult, Stage, build_stages, forward, forward_with_intermediates, plan

__all__ = [
    "GATE_CODES",
    "ChunkCall",
    "ForwardResult",
    "Intermediates",
    "Outputs",
    "Stage",
    "build_stages",
    "default_config",
    "forward",
    "forward_with_intermediates",
    "legal_params",
    "plan",
    "prepare_call",
]
