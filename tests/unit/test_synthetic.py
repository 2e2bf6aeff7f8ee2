"""Synthetic (Magpie) source: template prefix, seeded determinism, journal resume, filters with reasons,
evaluation-overlap rejects in the merge, and the stages on the tiny target."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from eagle3.config import DataConfig, RegenerateConfig, SourceConfig, TinyTargetConfig, load_config
from eagle3.data.merge import merge_sources, read_merged
from eagle3.data.rejects import FILTER_REASONS
from eagle3.data.synthesize import Synthesizer, journal_path, synthesize, user_turn_prefix
from eagle3.data.synthetic import synthetic_path
from eagle3.data.textcheck import NearDuplicates, degenerate_reason, word_ngrams, words

REGEN = RegenerateConfig(backend="hf", batch_size_conversations=4, generation_backend="dynamic")


def _source(name: str = "syn", **syn: Any) -> SourceConfig:
    settings = {"count": 10, "max_prompt_tokens": 4, "max_answer_tokens": 6, **syn}
    return SourceConfig(name=name, format="synthetic", synthetic=settings)


@pytest.fixture(scope="module")
def tiny():
    """A tiny ChatML target whose generation also stops on a third of the vocab (so some turns end)."""
    from eagle3.target import tiny as tiny_mod

    tok = tiny_mod.build_tiny_tokenizer(chat_template="chatml")
    model = tiny_mod.build_tiny_model(tok, TinyTargetConfig(), seed=0).eval()
    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = [tok.eos_token_id, *range(3, len(tok), 3)]
    return stopping, tok


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- generation


def test_user_turn_prefix_is_what_the_template_writes_before_user_content():
    """ChatML ends the prefix with '<|im_start|>user\\n' (after its default system prompt); Llama 3 with its header."""
    from eagle3.target import tiny as tiny_mod

    chatml = user_turn_prefix(tiny_mod.build_tiny_tokenizer(chat_template="chatml"))
    assert chatml.startswith("<|im_start|>system\n") and chatml.endswith("<|im_end|>\n<|im_start|>user\n")
    llama3 = user_turn_prefix(tiny_mod.build_tiny_tokenizer(chat_template="llama3"))
    assert llama3 == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"


def test_same_seed_gives_the_same_records_and_another_seed_others(tmp_path, tiny):
    """Two runs with seed 0 write byte-identical files; seed 1 samples other user turns."""
    out = {}
    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        paths, _ = synthesize([_source(seed=seed)], tmp_path / run, REGEN, lambda: tiny, "fp")
        out[run] = paths["syn"].read_text()
    assert out["a"] == out["b"]
    prompts = {
        run: [r["messages"][0]["content"] for r in map(json.loads, text.splitlines())] for run, text in out.items()
    }
    assert prompts["a"] != prompts["c"] and len(prompts["a"]) == 10


def test_straggler_batches_give_reproducible_records_under_their_own_key(tmp_path, tiny):
    """With straggler_rows the source is byte-identical run to run, its records are journaled under another key
    than without (so they are never mixed), and a grown count keeps that key (settings_key leaves count out)."""
    from eagle3.data.synthesize import settings_key

    regen = REGEN.model_copy(update={"straggler_rows": 2})
    runs = [synthesize([_source(max_prompt_tokens=12)], tmp_path / run, regen, lambda: tiny, "fp") for run in "ab"]
    texts = [paths["syn"].read_text() for paths, _ in runs]
    assert texts[0] == texts[1] and len(texts[0].splitlines()) == 10
    prompts = runs[0][1]["sources"]["syn"]["generation"]["prompts"]
    assert prompts["calls"] > 3, f"no batch of the 3 handed stragglers on: {prompts}"
    syn = _source().synthetic
    assert settings_key(syn, regen, "fp") != settings_key(syn, REGEN, "fp")
    assert settings_key(syn.model_copy(update={"count": 99}), regen, "fp") == settings_key(syn, regen, "fp")


def test_journals_written_before_straggler_rows_keep_their_key():
    """With straggler_rows 0 the synthetic key is the hash of exactly the fields it had before that setting."""
    from eagle3.data.synthesize import settings_key
    from infra.storage import sha256_json

    syn = _source().synthetic
    before = (
        "temperature",
        "batch_size_conversations",
        "generation_backend",
        "prompt_bucket",
        "decode_attention",
        "device",
    )
    old = sha256_json(
        {
            "synthetic": syn.model_dump(exclude={"near_duplicate", "count"}),
            "regenerate": {k: getattr(REGEN, k) for k in before},
            "target": "fp",
        }
    )[:16]
    assert settings_key(syn, REGEN, "fp") == old


def test_records_keep_seed_settings_and_only_finished_prompts_are_answered(tmp_path, tiny):
    """Each record carries its seed and generation settings; empty or truncated prompts get no answer."""
    paths, stats = synthesize([_source(seed=3)], tmp_path, REGEN, lambda: tiny, "fp")
    records = _lines(paths["syn"])
    assert [r["id"] for r in records] == [str(i) for i in range(10)]
    gen = records[5]["generation"]
    assert {
        k: gen[k]
        for k in (
            "seed",
            "index",
            "temperature",
            "max_prompt_tokens",
            "max_answer_tokens",
            "batch_size",
            "answer_temperature",
            "generation_backend",
        )
    } == {
        "seed": 3,
        "index": 5,
        "temperature": 1.0,
        "max_prompt_tokens": 4,
        "max_answer_tokens": 6,
        "batch_size": 4,
        "answer_temperature": 0.0,
        "generation_backend": "dynamic",
    }
    assert records[0]["generation"]["batch_seed"] == records[3]["generation"]["batch_seed"] != gen["batch_seed"]
    for r in records:
        answered = len(r["messages"]) == 2
        assert answered == (r["finish_reasons"]["prompt"] == "stop"), r
    prompt_reasons = stats["sources"]["syn"]["finish_reasons"]["prompt"]
    assert sum(prompt_reasons.values()) == 10 and prompt_reasons.get("stop", 0) > 0  # the fixture makes some end
    generation = stats["sources"]["syn"]["generation"]  # every user turn written, only the finished ones answered
    assert generation["prompts"]["rows"] == 10 and generation["answers"]["rows"] == prompt_reasons["stop"]


class _DiesAfterOneBatch(Synthesizer):
    """A Synthesizer that raises after its first batch (a killed run)."""

    batches = 0

    def batch(self, indices, seed):
        if _DiesAfterOneBatch.batches >= 1:
            raise KeyboardInterrupt("killed")
        _DiesAfterOneBatch.batches += 1
        return super().batch(indices, seed)


def test_killed_run_resumes_from_the_journal_and_matches_a_clean_run(tmp_path, tiny, monkeypatch):
    """After a kill, a re-run generates only the missing batches and writes the clean run's file; a third run loads
    no model."""
    clean, _ = synthesize([_source()], tmp_path / "clean", REGEN, lambda: tiny, "fp")
    import eagle3.data.synthesize as synth_mod

    with monkeypatch.context() as m:
        m.setattr(synth_mod, "Synthesizer", _DiesAfterOneBatch)
        with pytest.raises(KeyboardInterrupt):
            synthesize([_source()], tmp_path / "resumed", REGEN, lambda: tiny, "fp")
    assert len(journal_path(tmp_path / "resumed", "syn").read_text().splitlines()) == 4
    paths, stats = synthesize([_source()], tmp_path / "resumed", REGEN, lambda: tiny, "fp")
    assert paths["syn"].read_text() == clean["syn"].read_text()
    assert stats["sources"]["syn"]["generated"] == 6 and stats["sources"]["syn"]["skipped_done"] == 4

    def no_model():
        raise AssertionError("everything is journaled: the model must not be loaded")

    _, again = synthesize([_source()], tmp_path / "resumed", REGEN, no_model, "fp")
    assert again["sources"]["syn"]["generated"] == 0
    _, other = synthesize([_source()], tmp_path / "resumed", REGEN, lambda: tiny, "another target")
    assert other["sources"]["syn"]["generated"] == 10  # journal records of another target are not reused


def test_a_source_grown_or_shrunk_keeps_only_batches_with_the_same_members_and_matches_a_clean_run(tmp_path, tiny):
    """count 6 then 10 (batches of 4): the first full batch is reused, the short last one and the new ones run, and
    the file equals a clean run of 10; back to 6, the batch [4, 5] cut from [4..7] runs again (other members)."""
    clean, _ = synthesize([_source(count=10)], tmp_path / "clean", REGEN, lambda: tiny, "fp")
    synthesize([_source(count=6)], tmp_path / "grown", REGEN, lambda: tiny, "fp")
    paths, stats = synthesize([_source(count=10)], tmp_path / "grown", REGEN, lambda: tiny, "fp")
    assert paths["syn"].read_text() == clean["syn"].read_text()
    assert stats["sources"]["syn"]["generated"] == 6 and stats["sources"]["syn"]["skipped_done"] == 4
    _, shrunk = synthesize([_source(count=6)], tmp_path / "grown", REGEN, lambda: tiny, "fp")
    assert shrunk["sources"]["syn"]["generated"] == 2 and shrunk["sources"]["syn"]["skipped_done"] == 4


@pytest.mark.parametrize("names", [("x", "x.journal"), ("x.journal", "x"), ("x", "x")])
def test_sources_whose_files_would_collide_are_a_config_error_naming_both(tmp_path, names):
    """'x' writes x.jsonl and its journal x.journal.jsonl, the records file of 'x.journal': refused before anything
    is generated (by the stage key too), naming both sources; no file is written."""
    from eagle3.config_base import ConfigError
    from eagle3.data.synthesize import stage_config

    sources = [_source(name) for name in names]

    def no_model():
        raise AssertionError("a refused config must not load the model")

    with pytest.raises(ConfigError, match="synthetic sources") as err:
        synthesize(sources, tmp_path, REGEN, no_model, "fp")
    assert all(repr(n) in str(err.value) for n in names)
    assert not (tmp_path / "synthetic").exists()
    with pytest.raises(ConfigError):
        stage_config(sources, REGEN)


def test_sources_named_by_suffixes_of_each_other_write_their_own_files(tmp_path, tiny):
    """Names that share a prefix but cannot collide ('x', 'x.jsonl', 'x.j', 'journal') each get their own records and
    journal, identical to a run of the source alone."""
    names = ["x", "x.jsonl", "x.j", "journal"]
    paths, _ = synthesize([_source(n, count=4) for n in names], tmp_path / "all", REGEN, lambda: tiny, "fp")
    alone, _ = synthesize([_source("x", count=4)], tmp_path / "alone", REGEN, lambda: tiny, "fp")
    assert len({paths[n] for n in names}) == len(names)
    files = {journal_path(tmp_path / "all", n) for n in names} | set(paths.values())
    assert len(files) == 2 * len(names)
    assert all(json.loads(line)["id"] for n in names for line in paths[n].read_text().splitlines())
    assert paths["x"].read_text() == alone["x"].read_text()


# ---------------------------------------------------------------- merge-time filters


def _record(
    i: int, prompt: str | None, answer: str | None, prompt_finish: str = "stop", answer_finish: str | None = "stop"
) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] + (
        [{"role": "assistant", "content": answer}] if answer is not None else []
    )
    return {
        "id": str(i),
        "messages": messages,
        "generation": {"seed": 0, "index": i},
        "finish_reasons": {"prompt": prompt_finish, "answer": answer_finish if answer is not None else None},
    }


CRAFTED = [  # (record, expected outcome)
    (_record(0, "How do I bake sourdough bread at home with a simple starter?", "Feed the starter daily."), "ok"),
    (_record(1, "  ", None, "empty"), "empty_turn"),
    (_record(2, "Tell me about the history of", None, "length"), "truncated"),
    (_record(3, "What is the capital of France?", "The capital of France is", "stop", "length"), "truncated"),
    (_record(4, "Name three prime numbers below twenty.", "", "stop", "empty"), "empty_turn"),
    (_record(5, "%%%% $$$ ### @@@ !!! ??? ***", "Sure."), "degenerate"),
    (_record(6, "Write a poem about the sea.", "the waves go on and " * 12), "degenerate"),
    (_record(7, "how do I bake SOURDOUGH bread at home, with a simple starter", "Use flour."), "duplicate_prompt"),
    (_record(8, "How do I bake sourdough bread at home with a simple starter today?", "Knead it."), "near_duplicate"),
    (_record(9, "Explain how a refrigerator keeps food cold using a compressor.", "It pumps heat out."), "ok"),
    ("not json {", "unparsable"),
]


def _write_crafted(data_dir: Path) -> None:
    path = synthetic_path(data_dir, "syn")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((rec if isinstance(rec, str) else json.dumps(rec)) + "\n" for rec, _ in CRAFTED))


def test_merge_rejects_bad_generations_with_reasons_and_counts_them(tmp_path):
    """Each crafted record is kept or rejected with its reason; stats say read = kept + rejected, by reason."""
    _write_crafted(tmp_path)
    paths, stats = merge_sources([_source()], DataConfig(val_fraction=0.0), seed=0, out_dir=tmp_path)
    rejects = [json.loads(line) for line in paths["rejects"].read_text().splitlines()]
    got = {r["location"]: r["reason"] for r in rejects}
    want = {f"syn.jsonl:{n}": outcome for n, (_, outcome) in enumerate(CRAFTED, 1) if outcome != "ok"}
    assert got == want
    assert sorted(r["id"] for r in read_merged(paths["merged"])) == ["syn:0", "syn:9"]
    counts = stats["sources"]["syn"]
    assert counts["read"] == len(CRAFTED) and counts["kept"] == 2 and counts["rejected"] == len(CRAFTED) - 2
    assert {r: n for r, n in counts["rejected_by_reason"].items() if n} == {
        "empty_turn": 2,
        "truncated": 2,
        "degenerate": 2,
        "duplicate_prompt": 1,
        "near_duplicate": 1,
        "unparsable": 1,
    }
    assert stats["sources"]["syn"]["format"] == "synthetic"


def test_missing_synthetic_file_names_the_stage_to_run(tmp_path):
    """A synthetic source whose file was never written is a clear error before anything is read."""
    from eagle3.data.rejects import SourceError

    with pytest.raises(SourceError, match="run the synthesize stage first"):
        merge_sources([_source()], DataConfig(), seed=0, out_dir=tmp_path)


def test_near_duplicates_match_brute_force_jaccard():
    """The prefix-filtered index flags exactly the texts a pairwise Jaccard over word 3-grams flags."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(12)]
    texts = [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 9))) for _ in range(200)]

    def grams(text: str) -> set:
        ws = words(text)
        return word_ngrams(ws, 3) or {tuple(ws)}

    sets = [grams(text) for text in texts]
    for threshold in (0.3, 0.5, 0.7, 1.0):
        index, kept = NearDuplicates(threshold), []
        for n, text in enumerate(texts):
            found = index.find(text)
            brute = [len(sets[n] & sets[k]) / len(sets[n] | sets[k]) for k in kept]
            assert (found is not None) == any(j >= threshold for j in brute), (threshold, text)
            if found is None:
                index.add(text, str(n))
                kept.append(n)
            else:
                assert found[1] == pytest.approx(max(brute))


def test_degenerate_text_is_symbols_or_loops_and_normal_text_is_not():
    """Mostly-symbol text and a repeated 3-gram loop are degenerate; prose and code are not."""
    assert "letters or digits" in degenerate_reason("?!?! ... ### ==> ***")
    assert "loop" in degenerate_reason("I am a cat. " * 10)
    assert degenerate_reason("The quick brown fox jumps over the lazy dog, then rests under a tree.") is None
    assert degenerate_reason("def add(a, b):\n    return a + b\n\nprint(add(2, 3))") is None


# ---------------------------------------------------------------- evaluation overlap


MTBENCH_81 = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
    "experiences and must-see attractions."
)


def _chat(i: int, user: str) -> dict[str, Any]:
    return {"id": f"r{i}", "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "ok"}]}


def test_merge_rejects_an_edited_copy_of_an_mtbench_question_and_keeps_normal_records(tmp_path):
    """A lightly edited MT-Bench question is rejected as eval_overlap (counted by dataset); others are kept."""
    from eagle3.evaluate.prompts import read_prompts

    assert read_prompts("mtbench", 1)[0].text == MTBENCH_81  # the first MT-Bench question, as the test assumes
    edited = (
        "Please compose an engaging travel-blog post about a recent trip to HAWAII highlighting the "
        "cultural experiences and must see attractions!!"
    )
    gsm8k = read_prompts("gsm8k", 1)[0].text
    records = [
        _chat(0, edited),
        _chat(1, "Write a travel blog post about Japan."),
        _chat(2, f"Solve: {gsm8k}"),
        _chat(3, "Compose an engaging limerick about a cat who likes to travel."),
    ]
    src_path = tmp_path / "chats.jsonl"
    src_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    src = SourceConfig(name="chats", path=str(src_path))
    paths, stats = merge_sources([src], DataConfig(val_fraction=0.0), seed=0, out_dir=tmp_path / "on")
    rejects = {json.loads(line)["id"]: json.loads(line) for line in paths["rejects"].read_text().splitlines()}
    assert set(rejects) == {"chats:r0", "chats:r2"} and all(r["reason"] == "eval_overlap" for r in rejects.values())
    assert "mtbench:81" in rejects["chats:r0"]["detail"] and "gsm8k:0" in rejects["chats:r2"]["detail"]
    overlap = stats["eval_overlap"]
    assert overlap["rejected"] == 2 and overlap["rejected_by_dataset"] == {"mtbench": 1, "humaneval": 0, "gsm8k": 1}
    assert overlap["eval_prompts"]["mtbench"] == 80 and stats["total"]["rejected_by_reason"]["eval_overlap"] == 2
    _, off = merge_sources([src], DataConfig(val_fraction=0.0, eval_overlap=False), seed=0, out_dir=tmp_path / "off")
    assert off["total"]["kept"] == 4 and off["eval_overlap"] == {"enabled": False}


def test_eval_overlap_ignores_number_runs_and_shared_boilerplate_but_finds_whole_prompts():
    """Matrix literals and a line every prompt shares prove no copy; a whole prompt (even all symbols) does."""
    from eagle3.data.textcheck import EvalOverlap

    header = "Complete the following Python function from typing import List def "
    prompts = [
        ("a:1", header + "grid_sum(grid): add [[0, 0, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]] up"),
        ("a:2", header + "other(x): return the x"),
        ("b:1", "x+y = 4z, x*y = 4z^2, express x-y in z"),
    ]
    index = EvalOverlap(prompts, min_shared=2)
    assert index.check(["m = [[0, 0, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]]"]) is None
    assert index.check([f"{header} mine(): pass"]) is None  # shared by a:1 and a:2: boilerplate
    hit = index.check(["solve this: X + Y = 4z; x * y = 4z^2 -- express x - y in z please"])
    assert hit is not None and hit.prompt_id == "b:1" and hit.shared == hit.total


def test_filter_reasons_are_all_exercised():
    """Between them the crafted synthetic records and the overlap test use every filter reason."""
    assert set(FILTER_REASONS) <= {outcome for _, outcome in CRAFTED} | {"eval_overlap"}


# ---------------------------------------------------------------- the stages on the tiny preset


def test_stages_synthesize_then_merge_regenerate_and_tokenize_on_the_tiny_target(tmp_path):
    """synthesize -> merge -> regenerate (synthetic rows kept as they are) -> tokenize run; a re-run skips all."""
    from eagle3.run.stages import run_all

    syn = "{count: 8, max_prompt_tokens: 8, max_answer_tokens: 8}"
    cfg = load_config(
        "tiny",
        [
            f"run.workdir={tmp_path / 'runs'}",
            f"target.cache_dir={tmp_path / 'targets'}",
            "data.sources=[{name: tiny-chats, path: 'pkg://eagle3/assets/tiny_chats.jsonl'}, "
            f"{{name: syn, format: synthetic, synthetic: {syn}}}]",
            "regenerate.enabled=true",
            "regenerate.backend=hf",
            "regenerate.max_new_tokens=4",
            "regenerate.max_conversations=3",
        ],
    )
    outcomes = {o.stage: o for o in run_all(cfg)}
    assert list(outcomes) == ["synthesize", "merge", "regenerate", "tokenize", "vocab"]
    counts = outcomes["merge"].stats["sources"]["syn"]
    assert counts["read"] == 8 and counts["kept"] + counts["rejected"] == 8
    regen = outcomes["regenerate"].stats
    assert (
        regen["success"] + regen["error"] + regen["skipped_done"] + regen["skipped_source"] + regen["skipped_limit"]
        == regen["input"]
    )
    assert all(not o.computed for o in run_all(cfg))
