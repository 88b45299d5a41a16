"""One call of the chunk forward, checked and prepared once: inputs, shape, precision, config and index tables.

Every stage launcher takes a :class:`ChunkCall`; nothing about the call is recomputed per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GATE_CODES, Config, next_power_of_2
from ..options import NO_IN_KERNEL, InKernel
from .tables import ChunkTables, build_tables, host_offsets

Tensor = torch.Tensor


def tile(choice: int, dim: int) -> int:
    """A tile of at most ``choice`` channels, at least 16 (tl.dot's minimum), no larger than the padded dim."""
    return max(16, min(choice, next_power_of_2(dim)))


def check_structure(config: Config) -> None:
    """The config rules that are not a per-parameter choice: ValueError naming them."""
    BT, BC = config["BT"], config["BC"]
    if BC > BT:
        raise ValueError(f"chunk config: BC={BC} must be <= BT={BT}")
    if config["SOLVE"] == "squaring" and BC != 16:
        raise ValueError(f"chunk config: SOLVE='squaring' inverts 16-row sub-chunks only, got BC={BC}")
    if config["INTRA"] == "onepass" and BT // BC not in (1, 2):
        raise ValueError(f"chunk config: INTRA='onepass' holds 1 or 2 sub-chunks, got BT={BT}, BC={BC}")
    if config["INTRA"] != "rows" and BT // BC not in (1, 2, 4):
        raise ValueError(f"chunk config: INTRA='{config['INTRA']}' holds 1, 2 or 4 sub-chunks, got BT={BT}, BC={BC}")
    if config["INTRA"] in ("blocks", "blocks_split") and config["intra_num_warps"] > 4:
        # Two DeltaNet configs (BT 128 / BC 64 and BT 64 / BC 16, both unfused) hit illegal memory accesses compiled:
        # in a search on an H200 (2026-11-29) and in tests/kernels/test_chunk_crash_gpu.py on an H100 (2026-12-06);
        # correct under the interpreter, cause not isolated. Its 16-row tiles gain nothing from more warps anyway.
        raise ValueError(
            f"chunk config: INTRA='{config['INTRA']}' runs at most 4 warps (intra_num_warps="
            f"{config['intra_num_warps']} hit illegal memory accesses compiled): use 1, 2 or 4, or INTRA='rows'"
        )
    wu, aqk = config.get("WU", "stored"), config.get("AQK", "stored")
    if wu == "recomputed" and config["INTRA"] not in ("blocks", "onepass"):
        raise ValueError(
            f"chunk config: WU='recomputed' runs stage 1 as INTRA='blocks' (or KDA's 'onepass'), got '{config['INTRA']}'"
        )
    if aqk == "recomputed" and config["INTRA"] not in ("blocks", "blocks_split"):
        raise ValueError(f"chunk config: AQK='recomputed' runs stage 1 as INTRA='blocks', got '{config['INTRA']}'")
    if aqk == "recomputed" and not config["FUSE_OUTPUT"]:
        raise ValueError("chunk config: AQK='recomputed' forms A_qk in the state pass, which needs FUSE_OUTPUT=True")


@dataclass(frozen=True)
class ChunkCall:
    """Contiguous inputs, shape, gate code, precision, the full config and the tables of one call."""

    q: Tensor  # [B, T, H, K]
    k: Tensor  # [B, T, H, K]
    v: Tensor  # [B, T, HV, V]
    g: Tensor | None  # [B, T, HV] or [B, T, HV, K] log gates
    beta: Tensor  # [B, T, HV]
    h0: Tensor | None  # [N, HV, K, V]
    gate: int  # GATE_CODES
    scale: float
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    dt: torch.dtype  # dtype of the intermediates and of the dots' operands
    dot_prec: str  # tl.dot input_precision for float32 operands
    output_final_state: bool
    config: Config
    tables: ChunkTables
    in_kernel: InKernel = NO_IN_KERNEL  # fla's options the stages apply as they load g, q, k and beta

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def varlen(self) -> bool:
        return self.tables.seq_bounds is not None

    @property
    def BT(self) -> int:
        return int(self.config["BT"])

    @property
    def NC(self) -> int:
        return self.tables.NC

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def fuse(self) -> bool:
        return bool(self.config["FUSE_OUTPUT"])

    @property
    def recompute(self) -> bool:
        """``WU = "recomputed"``: stage 1 stores the inverse ``T`` only, the state pass forms ``V_new`` and ``A_qk``."""
        return self.config.get("WU", "stored") == "recomputed"

    @property
    def recompute_qk(self) -> bool:
        """``AQK = "recomputed"``: the state pass forms ``scale · A_qk = scale · q kᵀ ⊙ e^(γ_i − γ_j)`` per chunk."""
        return self.config.get("AQK", "stored") == "recomputed"

    @property
    def tma(self) -> bool:
        """``STATE_TMA`` and a shape that allows it: every tile of a descriptor lies inside one head (K a power of two,
        ``h_BV`` dividing V) and the inputs start 16-byte aligned (the intermediates always do)."""
        if not self.config.get("STATE_TMA", False) or self.K != self.BK or self.V % self.h_BV or not self.tokens:
            return False
        return all(t.data_ptr() % 16 == 0 for t in (self.q, self.k, self.v))

    @property
    def BK(self) -> int:
        """The padded key dimension: the state pass holds every key channel."""
        return tile(next_power_of_2(self.K), self.K)

    @property
    def h_BV(self) -> int:
        return tile(self.config["h_BV"], self.V)

    def warps(self, stage: str) -> dict[str, Any]:
        """Launch options of a stage (``intra``, ``h`` or ``o``): warps, pipeline stages and the register cap where the
        config sets one (``intra_maxnreg``, ``h_maxnreg``; the interpreter ignores it)."""
        cfg = self.config
        opts = {"num_warps": cfg[f"{stage}_num_warps"], "num_stages": cfg[f"{stage}_num_stages"]}
        return opts | register_cap(cfg, stage)


def register_cap(config: Config, stage: str) -> dict[str, int]:
    """A stage's register cap as a launch option: Triton's ``maxnreg`` from ``<stage>_maxnreg`` (``intra``, ``h``,
    the backward's ``dqk``), none where it is 0 or absent (the interpreter ignores it)."""
    cap = int(config.get(f"{stage}_maxnreg", 0))
    return {"maxnreg": cap} if cap else {}


def intra_launch_options(call: ChunkCall) -> dict[str, Any]:
    """Constexprs and launch options of stage 1 that both variants (``intra``, ``intra_blocks``) take."""
    cfg = call.config
    BK, BV = tile(cfg["intra_BK"], call.K), tile(cfg["intra_BV"], call.V)
    return dict(
        H=call.H, HV=call.HV, K=call.K, V=call.V, BT=call.BT, BC=cfg["BC"], BK=BK, BV=BV, GATE=call.gate,
        NB=call.BT // cfg["BC"], NK=-(-call.K // BK), NV=-(-call.V // BV), VARLEN=call.varlen,
        DOT_PREC=call.dot_prec, **call.warps("intra"), **call.in_kernel.gate_args(), **call.in_kernel.chunk_args(),
    )  # fmt: skip


def prepare_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    config: Config,
    seq_offsets: Sequence[int] | None = None,
    in_kernel: InKernel = NO_IN_KERNEL,
) -> ChunkCall:
    """Check the config's structure, make the inputs contiguous and build the tables (inputs already validated).

    ``seq_offsets``: ``cu_seqlens`` on the host when the caller already has it (``dtune.inputs.check_inputs``
    returns it): then the tables cost no device-to-host copy. Without it ``cu_seqlens`` is read once here.
    ``in_kernel``: fla's in-kernel options the chunk forward applies: the gate activation (``g`` is then raw), the
    l2norm of q and k and beta's activation (every stage that loads them); not ``state_v_first`` (the caller transposes
    the states).
    """
    if gate not in GATE_CODES:
        raise ValueError(f"unknown gate mode {gate!r}")
    if in_kernel.state_vk:
        raise ValueError("the chunk forward takes [K, V] states: transpose state_v_first's around the call")
    if in_kernel.gate_activation and gate == "none":
        raise ValueError("use_gate_in_kernel needs a gated kernel (DeltaNet has no gate)")
    check_structure(config)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    offsets: Sequence[int] | None = None
    if cu_seqlens is not None:
        offsets = seq_offsets if seq_offsets is not None else host_offsets(cu_seqlens)
    N = B if offsets is None else len(offsets) - 1
    dt = torch.promote_types(q.dtype, v.dtype)
    tables = build_tables(offsets, B, T, int(config["BT"]), int(config.get("SEG_CHUNKS", 0)), q.device)
    return ChunkCall(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        g=None if g is None else g.contiguous(),
        beta=beta.contiguous(),
        h0=None if initial_state is None else initial_state.contiguous(),
        gate=GATE_CODES[gate],
        scale=float(scale),
        B=B,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        N=N,
        dt=dt,
        dot_prec=config["F32_DOT"] if dt == torch.float32 else "tf32",
        output_final_state=output_final_state,
        config=config,
        tables=tables,
        in_kernel=in_kernel,
    )
