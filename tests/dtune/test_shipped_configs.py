"""Every shipped tuned config (dtune/configs/*.json) passes the correctness gate under the interpreter.

The H200 searches gated each winner in bf16 at its own shape, but a shipped file is also what the ops launch on
shapes nobody tuned (the nearest bucket's config): here each distinct config runs at its bucket's head dims and
grouping on a short odd-length sequence (T not a multiple of the chunk), and segmented configs with SEG_CHUNKS (the
backward's dh_SEG_CHUNKS) cut to one chunk, so that their sequence-parallel state passes (transitions, segment
combine; the reverse pass's segment ends) run at this small T too.
fp32 (the interpreter's bf16 dots are wrong); the search space's fp32 tolerance; strong decays, both states.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dtune.kernels import get_kernel

from dtune.shape import Gate, Shape
from dtune.tune.gate import gate
from dtune.tune.space import load_space

CONFIG_DIR = Path(__file__).resolve().parents[2] / "dtune" / "configs"


def _cases() -> dict[str, tuple[str, dict[str, Any], dict[str, int]]]:
    cases: dict[str, tuple[str, dict[str, Any], dict[str, int]]] = {}
    seen: set[str] = set()
    for path in sorted(CONFIG_DIR.glob("*.json")):
        for e in json.loads(path.read_text())["entries"]:
            b = e["bucket"]
            key = json.dumps([e["kernel"], e["config"], b["K"], b["V"], b["HV"] // b["H"]], sort_keys=True)
            if key in seen:  # the same config at the same dims: one run covers every bucket that ships it
                continue
            seen.add(key)
            name = f"{path.stem}-{e['kernel']}-{e['dtype']}-T{b['T']}-B{b['B']}-HV{b['HV']}-K{b['K']}"
            cases[name] = (e["kernel"], e["config"], b)
    return cases


CASES = _cases()


def test_there_are_shipped_configs() -> None:
    assert len(CASES) >= 10  # the H200 file ships the chunk grid: an empty or unread folder must not pass silently


@pytest.mark.parametrize("name", sorted(CASES))
def test_shipped_config_passes_the_gate(name: str) -> None:
    kernel, config, b = CASES[name]
    spec = get_kernel(kernel)
    ratio = b["HV"] // b["H"]
    cfg = spec.check_config(b["K"], b["V"], config)
    segmented = bool(cfg.get("SEG_CHUNKS") or cfg.get("dh_SEG_CHUNKS"))
    if segmented:  # the forward's segments, and the backward's reverse pass in segments
        cfg = {**cfg, **{name: 1 for name in ("SEG_CHUNKS", "dh_SEG_CHUNKS") if cfg.get(name)}}
    bt = int(cfg.get("BT", 16))
    T = 3 * bt + 5 if kernel.startswith("chunk") else 9  # 4 chunks, the last one partial
    p = Shape(1, T, 1, ratio, b["K"], b["V"], 1, Gate(spec.gate))
    tol = load_space(kernel).tolerance["fp32"]
    result = gate(spec, p, torch.float32, "cpu", cfg, tol, edge=not kernel.endswith("_bwd"))
    assert result.passed, f"{name} (SEG_CHUNKS cut to 1: {segmented}): {result.reason}"
