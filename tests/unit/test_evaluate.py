"""The evaluate stage: dataset loaders, acceptance summaries (golden values), config checks, and the stage end to
end on a tiny target with a tiny drafter exported and loaded back."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from eagle3.config import ConfigError, EvaluateConfig, load_config
from eagle3.data.vocab import maps_from_used
from eagle3.drafter.model import Eagle3Drafter, export_state_dict, init_weights
from eagle3.evaluate.pool import evaluate_prompts, interleaved
from eagle3.evaluate.prompts import EvalPrompt, load_prompts, read_prompts, render
from eagle3.evaluate.records import (
    EvalSettings,
    GreedyReference,
    LosslessCheck,
    LosslessDifference,
    MethodRun,
    PromptRecord,
    TeacherForced,
)
from eagle3.evaluate.report import position_acceptance, report_markdown, summarize, summarize_all
from eagle3.evaluate.session import EvalJob, method_specs
from eagle3.evaluate.stage import JOURNAL_NAME, key_for, run_evaluate, write_partial_report
from eagle3.export.sglang import export_sglang
from eagle3.run.journal import Journal
from eagle3.target.load import prepare_target, target_info
from eagle3.target.tensors import drafter_dims
from eagle3.target.tiny import build_tiny_tokenizer

# ------------------------------------------------------------------------------------------------ datasets


def test_mtbench_first_turns_in_file_order():
    """80 MT-Bench questions, first turns, file order: the first is question 81, the Hawaii travel blog."""
    prompts = read_prompts("mtbench")
    assert len(prompts) == 80 and prompts[0].id == "mtbench:81"
    assert prompts[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert read_prompts("mtbench", 3) == prompts[:3]


def test_humaneval_and_gsm8k_counts_and_first_items():
    """164 HumanEval stubs (first HumanEval/0 inside the instruction) and 1319 GSM8K questions (Janet's ducks)."""
    humaneval, gsm8k = read_prompts("humaneval"), read_prompts("gsm8k")
    assert len(humaneval) == 164 and humaneval[0].id == "humaneval:HumanEval/0"
    assert (
        humaneval[0].text.startswith("Complete the following Python function.")
        and "def has_close_elements" in humaneval[0].text
    )
    assert len(gsm8k) == 1319 and gsm8k[0].text.startswith("Janet\u2019s ducks lay 16 eggs per day.")


def test_per_dataset_counts_replace_num_prompts():
    """num_prompts_by_dataset sets the count of the datasets it names; the others keep num_prompts."""
    e = EvaluateConfig(datasets=["mtbench", "gsm8k"], num_prompts=3, num_prompts_by_dataset={"gsm8k": 1})
    items = load_prompts(e.datasets, {d: e.limit_for(d) for d in e.datasets}, build_tiny_tokenizer())
    assert [p.dataset for p, _ in items] == ["mtbench"] * 3 + ["gsm8k"]
    with pytest.raises(ValueError, match="num_prompts_by_dataset"):
        EvaluateConfig(datasets=["mtbench"], num_prompts_by_dataset={"gsm8k": 2})


def test_unknown_dataset_is_named():
    """A dataset name we do not ship fails with its name and the known ones."""
    with pytest.raises(ValueError, match="unknown evaluation dataset 'alpaca'.*mtbench"):
        read_prompts("alpaca")


def test_prompts_are_rendered_with_the_chat_template():
    """A prompt is the user turn under the chat template, ending in the assistant header; datasets in order."""
    tokenizer = build_tiny_tokenizer()
    items = load_prompts(["gsm8k", "mtbench"], 2, tokenizer)
    assert [p.id for p, _ in items] == ["gsm8k:0", "gsm8k:1", "mtbench:81", "mtbench:82"]
    text = tokenizer.decode(items[2][1])
    assert text.endswith("<|im_start|>user\n" + items[2][0].text + "<|im_end|>\n<|im_start|>assistant\n")
    assert (
        render(tokenizer, "hi")
        == tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
    )


# -------------------------------------------------------------------------------------------------- summaries


def test_position_acceptance_golden():
    """Hand-computed: positions accepted / proposed, and conditional on the previous one; empty drafts ignored."""
    rates, conditional = position_acceptance([3, 3, 3, 3, 0], [3, 1, 0, 2, 0])
    assert rates == [0.75, 0.5, 0.25]
    assert conditional == pytest.approx([0.75, 2 / 3, 0.5])


def _record(index: int, depth, accepted, committed, wall_s: float, kind: str = "identical") -> PromptRecord:
    lossless = LosslessCheck(kind, None if kind == "identical" else 4)
    return PromptRecord(
        index,
        "mtbench",
        f"mtbench:{index}",
        0,
        GreedyReference(1 + sum(committed), 2.0, []),
        None,
        {"m": MethodRun(1 + sum(committed), wall_s, lossless, depth, accepted, committed)},
    )


def test_summary_golden():
    """Acceptance length = committed / verify forwards, speedup = greedy / method time, lossless counted by kind."""
    records = [_record(0, [3, 3], [3, 1], [4, 2], 1.0), _record(1, [3, 0, 3], [0, 0, 2], [1, 1, 3], 3.0, "near_tie")]
    row = summarize(records, "m")
    assert (row.num_verify, row.accept_len, row.speedup) == (5, 11 / 5, 1.0)
    assert row.per_position == [0.75, 0.5, 0.25] and row.num_tokens == 13
    assert row.lossless.identical == 1 and row.lossless.near_tie == 1
    assert row.lossless.differences == [LosslessDifference("mtbench:1", LosslessCheck("near_tie", 4))]
    assert [r.dataset for r in summarize_all(records, ["m"])] == ["mtbench"]
    assert row.teacher_forced_acc_0 is None  # records journaled before the cross-check existed


def test_teacher_forced_acc_golden():
    """Teacher-forced acc_0 pools hits over the prompts' tokens (3 + 1 of 4 + 6), not a mean of prompt rates."""
    records = [_record(0, [3], [3], [4], 1.0), _record(1, [3], [0], [1], 1.0)]
    records = [
        replace(records[0], teacher_forced=TeacherForced(4, 3)),
        replace(records[1], teacher_forced=TeacherForced(6, 1)),
    ]
    assert summarize(records, "m").teacher_forced_acc_0 == 0.4


def test_report_says_when_speeds_come_from_processes_sharing_a_device():
    """With several workers the report warns that tok/s and speedups include contention; with one it does not."""
    rows = summarize_all([_record(0, [3, 3], [3, 1], [4, 2], 1.0)], ["m"])
    settings = EvalSettings(
        {},
        target="t",
        target_dir="t",
        target_fingerprint="f",
        export_dir="e",
        aux_layer_ids=None,
        device="cuda",
        gpu=None,
        dtype="float32",
        max_new_tokens=8,
        num_prompts={"mtbench": 1},
        stop_ids=[],
        ngram="n",
        methods=[],
        num_workers=1,
        torch="",
        transformers="",
    )
    assert "processes sharing one cuda device" in report_markdown(rows, replace(settings, num_workers=14))
    assert "sharing" not in report_markdown(rows, replace(settings, num_workers=1))


def test_report_says_when_greedy_ran_padded_to_the_decode_width():
    """On the static path with decode_rows the report says greedy ran padded like the verifies; not on CPU."""
    rows = summarize_all([_record(0, [3, 3], [3, 1], [4, 2], 1.0)], ["m"])
    section = EvaluateConfig()
    settings = EvalSettings(
        section.resolved("cuda").model_dump(mode="json"),
        target="t",
        target_dir="t",
        target_fingerprint="f",
        export_dir="e",
        aux_layer_ids=None,
        device="cuda",
        gpu=None,
        dtype="bfloat16",
        max_new_tokens=8,
        num_prompts={"mtbench": 1},
        stop_ids=[],
        ngram="n",
        methods=[],
        num_workers=1,
        torch="",
        transformers="",
    )
    assert "every decode forward 16 rows wide, greedy included" in report_markdown(rows, settings)
    on_cpu = replace(settings, device="cpu", evaluate=section.resolved("cpu").model_dump(mode="json"))
    assert "rows wide" not in report_markdown(rows, on_cpu)
    unpadded = EvaluateConfig(decode_rows=None).resolved("cuda").model_dump(mode="json")
    assert "rows wide" not in report_markdown(rows, replace(settings, evaluate=unpadded))
    no_static = EvaluateConfig(static_cache="off", compile="off").resolved("cuda").model_dump(mode="json")
    assert "rows wide" not in report_markdown(rows, replace(settings, evaluate=no_static))


def test_speedups_divide_by_the_one_row_baseline_where_every_record_has_one():
    """With one-row baseline times on every record, greedy tok/s and speedups use them and the reference's own rate
    is kept beside; a record without one (a journal from before) makes the reference's time the baseline again."""
    records = [_record(0, [3, 3], [3, 1], [4, 2], 1.0), _record(1, [3], [3], [4], 1.0)]  # 7 + 5 tokens, 2 s each
    timed = [replace(r, greedy=replace(r.greedy, baseline_wall_s=1.5)) for r in records]
    row = summarize(timed, "m")
    assert (row.greedy_wall_s, row.speedup, row.greedy_tokens_per_s) == (3.0, 1.5, 12 / 3.0)
    assert row.reference_tokens_per_s == 12 / 4.0
    mixed = summarize([timed[0], records[1]], "m")
    assert (mixed.greedy_wall_s, mixed.speedup, mixed.reference_tokens_per_s) == (4.0, 2.0, None)
    assert summarize(records, "m").to_json().keys() == mixed.to_json().keys()  # results.json rows as before


def test_report_names_the_one_row_baseline_and_the_reference_rate():
    """The report says greedy tok/s is one-row decoding and gives the decode-width reference's rate beside it."""
    records = [replace(r, greedy=replace(r.greedy, baseline_wall_s=1.0)) for r in [_record(0, [3], [3], [4], 1.0)]]
    section = EvaluateConfig().resolved("cuda").model_dump(mode="json")
    settings = EvalSettings(
        section, "t", "t", "f", "e", None, "cuda", None, "bfloat16", 8, {"mtbench": 1}, [], "n", [], 1, "", ""
    )
    text = report_markdown(summarize_all(records, ["m"]), settings)
    assert "greedy tok/s is plain decoding at one row a forward" in text
    assert "5.0 tok/s over mtbench, against 2.5 for the reference at 16 rows" in text
    assert "one row a forward" not in report_markdown(summarize_all([_record(0, [3], [3], [4], 1.0)], ["m"]), settings)


def test_speed_baseline_resolves_to_one_row_only_where_the_reference_runs_wider():
    """auto: one_row on the GPU's bf16 static path (16 rows), reference on CPU float32 (one-row forwards already)
    and without decode_rows; one_row without the static cache is refused with the field named."""
    assert EvaluateConfig().resolved("cuda").speed_baseline == "one_row"
    assert EvaluateConfig().resolved("cpu").speed_baseline == "reference"
    assert EvaluateConfig(decode_rows=None).resolved("cuda").speed_baseline == "reference"
    assert EvaluateConfig(speed_baseline="reference").resolved("cuda").speed_baseline == "reference"
    with pytest.raises(ValueError, match="speed_baseline=one_row needs the static cache"):
        EvaluateConfig(speed_baseline="one_row", static_cache="off", compile="off")


def test_config_defaults_and_checks():
    """Defaults are the CPU demo (MT-Bench, 10 prompts, 64 tokens, chain 3 + n-gram 3..1 x 3); a tree too big
    for its depth and topk is refused with the field named."""
    e = EvaluateConfig()
    assert (e.datasets, e.num_prompts, e.max_new_tokens, e.methods, e.chain_steps) == (
        ["mtbench"],
        10,
        64,
        ["chain", "ngram"],
        [3],
    )
    assert (e.ngram_max, e.ngram_min, e.ngram_num_tokens) == (3, 1, 3)
    names = [s.name for s in method_specs(EvaluateConfig(methods=["chain", "tree", "ngram"], chain_steps=[7, 3]))]
    assert names == ["chain-3-1-4", "chain-7-1-8", "tree-5-4-8", "ngram"]
    with pytest.raises(ConfigError, match="tree_num_draft_tokens"):
        load_config(
            "tiny",
            [
                "evaluate.methods=[tree]",
                "evaluate.tree_steps=2",
                "evaluate.tree_topk=2",
                "evaluate.tree_num_draft_tokens=9",
            ],
        )


# ---------------------------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target run with a random drafter exported in the SGLang layout (float32)."""
    workdir = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "evaluate.num_prompts=2",
            "evaluate.max_new_tokens=12",
            "evaluate.methods=[chain,tree,ngram]",
            "evaluate.tree_steps=3",
            "evaluate.tree_topk=2",
            "evaluate.tree_num_draft_tokens=5",
            "evaluate.device=cpu",
            "evaluate.datasets=[mtbench,gsm8k]",
        ],
    )
    model_dir = prepare_target(cfg)
    info = target_info(model_dir, cfg.target)
    dims = drafter_dims(info, model_dir, draft_vocab_size=info.vocab_size // 2)
    drafter = Eagle3Drafter(dims)
    init_weights(drafter, std=0.2)
    d2t, t2d = maps_from_used(np.arange(0, info.vocab_size, 2), info.vocab_size)
    export_dir = export_sglang(
        export_state_dict(drafter), dims, d2t, t2d, info.aux_layer_ids, workdir / "drafter-export", dtype=torch.float32
    )
    return cfg, model_dir, export_dir


def test_stage_measures_every_method_losslessly_and_skips_when_done(tiny_run, capsys):
    """Chain, tree and n-gram on 2 prompts x 2 datasets: no mismatch, a row per dataset x method (+ all), the
    report and plot written, the start and each cross-check timed; the second call finds the manifest and
    computes nothing."""
    cfg, _, export_dir = tiny_run
    outcome = run_evaluate(cfg, export_dir=export_dir)
    assert re.search(r"evaluate: target and drafter loaded in [0-9.]+ s, warm-up .* [0-9.]+ s", capsys.readouterr().err)
    prompts = [json.loads(line) for line in (cfg.run_dir / "eval" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and all(p["teacher_forced"]["wall_s"] > 0 for p in prompts)
    assert outcome.computed
    doc = json.loads((cfg.run_dir / "eval" / "results.json").read_text())
    rows = {(r["dataset"], r["method"]): r for r in doc["results"]}
    assert set(rows) == {(d, m) for d in ("mtbench", "gsm8k", "all") for m in ("chain-3-1-4", "tree-3-2-5", "ngram")}
    for row in rows.values():
        assert row["lossless"]["mismatch"] == 0, row["lossless"]
        assert row["accept_len"] >= 1.0 and len(row["per_position"]) <= 3
    assert rows[("mtbench", "ngram")]["speedup_vs_ngram"] == 1.0
    assert rows[("all", "ngram")]["num_prompts"] == 4 and doc["settings"]["num_prompts"] == {"mtbench": 2, "gsm8k": 2}
    assert "| mtbench | tree-3-2-5 | 2 |" in (cfg.run_dir / "eval" / "report.md").read_text()
    assert 0.0 <= rows[("all", "chain-3-1-4")]["teacher_forced_acc_0"] <= 1.0
    assert "- gsm8k: teacher-forced acc_0 " in (cfg.run_dir / "eval" / "report.md").read_text()
    assert (cfg.run_dir / "eval" / "per_position.png").read_bytes()[:4] == b"\x89PNG"
    assert not run_evaluate(cfg, export_dir=export_dir).computed


def test_parallel_workers_give_the_same_records(tiny_run):
    """Two spawned workers sharing the device return the same tokens and acceptance per prompt as one process."""
    cfg, model_dir, export_dir = tiny_run
    e = cfg.evaluate.model_copy(update={"methods": ["chain"], "max_new_tokens": 8})
    job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), "cpu", [], num_threads=1)
    items = load_prompts(["mtbench"], 3, build_tiny_tokenizer())
    one, two = evaluate_prompts(job, items, 1), evaluate_prompts(job, items, 2)

    def strip(records):
        return [(r.id, r.greedy.tokens, r.methods["chain-3-1-4"].accepted) for r in records]

    assert strip(one) == strip(two) and len(two) == 3


def test_static_cache_session_gives_the_eager_records(tiny_run):
    """evaluate.static_cache=on (fixed-size caches, CPU, uncompiled): the same greedy tokens, verify steps and
    lossless checks per prompt and method as the eager session."""
    cfg, model_dir, export_dir = tiny_run
    items = load_prompts(["mtbench"], 2, build_tiny_tokenizer())

    def records(static_cache: str) -> list:
        e = cfg.evaluate.model_copy(update={"max_new_tokens": 12, "static_cache": static_cache})
        job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), "cpu", [], num_threads=1)
        return [
            (r.greedy.tokens, {m: (v.accepted, v.lossless.kind) for m, v in r.methods.items()})
            for r in evaluate_prompts(job, items, 1)
        ]

    static = records("on")
    assert static == records("off") and all(k == "identical" for _, m in static for _, k in m.values())


def test_one_row_baseline_times_the_reference_length_on_the_static_path(tiny_run):
    """speed_baseline=one_row (static cache, 8-row forwards, CPU): every record has a one-row time, for the same
    tokens as without it, also with the GPU presets' gathered-keys reference beside a flex one-row baseline; the
    reference alone is timed when the baseline is the reference."""
    cfg, model_dir, export_dir = tiny_run
    items = load_prompts(["mtbench"], 2, build_tiny_tokenizer())

    def records(baseline: str, **more: str) -> list:
        update = {"methods": ["chain"], "static_cache": "on", "decode_rows": 8, "speed_baseline": baseline, **more}
        e = cfg.evaluate.model_copy(update=update)
        job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), "cpu", [], num_threads=1)
        return evaluate_prompts(job, items, 1)

    one_row, reference = records("one_row"), records("reference")
    flex = records("one_row", decode_keys="gathered", baseline_attention="flex")
    for run in (one_row, flex):
        assert all(r.greedy.baseline_wall_s is not None and r.greedy.baseline_wall_s > 0 for r in run)
    assert all(r.greedy.baseline_wall_s is None for r in reference)
    assert [r.greedy.tokens for r in one_row] == [r.greedy.tokens for r in reference] == [r.greedy.tokens for r in flex]


def test_killed_evaluation_resumes_from_its_journal(tiny_run, tmp_path, monkeypatch):
    """Prompts journaled under the same key are not measured again and give the uninterrupted records; another
    key (other settings) measures everything afresh."""
    import eagle3.evaluate.pool as evaluate_module

    cfg, model_dir, export_dir = tiny_run
    e = cfg.evaluate.model_copy(update={"methods": ["chain"], "max_new_tokens": 8})
    job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), "cpu", [], num_threads=1)
    items = load_prompts(["mtbench"], 3, build_tiny_tokenizer())
    journal = Journal(tmp_path / "evaluate.journal.jsonl")
    evaluate_prompts(job, items[:2], 1, journal=journal, key="k1")  # "killed" after two prompts
    measured = []
    real = evaluate_module.evaluate_prompt
    monkeypatch.setattr(
        evaluate_module, "evaluate_prompt", lambda s, i, p, ids: measured.append(i) or real(s, i, p, ids)
    )
    resumed = evaluate_prompts(job, items, 1, journal=journal, key="k1")
    assert measured == [2]

    def strip(records):
        return [(r.index, r.id, r.greedy.tokens, r.methods["chain-3-1-4"].accepted) for r in records]

    assert strip(resumed) == strip(evaluate_prompts(job, items, 1))
    measured.clear()
    evaluate_prompts(job, items, 1, journal=journal, key="k2")
    assert measured == [0, 1, 2]


def test_stage_removes_its_journal_once_outputs_exist(tiny_run):
    """After a completed evaluation the per-prompt journal is gone (prompts.jsonl holds the records)."""
    cfg, _, export_dir = tiny_run
    run_evaluate(cfg, export_dir=export_dir, force=True)
    assert (cfg.run_dir / "eval" / "prompts.jsonl").is_file()
    assert not (cfg.run_dir / "eval" / JOURNAL_NAME).exists()


def test_measuring_order_interleaves_datasets():
    """First prompt of each dataset, then the second of each...; indices (output order) are untouched."""
    prompts = [EvalPrompt("mtbench", f"m{i}", "") for i in range(3)] + [
        EvalPrompt("gsm8k", f"g{i}", "") for i in range(2)
    ]
    order = interleaved([(i, p, [0]) for i, p in enumerate(prompts)])
    assert [item[0] for item in order] == [0, 3, 1, 4, 2]


def test_partial_report_covers_the_journaled_prompts_only(tiny_run):
    """An evaluation cut short: the partial report has exactly the journaled prompts, says PARTIAL, writes no
    manifest; the stage run afterwards measures only the rest."""
    cfg, model_dir, export_dir = tiny_run
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "partial"})})
    plan_items = load_prompts(cfg.evaluate.datasets, cfg.evaluate.num_prompts, build_tiny_tokenizer())
    e = cfg.evaluate
    job = EvalJob(str(model_dir), str(export_dir), e.model_dump(mode="json"), "cpu", [], num_threads=1)
    journal = Journal(cfg.run_dir / "eval" / JOURNAL_NAME)
    key = key_for(cfg, model_dir, export_dir)
    evaluate_prompts(job, plan_items[:2], 1, journal=journal, key=key)  # the two MT-Bench prompts, then "killed"
    report = write_partial_report(cfg, export_dir)["report"].read_text()
    assert "PARTIAL: 2 of 4 prompts measured" in report and "| mtbench | ngram | 2 |" in report
    assert "| gsm8k |" not in report
    assert not (cfg.run_dir / "eval" / "evaluate.manifest.json").exists()
