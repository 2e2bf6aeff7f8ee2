"""The locally built tiny target: deterministic tokenizer, chat templates, model, and the saved HF folder."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.config import TinyTargetConfig
from eagle3.target.tiny import (
    CHATML_SYSTEM_PROMPT,
    MANIFEST_NAME,
    VOCAB_MULTIPLE,
    build_tiny_model,
    build_tiny_tokenizer,
    byte_symbols,
    derive_merges,
    save_tiny_target,
)

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
SAMPLE_TEXT = "The capital of France is Paris. héllo wörld 😀 def add(a, b):\n\treturn a + b"


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def style(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, style: str) -> Path:
    cfg = TinyTargetConfig(chat_template=style)
    return save_tiny_target(tmp_path_factory.mktemp("tiny") / f"target-{style}", cfg, seed=0)


def test_byte_symbols_match_the_byte_level_alphabet() -> None:
    """The 256 byte stand-ins are distinct and are exactly the tokenizers library's byte-level alphabet."""
    from tokenizers import pre_tokenizers

    symbols = byte_symbols()
    assert len(set(symbols)) == 256
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    assert symbols[ord("A")] == "A" and symbols[ord(" ")] == "Ġ"


def test_tokenizer_builds_fast_and_deterministically(style: str) -> None:
    """Two builds give the same serialized tokenizer, and one build takes well under half a second."""
    start = time.perf_counter()
    first = build_tiny_tokenizer(style)
    elapsed = time.perf_counter() - start
    second = build_tiny_tokenizer(style)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert derive_merges() == derive_merges() and len(derive_merges()) > 50
    assert elapsed < 0.5, f"build took {elapsed:.2f} s"


def test_special_token_ids_per_style() -> None:
    """ChatML puts <|endoftext|>, <|im_start|>, <|im_end|> at 0,1,2; Llama 3 uses <|eot_id|> as eos."""
    chatml = build_tiny_tokenizer("chatml")
    assert chatml.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (chatml.bos_token_id, chatml.eos_token_id, chatml.pad_token_id) == (1, 2, 2)
    llama = build_tiny_tokenizer("llama3")
    assert llama.eos_token == "<|eot_id|>" and llama.bos_token == "<|begin_of_text|>"
    assert llama.eos_token_id == llama.convert_tokens_to_ids("<|eot_id|>")


def test_vocab_is_padded_to_a_multiple(style: str) -> None:
    """len(tokenizer) is a multiple of VOCAB_MULTIPLE and every id below it decodes to a known token."""
    tok = build_tiny_tokenizer(style)
    assert len(tok) % VOCAB_MULTIPLE == 0
    assert len(tok.get_vocab()) == len(tok)
    assert sorted(tok.get_vocab().values()) == list(range(len(tok)))


def test_encode_decode_round_trip_and_offsets(style: str) -> None:
    """Any text (incl. non-ASCII) survives encode/decode, and token offsets tile the text exactly."""
    tok = build_tiny_tokenizer(style)
    enc = tok(SAMPLE_TEXT, return_offsets_mapping=True)
    assert tok.decode(enc["input_ids"]) == SAMPLE_TEXT
    offsets = enc["offset_mapping"]
    assert offsets[0][0] == 0 and offsets[-1][1] == len(SAMPLE_TEXT)
    assert all(prev[1] <= cur[0] or prev == cur for prev, cur in zip(offsets, offsets[1:]))
    assert len(enc["input_ids"]) < len(SAMPLE_TEXT.encode()), "merges should shorten common English text"


def test_plain_call_adds_no_special_tokens(style: str) -> None:
    """Like SmolLM2, tok(text) adds no BOS/EOS; specials in the text are single tokens."""
    tok = build_tiny_tokenizer(style)
    ids = tok("Paris")["input_ids"]
    assert tok.bos_token_id not in ids and tok.eos_token_id not in ids
    assert tok(tok.eos_token)["input_ids"] == [tok.eos_token_id]


def test_chatml_template_matches_smollm2_layout() -> None:
    """ChatML adds a default system turn, ends each turn with <|im_end|>\\n, and has a generation prompt."""
    tok = build_tiny_tokenizer("chatml")
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{CHATML_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *CHAT]
    rendered = tok.apply_chat_template(with_system, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


def test_llama3_template_layout() -> None:
    """Llama 3 style: BOS once, header + blank line per turn, trimmed content, <|eot_id|> without newline."""
    tok = build_tiny_tokenizer("llama3")
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_model_matches_tokenizer_and_config() -> None:
    """The random model's vocab and special ids come from the tokenizer; embeddings are not tied."""
    tok = build_tiny_tokenizer("llama3")
    cfg = TinyTargetConfig(chat_template="llama3")
    model = build_tiny_model(tok, cfg, seed=0)
    assert model.config.vocab_size == len(tok)
    assert model.config.num_hidden_layers == cfg.num_hidden_layers and model.config.hidden_size == cfg.hidden_size
    assert model.config.max_position_embeddings == 4096 and not model.config.tie_word_embeddings
    assert (model.config.eos_token_id, model.generation_config.eos_token_id) == (tok.eos_token_id,) * 2
    assert model.generation_config.pad_token_id == tok.pad_token_id == model.config.pad_token_id
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_model_init_is_seeded() -> None:
    """Same seed -> same weights; another seed -> different weights."""
    tok, cfg = build_tiny_tokenizer(), TinyTargetConfig()
    a, b, c = (build_tiny_model(tok, cfg, seed=s).lm_head.weight for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_save_is_byte_deterministic(tmp_path: Path, style: str) -> None:
    """Two saves with the same cfg and seed give byte-identical model.safetensors and tokenizer.json."""
    cfg = TinyTargetConfig(chat_template=style)
    one = save_tiny_target(tmp_path / "one", cfg, seed=7)
    two = save_tiny_target(tmp_path / "two", cfg, seed=7)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert not list(tmp_path.glob(".*.tmp")), "temp build folders must be cleaned up"


def test_save_is_idempotent_and_rebuilds_on_change(tmp_path: Path) -> None:
    """A complete folder is reused untouched; a different seed replaces it."""
    cfg = TinyTargetConfig()
    folder = save_tiny_target(tmp_path / "t", cfg, seed=0)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert save_tiny_target(folder, cfg, seed=0) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    first = (folder / "model.safetensors").read_bytes()
    save_tiny_target(folder, cfg, seed=1)
    assert (folder / "model.safetensors").read_bytes() != first


def test_save_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    """A non-empty folder without our manifest is never deleted."""
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        save_tiny_target(foreign, TinyTargetConfig(), seed=0)
    assert (foreign / "weights.bin").read_bytes() == b"precious"
    assert not (foreign / MANIFEST_NAME).exists()


RACERS, RACE_TIMEOUT_S = 6, 60.0


def _race_to_save(out_dir: str, start, returned, results) -> None:
    """One of RACERS processes released at once to prepare the same target; once every racer has returned, it checks
    that the folder it was given is still whole (a later builder must never have cleared it)."""
    from eagle3.target.tiny import _manifest, _read_manifest

    cfg, outcome = TinyTargetConfig(num_hidden_layers=2), "ok"
    try:
        start.wait(RACE_TIMEOUT_S)
        folder = save_tiny_target(Path(out_dir), cfg, seed=0)
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        folder, outcome = None, f"{type(exc).__name__}: {exc}"
    returned.wait(RACE_TIMEOUT_S)
    if folder is not None and (
        _read_manifest(folder) != _manifest(cfg, 0) or not (folder / "model.safetensors").is_file()
    ):
        outcome = f"the folder returned is no longer complete: {sorted(p.name for p in folder.glob('*'))}"
    results.put(outcome)


@pytest.mark.parametrize("start_from", ["nothing", "stale"])
def test_concurrent_preparation_of_one_target_gives_every_process_a_complete_folder(tmp_path, start_from) -> None:
    """3 rounds of 6 processes released at once on a shared cache (empty, or holding a stale build of an older
    format): every one returns the folder, which stays whole after all have returned; no temp folder is left."""
    import json
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")  # fork-safe (no torch threads in the server) and cheap per process
    ctx.set_forkserver_preload(["tests.unit.test_tiny"])
    for round_ in range(3):
        cache = tmp_path / f"round-{round_}"
        out_dir = cache / "tiny-target"
        out_dir.mkdir(parents=True)
        if start_from == "stale":
            (out_dir / "model.safetensors").write_bytes(b"old")
            (out_dir / MANIFEST_NAME).write_text(json.dumps({"format_version": 0}))
        start, returned, results = ctx.Barrier(RACERS), ctx.Barrier(RACERS), ctx.Queue()
        racers = [
            ctx.Process(target=_race_to_save, args=(str(out_dir), start, returned, results)) for _ in range(RACERS)
        ]
        for racer in racers:
            racer.start()
        outcomes = [results.get(timeout=RACE_TIMEOUT_S) for _ in racers]
        for racer in racers:
            racer.join(RACE_TIMEOUT_S)
        assert outcomes == ["ok"] * RACERS, (round_, outcomes)
        assert [p.name for p in cache.iterdir() if not p.name.startswith(".") or p.is_dir()] == [out_dir.name]


def test_a_build_removes_the_temp_folders_of_killed_builds_of_its_target_only(tmp_path) -> None:
    """Temp folders a killed build left beside the target go with the next build; another target's stay."""
    killed, other = tmp_path / ".t.abcd1234.tmp", tmp_path / ".t2.abcd1234.tmp"
    for folder in (killed, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    save_tiny_target(tmp_path / "t", TinyTargetConfig(num_hidden_layers=2), seed=0)
    assert not killed.exists() and other.exists()


def test_saved_folder_reloads_with_auto_classes(saved: Path, style: str) -> None:
    """AutoTokenizer/AutoModelForCausalLM reload the folder with the same template, tokenization and weights."""
    original_tok = build_tiny_tokenizer(style)
    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.chat_template == original_tok.chat_template
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert rendered == original_tok.apply_chat_template(CHAT, tokenize=False)
    assert tok(rendered)["input_ids"] == original_tok(rendered)["input_ids"]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, len(tok)) == (
        original_tok.eos_token_id,
        original_tok.bos_token_id,
        original_tok.pad_token_id,
        len(original_tok),
    )
    model = AutoModelForCausalLM.from_pretrained(saved)
    fresh = build_tiny_model(original_tok, TinyTargetConfig(chat_template=style), seed=0)
    assert torch.equal(model.lm_head.weight, fresh.lm_head.weight)
    assert model.generation_config.eos_token_id == tok.eos_token_id
