"""The data-scaling curve that lab/curve_report.py draws shows in the run report."""

from __future__ import annotations

import json

from eagle3.run.layout import run_layout
from flows.report import render_run_report
from lab.curve_report import write_curve_report


def test_a_drawn_data_scaling_curve_is_in_the_run_report(data_only_run, tmp_path):
    """With the curve written into the run's appendix/, the run report holds its tables (sections nested under its
    title) and its plot; without it, no such section."""
    cfg = data_only_run
    plain = render_run_report(cfg)
    assert "## Data-scaling curve" not in plain
    result = {
        "dataset": "all",
        "method": "chain-3-1-4",
        "accept_len": 1.653,
        "num_prompts": 160,
        "lossless": {"identical": 160},
    }
    (tmp_path / "3M").mkdir()
    (tmp_path / "3M" / "results.json").write_text(json.dumps({"settings": {}, "results": [result]}))
    outputs = write_curve_report({3_000_000: tmp_path / "3M" / "results.json"}, run_layout(cfg).appendix)
    try:
        report = render_run_report(cfg)
    finally:
        for path in outputs.values():
            path.unlink()
    assert "## Data-scaling curve" in report and "### all" in report and "| 3M | 1.653 |" in report
    assert report.count("data:image/png") == plain.count("data:image/png") + 1 and "\n## all" not in report
