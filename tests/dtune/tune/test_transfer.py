"""Transfer: a new shape starts from the winners of the nearest tuned buckets, nearest first, each config once."""

from __future__ import annotations

from dtune.shape import Shape
from dtune.tune.transfer import Donor, nearest


def donor(T: int, config: dict[str, int], gpu: str = "h200", dtype: str = "bf16", K: int = 128) -> Donor:
    bucket = {"T": T, "B": 1, "H": 16, "HV": 16, "K": K, "V": K}
    return Donor("chunk_kda", gpu, dtype, bucket, config, 1.0, "test")


def test_nearest_donors_first_each_config_once() -> None:
    shape = Shape(1, 4096, 16, 16, 128, 128)
    donors = [
        donor(65536, {"BT": 1}),
        donor(4096, {"BT": 2}, gpu="h100"),  # another GPU: after every donor of this one
        donor(8192, {"BT": 3}),
        donor(4096, {"BT": 4}, K=64),  # other head dims: after the same dims
        donor(2048, {"BT": 3}),  # the same config as a nearer bucket's: once
        donor(4096, {"BT": 5}, dtype="fp16"),
        Donor("chunk_gated_delta_rule", "h200", "bf16", {"T": 4096, "B": 1, "H": 16, "HV": 16, "K": 128, "V": 128},
              {"BT": 6}, 1.0, "test"),  # another kernel: never
    ]  # fmt: skip
    got = [d.config["BT"] for d in nearest(donors, "chunk_kda", "h200", "bf16", shape, count=10)]
    assert got == [3, 1, 4, 5, 2]
    assert [d.config["BT"] for d in nearest(donors, "chunk_kda", "h200", "bf16", shape, count=2)] == [3, 1]
    assert nearest(donors, "chunk_kda", "h200", "bf16", shape, count=0) == []  # --transfer-count 0: none
