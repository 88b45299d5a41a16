"""dtune.integrations.fla_check.compare on synthetic outcomes (no GPU): a call fla refuses in its backward still
compares fla's output and final state; a refusal before any output compares nothing of fla's."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import pytest
import torch

from dtune.integrations import fla_check


def outcomes(refused_after_forward: bool) -> list[fla_check.Outcome]:
    g = torch.Generator().manual_seed(0)
    ref_o, ref_ht, ref_dq = (torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def near(x: torch.Tensor, e: float) -> torch.Tensor:
        return x + e * torch.randn(x.shape, generator=g, dtype=torch.float64) * x.pow(2).mean().sqrt()

    error = "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produce wrong gradients"
    theirs = (
        fla_check.Outcome(o=near(ref_o, 1e-3), ht=near(ref_ht, 1e-3), route="fla", error=error)
        if refused_after_forward
        else fla_check.Outcome(route="fla", error=error)
    )
    ours = fla_check.Outcome(o=near(ref_o, 2e-3), ht=near(ref_ht, 2e-3), grads={"q": near(ref_dq, 2e-3)}, route="dtune")
    ref = fla_check.Outcome(o=ref_o, ht=ref_ht, grads={"q": ref_dq}, route="fla")
    return [theirs, ours, ref]  # in the order compare runs them


@pytest.mark.parametrize("refused_after_forward", [True, False])
def test_fla_refusing_its_backward_still_compares_its_forward(
    backend: ModuleType, monkeypatch: pytest.MonkeyPatch, refused_after_forward: bool
) -> None:
    queue = outcomes(refused_after_forward)
    monkeypatch.setattr(fla_check, "make_inputs", lambda *a, **k: {})
    monkeypatch.setattr(fla_check, "run", lambda case, x, call: queue.pop(0))
    case = fla_check.Case("gdn-plain", "chunk_gated_delta_rule")
    row: dict[str, Any] = fla_check.compare(case, fla_check.Dims(1, 8, 1, 1, 8, 8), torch.float64, torch.device("cuda"))
    assert row["route_with"] == "dtune" and row["agree"], row
    if refused_after_forward:
        e = float(row["fla_vs_ref"].split()[0])
        assert 0 < e < 3e-3 and ("(ht)" in row["fla_vs_ref"] or "(o)" in row["fla_vs_ref"]), row
        assert not math.isnan(float(row["dtune_vs_fla"].split()[0]))
        assert row["note"].startswith("fla's forward compared, its gradients not"), row
    else:
        assert "fla_vs_ref" not in row and "dtune_vs_fla" not in row, row
        assert row["note"].startswith("RuntimeError"), row
