"""Lab: lab/sglang_accept_subset.py pairs an evaluated subset with the deploy run's prompts and compares accept."""

from __future__ import annotations

from eagle3.evaluate.records import GreedyReference, LosslessCheck, MethodRun, PromptRecord
from infra.sglang_bench import output_digest
from lab.sglang_accept_subset import pair_prompts, rows_of


def _record(index: int, dataset: str, tokens: list[int], committed: list[int]) -> PromptRecord:
    run = MethodRun(
        len(tokens), 0.1, LosslessCheck("identical"), [3] * len(committed), [c - 1 for c in committed], committed
    )
    return PromptRecord(
        index, dataset, f"{dataset}-{index}", 5, GreedyReference(len(tokens), 0.1, tokens), None, {"chain-3-1-4": run}
    )


def test_the_kth_prompt_of_each_dataset_is_paired_and_accept_is_tokens_over_verify_steps():
    """Deploy prompts a0 a1 a2 b0 b1; eval covers a0 a1 b0: pairs follow dataset positions, not raw indices."""
    groups = ["a", "a", "a", "b", "b"]
    outs = [[1, 2, 3, 4], [5, 6], [7], [8, 9, 10, 11], [12]]
    level = {
        "completion_by_prompt": [len(o) for o in outs],
        "verify_by_prompt": [2, 1, 1, 1, 1],
        "output_digests": [output_digest(o) for o in outs[:3]] + [output_digest([0, 0, 0, 0]), output_digest([12])],
    }
    records = [
        _record(0, "a", [1, 2, 3, 4], [2, 2]),  # same text as deploy prompt 0, 2 verify steps each
        _record(1, "a", [5, 6], [1, 1]),  # same text, 2 eval steps against SGLang's 1
        _record(2, "b", [8, 9, 10, 11], [4]),  # deploy prompt 3 (SGLang's output differs)
    ]
    pairs = pair_prompts(level, groups, records, "chain-3-1-4")
    assert [(p.dataset, p.sglang_tokens, p.sglang_verify, p.same_text) for p in pairs] == [
        ("a", 4, 2, True),
        ("a", 2, 1, True),
        ("b", 4, 1, False),
    ]
    rows = {r.dataset: r for r in rows_of(pairs)}
    assert (rows["a"].sglang, rows["a"].evaluate) == (6 / 3, 6 / 4)
    assert abs(rows["a"].rel_diff - (2.0 - 1.5) / 1.5) < 1e-12
    assert (rows["b"].same_text_prompts, rows["b"].same_text_sglang) == (0, None)
    assert (rows["all"].prompts, rows["all"].sglang, rows["all"].evaluate) == (3, 10 / 4, 10 / 5)
