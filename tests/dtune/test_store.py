"""Run-time dispatch: nearest bucket, legal configs only, corrupt files refused or warned about."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dtune.gpu
import dtune.store as store
from dtune.shape import Gate, Shape
from dtune.store import ConfigFileError, load_configs, read_configs, tuned_config

KDA = "fused_recurrent_kda"
CUDA = torch.device("cuda", 0)  # a descriptor only: no GPU is touched


def entry(T: int, B: int, BV: int, H: int = 16, HV: int = 16, K: int = 128, V: int = 128, **kw: Any) -> dict[str, Any]:
    e = {
        "kernel": KDA,
        "dtype": "bf16",
        "bucket": {"T": T, "B": B, "H": H, "HV": HV, "K": K, "V": V},
        "config": {"BV": BV, "num_warps": 4, "num_stages": 1},
        "time_ms": 1.0,
        "default_time_ms": 2.0,
        "speedup": 2.0,
        "gate_error": 1e-3,
        "trials": {"complete": 3, "failed": 1, "pruned": 1},
    }
    e.update(kw)
    return e


ENTRIES = [entry(1, 1, 8), entry(1, 256, 16), entry(64, 32, 32), entry(1024, 32, 64), entry(64, 32, 128, HV=32)]


def doc(entries: list[dict[str, Any]] = ENTRIES, gpu: str = "h100", schema: int = 1) -> dict[str, Any]:
    return {"schema": schema, "gpu": gpu, "gpu_name": "x", "created": "now", "versions": {}, "entries": entries}


def write(tmp_path: Path, content: Any, name: str = "tuned.json") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def problem(T: int, B: int, H: int = 16, HV: int = 16, K: int = 128, V: int = 128) -> Shape:
    return Shape(B=B, T=T, H=H, HV=HV, K=K, V=V, N=B, gate=Gate.CHANNEL)


@pytest.fixture
def on_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "h100")


@pytest.mark.parametrize(
    ("T", "B", "BV"),
    [
        (1, 1, 8),  # exact
        (1, 256, 16),  # exact
        (1, 200, 16),  # nearest batch at T = 1
        (2, 1, 8),  # T = 2: log-nearest is 1
        (100, 8, 32),  # nearest T is 64
        (700, 1, 64),  # nearest T is 1024
    ],
    ids=lambda x: str(x),
)
def test_nearest_bucket(tmp_path: Path, on_h100: None, T: int, B: int, BV: int) -> None:
    load_configs(write(tmp_path, doc()), gpu="h100")
    assert tuned_config(KDA, problem(T, B), torch.bfloat16, CUDA) == {"BV": BV, "num_warps": 4, "num_stages": 1}


def test_no_entry_means_default(tmp_path: Path, on_h100: None) -> None:
    load_configs(write(tmp_path, doc()), gpu="h100")
    assert tuned_config(KDA, problem(64, 32), torch.float16, CUDA) is None  # dtype differs
    assert tuned_config("fused_recurrent_delta_rule", problem(64, 32), torch.bfloat16, CUDA) is None
    assert tuned_config(KDA, problem(64, 32, HV=32), torch.bfloat16, CUDA)["BV"] == 128  # type: ignore[index]
    assert tuned_config(KDA, problem(64, 32), torch.bfloat16, torch.device("cpu")) is None  # interpreter


def test_other_head_dims_borrow_and_say_so(tmp_path: Path, on_h100: None) -> None:
    """No entry at D = 64 or 16: the nearest bucket's config, its V tile cut to the padded head dim (dtune.borrow)."""
    load_configs(write(tmp_path, doc()), gpu="h100")
    p = problem(64, 32, K=64, V=64)
    assert tuned_config(KDA, p, torch.bfloat16, CUDA) == {"BV": 32, "num_warps": 4, "num_stages": 1}
    choice = store.tuned_choice(KDA, p, torch.bfloat16, CUDA)
    assert choice is not None and choice.match == "borrowed" and choice.changes == ()
    assert choice.describe() == "borrowed: tuned.json T64-B32-H16-HV16-K128-V128"
    small = store.tuned_choice(KDA, problem(1024, 32, K=16, V=16), torch.bfloat16, CUDA)
    assert small is not None and small.config["BV"] == 16  # 64 cut to the padded V = 16
    assert "BV 64→16" in small.describe()
    exact = store.tuned_choice(KDA, problem(64, 32), torch.bfloat16, CUDA)
    assert exact is not None and exact.describe() == "exact: tuned.json T64-B32-H16-HV16-K128-V128"


def test_lookup_cache_keeps_dtypes_apart(tmp_path: Path, on_h100: None) -> None:
    """The cached lookup is per dtype: after a bf16 call, an fp16 call of the same shape gets fp16's entry."""
    load_configs(write(tmp_path, doc([*ENTRIES, entry(64, 32, 16, dtype="fp16")])), gpu="h100")
    p = problem(64, 32)
    assert tuned_config(KDA, p, torch.bfloat16, CUDA) == {"BV": 32, "num_warps": 4, "num_stages": 1}
    assert tuned_config(KDA, p, torch.float16, CUDA) == {"BV": 16, "num_warps": 4, "num_stages": 1}
    assert tuned_config(KDA, p, torch.float32, CUDA) is None


def test_other_gpu_gets_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_configs(write(tmp_path, doc()), gpu="h100")
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "a100")
    with pytest.warns(RuntimeWarning, match="for 'h100', not this 'a100'"):
        assert tuned_config(KDA, problem(1, 1), torch.bfloat16, CUDA) is None


def test_lookup_is_cached(tmp_path: Path, on_h100: None, monkeypatch: pytest.MonkeyPatch) -> None:
    load_configs(write(tmp_path, doc()), gpu="h100")
    p = problem(64, 32)
    first = tuned_config(KDA, p, torch.bfloat16, CUDA)

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("the hot path must be a dict hit")

    monkeypatch.setattr(dtune.gpu, "detect", boom)
    monkeypatch.setattr(store, "_configs_for", boom)
    assert tuned_config(KDA, p, torch.bfloat16, CUDA) == first


def test_the_cache_is_bounded(tmp_path: Path, on_h100: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed batches of ever new total lengths are new shapes: the oldest lookups go, the newest stay hits."""
    load_configs(write(tmp_path, doc()), gpu="h100")
    monkeypatch.setattr(store, "CACHE_SIZE", 8)
    for T in range(100, 120):
        tuned_config(KDA, problem(T, 1), torch.bfloat16, CUDA)
    assert len(store._cache) == 8 and list(store._cache)[-1][1] == problem(119, 1)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        (doc(schema=2), "schema 2 is not supported"),
        (doc(gpu="a100"), "is for GPU 'a100', but this is 'h100'"),
        (doc([entry(1, 1, 8, kernel="nope")]), "unknown kernel 'nope'"),
        (doc([entry(1, 1, 3)]), "illegal config.*BV=3"),
        (doc([{**entry(1, 1, 8), "config": {"BQ": 8}}]), "illegal config.*unknown parameter"),
        (doc([entry(1, 1, 8, dtype="fp8")]), "unknown dtype"),
        (doc([{**entry(1, 1, 8), "bucket": {"T": 1}}]), "bucket must give"),
        ([1, 2], "not a JSON object"),
    ],
    ids=["json", "schema", "gpu", "kernel", "illegal-value", "unknown-param", "dtype", "bucket", "not-object"],
)
def test_corrupt_files_are_errors_when_loaded(tmp_path: Path, content: Any, match: str) -> None:
    with pytest.raises(ConfigFileError, match=match):
        load_configs(write(tmp_path, content), gpu="h100")
    with pytest.raises(ConfigFileError, match="cannot be read"):
        read_configs(tmp_path / "missing.json")


def test_corrupt_env_file_is_a_warning(tmp_path: Path, on_h100: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(store.ENV, str(write(tmp_path, doc([entry(1, 1, 3)]))))
    with pytest.warns(RuntimeWarning, match="illegal config"):
        assert tuned_config(KDA, problem(1, 1), torch.bfloat16, CUDA) is None
    store.reset()
    monkeypatch.setenv(store.ENV, str(write(tmp_path, doc(), "good.json")))
    assert tuned_config(KDA, problem(1, 1), torch.bfloat16, CUDA) == {"BV": 8, "num_warps": 4, "num_stages": 1}


GDN = "chunk_gated_delta_rule"


class _Shipped:
    """Stands in for ``importlib.resources`` in :mod:`dtune.store`: the shipped folder is ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def files(self, package: str) -> Path:
        return self.folder


def test_a_gpu_without_shipped_configs_reads_those_of_its_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An H100 with no h100.json shipped runs the H200's tuned configs, not the templates' defaults; an A100 (no GPU
    of its kind ships configs) the defaults; dtune list names the file in force and why."""
    real = Path(str(store.resources.files("dtune.configs")))
    (tmp_path / "h200.json").write_text((real / "h200.json").read_text())
    monkeypatch.setattr(store, "resources", _Shipped(tmp_path))  # the shipped folder without h100.json
    monkeypatch.delenv(store.ENV, raising=False)
    store.reset()
    assert store.shipped_gpus() == ["h200"]
    h200 = read_configs(tmp_path / "h200.json")
    anchor = next(e for e in h200.entries if e.kernel == GDN and e.bucket["T"] == 4096 and e.bucket["B"] == 8)
    p = Shape(B=8, T=4096, H=16, HV=16, K=128, V=128, N=8, gate=Gate.SCALAR)
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "h100")
    assert tuned_config(GDN, p, torch.bfloat16, CUDA) == anchor.config
    (active,) = [st for st in store.config_status("h100") if st.active]
    assert (active.gpu, active.kin) == ("h200", "h200")
    store.reset()
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "a100")
    assert tuned_config(GDN, p, torch.bfloat16, CUDA) is None
    assert not any(st.active for st in store.config_status("a100"))
    store.reset()


def test_a_gpu_tuned_in_part_reads_its_kins_configs_where_it_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An H100 with an h100.json of a few entries runs them, and the H200's (of its kind) for every bucket its file
    lacks, exact or borrowed, each named after its file; dtune list says both are in force and which wins; a corrupt
    h100.json leaves the H200's in force, with a warning."""
    real = Path(str(store.resources.files("dtune.configs")))
    h200 = read_configs(real / "h200.json")
    (tmp_path / "h200.json").write_text((real / "h200.json").read_text())
    bwd = GDN + "_bwd"
    b8 = next(e for e in h200.entries if e.kernel == bwd and e.bucket["T"] == 4096 and e.bucket["B"] == 8)
    b1 = next(e for e in h200.entries if e.kernel == bwd and e.bucket["T"] == 32768 and e.bucket["B"] == 1)
    fwd = next(e for e in h200.entries if e.kernel == GDN and e.bucket["T"] == 4096 and e.bucket["B"] == 8)
    mine = {**b8.config, "dqk_num_stages": 3}
    own = {"kernel": bwd, "dtype": "bf16", "bucket": b8.bucket, "config": mine, "time_ms": 2.43}
    write(tmp_path, doc([own], gpu="h100"), "h100.json")
    monkeypatch.setattr(store, "resources", _Shipped(tmp_path))
    monkeypatch.delenv(store.ENV, raising=False)
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "h100")
    store.reset()
    assert store.kin_gpu("h100") == "h200" and store.kin_gpu("h200") == "h100" and store.kin_gpu("a100") is None
    p8 = Shape(B=8, T=4096, H=16, HV=16, K=128, V=128, N=8, gate=Gate.SCALAR)
    p1 = Shape(B=1, T=32768, H=16, HV=16, K=128, V=128, N=1, gate=Gate.SCALAR)
    assert tuned_config(bwd, p8, torch.bfloat16, CUDA) == mine  # its own entry wins
    assert tuned_config(bwd, p1, torch.bfloat16, CUDA) == b1.config  # the kin's, where it has none
    assert tuned_config(GDN, p8, torch.bfloat16, CUDA) == fwd.config  # ... of any kernel
    assert store.tuned_choice(bwd, p8, torch.bfloat16, CUDA).source == "h100.json"  # type: ignore[union-attr]
    assert store.tuned_choice(bwd, p1, torch.bfloat16, CUDA).source == "h200.json"  # type: ignore[union-attr]
    status = {Path(st.path).name: st for st in store.config_status("h100")}
    assert status["h100.json"].active and status["h100.json"].kin is None
    assert status["h200.json"].active and (status["h200.json"].kin, status["h200.json"].under) == ("h200", "h100")
    # a corrupt own file: left out (warned), the kin's in force alone
    write(tmp_path, "{not json", "h100.json")
    store.reset()
    with pytest.warns(RuntimeWarning, match="h100.json"):
        assert tuned_config(bwd, p8, torch.bfloat16, CUDA) == b8.config
    store.reset()
