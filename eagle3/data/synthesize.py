"""The synthesize stage: the target writes user turns itself, then answers them (the Magpie technique).

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing") gives an aligned model only its chat template's user-turn prefix (ChatML
``<|im_start|>user\\n``, after any default system prompt the template writes) and samples: the model
completes it with a user request, ended by its end-of-turn token. That request is then answered as in
regeneration (``HFGenerateBackend.generate_batch``), so the drafter trains on prompts and answers of the
target's own distribution, as many as asked for, from no dataset at all.

Determinism: records are generated in batches of ``regenerate.batch_size_conversations`` in index order;
before a batch's user turns (and again before its answers, when they are sampled) torch's generator is
seeded with a hash of (synthetic.seed, batch number), so the same seed, target and settings give the same
records, also when a run is resumed. Each record keeps that seed and its generation settings.

Resumability: every finished batch is appended to ``<name>.journal.jsonl`` (one fsynced line per record,
eagle3.run.journal); a re-run redoes only batches without a journal record under the current settings. The
stage then writes every record, in index order, to ``data/synthetic/<name>.jsonl`` (atomically), rejects
included: the merge decides, with reasons, which become rows (eagle3.data.synthetic).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3.config import RegenerateConfig, SourceConfig, SyntheticConfig
from eagle3.config_base import unset_added_fields
from eagle3.data.chat_backends import CompletionError, HFGenerateBackend
from eagle3.data.synthetic import check_file_names, synthetic_journal_path, synthetic_path
from eagle3.run.journal import Journal
from eagle3.run.progress import Progress, ProgressFn
from infra.storage import atomic_write_text, sha256_json

PROBE = "\u2063synthetic-user-turn\u2063"
"""Content put in a user turn to find where the template writes it (invisible separators: never in a template)."""
REGENERATE_FIELDS = (
    "temperature",
    "batch_size_conversations",
    "generation_backend",
    "prompt_bucket",
    "decode_attention",
    "device",
    "straggler_rows",
    "compile_dynamic",
    "loop_stop_tokens",
)
"""regenerate settings that change the records (the answer temperature, the batches and their seeds, the decoder,
its padding, attention path, straggler batches and compile, where loops stop, and the device: each moves the
rounding or the sampling stream or the answers' ends, so a sampled row, or a greedy answer at a tie, can turn)."""


def regenerate_fields(regen: RegenerateConfig) -> dict[str, Any]:
    """The REGENERATE_FIELDS values that the synthetic key and the stage key hash (an added field only once set,
    config_base.Added, so journals written before it keep their key)."""
    unset = unset_added_fields(regen)
    return {k: getattr(regen, k) for k in REGENERATE_FIELDS if k not in unset}


def journal_path(data_dir: Path, name: str) -> Path:
    """The journal of one synthetic source (beside its records file)."""
    return synthetic_journal_path(data_dir, name)


def user_turn_prefix(tokenizer: Any) -> str:
    """What the chat template writes before a first user turn's content (e.g. ChatML's '<|im_start|>user\\n')."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE}], tokenize=False, add_generation_prompt=False
    )
    at = text.find(PROBE)
    if at <= 0:
        raise ValueError(
            "the chat template writes nothing before a user turn's content (or drops it), so the "
            "target cannot be asked to write a user turn"
        )
    return text[:at]


def batch_seed(seed: int, batch: int) -> int:
    """The torch seed of one batch: a hash of (source seed, batch number), so batches never share a stream."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{batch}".encode()).digest()[:8], "big") >> 1


def settings_key(syn: SyntheticConfig, regen: RegenerateConfig, target: str) -> str:
    """Hash of what changes the records; journal records made under another key are generated again.

    Not the count: a record depends on its batch (number and members), never on how many batches follow, so a
    source grown to more records keeps its finished batches. The members are checked per record instead
    (``batch_rows`` in the journal): a short last batch whose count grew, or a batch cut short by a smaller
    count, runs again, as in a clean run of the new count."""
    gen = syn.model_dump(exclude={"near_duplicate", "count"})  # near_duplicate: a merge-time filter
    return sha256_json({"synthetic": gen, "regenerate": regenerate_fields(regen), "target": target})[:16]


class Synthesizer:
    """Generates the records of one batch: user turns from the template's prefix, then their answers."""

    def __init__(self, model: Any, tokenizer: Any, syn: SyntheticConfig, regen: RegenerateConfig):
        import torch

        from eagle3.data.generate import TokenGenerator

        self.torch, self.syn = torch, syn
        answer_cfg = regen.model_copy(update={"backend": "hf", "max_new_tokens": syn.max_answer_tokens})
        self.answers = HFGenerateBackend(model, tokenizer, answer_cfg)
        settings = dataclasses.replace(
            self.answers.generator.settings, max_new_tokens=syn.max_prompt_tokens, temperature=syn.temperature
        )
        self.prompts = TokenGenerator(model, settings)
        self.prefix = list(tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"])
        self.backend = settings.backend  # resolved: 'auto' became static or dynamic
        self.answer_temperature = regen.temperature

    def batch(self, indices: list[int], seed: int) -> list[dict[str, Any]]:
        """One record per index; prompts that are empty or truncated are not answered."""
        self.torch.manual_seed(seed)
        prompts = [self.answers.decode(row) for row in self.prompts.generate([self.prefix] * len(indices))]
        usable = {
            k: p.content.strip()
            for k, p in enumerate(prompts)
            if not isinstance(p, CompletionError) and p.finish_reason == "stop"
        }  # index -> prompt text
        self.torch.manual_seed(seed + 1)  # answers sampled at temperature > 0 get their own stream
        replies = self.answers.generate_batch([[{"role": "user", "content": text}] for text in usable.values()])
        answers: dict[int, Any] = dict(zip(usable, replies, strict=True))
        return [self._record(i, seed, prompts[k], answers.get(k)) for k, i in enumerate(indices)]

    def _record(self, index: int, seed: int, prompt: Any, answer: Any) -> dict[str, Any]:
        user = "" if isinstance(prompt, CompletionError) else prompt.content.strip()
        messages = [{"role": "user", "content": user}]
        finish = {"prompt": "empty" if isinstance(prompt, CompletionError) else prompt.finish_reason, "answer": None}
        if answer is not None:
            messages.append(
                {"role": "assistant", "content": "" if isinstance(answer, CompletionError) else answer.content}
            )
            finish["answer"] = "empty" if isinstance(answer, CompletionError) else answer.finish_reason
        syn = self.syn
        generation = {
            "seed": syn.seed,
            "batch_seed": seed,
            "index": index,
            "temperature": syn.temperature,
            "answer_temperature": self.answer_temperature,
            "max_prompt_tokens": syn.max_prompt_tokens,
            "max_answer_tokens": syn.max_answer_tokens,
            "batch_size": self.answers.max_parallel,
            "generation_backend": self.backend,
        }
        return {"id": str(index), "messages": messages, "finish_reasons": finish, "generation": generation}


def synthesize_source(
    src: SourceConfig,
    data_dir: Path,
    regen: RegenerateConfig,
    make: Any,
    target: str,
    progress: ProgressFn | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Generate (or resume) every record of one synthetic source; ``make()`` returns its Synthesizer.

    The model is loaded (``make``) only when some batch is not in the journal yet.
    """
    syn = src.synthetic
    assert syn is not None, "SourceConfig fills synthetic for format synthetic"
    start, key = time.monotonic(), settings_key(syn, regen, target)
    journal = Journal(journal_path(data_dir, src.name))
    size = regen.batch_size_conversations
    batches = [list(range(b, min(b + size, syn.count))) for b in range(0, syn.count, size)]
    journaled = journal.load()

    def finished(indices: list[int]) -> bool:  # journaled under these settings, in a batch of these members
        recs = [journaled.get(str(i)) for i in indices]
        return all(
            r is not None and r.get("settings") == key and r.get("batch_rows", len(indices)) == len(indices)
            for r in recs
        )

    todo = [(n, idx) for n, idx in enumerate(batches) if not finished(idx)]
    synth = make() if todo else None
    with journal.appender() as append, Progress(sum(len(idx) for _, idx in todo), "synthesize", progress) as bar:
        for number, indices in todo:
            assert synth is not None  # (made whenever a batch is to do)
            for record in synth.batch(indices, batch_seed(syn.seed, number)):
                append({"id": record["id"], "settings": key, "batch_rows": len(indices), "record": record})
            bar.update(len(indices), source=src.name)
    records = journal.load()
    ordered = [records[str(i)]["record"] for i in range(syn.count)]
    path = synthetic_path(data_dir, src.name)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    finish = {
        part: dict(sorted(Counter(str(r["finish_reasons"][part]) for r in ordered).items()))
        for part in ("prompt", "answer")
    }
    stats = {
        "count": syn.count,
        "generated": sum(len(idx) for _, idx in todo),
        "skipped_done": syn.count - sum(len(idx) for _, idx in todo),
        "finish_reasons": finish,
        "elapsed_s": round(time.monotonic() - start, 3),
    }
    if synth is not None:  # the generate figures of the user turns and of their answers
        stats["generation"] = {
            "prompts": synth.prompts.stats.to_json(),
            "answers": synth.answers.generator.stats.to_json(),
        }
    return path, stats


def stage_config(sources: list[SourceConfig], regen: RegenerateConfig) -> dict[str, Any]:
    """What the synthesize stage's key hashes: each source's generation settings and the regenerate ones it uses
    (ConfigError when two sources would write one file: the key is asked for before the stage runs)."""
    check_file_names(sources)
    return {
        "sources": [
            {"name": s.name, **(s.synthetic.model_dump(exclude={"near_duplicate"}) if s.synthetic else {})}
            for s in sources
        ],
        "regenerate": regenerate_fields(regen),
    }


def synthesize(
    sources: list[SourceConfig],
    data_dir: Path,
    regen: RegenerateConfig,
    load: Any,
    target: str,
    progress: ProgressFn | None = None,
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Every synthetic source -> data/synthetic/<name>.jsonl; ``load()`` returns (model, tokenizer), called once
    and only when something is left to generate. Returns ({name: path}, {"sources": {name: stats}})."""
    check_file_names(sources)
    loaded: list[Any] = []

    def make_for(syn: SyntheticConfig):
        def make() -> Synthesizer:
            if not loaded:
                loaded.extend(load())
            return Synthesizer(loaded[0], loaded[1], syn, regen)

        return make

    outputs: dict[str, Path] = {}
    stats: dict[str, Any] = {}
    for src in sources:
        assert src.synthetic is not None
        outputs[src.name], stats[src.name] = synthesize_source(
            src, data_dir, regen, make_for(src.synthetic), target, progress
        )
    return outputs, {"sources": stats}
