"""Preset smollm2-40m: smollm2-quality's recipe on more generated data, built on the text smollm2-quality's data
build journaled (the same keys for every conversation and synthetic record the two share)."""

from __future__ import annotations

import json

import pytest

from eagle3.config import load_config
from eagle3.data.merge import merge_sources, read_merged
from eagle3.data.regenerate import JOURNAL_NAME, pending_work, plan_turns
from eagle3.data.regenerate import settings_key as regenerate_key
from eagle3.data.stages.common import kept_answer_sources
from eagle3.data.synthesize import journal_path, synthesize_source
from eagle3.data.synthesize import settings_key as synthetic_key
from eagle3.data.synthetic import synthetic_path
from eagle3.run.journal import Journal

TARGET = "fingerprint:bfloat16"
"""The generating target as the synthesize stage names it (fingerprint and dtype): the same for both presets."""


def test_the_40m_preset_is_the_quality_recipe_on_more_generated_data():
    """smollm2-40m = smollm2-quality with every ShareGPT conversation re-answered, a second synthetic source of magpie's
    settings under another seed (whole batches), and a 40M-token train budget; nothing else differs."""
    big, quality = load_config("smollm2-40m"), load_config("smollm2-quality")
    assert big.run.name == "smollm2-40m" and big.train.max_train_tokens == 40_000_000
    assert [s.name for s in big.data.sources] == ["sharegpt", "sharegpt-original", "magpie", "magpie-more"]
    sharegpt, original, magpie, more = big.data.sources
    assert sharegpt == quality.data.sources[0].model_copy(update={"max_records": None})
    assert [original, magpie] == quality.data.sources[1:]
    assert more.synthetic is not None and magpie.synthetic is not None
    assert more.synthetic.seed != magpie.synthetic.seed
    assert more.synthetic.model_copy(update={"seed": magpie.synthetic.seed, "count": magpie.synthetic.count}) == (
        magpie.synthetic
    )
    assert more.synthetic.count % big.regenerate.batch_size_conversations == 0  # a grown count later redoes no batch
    train = big.train.model_copy(update={"max_train_tokens": quality.train.max_train_tokens})
    data = big.data.model_copy(update={"sources": quality.data.sources})
    assert big.model_copy(update={"run": quality.run, "data": data, "train": train}) == quality


def _sharegpt_file(path):
    """ShareGPT conversations: 1 to 5 user turns each, one repeated (a duplicate) and one too long for max_chars."""
    convs = []
    for i in range(14):
        turns = []
        for t in range(1 + i % 5):
            turns += [{"from": "human", "value": f"question {t} of conversation {i}"}, {"from": "gpt", "value": "ok"}]
        convs.append({"id": f"c{i}", "conversations": turns})
    convs.insert(5, {**convs[2], "id": "copy"})
    convs.insert(3, {"id": "long", "conversations": [{"from": "human", "value": "x " * 3000}]})
    path.write_text(json.dumps(convs))
    return path


def _configs(tmp_path):
    """Both presets on one small ShareGPT file (smollm2-quality's cap of 6,000 of 17,672 scaled to 5), each its run."""
    sharegpt = _sharegpt_file(tmp_path / "sharegpt.json")
    common = [f"run.workdir={tmp_path}", "data.eval_overlap=false"]
    common += [f"data.sources.{i}.path={sharegpt}" for i in (0, 1)]
    return load_config("smollm2-quality", [*common, "data.sources.0.max_records=5"]), load_config("smollm2-40m", common)


def _merge(cfg):
    """The preset's merged rows (its synthetic sources not written yet: empty records files)."""
    data = cfg.run_dir / "data"
    for src in cfg.data.sources:
        if src.format == "synthetic":
            synthetic_path(data, src.name).parent.mkdir(parents=True, exist_ok=True)
            synthetic_path(data, src.name).write_text("")
    return read_merged(merge_sources(cfg.data.sources, cfg.data, cfg.run.seed, data)[0]["merged"])


def test_the_quality_regeneration_journal_answers_every_conversation_the_two_presets_share(tmp_path):
    """Every conversation smollm2-quality re-answered is in smollm2-40m's merge with the same id and content, so its
    journal record (restored into the 40m run) is reused and only the conversations past the old cap are sent; with
    more user turns per conversation the records of the longer conversations would be answered again instead."""
    quality, big = _configs(tmp_path)
    assert regenerate_key(big.regenerate) == regenerate_key(quality.regenerate)
    answered = [r for r in _merge(quality) if r["source"] == "sharegpt"]
    rows = [r for r in _merge(big) if r["source"] == "sharegpt"]
    assert len(answered) == 5 and len(rows) == 14  # all 15 but the copy; the long one rejected by both
    assert {(r["id"], r["content_hash"]) for r in answered} < {(r["id"], r["content_hash"]) for r in rows}
    key, turns = regenerate_key(quality.regenerate), quality.regenerate.max_user_turns
    Journal(big.run_dir / "data" / JOURNAL_NAME).extend(
        {
            "id": r["id"],
            "content_hash": r["content_hash"],
            "settings": key,
            "status": "ok",
            "messages": r["messages"],
            "finish_reasons": ["stop"] * plan_turns(r["messages"], turns).count(None),
        }
        for r in answered
    )
    merged, data, own = big.run_dir / "data" / "merged.parquet", big.run_dir / "data", kept_answer_sources(big)
    todo = {r["id"] for r in pending_work(merged, data, big.regenerate, keep_sources=own).todo}
    assert todo == {r["id"] for r in rows} - {r["id"] for r in answered}
    longer = big.regenerate.model_copy(update={"max_user_turns": 4})
    redone = {r["id"] for r in pending_work(merged, data, longer, keep_sources=own).todo} - todo
    assert redone == {r["id"] for r in answered if plan_turns(r["messages"]).count(None) > 3} != set()


def test_the_quality_synthesis_journal_is_magpies_whole_and_magpie_more_is_generated_anew(tmp_path):
    """magpie's 4,000 records journaled under smollm2-quality's key (its journal alone, as pack-journals carries it)
    rebuild its records file in the 40m run with no model loaded; magpie-more has its own key and journal, so all
    of its batches are generated."""
    quality, big = _configs(tmp_path)
    q_magpie, (magpie, more) = quality.data.sources[2], big.data.sources[2:]
    assert q_magpie.synthetic is not None and magpie.synthetic is not None and more.synthetic is not None
    key = synthetic_key(q_magpie.synthetic, quality.regenerate, TARGET)
    assert synthetic_key(magpie.synthetic, big.regenerate, TARGET) == key
    assert synthetic_key(more.synthetic, big.regenerate, TARGET) != key
    data, size, count = big.run_dir / "data", quality.regenerate.batch_size_conversations, q_magpie.synthetic.count
    Journal(journal_path(data, "magpie")).extend(
        {
            "id": str(i),
            "settings": key,
            "batch_rows": min(size, count - i // size * size),
            "record": {
                "id": str(i),
                "messages": [{"role": "user", "content": f"q{i}"}],
                "finish_reasons": {"prompt": "length", "answer": None},
            },
        }
        for i in range(count)
    )

    def no_model():
        raise AssertionError("a batch was left to generate")

    path, stats = synthesize_source(magpie, data, big.regenerate, no_model, TARGET)
    assert (stats["generated"], stats["skipped_done"]) == (0, 4000) and len(path.read_text().splitlines()) == 4000
    assert journal_path(data, "magpie-more") != journal_path(data, "magpie")
    with pytest.raises(AssertionError, match="left to generate"):
        synthesize_source(more, data, big.regenerate, no_model, TARGET)
