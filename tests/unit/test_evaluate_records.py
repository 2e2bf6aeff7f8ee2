"""The evaluation's typed records against golden files written by the dict-based code they replaced: a journal with
one record from before the teacher-forced cross-check and one after, its prompts.jsonl, results.json and report.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.evaluate.pool import journaled_records
from eagle3.evaluate.prompts import EvalPrompt
from eagle3.evaluate.records import EvalResults, EvalSettings, PromptRecord, RecordError, SummaryRow
from eagle3.evaluate.report import report_markdown, summarize_all, write_outputs
from eagle3.run.journal import Journal

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
METHODS = ["chain-3-1-4", "ngram"]


def _journal_lines() -> list[str]:
    return (GOLDEN / "evaluate.journal.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


def _golden_records() -> list[PromptRecord]:
    return [PromptRecord.from_json(json.loads(line)["record"]) for line in _journal_lines()]


def test_journal_lines_round_trip_byte_for_byte():
    """Each golden journal line (old one without teacher_forced, new one with) loads and is written back identically."""
    for line in _journal_lines():
        entry = json.loads(line)
        record = PromptRecord.from_json(entry["record"])
        assert json.dumps(entry | {"record": record.to_json()}, ensure_ascii=False) + "\n" == line
    old, new = _golden_records()
    assert old.teacher_forced is None and new.teacher_forced is not None and new.teacher_forced.num_hits == 4
    assert old.methods["ngram"].tokens is not None and old.methods["chain-3-1-4"].tokens is None
    assert old.methods["ngram"].lossless.kind == "near_tie" and old.methods["ngram"].lossless.top2_gap == 0.0625


def test_old_journal_resumes_with_typed_records(tmp_path):
    """journaled_records reads a journal written before the typed records: the same prompts come back, typed."""
    journal = Journal(tmp_path / "evaluate.journal.jsonl")
    journal.path.write_text("".join(_journal_lines()), encoding="utf-8")
    prompts = [
        (0, EvalPrompt("mtbench", "mtbench:81", ""), [0] * 37),
        (1, EvalPrompt("gsm8k", "gsm8k:0", ""), [0] * 61),
    ]
    assert journaled_records(journal, "golden-key", prompts) == dict(enumerate(_golden_records()))
    assert journaled_records(journal, "other-key", prompts) == {}
    assert list(journaled_records(journal, "golden-key", [(1, prompts[1][1], [0] * 60)])) == []  # other length


def test_outputs_equal_the_dict_codes_golden_files(tmp_path):
    """Summaries, results.json, report.md and prompts.jsonl from the golden records equal the old code's bytes."""
    golden = json.loads((GOLDEN / "evaluate_results.json").read_text())
    settings = EvalSettings.from_json(golden["settings"])
    rows = summarize_all(_golden_records(), METHODS)
    assert [r.to_json() for r in rows] == golden["results"]
    outputs = write_outputs(tmp_path, _golden_records(), rows, settings)
    for name, key in (
        ("evaluate_results.json", "results"),
        ("evaluate_report.md", "report"),
        ("evaluate_prompts.jsonl", "prompts"),
    ):
        assert outputs[key].read_bytes() == (GOLDEN / name).read_bytes(), name
    assert report_markdown(rows, settings) == (GOLDEN / "evaluate_report.md").read_text()


def test_results_json_round_trips():
    """results.json loads into EvalResults and is written back identically; a row without the later fields loads."""
    text = (GOLDEN / "evaluate_results.json").read_text()
    results = EvalResults.from_json(json.loads(text))
    assert json.dumps(results.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n" == text
    assert results.settings.partial is not None and results.settings.partial.num_planned == 3
    assert results.settings.methods[0].name == "chain-3-1-4"
    older = {k: v for k, v in results.to_json()["results"][0].items() if k != "teacher_forced_acc_0"}
    assert SummaryRow.from_json(older).teacher_forced_acc_0 is None


def test_bad_record_names_the_prompt_and_field(tmp_path):
    """A journaled record with a missing field or an unknown lossless kind fails naming the file, prompt and field."""
    entry = json.loads(_journal_lines()[0])
    del entry["record"]["methods"]["ngram"]["committed"]
    with pytest.raises(RecordError, match=r"'mtbench:81': method ngram: missing field 'committed'"):
        PromptRecord.from_json(entry["record"])
    entry = json.loads(_journal_lines()[0])
    entry["record"]["methods"]["ngram"]["lossless"]["kind"] = "close"
    journal = Journal(tmp_path / "evaluate.journal.jsonl")
    journal.path.write_text(json.dumps(entry) + "\n")
    with pytest.raises(RecordError, match=r"evaluate.journal.jsonl, entry 0: .*lossless: unknown kind 'close'"):
        journaled_records(journal, "golden-key", [(0, EvalPrompt("mtbench", "mtbench:81", ""), [0] * 37)])


def test_decode_fallbacks_travel_from_records_to_results_and_report(tmp_path):
    """A record's fallen-back steps round-trip through the journal line, and results.json and report.md name them."""
    from dataclasses import replace

    record = replace(_golden_records()[1], decode_fallbacks={"tree draft round (5, 4, 8)": "RuntimeError('capture')"})
    assert PromptRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert "decode_fallbacks" not in _golden_records()[1].to_json()  # absent when nothing fell back
    golden = json.loads((GOLDEN / "evaluate_results.json").read_text())
    settings = replace(EvalSettings.from_json(golden["settings"]), decode_fallbacks=record.decode_fallbacks)
    assert EvalSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    report = report_markdown(summarize_all([record], METHODS), settings)
    assert "Ran on eager kernels" in report and "tree draft round (5, 4, 8): RuntimeError('capture')" in report


def test_a_one_row_baseline_time_round_trips_and_is_absent_otherwise():
    """A reference with its one-row baseline time loads back equal; one without writes no baseline key (journals
    and prompts.jsonl of evaluations without it stay as they were)."""
    from eagle3.evaluate.records import GreedyReference

    timed = GreedyReference(3, 0.5, [1, 2, 3], None, 0.25)
    assert GreedyReference.from_json(json.loads(json.dumps(timed.to_json()))) == timed
    assert timed.speed_wall_s == 0.25
    plain = GreedyReference(3, 0.5, [1, 2, 3])
    assert "baseline_wall_s" not in plain.to_json() and plain.speed_wall_s == 0.5
