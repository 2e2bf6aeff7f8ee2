"""The run summary's stage table and the acceptance trend across runs (issue 39, list 1, item 3): plain functions
on records and paths, checked against golden rows without a Prefect server."""

from __future__ import annotations

import json
import types
from datetime import datetime, timezone
from pathlib import Path

import pytest

from eagle3.evaluate.stage import acceptance_by_method
from eagle3.run.history import (
    AcceptanceRecord,
    acceptance_record,
    append_acceptance,
    read_acceptance,
    trend_methods,
    trend_rows,
)
from eagle3.run.layout import RunLayout
from eagle3.run.summary import (
    CACHED,
    COMPLETED,
    FAILED,
    NOT_STARTED,
    SKIPPED,
    SUMMARY_COLUMNS,
    StageRun,
    headline,
    render_early_failure,
    render_summary,
    stage_output,
    state_label,
    summary_rows,
)

UI = "http://127.0.0.1:4200"
TASK = f"{UI}/runs/task-run/0000-merge"
SUBFLOW = f"{UI}/runs/flow-run/0000-capture"


def _results_doc(rows: list[tuple[str, str, int, float]]) -> dict:
    """A results.json document with the fields the history reads (dataset, method, num_prompts, accept_len)."""
    return {
        "settings": {},
        "results": [{"dataset": d, "method": m, "num_prompts": n, "accept_len": a} for d, m, n, a in rows],
    }


def test_state_labels_read_the_same_for_every_up_to_date_stage():
    """Prefect's Cached (a task answered from its cache, or the capture subflow's up-to-date end) and an up-to-date
    fan-out both read 'Cached (up to date)'; other end states keep Prefect's name."""
    assert state_label("Cached") == CACHED == "Cached (up to date)"
    assert state_label("Completed") == COMPLETED and state_label("Failed") == FAILED
    assert state_label("Crashed") == "Crashed"
    assert state_label(None, computed=False) == CACHED
    assert state_label(None, computed=True) == COMPLETED and state_label(None, computed=None) == COMPLETED


def test_stage_outputs_are_paths_under_the_run_directory(tmp_path):
    """Each registry stage's outputs as the summary names them: relative to the run dir, folders ending in '/'; a
    row that is no stage (the target check) names none."""
    layout = RunLayout(tmp_path / "run")
    assert {
        s: stage_output(layout, s)
        for s in (
            "target",
            "synthesize",
            "merge",
            "regenerate",
            "tokenize",
            "vocab",
            "capture",
            "train",
            "export",
            "evaluate",
            "deploy",
        )
    } == {
        "target": "",
        "synthesize": "data/synthetic/",
        "merge": "data/merged.parquet",
        "regenerate": "data/regenerated.parquet",
        "tokenize": "data/tokenized.parquet",
        "vocab": "vocab/",
        "capture": "features/",
        "train": "train/",
        "export": "export/",
        "evaluate": "eval/",
        "deploy": "deploy/",
    }


def test_headlines_give_each_stage_its_main_counts():
    """The 'result' cell from a stage's task result (JSON): counts for the data stages, capture and train, the
    acceptance per method for evaluate (the 'all' rows when there are several datasets), the skip reason."""
    assert headline("merge", {"stats": {"total": {"read": 40, "kept": 38}}}) == "kept 38 of 40 conversations"
    assert headline("tokenize", {"stats": {"rows_written": 38, "num_tokens": 4096}}) == "38 rows, 4096 tokens"
    assert (
        headline("vocab", {"stats": {"draft_vocab_size": 64, "coverage": 0.91234}}) == "64 draft tokens, coverage 0.912"
    )
    assert (
        headline("capture", {"stats": {"num_shards": 3, "num_tokens": 4096, "num_bytes": 2_500_000}})
        == "3 shards, 4096 tokens, 2.5 MB"
    )
    assert (
        headline("train", {"last_eval": {"acc_0": 0.1485148514851485, "accept_len_est": 1.1738472543460599}})
        == "val acc_0 0.149, accept_len_est 1.174"
    )
    assert headline("train", {"last_eval": None}) == "val acc_0 -, accept_len_est -"
    stats = {
        "mtbench/chain-3-1-4": {"accept_len": 1.2},
        "gsm8k/chain-3-1-4": {"accept_len": 1.4},
        "all/chain-3-1-4": {"accept_len": 1.3},
        "all/ngram": {"accept_len": 1.1},
        "mtbench/ngram": {},
    }
    assert acceptance_by_method(stats) == {"chain-3-1-4": 1.3, "ngram": 1.1}
    assert headline("evaluate", {"stats": stats}) == "chain-3-1-4 1.300, ngram 1.100"
    assert headline("evaluate", {"stats": {"mtbench/ngram": {"accept_len": 1.184}}}) == "ngram 1.184"
    assert headline("export", {"outputs": {"sglang": "/x", "speculators": "/y"}}) == "`sglang`, `speculators`"
    assert headline("capture", {"skipped": "online"}) == "online"
    assert headline("target", None) == "" and headline("target", object()) == ""  # type: ignore[arg-type]


def test_a_stage_says_its_own_headline_through_the_registry(monkeypatch):
    """The result cell of a registry stage is its module's headline(result) (the summary names no stage); a module
    without one, or one that says nothing of this result, gets the result's outputs."""
    from eagle3.run import registry
    from eagle3.run.stage import StageId

    toy, plain = types.ModuleType("toy_stage"), types.ModuleType("plain_stage")
    toy.STAGE, plain.STAGE = StageId("toy", "toy"), StageId("plain", "plain")
    toy.headline = lambda result: f"{result['stats']['rows']} rows" if result.get("stats") else None
    specs = {"toy": registry.StageSpec(toy), "plain": registry.StageSpec(plain)}
    monkeypatch.setattr(registry, "BY_NAME", {**registry.BY_NAME, **specs})
    assert headline("toy", {"stats": {"rows": 3}, "outputs": {"count": "/x"}}) == "3 rows"
    assert headline("toy", {"outputs": {"count": "/x"}}) == "`count`"
    assert headline("plain", {"stats": {"rows": 3}, "outputs": {"count": "/x"}}) == "`count`"


GOLDEN_RUNS = [
    StageRun("target", COMPLETED, 1.234, "", f"{UI}/runs/task-run/0000-target", "task run"),
    StageRun("merge", CACHED, 0.05, "data/merged.parquet", TASK, "task run", "kept 38 of 40 conversations"),
    StageRun("capture", COMPLETED, 12.0, "features/", SUBFLOW, "subflow run", "3 shards | 4096 tokens"),
    StageRun("train", FAILED, 3.5, "train/", None, "", ""),
    StageRun("export", NOT_STARTED, None, "export/"),
    StageRun("benchmark", SKIPPED, None, "deploy/", note="serve.enabled is false"),
]


def test_summary_rows_golden():
    """One row per stage: state, seconds to 0.01, outputs as code, the result (no '|' breaking the table), a link
    named after the kind of run."""
    assert summary_rows(GOLDEN_RUNS) == [
        {
            "stage": "target",
            "state": "Completed",
            "seconds": "1.23",
            "outputs": "",
            "result": "",
            "run": f"[task run]({UI}/runs/task-run/0000-target)",
        },
        {
            "stage": "merge",
            "state": "Cached (up to date)",
            "seconds": "0.05",
            "outputs": "`data/merged.parquet`",
            "result": "kept 38 of 40 conversations",
            "run": f"[task run]({TASK})",
        },
        {
            "stage": "capture",
            "state": "Completed",
            "seconds": "12.00",
            "outputs": "`features/`",
            "result": "3 shards / 4096 tokens",
            "run": f"[subflow run]({SUBFLOW})",
        },
        {"stage": "train", "state": "Failed", "seconds": "3.50", "outputs": "`train/`", "result": "", "run": ""},
        {"stage": "export", "state": "Not started", "seconds": "", "outputs": "`export/`", "result": "", "run": ""},
        {
            "stage": "benchmark",
            "state": "Skipped",
            "seconds": "",
            "outputs": "`deploy/`",
            "result": "serve.enabled is false",
            "run": "",
        },
    ]


def test_rendered_summary_is_one_table_with_a_row_per_stage(tmp_path):
    """The markdown: the failure first (stage and error), the run dir and target, the total, then one table."""
    text = render_summary(
        "tiny", tmp_path, GOLDEN_RUNS, target="`/models/tiny`", failure=("train", "RuntimeError: boom")
    )
    lines = text.splitlines()
    assert lines[0] == "# Run `tiny` failed" and "**Failed at stage `train`**:" in text and "RuntimeError: boom" in text
    assert f"* run directory: `{tmp_path}`" in text and "* target: `/models/tiny`" in text
    assert "* stages: 16.8 s in all" in text
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "| " + " | ".join(SUMMARY_COLUMNS) + " |" and len(table) == 2 + len(GOLDEN_RUNS)
    assert (
        "| merge | Cached (up to date) | 0.05 | `data/merged.parquet` | kept 38 of 40 conversations | "
        f"[task run]({TASK}) |" in table
    )
    assert all(line.count("|") == len(SUMMARY_COLUMNS) + 1 for line in table)
    assert render_summary("tiny", tmp_path, []).startswith("# Run `tiny`\n")


def test_stage_run_round_trips_through_json():
    """A subflow hands its steps' rows to the pipeline as JSON."""
    assert [StageRun.from_json(json.loads(json.dumps(r.to_json()))) for r in GOLDEN_RUNS] == GOLDEN_RUNS


def test_early_failure_summary_names_the_reason_the_overrides_and_the_fix():
    """A run refused before any stage: title, the error in a code block, the preset and each override, the fix."""
    text = render_early_failure(
        "big",
        "needs a GPU host",
        "the run's settings need a CUDA device.",
        "NeedsGpuError: pipeline needs a CUDA GPU host (capture.backend=sglang)",
        "llama31-8b",
        ["run.workdir=/w"],
        "Run it on a GPU worker.",
    )
    assert text.startswith("# Run `big` failed: needs a GPU host\n")
    assert "**Failed before any stage**: the run's settings need a CUDA device." in text
    assert "```\nNeedsGpuError: pipeline needs a CUDA GPU host (capture.backend=sglang)\n```" in text
    assert "preset: `llama31-8b`" in text and "* `run.workdir=/w`" in text
    assert text.endswith("Run it on a GPU worker.\n")
    assert "* (none)" in render_early_failure("x", "t", "w", "m", "tiny", [], "a")


FINISHED = datetime(2026, 12, 6, 21, 30, 5, 123, tzinfo=timezone.utc)


def test_acceptance_record_reads_the_pooled_rows_of_results_json():
    """Several datasets: the 'all' rows; one dataset: its rows. A results.json without rows gives no record."""
    doc = _results_doc(
        [
            ("mtbench", "chain-3-1-4", 10, 1.2),
            ("gsm8k", "chain-3-1-4", 5, 1.4),
            ("all", "chain-3-1-4", 15, 1.2667),
            ("mtbench", "ngram", 10, 1.1),
            ("gsm8k", "ngram", 5, 1.0),
            ("all", "ngram", 15, 1.0667),
        ]
    )
    record = acceptance_record(doc, "id-1", "pipeline-a", FINISHED, computed=True)
    assert record == AcceptanceRecord(
        "id-1", "2026-12-06T21:30:05Z", "pipeline-a", True, "all", 15, {"chain-3-1-4": 1.2667, "ngram": 1.0667}
    )
    one = acceptance_record(
        _results_doc([("mtbench", "chain-3-1-4", 10, 1.198), ("mtbench", "ngram", 10, 1.184)]),
        "id-2",
        "pipeline-b",
        datetime(2026, 12, 6, 22, 0, 0),
        computed=False,
    )
    assert (one.dataset, one.num_prompts, one.accept_len, one.date) == (
        "mtbench",
        10,
        {"chain-3-1-4": 1.198, "ngram": 1.184},
        "2026-12-06T22:00:00Z",
    )
    assert acceptance_record({"results": []}, "id-3", "x", FINISHED, True) is None


def test_history_appends_one_line_per_run_and_survives_a_torn_line(tmp_path):
    """Each record is one line; a retried flow run (same id) replaces its own record in place; a torn last line
    (a kill mid-write) and a line of an unknown shape are left out; an absent history is empty."""
    path = tmp_path / "history" / "acceptance.jsonl"
    assert read_acceptance(path) == []
    first = AcceptanceRecord("id-1", "2026-12-06T21:30:05Z", "run-a", True, "mtbench", 10, {"ngram": 1.184})
    second = AcceptanceRecord("id-2", "2026-12-06T22:00:00Z", "run-b", False, "mtbench", 10, {"ngram": 1.184})
    append_acceptance(path, first)
    append_acceptance(path, second)
    assert len(path.read_text().splitlines()) == 2 and read_acceptance(path) == [first, second]
    retried = AcceptanceRecord("id-1", "2026-12-06T21:40:00Z", "run-a", True, "mtbench", 10, {"ngram": 1.2})
    append_acceptance(path, retried)
    assert read_acceptance(path) == [retried, second]
    with open(path, "ab") as fh:
        fh.write(b'{"id": "id-9"}\n{"id": "id-4", "date": "2026-12-0')
    assert read_acceptance(path) == [retried, second]
    third = AcceptanceRecord("id-3", "2026-12-07T01:00:00Z", "run-c", True, "mtbench", 10, {"ngram": 1.19})
    append_acceptance(path, third)  # after a torn line: on a fresh line
    assert read_acceptance(path) == [retried, second, third]


def _record(i: int, methods: dict[str, float], computed: bool = True) -> AcceptanceRecord:
    return AcceptanceRecord(f"id-{i}", f"2026-12-0{i}T10:00:00Z", f"run-{i}", computed, "mtbench", 10, methods)


def test_trend_rows_golden():
    """One row per run, oldest first: date, flow run, whether it measured, prompts, then the n-gram baseline and
    each method ("" where a run did not measure one)."""
    records = [
        _record(1, {"chain-3-1-4": 1.198, "ngram": 1.184}),
        _record(2, {"chain-3-1-4": 1.198, "ngram": 1.184}, computed=False),
        _record(3, {"chain-3-1-4": 1.25, "tree-5-4-8": 1.4, "ngram": 1.184}),
    ]
    assert trend_methods(records) == ["ngram", "chain-3-1-4", "tree-5-4-8"]
    assert trend_rows(records) == [
        {
            "date": "2026-12-01 10:00:00 UTC",
            "flow run": "run-1",
            "evaluation": "measured",
            "prompts": 10,
            "ngram": "1.184",
            "chain-3-1-4": "1.198",
            "tree-5-4-8": "",
        },
        {
            "date": "2026-12-02 10:00:00 UTC",
            "flow run": "run-2",
            "evaluation": "up to date (earlier figures)",
            "prompts": 10,
            "ngram": "1.184",
            "chain-3-1-4": "1.198",
            "tree-5-4-8": "",
        },
        {
            "date": "2026-12-03 10:00:00 UTC",
            "flow run": "run-3",
            "evaluation": "measured",
            "prompts": 10,
            "ngram": "1.184",
            "chain-3-1-4": "1.250",
            "tree-5-4-8": "1.400",
        },
    ]
    assert trend_rows([]) == []


@pytest.mark.parametrize("max_columns", [6, 8])
def test_trend_rows_never_exceed_the_page_width(max_columns):
    """More methods than columns: the n-gram baseline keeps its column, the rest share a last 'more methods' one."""
    methods = {
        "ngram": 1.1,
        "chain-1-1-2": 1.2,
        "chain-3-1-4": 1.3,
        "chain-5-1-6": 1.4,
        "chain-7-1-8": 1.5,
        "tree-5-4-8": 1.6,
    }
    (row,) = trend_rows([_record(1, methods)], max_columns)
    assert len(row) == max_columns and list(row)[4] == "ngram" and list(row)[-1] == "more methods"
    shown = list(row)[4:-1]
    assert row["more methods"] == "; ".join(f"{m} {v:.3f}" for m, v in methods.items() if m not in shown)


def test_history_path_is_outside_every_stage_folder(tmp_path):
    """No stage owns (or clears) the history: it sits in its own folder of the run directory."""
    layout = RunLayout(tmp_path)
    assert layout.acceptance_history == tmp_path / "history" / "acceptance.jsonl"
    assert all(
        not layout.acceptance_history.is_relative_to(Path(tmp_path / d))
        for d in ("data", "vocab", "features", "train", "export", "eval", "deploy")
    )


def test_stage_clock_records_state_duration_outputs_and_ui_link(tmp_path):
    """flows.stage_runs.StageClock (Prefect states built here, no server): a task's link is its task run's page, a
    subflow's its flow run's (not the stand-in task run), both as Prefect's url_for builds them from PREFECT_UI_URL;
    a failed call is recorded before it raises; fan-outs are labelled by whether they computed."""
    from uuid import uuid4

    from prefect.settings import PREFECT_UI_URL, temporary_settings
    from prefect.states import Completed, Failed

    from flows.stage_runs import StageClock

    task_id, flow_id, stand_in = uuid4(), uuid4(), uuid4()
    cached = Completed(name="Cached")
    cached.state_details.task_run_id = task_id
    sub = Completed()
    sub.state_details.flow_run_id, sub.state_details.task_run_id = flow_id, stand_in
    clock = StageClock(tmp_path / "run", {"benchmark": "deploy"})  # a step's row named apart from its stage
    with temporary_settings({PREFECT_UI_URL: UI}):
        clock.call("merge", "task-run", lambda: cached)
        clock.call("capture", "flow-run", lambda: sub)
        clock.call("train", "task-run", lambda: Failed(message="boom"))
        clock.plain("regenerate", lambda: "outcome", lambda _: False)
        with pytest.raises(RuntimeError):
            clock.plain("tokenize", lambda: (_ for _ in ()).throw(RuntimeError("x")), lambda _: True)
    clock.skipped("benchmark", "not enabled")
    clock.not_started(["vocab"])
    by_stage = {r.stage: r for r in clock.runs}
    assert [r.stage for r in clock.runs] == [
        "merge",
        "capture",
        "train",
        "regenerate",
        "tokenize",
        "benchmark",
        "vocab",
    ]
    assert (by_stage["merge"].state, by_stage["merge"].url, by_stage["merge"].outputs) == (
        CACHED,
        f"{UI}/runs/task-run/{task_id}",
        "data/merged.parquet",
    )
    assert (by_stage["capture"].url, by_stage["capture"].run_kind) == (f"{UI}/runs/flow-run/{flow_id}", "subflow run")
    assert by_stage["train"].state == FAILED and by_stage["train"].url is None  # a state without a run id
    assert by_stage["regenerate"].state == CACHED and by_stage["tokenize"].state == FAILED
    assert all(r.duration_s is not None and r.duration_s >= 0 for r in clock.runs[:5])
    assert (
        by_stage["benchmark"].state,
        by_stage["benchmark"].note,
        by_stage["benchmark"].duration_s,
        by_stage["benchmark"].outputs,
    ) == (SKIPPED, "not enabled", None, "deploy/")
    assert by_stage["vocab"].state == NOT_STARTED


def test_unstarted_stages_after_a_failure(tmp_path):
    """flows.pipeline.unstarted_stages: the planned stages after the failed one are 'Not started'; a failed deploy
    subflow's row stands for every step it had (none of them listed again)."""
    from eagle3.config import load_config
    from flows.pipeline import deploy_label, unstarted_stages

    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    done = [StageRun("target", COMPLETED, 1.0), StageRun("merge", FAILED, 0.5)]
    assert unstarted_stages(cfg, "evaluate", {"target": object()}, done) == [
        "tokenize",
        "vocab",
        "capture",
        "train",
        "export",
        "evaluate",
    ]
    results = dict.fromkeys(["target", "merge", "tokenize", "vocab", "capture", "train"])
    deploy = StageRun(deploy_label(["export", "evaluate"]), FAILED, 9.0)
    assert deploy.stage == "deploy subflow (export, evaluate)"
    assert unstarted_stages(cfg, "evaluate", results, [*done, deploy]) == []
    assert unstarted_stages(cfg, "vocab", dict.fromkeys(["target", "merge", "tokenize", "vocab"]), done) == []
