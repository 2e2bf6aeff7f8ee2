"""The data-scaling curve's report: its tables, plot and curve.json from the sizes' results, replays and the sweep,
and a size borrowed from another preset's run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import curve_phases, curve_report, curve_runs


def _fake_results(path: Path, accept: dict[str, float]) -> Path:
    """A fake eval/results.json (the fields the curve reads, values made up)."""
    rows = [
        {
            "dataset": d,
            "method": m,
            "accept_len": a + (0.1 if d == "gsm8k" else 0.0),
            "num_prompts": 2,
            "lossless": {"identical": 2},
        }
        for d in ("mtbench", "gsm8k", "all")
        for m, a in accept.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": {"fake": True}, "results": rows}))
    return path


def test_curve_report_table_and_flat_ngram(tmp_path):
    """Each measured size is a table row per dataset; n-gram comes from the first size; unmeasured sizes are named."""
    results = {
        3_000_000: _fake_results(tmp_path / "fake-3M/results.json", {"chain-3-1-4": 1.5, "ngram": 1.7}),
        10_000_000: _fake_results(tmp_path / "fake-10M/results.json", {"chain-3-1-4": 1.9}),
        20_000_000: tmp_path / "fake-20M/results.json",
    }
    out = curve_report.write_curve_report(results, tmp_path / "curve")
    text = out["markdown"].read_text()
    assert "| 3M | 1.500 | 1.700 |" in text and "| 10M | 1.900 | 1.700 |" in text
    assert "| 10M | 2.000 | 1.800 |" in text  # gsm8k table
    assert "Not measured yet: 20M." in text
    data = json.loads(out["json"].read_text())
    assert data["not_measured"] == [20_000_000] and len(data["rows"]) == 9
    assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_is_drawn_again_from_a_curve_json_alone_and_a_bad_one_is_named(tmp_path):
    """curve_report.py CURVE_JSON OUT_PNG redraws curve.png from the rows of a curve.json, with no run beside it; a file
    that is not one fails naming the file."""
    results = {3_000_000: _fake_results(tmp_path / "fake-3M/results.json", {"chain-3-1-4": 1.5, "ngram": 1.7})}
    curve_json = curve_report.write_curve_report(results, tmp_path / "curve")["json"]
    rows = curve_report.rows_of(curve_json)
    assert {(r.tokens, r.method) for r in rows if r.dataset == "all"} == {
        (3_000_000, "chain-3-1-4"),
        (3_000_000, "ngram"),
    }
    curve_report.main([str(curve_json), str(tmp_path / "again.png")])
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text('{"rows": [{"tokens": 1}]}')
    with pytest.raises(SystemExit, match="bad.json: not a curve.json"):
        curve_report.main([str(tmp_path / "bad.json"), str(tmp_path / "x.png")])


def test_an_evaluation_of_one_dataset_is_its_all_row_in_the_tables_and_the_sweep(tmp_path):
    """A size evaluated on one dataset (no 'all' rows of its own) fills the 'all' table with its decoded figures."""
    path = tmp_path / "one/results.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "results": [
                    {
                        "dataset": "mtbench",
                        "method": "chain-3-1-4",
                        "accept_len": 2.5,
                        "num_prompts": 4,
                        "lossless": {"identical": 4},
                    }
                ]
            }
        )
    )
    rows, missing = curve_report.read_rows({2_000: path})
    assert missing == [] and [(r.dataset, r.accept_len, r.replayed) for r in rows] == [
        ("mtbench", 2.5, False),
        ("all", 2.5, False),
    ]
    three = _fake_results(tmp_path / "three/results.json", {"chain-3-1-4": 1.5})  # has its own 'all' rows
    assert [r.dataset for r in curve_report.read_rows({2_000: three})[0]] == ["mtbench", "gsm8k", "all"]


def test_curve_report_fills_undecoded_methods_from_replays_and_marks_them(tmp_path):
    """A size with only a replay file is measured (its figures marked †, no lossless claim); where a size has both,
    the decoded figure wins and the replay adds only the methods the decode lacked."""

    def replay(path: Path, accept: dict[str, float]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "accept_len": {f"{d}/{m}": a for d in ("mtbench", "gsm8k", "all") for m, a in accept.items()},
                    "num_prompts": {"mtbench": 1, "gsm8k": 1, "all": 2},
                }
            )
        )
        return path

    results = {
        2_000: _fake_results(tmp_path / "s-2K/results.json", {"chain-3-1-4": 1.4}),
        4_000: tmp_path / "s-4K/results.json",
        8_000: tmp_path / "s-8K/results.json",
    }
    replayed = {
        2_000: replay(tmp_path / "s-2K/replayed.json", {"chain-3-1-4": 9.9, "chain-7-1-8": 1.45, "ngram": 1.7}),
        4_000: replay(tmp_path / "s-4K/replayed.json", {"chain-3-1-4": 1.6, "chain-7-1-8": 1.65}),
    }
    text = curve_report.write_curve_report(results, tmp_path / "curve", replayed=replayed)["markdown"].read_text()
    assert "| 2K | 1.400 | 1.450† | 1.700† |" in text and "| 4K | 1.600† | 1.650† | 1.700† |" in text
    assert "† replayed from an evaluation's greedy texts" in text and "Every decode token-identical" in text
    assert "Not measured yet: 8K." in text and "9.9" not in text
    sweep = {"lr-x2": tmp_path / "s-8K-lr-x2/results.json"}
    out = curve_report.write_curve_report(
        results,
        tmp_path / "curve2",
        sweep,
        replayed,
        {"lr-x2": replay(tmp_path / "s-8K-lr-x2/r.json", {"chain-3-1-4": 1.8})},
    )
    assert "| lr-x2 | 1.800† | replayed, no decode |" in out["markdown"].read_text()


def test_curve_report_tables_the_recipe_sweep_beside_the_largest_size(tmp_path):
    """Variants measured at the largest size get a table: the baseline row first, each variant's acceptance per
    method and its lossless count; variants not measured yet are named under the table, not tabled."""
    results = {
        2_000: _fake_results(tmp_path / "s-2K/results.json", {"chain-3-1-4": 1.4, "ngram": 1.7}),
        4_000: _fake_results(tmp_path / "s-4K/results.json", {"chain-3-1-4": 1.5}),
    }
    sweep = {
        "lr-x2": _fake_results(tmp_path / "s-4K-lr-x2/results.json", {"chain-3-1-4": 1.6}),
        "lr-half": tmp_path / "s-4K-lr-half/results.json",
    }
    out = curve_report.write_curve_report(results, tmp_path / "curve", sweep)
    text = out["markdown"].read_text()
    assert "## Recipe sweep at 4K (all prompts)" in text
    assert "| baseline | 1.500 | 2/2 identical |" in text and "| lr-x2 | 1.600 | 2/2 identical |" in text
    assert "| lr-half |" not in text and "Not measured yet: lr-half." in text
    assert json.loads(out["json"].read_text())["sweep_not_measured"] == ["lr-half"]
    assert [r["tokens"] for r in json.loads(out["json"].read_text())["sweep"]["lr-x2"]] == [4_000]


def _train_log(run: Path, evals: list[tuple[int, float]], last_step: int, finished: bool) -> None:
    """A run's train/metrics.jsonl with these validations (and train records up to ``last_step``), and its train
    manifest when ``finished``."""
    from eagle3.run.layout import RunLayout
    from eagle3.run.registry import get_stage

    layout = RunLayout(run)
    layout.metrics.parent.mkdir(parents=True, exist_ok=True)
    records = [{"type": "train", "step": s, "loss": 1.0} for s in range(1, last_step + 1)]
    records += [{"type": "eval", "step": s, "accept_len_est": a} for s, a in evals]
    layout.metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    if finished:
        get_stage("train").manifest(layout.root).write_text("{}")


def test_a_variant_stopped_before_its_last_step_is_reported_by_its_validation_and_marked(tmp_path):
    """Each run's best validation (the first step to reach it) is in the curve and sweep tables and curve.json; a
    variant whose training stopped early, with no results, is tabled by it and marked stopped, not 'not measured'."""
    results = {4_000: _fake_results(tmp_path / "s-4K/eval/results.json", {"chain-3-1-4": 1.5})}
    _train_log(tmp_path / "s-4K", [(2, 1.9), (4, 2.1), (6, 2.1)], 6, finished=True)
    sweep = {"lr-x2": tmp_path / "s-4K-lr-x2/eval/results.json", "lr-half": tmp_path / "s-4K-lr-half/eval/results.json"}
    _train_log(tmp_path / "s-4K-lr-x2", [(2, 2.0), (4, 2.3)], 5, finished=False)
    out = curve_report.write_curve_report(results, tmp_path / "curve", sweep)
    text = out["markdown"].read_text()
    assert "| 4K | 1.500 | - | 2.100 (step 4) |" in text  # the 'all' table; the method columns: chain 3, n-gram
    assert "| baseline | 1.500 | 2/2 identical | 2.100 (step 4) |" in text
    assert "| lr-x2 | - | not decoded | 2.300 (step 4; stopped at 5) |" in text
    assert "Not measured yet: lr-half." in text
    data = json.loads(out["json"].read_text())
    assert data["sweep_not_measured"] == ["lr-half"] and data["validation"]["4000"]["best"] == 2.1
    assert data["sweep_validation"]["lr-x2"] == {"best_step": 4, "best": 2.3, "last_step": 5, "finished": False}


def test_a_run_of_the_curves_largest_size_is_borrowed_and_a_different_run_is_refused(tmp_path):
    """--size-run 20M=P: the report takes P's results as the 20M point because every setting but its name matches that
    size's run; as the 10M point it is refused, naming max_train_tokens; smollm2-quality (the sweep's best lr) is
    refused as the 20M point, naming the learning rate."""
    preset = tmp_path / "q20.yaml"
    preset.write_text("base: smollm2-curve\nrun:\n  name: q20\ntrain:\n  max_train_tokens: 20000000\n")
    sizes = [curve_runs.Size(t) for t in (3_000_000, 10_000_000, 20_000_000)]
    c = curve_phases.Curve(
        "smollm2-curve",
        [f"run.workdir={tmp_path}"],
        sizes,
        dict(curve_phases.DEFAULT_BUDGETS_S),
        lambda *a: True,
        size_runs=((20_000_000, str(preset)),),
    )
    assert curve_phases.borrowed_eval(c, sizes[2], str(preset)) == tmp_path / "q20" / "eval"
    with pytest.raises(SystemExit, match=r"train\.max_train_tokens \(10000000 here, 20000000 there\)"):
        curve_phases.borrowed_eval(c, sizes[1], str(preset))
    with pytest.raises(SystemExit, match=r"train\.lr \(0\.001 here, 0\.002 there\)"):
        curve_phases.borrowed_eval(c, sizes[2], "smollm2-quality")
    _fake_results(tmp_path / "q20/eval/results.json", {"chain-3-1-4": 2.3, "ngram": 1.7})
    text = curve_phases.phase_report(c)["markdown"].read_text()
    assert "| 20M | 2.300 | 1.700 |" in text and "Not measured yet: 3M, 10M." in text


def test_token_labels_round_trip():
    """Size labels name the runs; parsing a label gives the budget back."""
    for tokens in (2_000, 500_000, 1_500_000, 3_000_000, 20_000_000):
        assert curve_runs.parse_tokens(curve_report.token_label(tokens)) == tokens
