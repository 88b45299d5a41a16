"""A model of what a config's kernels will use, to drop hopeless configs before compiling them.

Per stage of the chunk pipeline: the register demand per thread (the live float32 tile elements each thread
holds, a linear fit) and the shared memory of its pipelined loads. A stage whose demand exceeds the registers a
thread may have (255, or 65536 / threads when fewer) by more than :data:`SPILL_SLACK` registers is predicted to
spill; the search drops (prunes, reason ``predicted``) a config predicted to spill *heavily* (demand above
:data:`DROP_FACTOR` x the cap: those ran 1.5-20x slower than the default on the H200, 2026-11-30) or to exceed
the GPU's shared memory per block.

Checked against ptxas on real compiles: the coefficients were fitted to sm_90a compiles (Triton 3.9's ptxas, on a
CPU) of 250 random legal configs of the three chunk kernels at D = 64 and 128, half of them one to three moves from
the default. Fitted on the first 150 and checked on the other 100: spill predicted right for 96% of intra "blocks"
stages, 100% of "rows" (11) and output (24) stages, 91% of state passes (its errors: predicted spills that ptxas
avoided); of the 8 configs the model would drop, 6 spilled heavily and 2 spilled 56 bytes. On the H200's own compiles
(Triton 3.6; the 65 distinct chunk configs the searches of 2026-11-29/30 compiled, spills summed over the stages)
it predicts spilling right for 52 (80%) and drops 10: 8 spilled more than 64 bytes, 2 spilled 38-40 bytes, and
all 10 ran 1.5-20x slower than the best config of their search.
``scripts/resource_model_check.py`` compiles a fresh sample without a GPU and prints the same figures; on a GPU
every compiled trial records the model's prediction next to what its kernels really used (``trials.csv`` columns
``pred_spill``, ``spilled``, ``model_hit``; the run summary's ``model_hit_rate``). Shared memory is predicted from
the pipelined loads (state pass: within 0.7-2.5x of ptxas; intra and output: within 0.2-2.3x), so it only drops a
config predicted over the limit by :data:`SMEM_MARGIN` (an overflow fails fast in the compile pool anyway).
A stage "spilled" when ptxas reports more than :data:`SPILL_BYTES` bytes of spill stores (a few bytes at the
255-register cap are common and harmless: the default KDA intra stage spills 0-12 bytes depending on Triton).

Only the chunk family has a model; other kernels are never dropped by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dtune.kernels.config import next_power_of_2

MAX_REGS = 255
SPILL_SLACK = 16  # registers of demand over the cap before a spill counts (SPILL_BYTES / 4)
SPILL_BYTES = 64  # spill stores (bytes) that count as spilling
DROP_FACTOR = 1.35  # drop a config whose demand in some stage exceeds this many times its cap
SMEM_MARGIN = 1.25  # drop a config whose predicted shared memory exceeds the limit this many times

# Fitted register demand per thread (sm_90a, Triton 3.9 ptxas; scripts/resource_model_check.py): intercept, then
# coefficients of the features of _features (element counts per thread of each stage's main tiles).
_COEFS: dict[str, tuple[float, ...]] = {
    "intra-blocks": (59.03, 85.89, 0.79, 0.52, 1.59, 0.96, 7.47),
    "intra-rows": (199.29, 27.89, -0.52, -0.9, 1.33, 1.51, 4.86),
    "state": (89.95, 0.62, 2.15, 0.93, 0.03, -0.04, -18.58, -2.05),
    "output": (38.64, 1.7, -0.14, 0.75, -0.05, -6.01),
}


@dataclass(frozen=True)
class StagePrediction:
    """What one stage's kernels are predicted to use."""

    registers: float  # demand per thread (above ``cap``: spills)
    shared: int  # bytes per block
    cap: int  # registers a thread may use at this warp count

    @property
    def spills(self) -> bool:
        return self.registers > self.cap + SPILL_SLACK

    @property
    def heavy(self) -> bool:
        return self.registers > self.cap * DROP_FACTOR


def _tile(choice: int, dim: int) -> int:
    return max(16, min(choice, next_power_of_2(dim)))


def _cap(warps: int, maxnreg: int = 0) -> int:
    """Registers a thread may use: 255, fewer at many warps, and no more than the config's cap (``*_maxnreg``)."""
    return min(MAX_REGS, 65536 // (32 * warps), maxnreg or MAX_REGS)


def _dot(name: str, x: tuple[float, ...]) -> float:
    return sum(c * f for c, f in zip(_COEFS[name], (1.0, *x)))


def chunk_prediction(gate: str, config: Mapping[str, Any], K: int, V: int, elem: int) -> dict[str, StagePrediction]:
    """The chunk pipeline's stages (``intra``, ``state``, and ``output`` when unfused) for one config; ``elem`` is
    the inputs' element size in bytes (2 for 16-bit, 4 for float32)."""
    BT, Kp = config["BT"], next_power_of_2(K)
    ch = float(gate == "channel")
    out: dict[str, StagePrediction] = {}

    w = config["intra_num_warps"]
    P = 32 * w
    BK, BV = _tile(config["intra_BK"], K), _tile(config["intra_BV"], V)
    x: tuple[float, ...] = (
        ch,
        BT * BK / P,
        BT * BV / P,
        BT * BT / P,
        ch * BT * BK / P,
        float(config["intra_num_stages"] > 1),
    )
    variant = "intra-blocks" if config["INTRA"] == "blocks" else "intra-rows"
    intra_smem = (config["intra_num_stages"] * elem * BT * (BK + BV) + 4 * BT * BT) // 3  # fitted scale
    out["intra"] = StagePrediction(_dot(variant, x), intra_smem, _cap(w, int(config.get("intra_maxnreg", 0))))

    w = config["h_num_warps"]
    P = 32 * w
    hBV, fuse = _tile(config["h_BV"], V), bool(config["FUSE_OUTPUT"])
    x = (
        float(gate != "none"),
        Kp * hBV / P,
        BT * Kp / P,
        float(fuse) * BT * (Kp + BT) / P,
        BT * hBV / P,
        float(config["STATE_LAYOUT"] == "vk"),
        float(config["h_num_stages"]),
    )
    # pipelined loads per stage (16-bit: 2 bytes): W, k~ [BT, K], U [BT, h_BV], and fused also q~ [BT, K], A_qk [BT, BT]
    state_smem = 3 * config["h_num_stages"] * elem * BT * ((3 if fuse else 2) * Kp + hBV + BT) // 4
    out["state"] = StagePrediction(_dot("state", x), state_smem, _cap(w, int(config.get("h_maxnreg", 0))))

    if not fuse:
        w = config["o_num_warps"]
        P = 32 * w
        oBK, oBV = _tile(config["o_BK"], K), _tile(config["o_BV"], V)
        x = (BT * oBV / P, oBK * oBV / P, BT * oBK / P, BT * BT / P, float(config["o_num_stages"]))
        o_smem = config["o_num_stages"] * elem * (BT * oBK + oBK * oBV + BT * BT) // 2
        out["output"] = StagePrediction(_dot("output", x), o_smem, _cap(w))
    return out


def predict(kernel: str, config: Mapping[str, Any], K: int, V: int, dtype: str) -> dict[str, StagePrediction] | None:
    """Per-stage predictions of ``kernel`` with a full config, or None when the kernel has no model (the chunk
    forward has one)."""
    from dtune.kernels import get_kernel

    spec = get_kernel(kernel)
    if spec.family != "chunk" or spec.backward:  # fitted on the forward's stages only
        return None
    return chunk_prediction(spec.gate, config, K, V, 4 if dtype == "fp32" else 2)


def drop_reason(pred: Mapping[str, StagePrediction] | None, smem_per_block: int) -> str | None:
    """Why the model drops the config (heavy spills or shared memory over the limit), or None."""
    if not pred:
        return None
    for name, p in pred.items():
        if p.shared > smem_per_block * SMEM_MARGIN:
            return f"predicted: stage {name} needs ~{p.shared} bytes of shared memory (limit {smem_per_block})"
        if p.heavy:
            return f"predicted: stage {name} needs ~{p.registers:.0f} registers a thread (cap {p.cap}): heavy spills"
    return None


def predicted_spills(pred: Mapping[str, StagePrediction] | None) -> list[str]:
    return sorted(n for n, p in (pred or {}).items() if p.spills)


def actual_spills(stage_resources: Mapping[str, Any]) -> list[str] | None:
    """Stages whose kernels spilled more than SPILL_BYTES (None when unknown, e.g. under the interpreter)."""
    if not stage_resources:
        return None
    spilled, known = [], False
    for name, res in stage_resources.items():
        spills = res[1] if isinstance(res, (list, tuple)) and len(res) > 1 else None
        if isinstance(spills, int):
            known = True
            if spills > SPILL_BYTES:
                spilled.append(name)
    return sorted(spilled) if known else None


def hit(pred: Mapping[str, StagePrediction] | None, stage_resources: Mapping[str, Any]) -> bool | None:
    """Whether the model's spill prediction matched every stage that ran (None: nothing to compare)."""
    actual = actual_spills(stage_resources)
    if pred is None or actual is None:
        return None
    ran = [n for n in pred if n in stage_resources]
    return all((n in actual) == pred[n].spills for n in ran)
