"""The data-scaling curve's runs and phases: token-budget prefixes, sweep variants, phase lists, budgets and
deadlines, and the CPU smoke of every phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.train.build import first_tokens
from lab import curve_carry, curve_phases, curve_runs, quality_curve


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

    c = curve_phases.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000), curve_runs.Size(4_000)],
        dict(curve_phases.DEFAULT_BUDGETS_S),
        runner,
    )
    assert quality_curve.run_phase(c, "train-4K-epochs-2")
    assert calls == [("eagle3.train.stage", str(tmp_path / "tiny-4K-epochs-2/config.json"))]
    assert json.loads(Path(calls[0][1]).read_text())["train"]["num_epochs"] == 2
    variant = c.variant("epochs-2")
    assert "ngram" not in c.size_run(curve_runs.Size(4_000), variant)[0].evaluate.methods
    every = curve_phases.Curve("tiny", [f"run.workdir={tmp_path}"], c.sizes, c.budgets, runner, ngram_every_size=True)
    assert "ngram" in every.size_run(curve_runs.Size(4_000), variant)[0].evaluate.methods  # a full quality run
    with pytest.raises(SystemExit, match="largest size"):
        quality_curve.run_phase(c, "eval-2K-epochs-2")
    with pytest.raises(SystemExit, match="no variant"):
        quality_curve.run_phase(c, "export-4K-lr-x9")


def test_a_phase_list_runs_in_order_stops_at_the_first_cut_and_checks_every_name_first(tmp_path):
    """data,train-N,export-N: in order under one deadline; the first phase cut short ends the list (exit 3), and a
    bad name anywhere in the list fails before any phase runs."""
    calls, cut = [], {"eagle3.export.stage"}

    def runner(module, argv, budget_s):
        calls.append(module)
        return module not in cut

    c = curve_phases.Curve(
        "tiny", [f"run.workdir={tmp_path}"], [curve_runs.Size(4_000)], dict(curve_phases.DEFAULT_BUDGETS_S), runner
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
    c = curve_phases.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000), curve_runs.Size(4_000)],
        dict(curve_phases.DEFAULT_BUDGETS_S),
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
    assert curve_phases.greedy_texts(c) == texts  # the largest size's, decoded first


def test_a_deadline_cuts_each_phase_budget_and_starts_nothing_it_cannot_fit(tmp_path, monkeypatch):
    """--deadline-s: a phase runs with at most the time left minus the SIGTERM grace; with less than
    MIN_PHASE_S left it is not started and counts as cut short (the same command continues later)."""
    budgets = []
    c = curve_phases.Curve(
        "tiny",
        [f"run.workdir={tmp_path}"],
        [curve_runs.Size(2_000)],
        dict(curve_phases.DEFAULT_BUDGETS_S),
        lambda m, a, b: budgets.append(b) or True,
        deadline=1_000.0,
    )
    monkeypatch.setattr(curve_phases.time, "monotonic", lambda: 1_000.0 - 400)
    assert c.run("m", [], 650.0) and budgets == [400 - curve_phases.GRACE_S]
    assert c.run("m", [], 90.0) and budgets[-1] == 90.0
    monkeypatch.setattr(curve_phases.time, "monotonic", lambda: 1_000.0 - curve_phases.GRACE_S - 10)
    assert not c.run("m", [], 90.0) and len(budgets) == 2


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

    c = curve_phases.Curve(
        "tiny", [f"run.workdir={tmp_path}"], [curve_runs.Size(4_000)], dict(curve_phases.DEFAULT_BUDGETS_S), runner
    )
    assert quality_curve.run_phase(c, "size-4K")
    assert calls == ["eagle3.train.stage", "eagle3.export.stage", "eagle3.evaluate.stage"]
    assert curve_phases.per_run_phases(replay=True)[-1] is curve_phases.phase_replay
