"""The data-scaling curve: token-budget prefixes, the curve report, asset bundles and the CPU smoke of every phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.train.build import first_tokens
from lab import curve_assets, curve_carry, curve_report, curve_runs, quality_curve


def test_first_tokens_is_a_nested_prefix():
    """A budget keeps the longest prefix within it; a larger budget's rows start with a smaller one's."""
    rows = [("a", 5), ("b", 3), ("c", 4), ("d", 2)]
    assert first_tokens(rows, 8, Path("t")) == [("a", 5), ("b", 3)]
    assert first_tokens(rows, 11, Path("t")) == [("a", 5), ("b", 3)]
    assert first_tokens(rows, 12, Path("t")) == rows[:3]
    assert first_tokens(rows, 14, Path("t")) == rows


def test_first_tokens_refuses_a_budget_the_split_cannot_fill():
    """A curve point would be mislabelled if the split held fewer tokens than its budget: a clear error."""
    with pytest.raises(ValueError, match="holds only 14 tokens"):
        first_tokens([("a", 5), ("b", 3), ("c", 4), ("d", 2)], 15, Path("tok.parquet"))
    with pytest.raises(ValueError, match="below the first train row"):
        first_tokens([("a", 5), ("b", 3)], 4, Path("tok.parquet"))


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


def test_sweep_variants_change_one_setting_each():
    """lr x2, x4 and /2, half and twice the epochs (half only where it is a whole epoch less) and twice the draft
    vocab, each its own run name beside the size's."""
    base = curve_runs.base_config("tiny", [])
    variants = curve_runs.sweep_variants(base)
    assert base.train.num_epochs == 1
    assert [v.label for v in variants] == ["lr-x2", "lr-x4", "lr-half", "epochs-2", "vocab-256"]
    assert [v.own_vocab for v in variants] == [False, False, False, False, True]
    assert variants[3].overrides == ("train.num_epochs=2",)
    cfg = curve_runs.size_config("tiny", [], curve_runs.Size(4_000), False, variants[0])
    assert (cfg.run.name, cfg.train.lr, cfg.train.max_train_tokens) == ("tiny-4K-lr-x2", 2 * base.train.lr, 4_000)
    x4 = curve_runs.size_config("tiny", [], curve_runs.Size(4_000), False, variants[1])
    assert (x4.run.name, x4.train.lr) == ("tiny-4K-lr-x4", pytest.approx(4 * base.train.lr))
    assert curve_runs.size_config("tiny", [], curve_runs.Size(4_000), False, variants[4]).vocab.draft_vocab_size == 256
    curve = curve_runs.sweep_variants(curve_runs.base_config("smollm2-curve", []))
    assert [v.label for v in curve] == ["lr-x2", "lr-x4", "lr-half", "epochs-3", "epochs-12", "vocab-32768"]


def test_one_step_of_a_sweep_variant_runs_alone(tmp_path):
    """train-N-VARIANT runs only the training of that variant's run (N the largest size); other sizes are refused;
    its evaluation leaves n-gram out unless --ngram-every-size asks for it."""
    calls = []

    def runner(module, argv, budget_s):
        calls.append((module, argv[-1]))
        return True

    c = quality_curve.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000), curve_runs.Size(4_000)],
        dict(quality_curve.DEFAULT_BUDGETS_S),
        runner,
    )
    assert quality_curve.run_phase(c, "train-4K-epochs-2")
    assert calls == [("eagle3.train.stage", str(tmp_path / "tiny-4K-epochs-2/config.json"))]
    assert json.loads(Path(calls[0][1]).read_text())["train"]["num_epochs"] == 2
    variant = c.variant("epochs-2")
    assert "ngram" not in c.size_run(curve_runs.Size(4_000), variant)[0].evaluate.methods
    every = quality_curve.Curve("tiny", [f"run.workdir={tmp_path}"], c.sizes, c.budgets, runner, ngram_every_size=True)
    assert "ngram" in every.size_run(curve_runs.Size(4_000), variant)[0].evaluate.methods  # a full quality run
    with pytest.raises(SystemExit, match="largest size"):
        quality_curve.run_phase(c, "eval-2K-epochs-2")
    with pytest.raises(SystemExit, match="no variant"):
        quality_curve.run_phase(c, "export-4K-lr-x9")


def test_a_run_of_the_curves_largest_size_is_borrowed_and_a_different_run_is_refused(tmp_path):
    """--size-run 20M=P: the report takes P's results as the 20M point because every setting but its name matches that
    size's run; as the 10M point it is refused, naming max_train_tokens; smollm2-quality (the sweep's best lr) is
    refused as the 20M point, naming the learning rate."""
    preset = tmp_path / "q20.yaml"
    preset.write_text("base: smollm2-curve\nrun:\n  name: q20\ntrain:\n  max_train_tokens: 20000000\n")
    sizes = [curve_runs.Size(t) for t in (3_000_000, 10_000_000, 20_000_000)]
    c = quality_curve.Curve(
        "smollm2-curve",
        [f"run.workdir={tmp_path}"],
        sizes,
        dict(quality_curve.DEFAULT_BUDGETS_S),
        lambda *a: True,
        size_runs=((20_000_000, str(preset)),),
    )
    assert quality_curve.borrowed_eval(c, sizes[2], str(preset)) == tmp_path / "q20" / "eval"
    with pytest.raises(SystemExit, match=r"train\.max_train_tokens \(10000000 here, 20000000 there\)"):
        quality_curve.borrowed_eval(c, sizes[1], str(preset))
    with pytest.raises(SystemExit, match=r"train\.lr \(0\.001 here, 0\.002 there\)"):
        quality_curve.borrowed_eval(c, sizes[2], "smollm2-quality")
    _fake_results(tmp_path / "q20/eval/results.json", {"chain-3-1-4": 2.3, "ngram": 1.7})
    text = quality_curve.phase_report(c)["markdown"].read_text()
    assert "| 20M | 2.300 | 1.700 |" in text and "Not measured yet: 3M, 10M." in text


def test_a_phase_list_runs_in_order_stops_at_the_first_cut_and_checks_every_name_first(tmp_path):
    """data,train-N,export-N: in order under one deadline; the first phase cut short ends the list (exit 3), and a
    bad name anywhere in the list fails before any phase runs."""
    calls, cut = [], {"eagle3.export.stage"}

    def runner(module, argv, budget_s):
        calls.append(module)
        return module not in cut

    c = quality_curve.Curve(
        "tiny", [f"run.workdir={tmp_path}"], [curve_runs.Size(4_000)], dict(quality_curve.DEFAULT_BUDGETS_S), runner
    )
    assert not quality_curve.run_phases(c, ["data", "train-4K", "export-4K", "eval-4K"])
    assert calls == ["eagle3.run.stages", "eagle3.train.stage", "eagle3.export.stage"]
    cut.clear()
    assert quality_curve.run_phases(c, ["export-4K", "eval-4K"]) and calls[3:] == [
        "eagle3.export.stage",
        "eagle3.evaluate.stage",
    ]
    for bad, message in (("train-9K", "not in --sizes"), ("eval-4K-lr-x9", "no variant"), ("capture", "unknown phase")):
        with pytest.raises(SystemExit, match=message):
            quality_curve.run_phases(c, ["data", bad])
    assert len(calls) == 5


def test_replay_smaller_decodes_the_largest_size_first_with_ngram_and_replays_the_rest(tmp_path):
    """all --replay-smaller: data, the largest size's train/export/eval (n-gram in its methods), then the smaller
    sizes trained, exported and replayed on the largest's greedy texts, then the report."""
    c = quality_curve.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000), curve_runs.Size(4_000)],
        dict(quality_curve.DEFAULT_BUDGETS_S),
        lambda *a: True,
        replay_smaller=True,
    )
    assert quality_curve.all_phases(c) == ["data", "size-4K", "train-2K", "export-2K", "replay-2K", "report"]
    assert "ngram" in c.size_run(curve_runs.Size(4_000))[0].evaluate.methods
    assert "ngram" not in c.size_run(curve_runs.Size(2_000))[0].evaluate.methods
    texts = tmp_path / "tiny-4K/eval/prompts.jsonl"
    texts.parent.mkdir(parents=True)
    texts.write_text("")
    (tmp_path / "tiny-2K/eval").mkdir(parents=True)
    (tmp_path / "tiny-2K/eval/prompts.jsonl").write_text("")
    assert quality_curve.greedy_texts(c) == texts  # the largest size's, decoded first


def test_a_deadline_cuts_each_phase_budget_and_starts_nothing_it_cannot_fit(tmp_path, monkeypatch):
    """--deadline-s: a phase runs with at most the time left minus the SIGTERM grace; with less than
    MIN_PHASE_S left it is not started and counts as cut short (the same command continues later)."""
    budgets = []
    c = quality_curve.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000)],
        dict(quality_curve.DEFAULT_BUDGETS_S),
        lambda m, a, b: budgets.append(b) or True,
        deadline=1_000.0,
    )
    monkeypatch.setattr(quality_curve.time, "monotonic", lambda: 1_000.0 - 400)
    assert c.run("m", [], 650.0) and budgets == [400 - quality_curve.GRACE_S]
    assert c.run("m", [], 90.0) and budgets[-1] == 90.0
    monkeypatch.setattr(quality_curve.time, "monotonic", lambda: 1_000.0 - quality_curve.GRACE_S - 10)
    assert not c.run("m", [], 90.0) and len(budgets) == 2


def test_token_labels_round_trip():
    """Size labels name the runs; parsing a label gives the budget back."""
    for tokens in (2_000, 500_000, 1_500_000, 3_000_000, 20_000_000):
        assert curve_runs.parse_tokens(curve_report.token_label(tokens)) == tokens


def test_assets_travel_in_bundles_and_assemble_checked(tmp_path):
    """Files cut over several bundles come back byte-identical (text via xz); a damaged chunk is an error."""
    blob, text = tmp_path / "w.gguf", tmp_path / "d.json"
    blob.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    text.write_text(json.dumps([{"x": "hello " * 50}] * 30))
    bundles = curve_assets.pack({"pkg_a/w.gguf": blob, "pkg_b/data/d.json": text}, tmp_path / "out", limit=4096)
    assert len(bundles) >= 3 and all(
        sum(f.stat().st_size for f in b.iterdir() if f.name != "assets.json") <= 4096 for b in bundles
    )
    site, stage = tmp_path / "site", tmp_path / "stage"
    missing = []
    for bundle in bundles:
        missing = curve_assets.unpack(bundle, stage, site)
    assert missing == []
    assert (site / "pkg_a/w.gguf").read_bytes() == blob.read_bytes()
    assert (site / "pkg_b/data/d.json").read_bytes() == text.read_bytes()
    (site / "pkg_a/w.gguf").unlink()
    damaged = next(p for p in stage.iterdir() if not p.name.endswith(".joined"))
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        for bundle in bundles:
            curve_assets.unpack(bundle, stage, site)


def test_curve_all_phases_on_the_tiny_target(tmp_path, capsys):
    """data, train/export/eval at 2 sizes and the report run on CPU; a second run recomputes nothing."""
    args = [
        "all",
        "--in-process",
        "--preset",
        "tiny",
        "--sizes",
        "2K,4K",
        "--set",
        f"run.workdir={tmp_path}",
        "--set",
        "train.features=online",
        "--set",
        "evaluate.datasets=[mtbench]",
        "--set",
        "evaluate.num_prompts=2",
        "--set",
        "evaluate.max_new_tokens=8",
        "--set",
        "evaluate.methods=[chain,ngram]",
    ]
    assert quality_curve.main(args) == 0
    small, large = (json.loads((tmp_path / f"tiny-{s}/eval/results.json").read_text()) for s in ("2K", "4K"))
    assert {r["method"] for r in small["results"]} == {"chain-3-1-4", "ngram"}
    assert {r["method"] for r in large["results"]} == {"chain-3-1-4"}  # n-gram measured once
    configs = [json.loads((tmp_path / f"tiny-{s}/config.json").read_text()) for s in ("2K", "4K")]
    assert [c["train"]["max_train_tokens"] for c in configs] == [2000, 4000]
    steps = [
        json.loads((tmp_path / f"tiny-{s}/train/train.manifest.json").read_text())["stats"]["total_steps"]
        for s in ("2K", "4K")
    ]
    assert 0 < steps[0] < steps[1]  # the smaller budget trained on fewer rows
    assert (tmp_path / "tiny-2K/data").resolve() == (tmp_path / "tiny/data").resolve()
    curve = (tmp_path / "tiny/appendix/curve.md").read_text()
    assert "| 2K |" in curve and "| 4K |" in curve
    # replay-4K on the 2K evaluation's greedy texts: the 4K drafter's decoded chain figures without its decode
    assert quality_curve.main(["replay-4K", *args[1:]]) == 0
    replayed = json.loads((tmp_path / "tiny-4K/eval/replayed.json").read_text())["accept_len"]
    decoded = {f"{r['dataset']}/{r['method']}": r["accept_len"] for r in large["results"]}
    assert decoded and all(replayed[k] == pytest.approx(v) for k, v in decoded.items()), (replayed, decoded)
    assert replayed["mtbench/ngram"] == pytest.approx(
        next(r["accept_len"] for r in small["results"] if r["method"] == "ngram" and r["dataset"] == "mtbench")
    )
    manifests = sorted(tmp_path.glob("tiny*/**/*.manifest.json"))
    stamps = {p: p.stat().st_mtime_ns for p in manifests}
    capsys.readouterr()
    assert quality_curve.main(args) == 0
    assert {p: p.stat().st_mtime_ns for p in manifests} == stamps
    assert '"computed": true' not in capsys.readouterr().out
    # the recipe sweep's own-vocab variant at the largest size: its own vocab/, the data run's data/
    sweep = ["sweep", "--variants", "vocab-256", *args[1:]]
    assert quality_curve.main(sweep) == 0
    variant = tmp_path / "tiny-4K-vocab-256"
    assert (variant / "data").resolve() == (tmp_path / "tiny/data").resolve() and not (variant / "vocab").is_symlink()
    assert json.loads((variant / "config.json").read_text())["vocab"]["draft_vocab_size"] == 256
    assert {r["method"] for r in json.loads((variant / "eval/results.json").read_text())["results"]} == {"chain-3-1-4"}
    assert quality_curve.main(["report", *args[1:]]) == 0
    assert "| vocab-256 |" in (tmp_path / "tiny/appendix/curve.md").read_text()
    # --pack-results-to: after a phase, its folder unpacks to every run's results and, with --with-weights, drafters
    carry = tmp_path / "carry"
    assert quality_curve.main(["report", *args[1:], "--pack-results-to", str(carry), "--with-weights"]) == 0
    names = set(curve_carry.unpack_results(tmp_path / "elsewhere", carry))
    for rel in (
        "tiny-2K/eval/results.json",
        "tiny-4K-vocab-256/eval/prompts.jsonl",
        "tiny/appendix/curve.md",
        "tiny-4K/export/sglang/model.safetensors",
    ):
        assert rel in names and (tmp_path / "elsewhere" / rel).read_bytes() == (tmp_path / rel).read_bytes()


def test_a_size_runs_its_stage_commands_in_the_registry_order(tmp_path):
    """size-N runs the train, export and evaluate stages' own commands (eagle3.run.registry's modules) in the
    registry's order; replay-N replays instead of decoding."""
    calls = []

    def runner(module, argv, budget_s):
        calls.append(module)
        return True

    c = quality_curve.Curve(
        "tiny", [f"run.workdir={tmp_path}"], [curve_runs.Size(4_000)], dict(quality_curve.DEFAULT_BUDGETS_S), runner
    )
    assert quality_curve.run_phase(c, "size-4K")
    assert calls == ["eagle3.train.stage", "eagle3.export.stage", "eagle3.evaluate.stage"]
    assert quality_curve.per_run_phases(replay=True)[-1] is quality_curve.phase_replay
