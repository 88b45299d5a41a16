"""What a user meets when something is wrong: one line naming the path and the problem (exit 2) for file-system and
config errors in every command; refusals that say why; non-zero exits when nothing passed; Ctrl-C's resume command;
output that fits an 80-column terminal."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dtune.cli import common
from dtune.cli.main import app

runner = CliRunner()
KERNEL = "fused_recurrent_kda"
TINY = ["--seq-lens", "1", "--head-dims", "16", "--heads", "1", "--batch", "1"]


def one_error_line(output: str, *needles: str) -> None:
    """Exactly one line starts with 'error:', it holds every needle, and there is no traceback."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output, output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    return f


def _commands(under: Path) -> dict[str, list[str]]:
    """Each command with an output path under a plain file."""
    return {
        "search": ["search", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--trials", "1", "--out", str(under)],
        "bench": ["bench", "-k", KERNEL, "--interpret", *TINY, "--out", str(under)],
        "profile": ["profile", "-k", KERNEL, "--interpret", "--out", str(under)],
        "verify": ["verify", "-k", KERNEL, "--interpret", "--out", str(under)],
        "report": ["report", "PLACEHOLDER", "-o", str(under / "r.html")],
    }


@pytest.mark.parametrize("command", ["search", "bench", "profile", "verify", "report"])
def test_output_under_a_file_is_one_line_exit_2(command: str, a_file: Path, tmp_path: Path) -> None:
    args = _commands(a_file / "sub")[command]
    if command == "report":
        args[1] = str(tmp_path)  # any folder: the output path is checked before the report is built
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    one_error_line(result.output, str(a_file))


def test_export_to_a_path_under_a_file(tmp_path: Path, a_file: Path) -> None:
    run = tmp_path / "run"
    args = ["search", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--trials", "1", *TINY, "--out", str(run)]
    assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["export", str(run), "-o", str(a_file / "x.json")])
    assert result.exit_code == 2
    one_error_line(result.output, str(a_file))


@pytest.mark.parametrize("command", ["bench", "profile"])
@pytest.mark.parametrize(("content", "problem"), [("{bad", "is not valid JSON"), (None, "cannot be read")])
def test_config_file_errors_name_the_file(tmp_path: Path, command: str, content: str | None, problem: str) -> None:
    path = tmp_path / "cfg.json"
    if content is not None:
        path.write_text(content)
    args = [command, "-k", KERNEL, "--interpret", "--config", str(path), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    one_error_line(result.output, str(path), problem)


def test_corrupt_dtune_config_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "corrupt.json"
    bad.write_text("{bad")
    monkeypatch.setenv("DTUNE_CONFIG", str(bad))
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 2
    flat = " ".join(result.output.split())
    assert "tuned configs (" in flat and f"DTUNE_CONFIG {bad}: NOT loaded" in flat  # the listing still shows
    one_error_line(result.output, f"DTUNE_CONFIG={bad}", "not valid JSON")
    result = runner.invoke(app, ["bench", "-k", KERNEL, "--interpret", *TINY, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    one_error_line(result.output, f"DTUNE_CONFIG={bad}")


def test_list_shows_the_active_config_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = tmp_path / "mine.json"
    text = Path(common.__file__).parent.parent.joinpath("configs", "h200.json").read_text()
    good.write_text(text)
    n = len(json.loads(text)["entries"])  # the shipped file grows with every tuning run
    assert n > 0
    monkeypatch.setenv("DTUNE_CONFIG", str(good))
    monkeypatch.setattr("dtune.gpu.detect", lambda index=0: "h200")
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert f"DTUNE_CONFIG {good}: loaded, h200, {n} entries (in force)" in flat
    monkeypatch.setattr("dtune.gpu.detect", lambda index=0: "h100")  # the file is for another GPU
    result = runner.invoke(app, ["list", "--json"])
    (src,) = json.loads(result.stdout)["config_sources"]
    assert src["active"] is False and "is for GPU 'h200'" in src["error"]


def test_space_errors_keep_their_section_name(tmp_path: Path) -> None:
    space = tmp_path / "s.toml"
    space.write_text('kernel = "fused_recurrent_kda"\n[params]\nBV = [16]\n[shapes]\nseq_lens = [1]\n')
    args = ["search", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--space", str(space)]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    one_error_line(result.output, str(space), "missing [tolerance]")  # not "missing  (relative RMS ...)"
    other = tmp_path / "other.toml"
    shipped = Path(common.__file__).parent.parent.parent / "search_spaces" / f"{KERNEL}.toml"
    other.write_text(shipped.read_text().replace(f'kernel = "{KERNEL}"', 'kernel = "chunk_kda"'))
    result = runner.invoke(app, ["search", "-k", "chunk_kda", "--interpret", "--space", str(other)])
    assert result.exit_code == 2
    one_error_line(result.output, "[params] 'BV' is not a parameter of the chunk_kda template", "another kernel")


# ---- honest failures ------------------------------------------------------------------------------------------


def test_bf16_chunk_under_the_interpreter_is_refused_or_runs_fp32(tmp_path: Path) -> None:
    args = ["search", "-k", "chunk_kda", "--interpret", "--trials", "1", *TINY]
    result = runner.invoke(app, [*args, "--dtype", "bf16", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and not (tmp_path / "a").exists()
    one_error_line(result.output, "--dtype bf16 with --interpret", "bfloat16")
    result = runner.invoke(app, ["bench", "-k", "chunk_kda", "--interpret", "--dtype", "bf16", *TINY])
    assert result.exit_code == 2
    one_error_line(result.output, "--dtype bf16 with --interpret")
    # Without --dtype: fp32, with a visible note.
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "note: chunk_kda under the interpreter runs in fp32" in result.output
    assert json.loads((tmp_path / "b" / "run.json").read_text())["dtype"] == "fp32"


def test_bench_record_needs_this_gpus_config_file(tmp_path: Path) -> None:
    """``dtune bench --record`` writes into the --config file: refused, before anything is timed, without one or with
    another GPU's; under the interpreter it records nothing (no meaningful time) and leaves the file as it was."""
    args = ["bench", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--baselines", "default", *TINY, "--record"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and not (tmp_path / "a").exists()
    one_error_line(result.output, "--record writes into the --config file")
    entry = {"kernel": KERNEL, "dtype": "fp32", "bucket": {"T": 1, "B": 1, "H": 1, "HV": 1, "K": 16, "V": 16},
             "config": {}, "time_ms": 1.0}  # fmt: skip
    other = tmp_path / "h200.json"
    other.write_text(json.dumps({"schema": 1, "gpu": "h200", "entries": [entry]}))
    result = runner.invoke(app, [*args, "--config", str(other), "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and not (tmp_path / "b").exists()
    one_error_line(result.output, "is for GPU 'h200' and this is 'cpu'")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{bad")
    result = runner.invoke(app, [*args, "--config", str(corrupt), "--out", str(tmp_path / "d")])
    assert result.exit_code == 2 and not (tmp_path / "d").exists()
    one_error_line(result.output, str(corrupt), "is not valid JSON")
    mine = tmp_path / "cpu.json"
    mine.write_text(text := json.dumps({"schema": 1, "gpu": "cpu", "entries": [entry]}))
    result = runner.invoke(app, [*args, "--config", str(mine), "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "recorded nothing in" in result.output and mine.read_text() == text


def _strict_space(tmp_path: Path) -> Path:
    """The shipped space with an fp32 tolerance no kernel meets: every trial fails the gate."""
    shipped = Path(common.__file__).parent.parent.parent / "search_spaces" / f"{KERNEL}.toml"
    strict = tmp_path / "strict.toml"
    strict.write_text(shipped.read_text().replace("fp32 = 1e-4", "fp32 = 1e-15"))
    return strict


def test_search_where_nothing_passes_exits_1_and_export_writes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["search", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--trials", "2", "--transfer-count", "0", *TINY]
    result = runner.invoke(app, [*args, "--space", str(_strict_space(tmp_path)), "--out", str(run)])
    assert result.exit_code == 1, result.output
    one_error_line(result.output, "no config passed the gate", "gate 1", "exceeds the fp32 tolerance")
    out = tmp_path / "exported.json"
    result = runner.invoke(app, ["export", str(run), "-o", str(out)])
    assert result.exit_code == 1 and not out.exists()
    one_error_line(result.output, "nothing to export", "no trial passed the gate", "gate 1")


# ---- Ctrl-C ----------------------------------------------------------------------------------------------------


def test_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search is interrupted after its first trial; the printed command, run as printed, resumes it."""
    import dtune.tune.search as search_mod

    original = search_mod.tune_shape

    def interrupted_after_one(cfg, *rest):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(cfg, "trials", 1)
        original(cfg, *rest)
        search_mod.INTERRUPTED.set()

    monkeypatch.setattr(search_mod, "tune_shape", interrupted_after_one)
    run = tmp_path / "my run"
    args = ["search", "-k", KERNEL, "--interpret", "--dtype", "fp32", "--trials", "3", "--seed", "5", *TINY[:2]]
    result = runner.invoke(app, [*args, "--heads", "1", "--out", str(run)])
    assert result.exit_code == 130, result.output
    assert "interrupted: 1 finished trial(s) are kept in sqlite:///" in result.output
    assert "tuned.json holds the best passing config of 1 shape(s)" in result.output
    line = result.output.splitlines()[result.output.splitlines().index(next(
        x for x in result.output.splitlines() if x.startswith("resume with"))) + 1].strip()  # fmt: skip
    words = shlex.split(line)
    assert words[:2] == ["dtune", "search"] and words[-3:] == ["--out", str(run), "--resume"]
    for option in ("--kernel", KERNEL, "--interpret", "--dtype", "fp32", "--trials", "3", "--seed", "5", "--heads"):
        assert option in words
    monkeypatch.setattr(search_mod, "tune_shape", original)
    result = runner.invoke(app, words[1:])  # the printed command, as is
    assert result.exit_code == 0, result.output
    tuned = json.loads((run / "tuned.json").read_text())
    assert tuned["entries"][0]["trials"]["complete"] + tuned["entries"][0]["trials"]["pruned"] >= 2


# ---- 80 columns ------------------------------------------------------------------------------------------------


@pytest.fixture
def columns_80(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "80")
    widths = (common.out.width, common.err.width)
    common.out.width = common.err.width = 80
    yield
    common.out.width, common.err.width = widths


@pytest.mark.parametrize("command", ["search", "export", "list", "bench", "profile", "verify", "report"])
def test_help_shows_whole_flag_names_at_80_columns(command: str, columns_80: None) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    if command == "search":
        assert "--allow-gpu-mismatch / --no-allow-gpu-mismatch" in result.output
        assert "--compile-ahead" in result.output and "--trial-timeout" in result.output


def test_search_summary_fits_80_columns(tmp_path: Path, columns_80: None) -> None:
    args = ["search", "-k", "chunk_kda", "--interpret", "--trials", "1", *TINY, "--out", str(tmp_path / "r")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert "T1-B1-H1-HV1-K16-V16" in result.stdout  # the whole shape key
    assert "best config" in result.stdout and "SAFE_DIAG=True" in result.stdout  # the whole config, on its own lines
    assert "STATE_LAYOUT=kv" in result.stdout


def test_list_fits_80_columns(columns_80: None) -> None:
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0
    assert "…" not in result.output and "fused_recurrent_gated_delta_rule" in result.output


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_measurement_tables_fit_80_columns(command: str, tmp_path: Path, columns_80: None) -> None:
    """Below 100 columns a row is a heading and wrapped 'name value' items: nothing is cut."""
    shape = TINY if command == "bench" else ["--seq-len", "1", "--head-dim", "16", "--heads", "1", "--batch", "1"]
    extra = ["--baselines", "default"] if command == "bench" else []
    result = runner.invoke(app, [command, "-k", KERNEL, "--interpret", *shape, *extra, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert f"dtune {command}: {KERNEL}" in result.stdout
    assert ("B1 T1 H1 D16 · tuned · eager" if command == "bench" else "total (whole op)") in result.stdout
    assert max(len(line) for line in result.stdout.splitlines() if not line.startswith("note")) <= 80


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_unknown_decays_are_refused_in_one_line(command: str, tmp_path: Path) -> None:
    shape = TINY if command == "bench" else ["--seq-len", "1", "--head-dim", "16", "--heads", "1", "--batch", "1"]
    args = [command, "-k", KERNEL, "--interpret", *shape, "--decays", "weak", "--out", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    one_error_line(result.output, "--decays", "'weak'", "strong", "model")


def test_bench_times_and_labels_the_decays_asked_for(tmp_path: Path) -> None:
    args = ["bench", "-k", "fused_recurrent_gated_delta_rule", "--interpret", *TINY, "--baselines", "default"]
    result = runner.invoke(app, [*args, "--decays", "model", "--json", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert rows and {r["decays"] for r in rows} == {"model"}
