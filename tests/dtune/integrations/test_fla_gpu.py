"""On a GPU: fla's ops with and without the dtune backend agree within bf16 error on every option (outputs, final
states and every gradient, each also against the float64 reference), and the calls are seen to route to dtune in fla's
own log. Shapes: the model heads of dtune/models.toml (Qwen3-Next's Gated DeltaNet H = 16, HV = 32; Kimi
Linear's KDA H = 32; D = 128), B = 1, T = 1024, bf16."""

from __future__ import annotations

import pytest
import torch

from dtune.integrations import fla_check

pytestmark = pytest.mark.gpu

CASES = fla_check.cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fla_op_with_and_without_dtune_agree(case: fla_check.Case) -> None:
    H, HV = (32, 32) if "kda" in case.op else (16, 32)
    row = fla_check.compare(case, fla_check.Dims(1, 1024, H, HV, 128, 128), torch.bfloat16, torch.device("cuda"))
    assert row["route_with"] == "dtune", row
    assert row["agree"], row


def test_training_step_fla_refuses_runs_on_dtune(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fla's own Gated DeltaNet backward raises (Hopper, Triton >= 3.4, < 3.7.1: fla issue 640), the default
    (measured) policy takes the training step: fla alone raises, with the backend on the same call runs on dtune and
    its gradients match the float64 reference."""
    from dtune.integrations import fla as dtune_fla

    if not dtune_fla.fla_checks_gated_backward():
        pytest.skip(
            "fla does not refuse its Gated DeltaNet backward here (it does on Hopper with Triton >= 3.4, < 3.7.1)"
        )
    monkeypatch.delenv(dtune_fla.ENV, raising=False)
    case = next(c for c in CASES if c.name == "gdn-layer")  # Qwen3-Next's call
    row = fla_check.compare(case, fla_check.Dims(1, 1024, 16, 32, 128, 128), torch.bfloat16, torch.device("cuda"),
                            policy="measured")  # fmt: skip
    assert "640" in row["note"], row  # fla alone raised its check
    assert row["route_with"] == "dtune", row
    assert row["agree"], row
