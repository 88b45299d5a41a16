"""A backward kernel end to end under the interpreter: `dtune search --kernel chunk_delta_rule_bwd` tunes the
backward's parameters on the training step, exports an entry, and the op's backward then runs with that entry's config
(recorded at the backward's launcher), and with the default once the file is gone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from dtune.kernels import get_kernel
from dtune.kernels.chunk import backward as chunk_bwd

import dtune.store
import dtune.tune.trials
from dtune import ops
from dtune.gpu import get_profile
from dtune.measure.harness import OpRun
from dtune.measure.inputs import make_inputs
from dtune.plugins import ENV
from dtune.tune.search import INTERPRET_SHAPES, SearchConfig, run_search
from dtune.tune.space import load_space

KERNEL = "chunk_delta_rule_bwd"
PLUGIN = Path(__file__).parent.parent / "bwd_timing.py"
SEED = {"SAVE": "all", "BT": 64, "dqk_BK": 32, "dqk_BV": 32}  # tiles: D = 32


def test_search_exports_a_backward_config_that_the_op_then_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(PLUGIN))  # the favoured config (SAVE = "all") wins the interpreter's timing
    monkeypatch.setattr(OpRun, "call", OpRun.call)  # restored after the test: the plugin patches them here too
    monkeypatch.setattr(dtune.tune.trials, "time_call", dtune.tune.trials.time_call)
    space = dataclasses.replace(load_space(KERNEL), seeds=(SEED,))
    shape = INTERPRET_SHAPES.shapes()[0]
    cfg = SearchConfig(
        kernel=KERNEL,
        gpu=get_profile("cpu"),
        space=space,
        shapes=[shape],
        out=tmp_path,
        dtype="fp32",
        trials=2,
        interpret=True,
        transfer_count=0,
    )  # fmt: skip (no shipped donor: the seed is the second trial)
    run = run_search(cfg)
    rows = pd.read_csv(tmp_path / "trials.csv").sort_values("number")
    assert rows["state"].tolist() == ["complete", "complete"], rows["message"].tolist()
    assert rows["error_s"].max() < 1e-4  # the gate checked the gradients (fp32 vs float64)
    assert run.shapes[0].best_config is not None and run.shapes[0].best_config["SAVE"] == "all"
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    (entry,) = tuned["entries"]
    assert entry["kernel"] == KERNEL and entry["config"] == {**get_kernel(KERNEL).default_config(32, 32), **SEED}

    # the op's backward reads the export (the interpreter has no tuned configs: treat the CPU as the run's "GPU")
    monkeypatch.setattr(dtune.store, "gpu_key", lambda device: "cpu")
    dtune.store.load_configs(tmp_path / "tuned.json", gpu="cpu")
    seen: list[dict[str, Any]] = []
    real = chunk_bwd.backward

    def record(*args: Any) -> Any:
        seen.append(args[12])  # backward(do, dht, q, k, v, g, beta, gate, scale, h0, cu, fwd_config, bwd_config, ..)
        return real(*args)

    monkeypatch.setattr(chunk_bwd, "backward", record)
    x = make_inputs(dataclasses.replace(shape, gate=shape.gate), seed=5)
    v = x["v"].requires_grad_()
    o, _ = ops.chunk_delta_rule(x["q"], x["k"], v, x["beta"], initial_state=x["initial_state"])
    o.sum().backward()
    assert seen == [entry["config"]] and v.grad is not None
    dtune.store.reset()
    v.grad = None
    o, _ = ops.chunk_delta_rule(x["q"], x["k"], v, x["beta"], initial_state=x["initial_state"])
    o.sum().backward()
    assert seen[-1] == get_kernel(KERNEL).default_config(32, 32)
    assert torch.isfinite(v.grad).all()
