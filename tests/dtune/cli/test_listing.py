"""``dtune list --shape``: which config the ops run for a shape and where it comes from, without a GPU present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dtune.store as store
from dtune.cli.listing import parse_shape
from dtune.cli.main import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fresh_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DTUNE_CONFIG", raising=False)
    store.reset()


def test_an_untuned_shape_says_what_it_borrows_and_changes() -> None:
    result = runner.invoke(app, ["list", "--shape", "T8192-B4-H16-D64", "-k", "chunk_kda", "--gpu", "h200"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "chunk_kda: borrowed: h200.json T4096-B8-H16-HV16-K64-V64" in flat
    # (the D = 64 entry ships the segmented entries' state pass: only the segments change, with their reason)
    assert "SEG_CHUNKS 0→32 (4 sequence(s) × 16 value heads of 8192 tokens: 64 state-pass programs" in flat
    rows = json.loads(
        runner.invoke(
            app, ["list", "--shape", "T4096-B8-D128", "-k", "chunk_kda,chunk_kda_bwd", "--gpu", "h200", "--json"]
        ).stdout
    )["lookups"]
    assert [r["match"] for r in rows] == ["exact", "exact"] and rows[0]["changes"] == []
    assert rows[0]["config"]["INTRA"] == "onepass"


def test_packed_and_defaults() -> None:
    out = json.loads(
        runner.invoke(
            app, ["list", "--shape", "N16-T52640", "-k", "chunk_gated_delta_rule", "--gpu", "h200", "--json"]
        ).stdout
    )
    (row,) = out["lookups"]
    assert row["match"] == "exact" and row["bucket"]["T"] == 3290 and row["bucket"]["B"] == 16
    fp32 = json.loads(
        runner.invoke(
            app, ["list", "--shape", "T4096", "-k", "chunk_kda", "--gpu", "h200", "--dtype", "fp32", "--json"]
        ).stdout
    )
    assert fp32["lookups"][0]["match"] == "default"  # nothing tuned in fp32


def test_the_fla_backend_s_speed_rule_per_shape(tmp_path: Path) -> None:
    def entry(kernel: str, B: int, T: int, times: dict[str, float]) -> dict[str, object]:
        bucket = {"T": T, "B": B, "H": 16, "HV": 16, "K": 128, "V": 128}
        return {"kernel": kernel, "dtype": "bf16", "bucket": bucket, "config": {}, "side_by_side_ms": times}

    doc = {"schema": 1, "gpu": "h200", "entries": [
        entry("chunk_gated_delta_rule", 1, 8192, {"dtune": 1.0, "fla": 2.0}),
        entry("chunk_gated_delta_rule_bwd", 1, 8192, {"dtune": 3.0, "fla": 2.0}),
    ]}  # fmt: skip
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(doc))
    store.load_configs(path, gpu="h200")
    kernels = "chunk_gated_delta_rule,chunk_delta_rule,fused_recurrent_delta_rule"
    args = ["list", "--shape", "T16384-B1-D128", "-k", kernels, "--gpu", "h200", "--json"]
    gdn, dn, decode = json.loads(runner.invoke(app, args).stdout)["lookups"]
    assert gdn["fla_backend"]["forward"] == "dtune"  # the B1 T8192 bucket speaks for T16384 (within 2x)
    assert "fla is faster at chunk_gated_delta_rule_bwd B1 T8192" in gdn["fla_backend"]["training step"]
    assert "no tuned chunk_delta_rule entry" in dn["fla_backend"]["forward"]
    assert decode["fla_backend"] == {}  # fla dispatches no fused-recurrent delta rule to a backend
    far = runner.invoke(app, ["list", "--shape", "T65536-B1-D128", "-k", "chunk_gated_delta_rule", "--gpu", "h200"])
    assert "fla backend, forward (against fla's own path): fla: the nearest measured bucket" in " ".join(
        far.output.split()
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--shape", "T4096-Q3"], "cannot read 'Q3'"),
        (["--shape", "B2-D64"], "needs the sequence length"),
        (["--shape", "T4096-H16-HV24"], "HV=24 is not a multiple of H=16"),
        (["--shape", "T4096", "-k", "nope"], "unknown kernel"),
        (["--shape", "T4096", "--gpu", "zz"], "unknown GPU 'zz'"),
    ],
)
def test_bad_shapes_are_one_line_errors(args: list[str], match: str) -> None:
    result = runner.invoke(app, ["list", *args])
    assert result.exit_code == 2 and match in " ".join(result.output.split()), result.output


def test_parse_shape_defaults() -> None:
    assert parse_shape("T64") == {"T": 64, "B": 1, "H": 16, "HV": 16, "K": 128, "V": 128, "N": 1, "varlen": 0}
    assert parse_shape("t9,b2,h4,hv8,k32,v64")["HV"] == 8 and parse_shape("N3-T90")["varlen"] == 1
