"""On a GPU: fla's ops with and without the dtune backend agree within bf16 error on every option (outputs, final
states and every gradient, each also against the float64 reference), and the calls are seen to route to dtune in fla's
own log. Shapes: the model heads of benchmarks/model_shapes.toml (Qwen3-Next's Gated DeltaNet H = 16, HV = 32; Kimi
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
