"""Progress without a terminal or a callback writes plain lines (a CLI logging to a file still shows progress)."""

from __future__ import annotations

import eagle3.run.progress as progress_module
from eagle3.run.progress import Progress


def test_lines_every_interval_and_at_the_end_when_no_bar_and_no_callback(monkeypatch, capsys):
    """With LOG_EVERY_S = 0 every update writes a line with the counters; the close writes the final one."""
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    with Progress(4, "capture") as bar:
        bar.update(1, tokens_per_s=12.5)
        bar.update(3)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("capture: 1/4 (25%)") and lines[0].endswith("tokens_per_s=12.5")
    assert lines[-1].startswith("capture: 4/4 (100%)") and len(lines) == 3


def test_no_lines_with_a_callback_or_an_explicitly_hidden_bar(monkeypatch, capsys):
    """A Prefect callback (or bar=False) means no stderr lines; the callback still sees every counter."""
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    seen = []
    with Progress(2, "train", callback=lambda done, total, info: seen.append((done, total))) as bar:
        bar.update(2)
    with Progress(2, "quiet", bar=False) as bar:
        bar.update(2)
    assert capsys.readouterr().err == "" and seen[-1] == (2, 2)
