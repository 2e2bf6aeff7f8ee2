"""Config sections of the data stages and the target: target, data (its sources, synthetic generation),
regenerate, tokenize, vocab (eagle3.config holds the run's tree and re-exports these)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3.config_base import Added, Device, Operational, PlainName, Section

CharsOf = Literal["all", "prompts"]
"""Which turns a conversation's character count covers (data.max_chars_of)."""


class TinyTargetConfig(Section):
    """Shape of the random tiny target built locally (tests, CI, smoke runs)."""

    architecture: Literal["llama", "qwen3", "deepseek_v3"] = "llama"
    """Which transformers class: Llama, Qwen3 (q/k norms), or DeepSeek-V3 (MLA attention + MoE, as Kimi-K2)."""
    num_hidden_layers: int = Field(8, ge=1, le=256)
    """Decoder layers (>= 8 when kind=tiny, so the default aux ids [1, N//2-1, N-4] are distinct and below N-1)."""
    hidden_size: int = Field(64, ge=2, le=16384)
    """Model width H (a multiple of num_attention_heads, with an even head size)."""
    num_attention_heads: int = Field(4, ge=1, le=1024)
    """Query heads."""
    num_key_value_heads: int = Field(2, ge=1, le=1024)
    """Key/value heads (GQA; they divide num_attention_heads; deepseek_v3 ignores it: MLA keeps one per query head)."""
    intermediate_size: int = Field(128, ge=1, le=65536)
    """MLP width (deepseek_v3: of the dense first layer; each expert is a quarter of it)."""
    chat_template: Literal["chatml", "llama3"] = "chatml"
    """Which chat template the locally built tokenizer carries."""


class TargetConfig(Section):
    kind: Literal["hf", "gguf", "tiny"] = "tiny"
    """hf: a transformers directory; gguf: a GGUF file converted once to safetensors; tiny: random model."""
    path: str | None = None
    """Model directory or GGUF file; 'pkg://{package}/{file}' finds a file inside an installed package."""
    name: PlainName = "tiny-llama"
    """Short slug for the target, used in cache folder names (one spelling everywhere); a plain name."""
    cache_dir: str | None = None
    """Where converted/built targets are cached; default {workdir}/_targets."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype when the model is loaded (bf16 is slow on CPUs without AVX-512)."""
    aux_layer_ids: list[int] | None = None
    """Aux layers, output-of-layer convention (0-based); default [1, N//2-1, N-4]."""
    tiny: TinyTargetConfig = TinyTargetConfig()
    """Shape of the tiny random target (kind=tiny only)."""

    @model_validator(mode="after")
    def _path_matches_kind(self) -> TargetConfig:
        if self.kind in ("hf", "gguf") and not self.path:
            raise ValueError(f"target.path is required when target.kind is {self.kind!r}")
        # Checked only where the tiny model is built: the section is inert for hf/gguf targets, and run
        # configs saved with other values must stay loadable.
        if self.kind == "tiny" and self.tiny.num_hidden_layers < 8:
            raise ValueError(
                f"target.tiny.num_hidden_layers must be >= 8 (got {self.tiny.num_hidden_layers}) so "
                "the default aux layer ids [1, N//2-1, N-4] are distinct and below the last layer"
            )
        if self.kind == "tiny":
            _check_tiny_heads(self.tiny)
        return self


def _check_tiny_heads(tiny: TinyTargetConfig) -> None:
    """Attention shapes the Llama layers can build: whole, even head sizes and whole query groups."""
    heads, kv = tiny.num_attention_heads, tiny.num_key_value_heads
    if tiny.hidden_size % heads or (tiny.hidden_size // heads) % 2:
        raise ValueError(
            f"target.tiny.hidden_size {tiny.hidden_size} must be num_attention_heads ({heads}) times "
            "an even head size (rotary embeddings rotate pairs of channels)"
        )
    if heads % kv:
        raise ValueError(f"target.tiny.num_key_value_heads {kv} must divide num_attention_heads {heads}")


class SyntheticConfig(Section):
    count: int = Field(1000, ge=1)
    """Conversations to generate (rejected ones included: the merge filters them)."""
    seed: int = 0
    """Seed of the sampled user turns: the same seed, target and settings give the same records."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the user turns the target writes (answers use regenerate.temperature)."""
    max_prompt_tokens: int = Field(256, ge=1)
    """Cap on a user turn's tokens; a turn that hits it without ending is rejected as truncated."""
    max_answer_tokens: int = Field(512, ge=1)
    """Cap on an answer's tokens; an answer that hits it without ending is rejected as truncated."""
    near_duplicate: float = Field(0.7, gt=0, le=1)
    """Reject a user turn whose word 3-gram Jaccard similarity to an earlier kept one is at least this."""


class SourceConfig(Section):
    name: str
    """Source name; becomes the id prefix '{name}:{id in source}'. Letters, digits, '-', '_' and '.'."""
    path: str | None = None
    """File (or 'pkg://{package}/{file}') holding the conversations; unset for a synthetic source."""
    format: Literal["auto", "sharegpt", "openai", "parquet", "synthetic"] = "auto"
    """Reader: ShareGPT JSON/JSONL, OpenAI 'messages' JSONL, Parquet; auto picks; synthetic = written by the target."""
    max_records: int | None = Field(None, ge=1)
    """Keep at most this many valid conversations from this source (cap applied after validation)."""
    synthetic: SyntheticConfig | None = None
    """Generation settings of a synthetic source (format synthetic; defaults when unset)."""
    keep_answers: bool = Added(False)
    """With regeneration on, keep this source's own answers (more text at no generation cost; still distilled)."""
    dedupe_scope: Literal["all", "source"] = Added("all")
    """Rows a conversation may not repeat: every source's, or this source's only (a repeat shares the first's split)."""

    @model_validator(mode="after")
    def _path_or_synthetic(self) -> SourceConfig:
        synthetic = self.format == "synthetic"
        if synthetic and self.path is not None:
            raise ValueError(
                f"source {self.name!r}: a synthetic source has no path (the synthesize stage writes "
                "data/synthetic/<name>.jsonl in the run)"
            )
        if not synthetic and (self.path is None or self.synthetic is not None):
            raise ValueError(f"source {self.name!r}: set path (and leave synthetic unset) unless format is synthetic")
        if synthetic and self.keep_answers:
            raise ValueError(
                f"source {self.name!r}: keep_answers is for file sources (a synthetic source's answers "
                "are the target's own already)"
            )
        if synthetic and self.synthetic is None:
            self.synthetic = SyntheticConfig()
        return self


class DataConfig(Section):
    sources: list[SourceConfig] = []
    """Chat datasets to merge, in order."""
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of rows put in the val split (by a seeded hash of the row id)."""
    dedupe: bool = True
    """Drop rows whose normalized content duplicates an earlier row (kept in rejects.jsonl)."""
    max_chars: int = Field(200_000, ge=1)
    """Reject conversations longer than this many characters in total (reason 'too_long')."""
    max_chars_of: CharsOf = "all"
    """Which turns max_chars counts: all, or prompts (system and user: regeneration replaces the answers)."""
    shuffle: bool = True
    """Shuffle the merged rows with run.seed."""
    min_rows: int = Field(1, ge=1)
    """Fail the merge when it keeps fewer rows than this (an empty merge is always an error)."""
    eval_overlap: bool = True
    """Reject records holding an evaluation prompt (MT-Bench, HumanEval, GSM8K) or a near-copy (reason eval_overlap)."""
    eval_overlap_min_ngrams: int = Field(4, ge=1)
    """A record is a near-copy when it shares this many word 8-grams found in one evaluation prompt only."""


class RegenerateConfig(Section):
    enabled: bool = False
    """Re-answer every user turn with the target before tokenizing."""
    backend: Literal["openai", "hf", "sglang"] = "openai"
    """openai: an OpenAI-compatible endpoint (SGLang, vLLM, hosted); hf: in-process transformers generate; sglang: an SGLang server this stage starts on the target (as the server section says), answers through its OpenAI endpoint, and stops."""
    endpoint: str = "http://127.0.0.1:30000/v1"
    """Base URL of the OpenAI-compatible API (ends in /v1)."""
    model: str = "default"
    """Model name sent in the request body."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself)."""
    max_concurrency: int = Field(8, ge=1)
    """Conversations in flight at once (openai and sglang backends)."""
    sglang_port: int = Operational(30200, ge=1, le=65535)
    """Port of the managed server of the sglang backend."""
    batch_size_conversations: int = Field(4, ge=1)
    """Conversations per generate() batch (hf backend); counts conversations, not tokens."""
    generation_backend: Literal["auto", "static", "dynamic", "continuous"] = "auto"
    """hf backend: static = static cache (compiled on CUDA), dynamic = plain generate, continuous = generate_batch; auto = static on CUDA, else dynamic."""
    prompt_bucket: int = Field(64, ge=1)
    """hf static: prompts are left padded to a multiple of this many tokens."""
    decode_attention: Literal["sdpa", "kv_heads", "flex"] = "kv_heads"
    """hf static: decode attention: sdpa (transformers'), kv_heads (no cache copy per query head), flex (also reads only used key blocks)."""
    straggler_rows: int = Added(0, ge=0)
    """hf static/dynamic: a batch down to this many running rows stops and they go on in a batch this size (0: off)."""
    compile_dynamic: bool = Added(False)
    """hf static on CUDA: compile the decode step once with symbolic batch and cache sizes, not once per shape."""
    loop_stop_tokens: int = Added(0, ge=0)
    """hf static/dynamic: end an answer once its last N tokens repeat with a period of at most N, as if capped (0: off)."""
    cut_loops: bool = Added(False)
    """Cut answers that hit max_new_tokens where they run into a loop (a few repeats kept), and drop later turns."""
    device: Device = "cpu"
    """Device of the in-process model (hf backend): auto, cpu, cuda or cuda:N."""
    max_new_tokens: int = Field(512, ge=1)
    """Cap on tokens generated per assistant turn."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    timeout_s: float = Field(120.0, gt=0)
    """Per-request timeout in seconds."""
    max_retries: int = Field(3, ge=0)
    """Retries per request on transport errors, timeouts and 5xx/429 answers."""
    max_conversations: int | None = Field(None, ge=1)
    """Regenerate only the first N rows (the rest are counted as skipped); None = all."""
    max_user_turns: int | None = Field(None, ge=1)
    """Keep only the first N user turns of each conversation (with their new answers); None = all."""
    num_slices: int = Operational(1, ge=1)
    """Flow runs the conversations left are split into, each on its own gpu-pool worker (1: regenerate in the flow itself)."""

    @model_validator(mode="after")
    def _loop_stop_needs_own_loop(self) -> RegenerateConfig:
        if self.loop_stop_tokens and self.generation_backend == "continuous":
            raise ValueError(
                "regenerate.loop_stop_tokens needs generation_backend static, dynamic or auto: "
                "transformers' continuous batching takes no per-row stopping criterion here"
            )
        return self

    @model_validator(mode="after")
    def _stragglers_below_batch(self) -> RegenerateConfig:
        if self.straggler_rows >= self.batch_size_conversations:
            raise ValueError(
                f"regenerate.straggler_rows ({self.straggler_rows}) must be below "
                f"batch_size_conversations ({self.batch_size_conversations}): its batch takes the rows "
                "still running when a full batch shrinks to it"
            )
        return self


class TokenizeConfig(Section):
    max_len: int = Field(2048, ge=8)
    """Maximum tokens per sample."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Policy for samples longer than max_len: cut at max_len, or drop (both are counted)."""
    min_loss_tokens: int = Field(1, ge=0)
    """Drop samples with fewer supervised tokens than this (after truncation)."""


class VocabConfig(Section):
    draft_vocab_size: int = Field(32000, ge=1)
    """Draft vocabulary size (clipped to the target vocab size)."""
