"""The run report and table artifacts: a data-only run's report holds its stats; no table is wider than the page."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from eagle3.config import load_config
from eagle3.run.layout import run_layout
from flows.report import render_run_report
from tasks.artifacts import MAX_TABLE_COLUMNS, narrow_tables


@pytest.fixture(scope="module")
def data_only_run(tmp_path_factory):
    """The tiny preset's data stages, run without Prefect (what a `--until vocab` run leaves on disk)."""
    from eagle3.run.stages import run_all

    cfg = load_config("tiny", [f"run.workdir={tmp_path_factory.mktemp('report')}"])
    run_all(cfg)
    return cfg


def _table_widths(markdown: str) -> list[int]:
    return [line.count("|") - 1 for line in markdown.splitlines() if line.startswith("|")]


def test_data_only_report_holds_the_data_stats(data_only_run):
    """The report of a run that stopped after vocab shows per-source counts, tokenization and vocab figures."""
    cfg = data_only_run
    stats = {
        s: json.loads((cfg.run_dir / p).read_text())["stats"]
        for s, p in (
            ("merge", "data/merge.manifest.json"),
            ("tokenize", "data/tokenize.manifest.json"),
            ("vocab", "vocab/vocab.manifest.json"),
        )
    }
    report = render_run_report(cfg)
    assert "## Data" in report and "## Tokenization" in report and "## Draft vocabulary" in report
    total = stats["merge"]["total"]
    row = " | ".join(str(total[k]) for k in ("read", "kept", "rejected", "train", "val"))
    assert f"| (total) | {row} |" in report
    assert f"{stats['tokenize']['num_tokens']:,} tokens" in report
    assert f"{stats['vocab']['draft_vocab_size']:,} of {stats['vocab']['target_vocab_size']:,}" in report
    assert "`<|im_end|>`" in report  # markup-like text only inside code spans, where the UI keeps it


def test_report_tables_fit_the_page(data_only_run):
    """With an evaluation on disk, every markdown table of the report has at most MAX_TABLE_COLUMNS columns and
    the acceptance figures and the lossless counts are all shown."""
    cfg = data_only_run
    result = {
        "dataset": "mtbench",
        "method": "chain",
        "num_prompts": 4,
        "accept_len": 2.5,
        "per_position": [0.9, 0.5, 0.25],
        "tokens_per_s": 12.0,
        "speedup": 1.7,
        "lossless": {"identical": 3, "mismatch": 0, "near_tie": 1},
    }
    (cfg.run_dir / "eval").mkdir(exist_ok=True)
    (cfg.run_dir / "eval" / "results.json").write_text(json.dumps({"results": [result]}))
    try:
        report = render_run_report(cfg)
    finally:
        (cfg.run_dir / "eval" / "results.json").unlink()
    assert _table_widths(report) and max(_table_widths(report)) <= MAX_TABLE_COLUMNS
    assert "| mtbench | chain | 4 | 2.5 | 0.900 / 0.500 / 0.250 | 12.0 | 1.7 |" in report
    assert "| mtbench | chain | 3/4 | 0 | 1 |" in report


def test_a_wide_table_is_split_into_narrow_parts_that_keep_every_cell():
    """A 21-column metrics table becomes parts of at most MAX_TABLE_COLUMNS columns, each repeating the index
    columns, that together hold every cell; a one-row table becomes field/value rows."""
    rows = [
        {"split": s, "step": 10 * i, **{f"m{k}": i * 100 + k for k in range(19)}}
        for i, s in enumerate(("train", "val", "val"))
    ]
    parts = narrow_tables(rows, index=2)
    assert len(parts) == 4 and all(len(p[0]) <= MAX_TABLE_COLUMNS for p in parts)
    assert all(
        [r["split"] for r in p] == ["train", "val", "val"] and [r["step"] for r in p] == [0, 10, 20] for p in parts
    )
    rebuilt = [{k: v for p in parts for k, v in p[i].items()} for i in range(3)]
    assert rebuilt == rows
    assert narrow_tables([{"a": 1, "b": 2}]) == [[{"field": "a", "value": 1}, {"field": "b", "value": 2}]]


def test_appendix_pages_are_sections_of_the_report(data_only_run):
    """Each appendix/<name>.md becomes a section, in name order, with its headings one level deeper and
    <name>.png embedded below it; the report without an appendix has none of them."""
    cfg = data_only_run
    plain = render_run_report(cfg)
    appendix = run_layout(cfg).appendix
    appendix.mkdir()
    try:
        (appendix / "b.md").write_text("# Second page\n\n## its part\n| x |\n")
        (appendix / "a.md").write_text("# First page\ntext\n")
        (appendix / "a.png").write_bytes(b"png bytes")
        (appendix / "a.json").write_text("{}")  # not a page
        report = render_run_report(cfg)
    finally:
        shutil.rmtree(appendix)
    assert "Second page" not in plain and render_run_report(cfg) == plain
    assert report.startswith(plain)  # the pages come after everything else (no deploy report in this run)
    added = report[len(plain) :].splitlines()
    image = "![a](data:image/png;base64," + base64.b64encode(b"png bytes").decode() + ")"
    assert added == ["", "## First page", "text", "", image, "", "## Second page", "", "### its part", "| x |"]
