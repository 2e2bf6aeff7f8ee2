"""Lab: lab/sglang_identity.py finds where two greedy outputs split and reads float32's margin there."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.config import load_config
from eagle3.target.load import prepare_target
from infra.sglang_bench import BenchResult, BenchSettings, RequestSample, summarize_level
from lab.sglang_identity import analyse, first_split, first_trio, level_outputs, summarize


def test_first_split_is_the_first_difference_or_the_shorter_end():
    """Equal outputs have no split; a prefix splits where it ends."""
    assert first_split([1, 2, 3], [1, 2, 3]) is None
    assert first_split([1, 2, 3], [1, 5, 3]) == 1
    assert first_split([1, 2, 3], [1, 2]) == 2


def test_the_compared_server_defaults_to_the_deploys_first_speculative_one():
    """A DFlash run's server is named by its block size (15-1-16), not 3-1-4: without --trio the deploy's first
    speculative run is compared, never SGLang's n-gram server listed after it."""
    level = {"concurrency": 1, "output_ids_by_prompt": [[5, 6]]}
    doc = {
        "baseline": {"result": {"levels": [level]}},
        "speculative": [
            {"trio": "15-1-16", "result": {"levels": [{"concurrency": 8}, level]}},
            {"trio": "ngram", "result": {"levels": []}},
        ],
    }
    assert first_trio(doc) == "15-1-16"
    assert level_outputs(doc, "speculative", first_trio(doc)) == [[5, 6]]
    with pytest.raises(ValueError, match="no speculative run"):
        first_trio({"speculative": []})


def test_output_ids_survive_the_results_json_round_trip():
    """The benchmark keeps each prompt's output ids, in prompt order, through results.json."""
    samples = [
        RequestSample(1, 1.0, 0.1, 2, 0, None, "d1", (7, 8)),
        RequestSample(0, 1.0, 0.1, 3, 0, None, "d0", (4, 5, 6)),
    ]
    level = summarize_level(1, samples, 1.0, False)
    assert level.output_ids_by_prompt == ((4, 5, 6), (7, 8))
    result = BenchResult("u", False, BenchSettings((1,), 2, 8, 0), "d", {}, (level,))
    assert BenchResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_a_split_reports_the_position_and_float32_logit_gap_of_the_two_tokens(tmp_path):
    """On the tiny target: a forced other token at position 2 is found there, with the model's own logit gap."""
    cfg = load_config("tiny", [f"run.workdir={tmp_path}"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(prepare_target(cfg)), dtype=torch.float32).eval()
    prompt = [5, 9, 13, 17]
    greedy: list[int] = []
    for _ in range(4):
        with torch.no_grad():
            greedy.append(int(model(input_ids=torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    other = greedy[:2] + [(greedy[2] + 1) % model.config.vocab_size, greedy[3]]
    splits = analyse(
        model, [prompt, prompt, prompt], ["a", "a", "b"], [greedy, greedy, greedy], [other, greedy, greedy[:3]], "cpu"
    )
    assert [(s.prompt, s.position) for s in splits] == [(0, 2), (2, 3)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + greedy[:2]])).logits[0, -1].float()
    assert splits[0].gap_fp32 == pytest.approx(float(logits[greedy[2]] - logits[other[2]]))
    assert splits[0].fp32_argmax == greedy[2] and splits[0].gap_fp32 >= 0
    assert splits[1].gap_fp32 is None and splits[1].token_b is None  # the second output stopped there
    summary = summarize(splits, ["a", "a", "b"], ("x", "y"))
    assert summary["a"]["identical"] == 1 and summary["b"]["stopped"] == 1 and summary["all"]["prompts"] == 3


def test_a_prompt_set_other_than_the_one_the_benchmark_sent_is_refused():
    """Outputs are paired with prompts by position: a re-rendered set with another digest stops the script."""
    from infra.sglang_bench import prompts_digest
    from lab.sglang_identity import check_same_prompts

    doc = {"baseline": {"result": {"prompts_digest": prompts_digest([[1, 2], [3]])}}}
    check_same_prompts(doc, [[1, 2], [3]])
    with pytest.raises(SystemExit, match="serve.prompts=evaluation"):
        check_same_prompts(doc, ["a fixed English prompt", "another"])


def test_eval_records_missing_for_some_deploy_prompts_stop_the_script_with_their_count(monkeypatch):
    """An evaluation of fewer prompts than the deploy sent is named (not a KeyError)."""
    import eagle3.deploy_checks as checks
    from lab.sglang_identity import eval_outputs

    monkeypatch.setattr(checks, "eval_records", lambda cfg: {0: object()})
    with pytest.raises(SystemExit, match="no record of 2 of the 3 prompts"):
        eval_outputs(load_config("tiny"), 3)
