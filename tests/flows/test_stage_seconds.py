"""A pipeline run leaves its stage rows in <run>/summary.json, under its own flow run id, so the client that
followed it (`eagle3 demo`, `eagle3 run`) prints the seconds of each stage at the end."""

from __future__ import annotations

from eagle3.config import load_config
from eagle3.run.layout import run_layout
from eagle3.run.summary import COMPLETED, read_stage_runs
from flows.pipeline import eagle3_pipeline
from flows.report import print_stage_seconds


def test_a_run_saves_its_stage_seconds_and_the_client_prints_them(tmp_path, capsys):
    """tiny up to vocab: summary.json holds target, merge, tokenize and vocab, completed, with their seconds, for
    this flow run; print_stage_seconds prints a line for each and the total, and nothing for another run's id."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    state = eagle3_pipeline(config=cfg, until="vocab", return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    runs = read_stage_runs(run_layout(cfg).summary, run_id)
    assert runs is not None and [r.stage for r in runs] == ["target", "merge", "tokenize", "vocab"]
    assert all(r.state == COMPLETED and r.duration_s is not None and r.duration_s >= 0 for r in runs)
    capsys.readouterr()
    print_stage_seconds(cfg, run_id)
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "== seconds per stage ==" and [line.split()[0] for line in out[2:]] == [
        "target",
        "merge",
        "tokenize",
        "vocab",
        "total",
    ]
    print_stage_seconds(cfg, "another-run")
    assert capsys.readouterr().out == ""
