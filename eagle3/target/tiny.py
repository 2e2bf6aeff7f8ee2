"""A random tiny target built locally, with no downloads: for tests, CI and smoke runs.

The model is one of transformers' own classes (``target.tiny.architecture``): Llama, Qwen3, or
DeepSeek-V3 (MLA attention + MoE, the text model of Kimi-K2/K2.5), so every stage runs on the
architectures users bring, not only on Llama.

The tokenizer is a byte-level BPE whose merges are derived in code from a constant English text,
so it needs no training data, builds in milliseconds and is identical on every machine. It carries
a chat template in one of two real-world styles (SmolLM2's ChatML or Llama 3) so that the template
rendering and loss-mask code paths are exercised exactly as with a real target.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3.config import TinyTargetConfig
from infra.locks import file_lock
from infra.storage import atomic_write_json

ChatStyle = Literal["chatml", "llama3"]

VOCAB_MULTIPLE = 64
"""Vocab sizes are padded with reserved specials to a multiple of this (as real targets do, for GPU-friendly shapes)."""
NUM_MERGES = 240
"""Upper bound on derived merges; the corpus below yields fewer, which keeps the vocab ~ 512."""
MANIFEST_NAME = "tiny_target.json"
"""Written last into a saved folder: its presence (with matching cfg + seed) means the folder is complete."""
FORMAT_VERSION = 1
"""Bumped when the saved tiny target changes meaning (tokenizer, template or init)."""

# Merges come from this text: a few chat-like sentences so that common words become single tokens
# and tokenized samples are shorter than pure bytes (like a real tokenizer, but tiny).
MERGE_CORPUS = (
    "You are a helpful assistant. The user asks a question and the assistant answers it. "
    "What is the capital of France? The capital of France is Paris. What is the capital of Italy? "
    "The capital of Italy is Rome. Can you write a short function in Python that returns the sum of "
    "two numbers? Here is the function: def add(a, b): return a + b. Thank you! You are welcome. "
    "Please explain how this works, and then give me an example with the numbers one, two and three. "
    "This is the answer to your question: the model reads the text and predicts the next token. "
    "I think that we should write the tests first, then the code, and then the documentation for the users. "
    "There are many ways to do that; the simplest one is to count the words in the text and sort them. "
)

CHATML_SYSTEM_PROMPT = "You are a tiny test assistant, built locally"
"""Default system prompt the ChatML template adds when a conversation has none (as SmolLM2 does)."""

# Written for this project in the style of SmolLM2's template: a default system turn when the first
# message is not a system message, no {% generation %} markers, and a trailing newline after each turn.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + CHATML_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3 style: one BOS, a header per turn, content trimmed (as Llama 3 does), no newline after <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] | trim -}}{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Per style: special tokens in id order, which of them play bos/eos/pad, and the template.
STYLES: dict[str, dict] = {
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "pad": "<|im_end|>",
        "unk": "<|endoftext|>",
        "template": CHATML_TEMPLATE,
    },
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
        "unk": None,
        "template": LLAMA3_TEMPLATE,
    },
}


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE, in byte order (0..255).

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255 in order, so every
    byte gets a visible, non-whitespace symbol (the convention of GPT-2 style byte-level BPE).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    keep = set(printable)
    symbols, num_shifted = [], 0
    for byte in range(256):
        if byte in keep:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + num_shifted))
            num_shifted += 1
    return symbols


def _merge_pair(seq: list[str], pair: tuple[str, str]) -> list[str]:
    """Replace each non-overlapping occurrence of ``pair`` in ``seq`` (left to right) by its concatenation."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == pair[0] and seq[i + 1] == pair[1]:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def derive_merges(text: str = MERGE_CORPUS, num_merges: int = NUM_MERGES) -> list[tuple[str, str]]:
    """Greedy BPE merges over the byte-level words of ``text``; ties go to the smaller pair, so it is deterministic."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word_counts = Counter(word for word, _ in pre.pre_tokenize_str(text))
    seqs = {word: list(word) for word in word_counts}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, num in word_counts.items():
            seq = seqs[word]
            for pair in zip(seq, seq[1:]):
                pairs[pair] += num
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:  # a pair seen once is not "common"; stop rather than memorize the corpus
            break
        merges.append(best)
        seqs = {word: _merge_pair(seq, best) for word, seq in seqs.items()}
    return merges


def _build_vocab(specials: list[str], merges: list[tuple[str, str]]) -> tuple[dict[str, int], list[str]]:
    """Vocab = specials, 256 bytes, merge results, then reserved specials up to a multiple of VOCAB_MULTIPLE."""
    tokens = [*specials, *byte_symbols()]
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    num_reserved = -len(tokens) % VOCAB_MULTIPLE
    reserved = [f"<|reserved_{k}|>" for k in range(num_reserved)]
    tokens.extend(reserved)
    return {tok: i for i, tok in enumerate(tokens)}, [*specials, *reserved]


def build_tiny_tokenizer(chat_template: ChatStyle = "chatml") -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with ChatML or Llama 3 specials and chat template."""
    style = STYLES[chat_template]
    merges = derive_merges()
    vocab, all_specials = _build_vocab(style["specials"], merges)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets cover the exact characters of each token, which the loss mask relies on.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in all_specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=style["bos"],
        eos_token=style["eos"],
        pad_token=style["pad"],
        unk_token=style["unk"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = style["template"]
    return tokenizer


def _special_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)  # (one token in, one id out)
    return token_id


def _llama(cfg: TinyTargetConfig, common: dict) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=cfg.num_key_value_heads))


def _qwen3(cfg: TinyTargetConfig, common: dict) -> PreTrainedModel:
    # Qwen3Config's head_dim defaults to 128 whatever the width; give it the usual H / heads.
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return Qwen3ForCausalLM(Qwen3Config(**common, num_key_value_heads=cfg.num_key_value_heads, head_dim=head_dim))


def _deepseek_v3(cfg: TinyTargetConfig, common: dict) -> PreTrainedModel:
    """MLA + MoE in DeepSeek-V3's proportions: layer 0 dense, the rest 8 routed experts (2 per token) + 1 shared."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **common,
            num_key_value_heads=cfg.num_attention_heads,  # MLA: no key/value head sharing
            q_lora_rank=cfg.hidden_size // 2,
            kv_lora_rank=cfg.hidden_size // 4,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=head_dim // 2,
            v_head_dim=head_dim,
            moe_intermediate_size=max(1, cfg.intermediate_size // 4),
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
        )
    )


ARCHITECTURES = {"llama": _llama, "qwen3": _qwen3, "deepseek_v3": _deepseek_v3}
"""target.tiny.architecture -> builder of the randomly initialized transformers model."""


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyTargetConfig, seed: int) -> PreTrainedModel:
    """A randomly initialized model of ``cfg.architecture`` whose vocab and special ids match ``tokenizer``."""
    ids = {
        "bos_token_id": _special_id(tokenizer, tokenizer.bos_token),
        "eos_token_id": _special_id(tokenizer, tokenizer.eos_token),
        "pad_token_id": _special_id(tokenizer, tokenizer.pad_token),
    }
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # EAGLE-3 reads lm_head separately from the embeddings; keep them distinct
        **ids,
    )
    torch.manual_seed(seed)
    model = ARCHITECTURES[cfg.architecture](cfg, common).eval()
    model.generation_config = GenerationConfig(**ids)
    return model


def _manifest(cfg: TinyTargetConfig, seed: int) -> dict:
    return {"format_version": FORMAT_VERSION, "seed": seed, "tiny": cfg.model_dump(mode="json")}


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _write_folder(folder: Path, cfg: TinyTargetConfig, seed: int) -> None:
    """Fill an empty folder with the HF files; the manifest goes last so a partial folder never looks complete."""
    tokenizer = build_tiny_tokenizer(cfg.chat_template)
    model = build_tiny_model(tokenizer, cfg, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    atomic_write_json(folder / MANIFEST_NAME, _manifest(cfg, seed))


def _clear_stale(out_dir: Path) -> None:
    """Remove a folder that an earlier build of ours left (manifest mismatch or interrupted); refuse foreign ones.

    Call only under the folder's lock: the folder is renamed aside first, so no reader sees it half deleted."""
    if not out_dir.exists():
        return
    ours = _read_manifest(out_dir) is not None or not any(out_dir.iterdir())
    if not ours:
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a tiny target folder; refusing to replace it")
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".stale", dir=out_dir.parent))
    os.replace(out_dir, aside / out_dir.name)
    shutil.rmtree(aside)


def _make_readable(folder: Path) -> None:
    """mkdtemp/mkstemp create owner-only modes; a shared target cache must be readable by other users."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        os.chmod(path, 0o644)


def _remove_killed_builds(out_dir: Path) -> None:
    """Delete the temp folders (``.<name>.XXXXXXXX.tmp`` / ``.stale``) that killed builds left; only under the lock."""
    pattern = re.compile(re.escape(f".{out_dir.name}.") + r"[A-Za-z0-9_]{8}\.(tmp|stale)")
    for path in out_dir.parent.iterdir():
        if pattern.fullmatch(path.name) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def save_tiny_target(out_dir: Path, cfg: TinyTargetConfig, seed: int) -> Path:
    """Write (or reuse) an HF folder with the tiny target; built in a temp sibling and renamed into place.

    Processes sharing a cache may prepare the same target at once: the build and the rename happen under a flock on
    ``.<name>.lock`` beside the folder, so one builds and the others, once they get the lock, find its complete
    folder and use it. A complete folder of these settings is never removed (only a stale or interrupted one)."""
    out_dir = Path(out_dir)
    if _read_manifest(out_dir) == _manifest(cfg, seed):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _read_manifest(out_dir) == _manifest(cfg, seed):  # built by the process we waited for
            return out_dir
        _remove_killed_builds(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        try:
            _write_folder(tmp, cfg, seed)
            _make_readable(tmp)
            _clear_stale(out_dir)
            os.rename(tmp, out_dir)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return out_dir
