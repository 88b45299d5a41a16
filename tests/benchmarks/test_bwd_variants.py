"""benchmarks/bwd_variants.py: every variant is a backward config the template accepts for each gate it runs on, and
the names are unique per gate and shape (a row of its CSV is one variant)."""

from __future__ import annotations

from types import ModuleType

import pytest
from dtune.kernels.chunk import backward as chunk_bwd

from tests.benchmarks.conftest import load_script


@pytest.fixture(scope="module")
def bv() -> ModuleType:
    return load_script("bwd_variants")


def test_every_variant_is_a_legal_backward_config(bv: ModuleType) -> None:
    seen: set[tuple[str, str, str]] = set()
    for name, cfg, shapes, gates in bv.VARIANTS:
        for gate in gates:
            if cfg is not None:
                chunk_bwd.check_config(128, 128, gate.value, cfg)  # raises on an unknown key or a broken rule
            for shape in shapes:
                assert shape in ("b8", "b1", "g2"), (name, shape)
                key = (name, gate.value, shape)
                assert key not in seen, f"variant {name!r} twice for {gate.value} at {shape}"
                seen.add(key)


def test_kin_lookup_reads_the_other_gpus_file(bv: ModuleType) -> None:
    """The kin GPU's entry on an H200 is the H100 file's config at the bucket (and the reverse), not the GPU's own."""
    from importlib import resources

    import torch

    from dtune.shape import Gate, Shape
    from dtune.store import kin_gpu, read_configs

    def own(gpu: str) -> dict[str, object] | None:
        ref = resources.files("dtune.configs").joinpath(f"{gpu}.json")
        return read_configs(str(ref), gpu).lookup("chunk_gated_delta_rule_bwd", "bf16", p)

    p = Shape(8, 4096, 16, 16, 128, 128, 8, Gate.SCALAR)
    for gpu in ("h200", "h100"):
        kin = kin_gpu(gpu)
        assert kin is not None and kin != gpu
        got = bv.kin_lookup("chunk_gated_delta_rule_bwd", p, torch.bfloat16, gpu)
        assert got == own(kin)
    assert bv.kin_lookup("chunk_gated_delta_rule_bwd", p, torch.bfloat16, None) is None


def test_pairs_run_only_where_a_variant_applies(bv: ModuleType) -> None:
    """g2 (grouped value heads) is Gated DeltaNet's alone: DeltaNet and KDA get no reference, fla or timing there."""
    from dtune.shape import Gate

    got = bv.pairs([Gate.NONE, Gate.SCALAR, Gate.CHANNEL], ["b8", "g2"])
    assert got == [(Gate.NONE, "b8"), (Gate.SCALAR, "b8"), (Gate.CHANNEL, "b8"), (Gate.SCALAR, "g2")]
    p = bv.shape(Gate.SCALAR, "g2", interpret=False)
    assert (p.B, p.T, p.H, p.HV) == (8, 4096, 16, 32)
