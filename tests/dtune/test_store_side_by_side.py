"""The tuned-config entries' optional side-by-side times (``side_by_side_ms``) and the nearest entry that carries them
(``TunedConfigs.nearest`` with ``keep``), as the fla backend's speed rule reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import dtune.gpu
from dtune.shape import Gate, Shape
from dtune.store import ConfigFileError, configs_in_force, load_configs, read_configs


def _doc(times: Any = None) -> dict[str, Any]:
    e: dict[str, Any] = {
        "kernel": "chunk_kda",
        "dtype": "bf16",
        "bucket": {"T": 4096, "B": 8, "H": 16, "HV": 16, "K": 128, "V": 128},
        "config": {"BT": 32},
    }
    if times is not None:
        e["side_by_side_ms"] = times
    return {"schema": 1, "gpu": "h100", "entries": [e]}


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    return path


def test_entries_carry_side_by_side_times(tmp_path: Path) -> None:
    (entry,) = read_configs(_write(tmp_path, _doc({"dtune": 1.0, "fla": 1.5, "flash_qla": 0.5}))).entries
    assert entry.side_by_side_ms == {"dtune": 1.0, "fla": 1.5, "flash_qla": 0.5}
    (old,) = read_configs(_write(tmp_path, _doc())).entries  # files without them still load
    assert old.side_by_side_ms == {}


@pytest.mark.parametrize("times", [[1.0], {"dtune": -1.0}, {"dtune": "fast"}, {"dtune": True}, {"fla": float("inf")}])
def test_bad_side_by_side_times_are_refused(tmp_path: Path, times: Any) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_doc(times)).replace("Infinity", "1e999"))
    with pytest.raises(ConfigFileError, match="side_by_side_ms"):
        read_configs(path)


def test_nearest_entry_that_keep_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtune.gpu, "detect", lambda index=0: "h100")
    doc = _doc({"dtune": 1.0, "fla": 2.0})  # B8 T4096, measured
    unmeasured = {**doc["entries"][0], "bucket": {**doc["entries"][0]["bucket"], "T": 8192, "B": 4}}
    del unmeasured["side_by_side_ms"]
    doc["entries"].append({**unmeasured, "config": {"BT": 64}})
    load_configs(_write(tmp_path, doc), gpu="h100")
    configs = configs_in_force("h100")
    assert configs is not None
    shape = Shape(B=4, T=8192, H=16, HV=16, K=128, V=128, gate=Gate.CHANNEL)  # exactly the unmeasured bucket
    assert configs.nearest("chunk_kda", "bf16", shape).config == {"BT": 64}
    measured = configs.nearest("chunk_kda", "bf16", shape, keep=lambda e: bool(e.side_by_side_ms))
    assert measured is not None and measured.config == {"BT": 32} and measured.side_by_side_ms["fla"] == 2.0
    assert configs.nearest("chunk_kda", "bf16", shape, keep=lambda e: False) is None
    assert configs.nearest("chunk_kda", "fp16", shape) is None
