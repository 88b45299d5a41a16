"""The backward search spaces (search_spaces/chunk_*_bwd.toml) load with dtune.tune.space against the registered
backward kernels (chunk_*_bwd), and the tuned-config store accepts (and checks) their entries."""

from __future__ import annotations

import pytest
from dtune.kernels import get_kernel

from dtune.gpu import get_profile
from dtune.shape import Shape
from dtune.store import ConfigFileError, parse_configs
from dtune.tune.space import load_space

GATES = {"chunk_delta_rule_bwd": "none", "chunk_gated_delta_rule_bwd": "scalar", "chunk_kda_bwd": "channel"}


@pytest.mark.parametrize("kernel", list(GATES))
def test_backward_spaces_load_and_admit_the_default(kernel: str) -> None:
    spec = get_kernel(kernel)
    assert spec.backward and spec.gate == GATES[kernel] and spec.forward_kernel == kernel.removesuffix("_bwd")
    assert get_kernel(spec.forward_kernel).backward_kernel == kernel
    space = load_space(kernel)
    assert space.kernel == kernel and space.size() > 1
    assert "FUSE_DV" in space.params
    for gpu in ("h100", "h200"):
        limits = get_profile(gpu).constraint_fields()
        for shape in space.shapes.shapes():
            default = spec.default_config(shape.K, shape.V)
            assert space.violations(default, shape, limits) == [], (gpu, shape.key)
    # seeds are legal backward configs (over the default) and run on an H200 at one of the targets: B = 8, T = 4096 or
    # B = 1, T = 32768 (the sequence-parallel ones) at D = 128, or B = 32, T = 1024 at D = 64
    targets = (Shape(8, 4096, 16, 16, 128, 128), Shape(1, 32768, 16, 16, 128, 128), Shape(32, 1024, 16, 16, 64, 64))
    limits = get_profile("h200").constraint_fields()
    for seed in space.seeds:
        assert any(space.violations(spec.check_config(p.K, p.V, seed), p, limits) == [] for p in targets), seed
    b1_only = [s for s in space.seeds if s.get("dh_SEG_CHUNKS")]
    assert b1_only and all(space.violations(spec.check_config(128, 128, s), targets[0], limits) for s in b1_only)


def _doc(config: dict) -> dict:
    bucket = {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 128, "V": 128}
    entry = {"kernel": "chunk_kda_bwd", "dtype": "bf16", "bucket": bucket, "config": config}
    return {"schema": 1, "gpu": "h200", "entries": [entry]}


def test_store_accepts_backward_entries_and_checks_their_rules() -> None:
    configs = parse_configs(_doc({"SAVE": "all", "BT": 32, "FUSE_DV": False}), "test")
    assert configs.entries[0].kernel == "chunk_kda_bwd"
    with pytest.raises(ConfigFileError, match="BC <= BT <= 4"):  # the backward family's cross-parameter rule
        parse_configs(_doc({"BT": 128, "BC": 16}), "test")
    with pytest.raises(ConfigFileError, match="unknown parameter"):
        parse_configs(_doc({"intra_BK": 64}), "test")  # a forward parameter is not a backward one
