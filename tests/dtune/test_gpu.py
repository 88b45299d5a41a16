from __future__ import annotations

import pytest

import dtune.gpu as gpu
from dtune.gpu import GpuError, get_profile, key_for_name, profiles, resolve_gpu

REQUIRED = ("h100", "h200", "a100", "l40s", "b200", "rtx4090", "cpu")


def test_profiles_complete_and_sourced() -> None:
    table = profiles()
    assert set(REQUIRED) <= set(table)
    for key, p in table.items():
        assert p.key == key
        assert p.sm_count > 0 and p.smem_per_block > 0 and p.regs_per_sm > 0, key
        assert p.source.strip(), key
        if key != "cpu":
            assert p.cc_major >= 8 and p.hbm_gbs > 0 and p.bf16_tflops > 0 and p.fp32_tflops > 0, key
            assert "http" in p.source, f"{key}: cite the datasheet"
    assert get_profile("h100").smem_per_block == 232448
    assert get_profile("A100").cc_major == 8  # keys are case-insensitive


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(GpuError, match=r"unknown GPU 'h900'.*h100"):
        get_profile("h900")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA GH200 480GB", None),  # not an H200
        ("Tesla T4", None),
    ],
    ids=lambda x: str(x),
)
def test_key_for_device_name(name: str, key: str | None) -> None:
    assert key_for_name(name) == key


def test_interpret_runs_are_labelled_cpu() -> None:
    assert resolve_gpu("auto", interpret=True).key == "cpu"
    assert resolve_gpu("cpu", interpret=True).key == "cpu"
    with pytest.raises(GpuError, match="labelled 'cpu'"):
        resolve_gpu("h100", interpret=True)
    assert resolve_gpu("h100", allow_mismatch=True, interpret=True).key == "h100"


def test_no_gpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "device_name", lambda index=0: None)
    with pytest.raises(GpuError, match="no CUDA GPU found; use --interpret"):
        resolve_gpu("auto")
    with pytest.raises(GpuError, match="no CUDA GPU found"):
        resolve_gpu("h100")


def test_mismatch_refused_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert resolve_gpu("auto").key == "h100"
    assert resolve_gpu("h100").key == "h100"
    assert gpu.detect() == "h100"
    with pytest.raises(GpuError, match=r"--gpu h200 .* does not match the GPU present"):
        resolve_gpu("h200")
    assert resolve_gpu("h200", allow_mismatch=True).key == "h200"
    with pytest.raises(GpuError, match="only for --interpret"):
        resolve_gpu("cpu")


def test_unprofiled_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "device_name", lambda index=0: "Tesla T4")
    with pytest.raises(GpuError, match="has no dtune profile"):
        resolve_gpu("auto")
    with pytest.raises(GpuError, match="does not match"):
        resolve_gpu("l40s")
    assert resolve_gpu("l40s", allow_mismatch=True).key == "l40s"


@pytest.mark.parametrize(
    ("key", "candidates", "expected"),
    [
        ("h100", ["h200"], "h200"),  # the same die: every H200 config is legal and fits on an H100
        ("h100", ["a100", "b200", "h200"], "h200"),  # other architectures never serve
        ("h200", ["h200"], None),  # a GPU is not its own kin
        ("a100", ["h200", "b200"], None),  # nothing of its kind: the templates' defaults
        ("cpu", ["h200"], None),
        ("nope", ["h200"], None),
    ],
)
def test_kin_is_a_gpu_of_the_same_kind(key: str, candidates: list[str], expected: str | None) -> None:
    assert gpu.kin(key, candidates) == expected
