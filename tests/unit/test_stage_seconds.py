"""The seconds per stage that a run's client prints at its end: the pipeline's StageRun rows saved in the run
directory round-trip for that flow run only, and print as one line per stage plus their total."""

from __future__ import annotations

from eagle3.run.summary import CACHED, COMPLETED, SKIPPED, StageRun, duration_lines, read_stage_runs, write_stage_runs

RUNS = [
    StageRun("target", COMPLETED, 12.5),
    StageRun("merge", CACHED, 0.25, "data/merged.parquet", "http://u/1", "task run"),
    StageRun("capture", SKIPPED, None, note="online"),
    StageRun("train", COMPLETED, 301.125),
]


def test_saved_rows_read_back_for_their_flow_run_only(tmp_path):
    """write_stage_runs then read_stage_runs gives the same rows for the same flow run id; another id, a missing
    file and a broken file give None (a crashed run must not show an earlier run's seconds)."""
    path = tmp_path / "summary.json"
    write_stage_runs(path, "run-a", RUNS)
    assert read_stage_runs(path, "run-a") == RUNS
    assert read_stage_runs(path, "run-b") is None
    assert read_stage_runs(tmp_path / "missing.json", "run-a") is None
    path.write_text("{not json")
    assert read_stage_runs(path, "run-a") is None


def test_duration_lines_show_each_stage_and_the_total():
    """One line per stage (name, state, seconds to 2 decimals, '-' for a stage that did not run), then the total."""
    lines = duration_lines(RUNS)
    assert [line.split()[0] for line in lines] == ["target", "merge", "capture", "train", "total"]
    assert lines[0].split()[-1] == "12.50" and lines[1].split()[-1] == "0.25" and lines[2].split()[-1] == "-"
    assert lines[-1].split() == ["total", "313.88"]  # 12.5 + 0.25 + 301.125, to 2 decimals
    assert "Cached (up to date)" in lines[1]
