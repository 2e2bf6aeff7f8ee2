"""Progress text never shows 'nan': an ETA not known yet reads 'ETA —' and an unknown value (None, NaN) is left out,
in the train progress artifact, the capture progress artifact, the stage progress artifacts, the plain stderr line
and train/progress.json itself."""

from __future__ import annotations

import json
import math

import eagle3.run.progress as progress_module
from eagle3.run.progress import UNKNOWN, Progress, eta_text, finite_or_none, fmt

NAN = float("nan")


def test_eta_and_values_unknown_are_a_dash_or_left_out():
    """None, NaN, infinities and negative ETAs are unknown; finite numbers are formatted."""
    assert [eta_text(v) for v in (None, NAN, math.inf, -1.0)] == [f"ETA {UNKNOWN}"] * 4
    assert eta_text(1234.4) == "ETA 1,234 s" and eta_text(0) == "ETA 0 s"
    assert [fmt(v, ".3f") for v in (None, NAN, -math.inf, "x", True)] == [None] * 5
    assert fmt(0.0, ".3f") == "0.000"  # a zero loss is a value, not an unknown one


def test_train_progress_text_at_start_and_with_nan_values():
    """The train artifact's line before the first step and with NaN loss/acc_0: no 'nan', 'ETA —'."""
    from tasks.train import progress_text

    start = progress_text({"state": "starting", "total_steps": 10})
    nans = progress_text(
        {"state": "running", "total_steps": 10, "step": 1, "loss": NAN, "acc_0": NAN, "tokens_per_s": NAN, "eta_s": NAN}
    )
    nulls = progress_text(
        {"state": "running", "total_steps": 10, "step": 1, "loss": None, "acc_0": None, "eta_s": None}
    )
    for text in (start, nans, nulls):
        assert "nan" not in text.lower() and text.endswith(f"ETA {UNKNOWN}"), text
        assert "loss" not in text and "acc_0" not in text and "tok/s" not in text
    full = progress_text(
        {
            "state": "running",
            "total_steps": 10,
            "step": 3,
            "loss": 4.12345,
            "acc_0": 0.0,
            "tokens_per_s": 1234.5,
            "eta_s": 12.3,
        }
    )
    assert full == "running: step 3/10, loss 4.1235, acc_0 0.000, 1,234 tok/s, ETA 12 s"


def test_capture_progress_before_the_first_shard_has_no_nan_eta(monkeypatch):
    """The capture artifact's first text (no tokens yet, so no rate) says 'ETA —'."""
    import flows.capture as capture_flow

    class Summary:
        num_shards, pending, num_tokens_pending = 4, [0, 1, 2, 3], 1000

    monkeypatch.setattr(capture_flow, "create_progress_artifact", lambda **kw: kw)
    cfg = type("Cfg", (), {"run": type("Run", (), {"name": "tiny"})()})()
    monkeypatch.setattr(capture_flow, "artifact_key", lambda cfg, name: f"tiny-{name}")
    progress = capture_flow.CaptureProgress(cfg, Summary())
    text = progress.artifact_id["description"]
    assert "nan" not in text.lower() and f"ETA {UNKNOWN}" in text, text


def test_stage_progress_artifact_leaves_out_an_unknown_rate_and_eta(monkeypatch):
    """ProgressArtifact: a NaN rate is left out, an unknown ETA is 'ETA —', a known one is shown."""
    import tasks.artifacts as artifacts

    texts = []
    monkeypatch.setattr(
        artifacts, "update_progress_artifact", lambda _id, progress, description: texts.append(description)
    )
    art = artifacts.ProgressArtifact("k", "regenerate (tiny)", min_interval_s=0.0)
    art.callback(0, 10, {"rate_per_s": NAN, "eta_s": None})
    art.callback(5, 10, {"rate_per_s": 2.0, "eta_s": 2.5})
    assert texts[0] == f"regenerate (tiny): 0/10, ETA {UNKNOWN}"
    assert texts[1] == "regenerate (tiny): 5/10 at 2.0/s, ETA 2 s"


def test_plain_progress_line_omits_unknown_values(monkeypatch, capsys):
    """The stderr line (no bar, no callback) leaves out counters that are None or NaN."""
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    with Progress(4, "capture") as bar:
        bar.update(1, eta_s=None, tokens_per_s=NAN, tokens=7)
    line = capsys.readouterr().err.splitlines()[0]
    assert "nan" not in line.lower() and "None" not in line and line.endswith("tokens=7"), line


def test_train_progress_json_stores_nan_as_null(tmp_path):
    """train/progress.json is valid JSON with null where the trainer had NaN (acc_0 of a step with no supervision)."""
    from eagle3.train.metrics import ProgressWriter

    writer = ProgressWriter(tmp_path / "progress.json", total_steps=10, enabled=True, every_s=0.0)
    writer.update(step=1, loss=NAN, acc_0=NAN, eta_s=math.inf, last_eval={"acc_0": NAN}, force=True)
    text = (tmp_path / "progress.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # NaN is not JSON
    assert doc["loss"] is None and doc["acc_0"] is None and doc["eta_s"] is None and doc["last_eval"]["acc_0"] is None
    assert finite_or_none([1.0, NAN]) == [1.0, None]


def test_train_watcher_ignores_an_earlier_runs_progress(tmp_path, monkeypatch):
    """A progress.json left by an earlier training (older than the watcher) is not shown as this run's progress."""
    import os
    import time

    import tasks.train as train_tasks

    shown = []
    monkeypatch.setattr(
        train_tasks, "update_progress_artifact", lambda _id, progress, description: shown.append(description)
    )
    watcher = object.__new__(train_tasks.ProgressWatcher)
    watcher.path, watcher.artifact_id, watcher.started = tmp_path / "progress.json", "id", time.time() - 2.0
    watcher.path.write_text(json.dumps({"state": "done", "step": 10, "total_steps": 10, "tokens_per_s": 999.0}))
    old = time.time() - 3600
    os.utime(watcher.path, (old, old))
    watcher.refresh()
    assert shown == []
    watcher.path.write_text(json.dumps({"state": "running", "step": 1, "total_steps": 10}))
    watcher.refresh()
    assert shown == [f"running: step 1/10, ETA {UNKNOWN}"]
