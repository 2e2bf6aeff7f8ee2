"""Evaluation prompts from a JSONL file (messages or prompt, optional category and id): rendering, rejected lines with
file:line and reason, config checks, the stage key, and the stage end to end at temperature 1 with per-category rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.config import EvaluateConfig, load_config
from eagle3.data.vocab import maps_from_used
from eagle3.drafter.model import Eagle3Drafter, export_state_dict, init_weights
from eagle3.evaluate.prompts import load_prompt_set, read_prompt_file, render_messages
from eagle3.evaluate.stage import key_for, run_evaluate
from eagle3.export.sglang import export_sglang
from eagle3.target.load import prepare_target, target_info
from eagle3.target.tensors import drafter_dims
from eagle3.target.tiny import build_tiny_tokenizer

GOOD = [
    {"prompt": "What is the capital of France?", "category": "geo"},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another one?"},
        ],
        "category": "math",
        "id": "primes-2",
    },
    {"prompt": "Write a haiku about rain.", "category": "geo"},
]
BAD = [
    '{"prompt": "x", "messages": []}',  # both forms
    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',  # ends with it
    '{"messages": [{"role": "tool", "content": "hi"}]}',
    '{"prompt": 5}',
    '{"prompt": "ok", "id": "primes-2"}',  # the id of line 3
    "not json",
]


def write_prompts(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    """Good lines 1, 3 and 5 around bad ones, and a blank line (not a record)."""
    lines = [json.dumps(GOOD[0]), BAD[0], json.dumps(GOOD[1]), BAD[1], json.dumps(GOOD[2]), "", *BAD[2:]]
    return write_prompts(tmp_path / "traffic.jsonl", lines)


def test_prompt_file_lines_become_prompts_in_file_order(prompt_file):
    """Usable lines in order: ids from the line number or the id field, categories kept, the last user turn as text."""
    prompts, _ = read_prompt_file(str(prompt_file))
    name = str(prompt_file)
    assert [p.id for p in prompts] == [f"{name}:1", f"{name}:primes-2", f"{name}:5"]
    assert [p.category for p in prompts] == ["geo", "math", "geo"] and prompts[1].text == "Another one?"
    assert prompts[1].messages[0] == ("system", "Be brief.") and len(prompts[1].messages) == 4
    assert read_prompt_file(name, limit=2)[0] == prompts[:2]


def test_bad_lines_are_rejected_with_file_line_and_reason(prompt_file):
    """Every bad line is a Reject naming traffic.jsonl:LINE and why; the good ones still load."""
    _, rejects = read_prompt_file(str(prompt_file))
    found = {r.location: r.reason for r in rejects}
    assert found == {
        "traffic.jsonl:2": "unparsable",
        "traffic.jsonl:4": "no_user_turn",
        "traffic.jsonl:7": "unknown_role",
        "traffic.jsonl:8": "non_string_content",
        "traffic.jsonl:9": "duplicate_id",
        "traffic.jsonl:10": "unparsable",
    }
    assert "exactly one of 'messages'" in next(r.detail for r in rejects if r.location.endswith(":2"))
    assert "ends with a user turn" in next(r.detail for r in rejects if r.location.endswith(":4"))


def test_a_file_without_a_usable_prompt_is_an_error(tmp_path):
    """Only bad lines: an error naming the file and the first reasons, never an empty evaluation."""
    path = write_prompts(tmp_path / "bad.jsonl", BAD[:2])
    with pytest.raises(ValueError, match="holds no usable prompt.*bad.jsonl:1"):
        read_prompt_file(str(path))


def test_file_prompts_render_their_whole_conversation(prompt_file):
    """A file's conversation (system and earlier turns included) goes through the chat template like a named set's."""
    tokenizer = build_tiny_tokenizer()
    prompt_set = load_prompt_set(["mtbench", str(prompt_file)], 1, tokenizer)
    assert [p.dataset for p, _ in prompt_set.items] == ["mtbench", str(prompt_file)]
    items = load_prompt_set([str(prompt_file)], None, tokenizer).items
    text = tokenizer.apply_chat_template(GOOD[1]["messages"], tokenize=False, add_generation_prompt=True)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert items[1][1] == expected == render_messages(tokenizer, GOOD_MESSAGES)


GOOD_MESSAGES = [(m["role"], m["content"]) for m in GOOD[1]["messages"]]


def test_config_takes_jsonl_paths_beside_the_named_sets(prompt_file):
    """datasets: named sets or .jsonl paths (per-file counts too); another name, a twice-named set, or top_p without
    sampling are refused."""
    e = EvaluateConfig(datasets=["gsm8k", str(prompt_file)], num_prompts_by_dataset={str(prompt_file): 2})
    assert e.limit_for(str(prompt_file)) == 2
    for bad in (["alpaca"], ["prompts.txt"], ["mtbench", "mtbench"]):
        with pytest.raises(ValueError, match="evaluate.datasets"):
            EvaluateConfig(datasets=bad)
    with pytest.raises(ValueError, match="only when sampling"):
        EvaluateConfig(top_p=0.9)
    assert EvaluateConfig(temperature=1.0, top_p=0.9, top_k=20).top_k == 20


# ---------------------------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """A tiny target run evaluating a prompt file (one bad line) at temperature 1, random drafter exported."""
    workdir = tmp_path_factory.mktemp("eval-file")
    lines = [json.dumps(GOOD[0]), BAD[1], json.dumps(GOOD[1]), json.dumps(GOOD[2])]
    path = write_prompts(workdir / "traffic.jsonl", lines)
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={workdir}",
            "evaluate.num_prompts=null",
            "evaluate.max_new_tokens=6",
            "evaluate.methods=[chain,tree,ngram]",
            "evaluate.tree_steps=2",
            "evaluate.tree_topk=2",
            "evaluate.tree_num_draft_tokens=4",
            "evaluate.device=cpu",
            f"evaluate.datasets=[{path}]",
            "evaluate.temperature=1.0",
            "evaluate.top_k=50",
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
    return cfg, model_dir, export_dir, path


def test_stage_reports_per_file_and_category_when_sampling(sampled_run):
    """At temperature 1 on a prompt file: a row per method for the file, one per category, the rejected line in
    rejects.jsonl and the report, every output inside the target's support with its log-prob beside the target's own
    sampling, and the report naming the check it ran instead of token identity."""
    cfg, _, export_dir, path = sampled_run
    run_evaluate(cfg, export_dir=export_dir)
    out = cfg.run_dir / "eval"
    doc = json.loads((out / "results.json").read_text())
    assert {r["dataset"] for r in doc["results"]} == {str(path)}
    categories = {(r["category"], r["method"]): r for r in doc["by_category"]}
    assert {c for c, _ in categories} == {"geo", "math"} and categories[("geo", "ngram")]["num_prompts"] == 2
    assert doc["settings"]["prompt_rejects"] == {str(path): 1}
    reject = json.loads((out / "rejects.jsonl").read_text())
    assert (reject["location"], reject["reason"]) == ("traffic.jsonl:2", "no_user_turn")
    for row in doc["results"]:
        assert row["lossless"]["sampled"] == 3 and row["lossless"]["mismatch"] == 0, row["lossless"]
        assert row["logprob_per_token"] < 0 and row["reference_logprob_per_token"] < 0
    report = (out / "report.md").read_text()
    assert "sampling at temperature 1.0" in report and "cannot be token-identical" in report
    assert "| geo | chain-3-1-4 | 2 |" in report
    assert f"{path}: 1" in report  # the rejected-lines count names the entry as given


def test_prompt_file_content_enters_the_stage_key(sampled_run, tmp_path):
    """Editing the prompt file (same path) changes the evaluate key; the named sets' keys carry no file hashes."""
    cfg, model_dir, export_dir, path = sampled_run
    before = key_for(cfg, model_dir, export_dir)
    original = path.read_text()
    try:
        path.write_text(original.replace("France", "Spain"))
        assert key_for(cfg, model_dir, export_dir) != before
    finally:
        path.write_text(original)
    assert key_for(cfg, model_dir, export_dir) == before


def test_deploy_benchmark_sends_the_file_prompts(sampled_run):
    """serve.prompts: evaluation sends the prompt file's rendered prompts (bad line left out) to the SGLang benchmark,
    grouped by the file's entry."""
    from eagle3.deploy import deploy_prompts
    from eagle3.target.load import load_tokenizer

    cfg, model_dir, _, path = sampled_run
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"prompts": "evaluation", "num_prompts": 3})})
    sent = deploy_prompts(cfg, str(model_dir))
    assert sent.groups == [str(path)] * 3
    assert sent.prompts[1] == render_messages(load_tokenizer(model_dir), GOOD_MESSAGES)
