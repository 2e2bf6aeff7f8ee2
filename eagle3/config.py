"""The run configuration: one strict pydantic tree, one section per stage.

A run is described by a preset (``configs/<name>.yaml``) plus dotted overrides
(``--set train.lr=1e-4``). The resolved tree is written to ``<run>/config.json`` and is
the only thing a stage reads; Prefect flows take the same model as a parameter, so the
UI form, ``prefect.yaml`` and ``python -m eagle3.<stage>`` share one schema.

Every field has a one-line doc (the attribute docstring below it); a test enforces it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS_DIR = REPO_ROOT / "configs"
MAX_NAME_CHARS = 100
"""Longest name that becomes one path component (file systems allow 255 bytes; suffixes are added to names)."""
MAX_PATH_COMPONENT_BYTES = 255


class ConfigError(ValueError):
    """A preset, override or config file that cannot be turned into a valid RunConfig."""


def _plain_name(value: str) -> str:
    """A name that becomes one path component: no separators, '..', leading '.', control characters; bounded."""
    if not value or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"must be 1 to {MAX_NAME_CHARS} characters (got {len(value)})")
    if any(c in value for c in "/\\") or value.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{value[:40]!r} must be a plain name: no '/', '\\', control characters or leading '.'")
    return value


PlainName = Annotated[str, AfterValidator(_plain_name)]
"""A config value used as a file or folder name inside a folder the pipeline owns."""


def _folder_path(value: str) -> str:
    """A folder path whose components fit the file system and whose nearest existing ancestor is a folder."""
    if not value or "\0" in value:
        raise ValueError("must be a non-empty path without NUL characters")
    path = Path(value)
    too_long = [part for part in path.parts if len(os.fsencode(part)) > MAX_PATH_COMPONENT_BYTES]
    if too_long:
        raise ValueError(f"the component {too_long[0][:40]!r}... is longer than {MAX_PATH_COMPONENT_BYTES} bytes")
    for ancestor in (path, *path.parents):
        try:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ValueError(f"{str(ancestor)!r} is a file, not a folder")
                break
        except OSError as exc:
            raise ValueError(f"cannot inspect {str(ancestor)!r}: {exc.strerror}") from None
    return value


def _relative_inside(value: str | None) -> str | None:
    """A path relative to a folder of the run that stays inside it (no absolute path, no '..')."""
    if value is not None and (not value or Path(value).is_absolute() or ".." in Path(value).parts or "\0" in value):
        raise ValueError(f"{value!r} must be a relative path inside its folder (no leading '/', no '..')")
    return value


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docs come from docstrings."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunSection(Section):
    workdir: Annotated[str, AfterValidator(_folder_path)] = "runs"
    """Directory that holds one sub-directory per run (relative paths are relative to the CWD)."""
    name: PlainName = "demo"
    """Run name; the run directory is {workdir}/{name}. A plain folder name of at most 100 characters."""
    seed: int = 0
    """Seed for shuffling, the train/val split, model init and training."""


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
            raise ValueError(f"target.tiny.num_hidden_layers must be >= 8 (got {self.tiny.num_hidden_layers}) so "
                             "the default aux layer ids [1, N//2-1, N-4] are distinct and below the last layer")
        if self.kind == "tiny":
            _check_tiny_heads(self.tiny)
        return self


def _check_tiny_heads(tiny: TinyTargetConfig) -> None:
    """Attention shapes the Llama layers can build: whole, even head sizes and whole query groups."""
    heads, kv = tiny.num_attention_heads, tiny.num_key_value_heads
    if tiny.hidden_size % heads or (tiny.hidden_size // heads) % 2:
        raise ValueError(f"target.tiny.hidden_size {tiny.hidden_size} must be num_attention_heads ({heads}) times "
                         "an even head size (rotary embeddings rotate pairs of channels)")
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

    @model_validator(mode="after")
    def _path_or_synthetic(self) -> SourceConfig:
        synthetic = self.format == "synthetic"
        if synthetic and self.path is not None:
            raise ValueError(f"source {self.name!r}: a synthetic source has no path (the synthesize stage writes "
                             "data/synthetic/<name>.jsonl in the run)")
        if not synthetic and (self.path is None or self.synthetic is not None):
            raise ValueError(f"source {self.name!r}: set path (and leave synthetic unset) unless format is synthetic")
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
    backend: Literal["openai", "hf"] = "openai"
    """openai: an OpenAI-compatible endpoint (SGLang, vLLM, hosted); hf: in-process transformers generate."""
    endpoint: str = "http://127.0.0.1:30000/v1"
    """Base URL of the OpenAI-compatible API (ends in /v1)."""
    model: str = "default"
    """Model name sent in the request body."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself)."""
    max_concurrency: int = Field(8, ge=1)
    """Conversations in flight at once (openai backend)."""
    batch_size_conversations: int = Field(4, ge=1)
    """Conversations per generate() batch (hf backend); counts conversations, not tokens."""
    generation_backend: Literal["auto", "static", "dynamic", "continuous"] = "auto"
    """hf backend: static = static cache (compiled on CUDA), dynamic = plain generate, continuous = generate_batch; auto = static on CUDA, else dynamic."""
    prompt_bucket: int = Field(64, ge=1)
    """hf static: prompts are left padded to a multiple of this many tokens."""
    kv_head_attention: bool = True
    """hf static: decode attention on the key/value heads, without copying the cache for each query head."""
    device: str = "cpu"
    """Device of the in-process model (hf backend): cpu, cuda or cuda:N."""
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


class SGLangCaptureConfig(Section):
    """The SGLang capture backend: managed server(s) or existing endpoints."""

    endpoints: list[str] = []
    """Existing aux-capture servers (http://host:port); empty = launch managed servers."""
    final_endpoints: list[str] = []
    """Existing final-hidden servers (--enable-return-hidden-states) for final_hidden supervision."""
    python: str = "python"
    """Interpreter that has sglang installed (runs `-m sglang.launch_server`)."""
    host: str = "127.0.0.1"
    """Interface a managed server binds to."""
    allow_remote_host: bool = False
    """Let a managed server bind a non-loopback host (reachable from other machines; it always gets an API key)."""
    port: int = Field(30100, ge=1, le=65535)
    """Port of a managed server."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of a managed server."""
    dp_size: int = Field(1, ge=1)
    """Data-parallel replicas inside a managed server."""
    api_key_env: str | None = "EAGLE3_SGLANG_API_KEY"
    """Env var holding the server API key; generated per launch when unset."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """--mem-fraction-static for a managed server (None = SGLang's choice)."""
    extra_args: list[str] = []
    """Extra launch flags, appended verbatim (checked against SGLang's parser in tests)."""
    max_concurrency: int = Field(4, ge=1)
    """Requests in flight per endpoint (each carries T x 3H floats as JSON)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one capture request."""
    startup_timeout_s: float = Field(1800.0, gt=0)
    """How long a managed server may take to pass the readiness probe."""
    max_restarts: int = Field(3, ge=0)
    """Restarts of a managed server that died, with backoff, before the capture fails."""


class CaptureConfig(Section):
    backend: Literal["hf", "sglang"] = "hf"
    """Where hidden states come from: in-process transformers or a managed SGLang server."""
    supervision: Literal["final_hidden", "topk_logprobs"] = "final_hidden"
    """What the trainer learns from: the post-norm final hidden state, or the target's top-K log-probs."""
    topk: int = Field(20, ge=1)
    """K for topk_logprobs supervision."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Storage dtype of the captured states."""
    aux_dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    """Storage of the aux states: bf16, or fp8 e4m3 with a per-token scale (half the bytes)."""
    max_tokens_per_batch: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Token budget of one forward batch (padded tokens, never a sample count); auto: from free GPU memory, 4096 on CPU."""
    tokens_per_shard: int = Field(131_072, ge=1)
    """Target tokens per shard file (balanced by tokens; ~4 GB per shard for an 8B target)."""
    max_concurrent_shards: int = Field(1, ge=1)
    """Shard tasks in flight in one flow run (they share the model or the servers)."""
    num_slices: int = Field(1, ge=1)
    """Flow runs the capture flow splits the pending shards into, each on its own gpu-pool worker (1: capture in the flow itself)."""
    device: str = "auto"
    """HF backend device: auto (cuda if available), cpu, cuda, cuda:N."""
    device_map: str | None = None
    """HF backend: 'auto' spreads a large model over all visible GPUs (accelerate)."""
    disk_margin_bytes: int = Field(1 << 30, ge=0)
    """Free space that must remain after the planned bytes are written."""
    allow_shared_gpus: bool = False
    """Start even when other processes hold GPU memory (default: stop and name them)."""
    stream_writes: bool = True
    """Write each sample's rows as soon as it is captured (false: a whole shard after its last forward)."""
    num_writers: int = Field(2, ge=1)
    """Writer threads: shards whose files are written (hashed, fsynced) at the same time."""
    write_queue_bytes: int = Field(4 << 30, ge=1)
    """Captured bytes waiting for a writer before the forwards pause (host-memory bound, backpressure)."""
    early_writeback: bool = True
    """Ask the kernel (Linux sync_file_range) to start writing shard pages early, so each fsync has little left."""
    pinned_handoff: bool = False
    """HF on CUDA: writers read the pinned copy buffers directly instead of a pageable clone (pins more memory)."""
    per_sample_attention: bool | Literal["auto"] = "auto"
    """HF: true = attention per sample (bitwise batch-invariant, for debugging); false = one padded SDPA per layer; auto = false on GPUs, true on CPU."""
    sglang: SGLangCaptureConfig = SGLangCaptureConfig()
    """SGLang backend settings."""


class DrafterConfig(Section):
    ttt_steps: int = Field(7, ge=1)
    """Training-time-test unroll length."""
    step_decay: float = Field(0.8, gt=0)
    """Loss weight of TTT step k is step_decay**k (EAGLE, SpecForge: 0.8)."""
    attn_impl: Literal["auto", "dense", "flex"] = "auto"
    """TTT attention kernel: auto = compiled flex_attention on CUDA, dense elsewhere."""
    init_std: float = Field(0.02, gt=0)
    """Std of the seeded normal init of every linear layer (HF Llama's 0.02)."""
    init_lm_head_from_target: bool = True
    """Start lm_head from the target lm_head rows of the draft vocab (else random init)."""


class TrainConfig(Section):
    features: Literal["offline", "online"] = "offline"
    """offline: read captured shards; online: run the frozen target in each training step (no capture, no feature disk)."""
    lr: float = Field(1e-4, gt=0)
    """Peak learning rate, tuned for reference_rows_per_step rows per optimizer step (see lr_scaling)."""
    num_epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps in total (None = all epochs); the LR schedule spans them."""
    max_train_tokens: int | None = Field(None, ge=1)
    """Train on the first train-split rows (tokenized order) totalling at most this many tokens; None = all rows."""
    max_tokens_per_batch: int = Field(4096, ge=8)
    """Tokens of one packed micro-batch row (documents packed, then padded); longer samples are cut to it."""
    grad_accum_steps: int = Field(1, ge=1)
    """Micro-batches (packed rows) per rank accumulated into one optimizer step."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """How lr scales with rows per step R = world_size x grad_accum_steps: x1, x R/ref or x sqrt(R/ref)."""
    reference_rows_per_step: int = Field(1, ge=1)
    """The rows per optimizer step (world_size x grad_accum_steps) that lr was tuned for."""
    warmup_ratio: float = Field(0.015, ge=0, lt=1)
    """Linear warmup length as a fraction of all optimizer steps (SpecForge 0.015)."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warmup length in optimizer steps; overrides warmup_ratio when set."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The cosine decay ends at lr x min_lr_ratio."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay on weight matrices (norm weights are never decayed)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(0.5, ge=0)
    """Clip the global gradient norm to this (0 = no clipping; SpecForge 0.5)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism under torchrun: DDP (replicated weights) or FSDP2 (fully_shard, sharded state)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    aux_noise: Literal["none", "uniform", "gaussian"] = "none"
    """Noise added to the aux features of train batches (never to val): U(-s, s) or N(0, s^2)."""
    aux_noise_std: float = Field(0.05, ge=0)
    """The noise scale s: half-width of the uniform noise, std of the gaussian noise."""
    eval_every_steps: int = Field(200, ge=0)
    """Validate on the val split every N optimizer steps (0 = only at the end)."""
    checkpoint_every_steps: int = Field(500, ge=0)
    """Write a full checkpoint every N optimizer steps (0 = only at the end and on SIGTERM)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Keep this many newest checkpoints (and the best one by validation); older ones are deleted."""
    select: Literal["best", "last"] = "best"
    """Checkpoint the export ships: best = highest validation accept_len_est, last = the final one."""
    progress_every_s: float = Field(5.0, ge=0)
    """Rewrite train/progress.json at most this often (seconds)."""
    prefetch_rows: int = Field(2, ge=0)
    """Rows collated ahead on a background thread (0 = load in the training thread)."""
    nproc_per_node: int | None = Field(None, ge=1)
    """torchrun processes per node; None = one per visible GPU (1 without GPUs)."""
    nnodes: int = Field(1, ge=1)
    """Nodes in the torchrun job (each node's worker runs the same task)."""
    node_rank: int = Field(0, ge=0)
    """This node's rank in a multi-node job."""
    rdzv_endpoint: str | None = None
    """host:port of the c10d rendezvous for multi-node jobs."""
    timeout_s: float = Field(7 * 24 * 3600.0, gt=0)
    """Wall-clock limit of one torchrun launch; the group is killed past it (a retry resumes)."""
    compile: bool = True
    """torch.compile the TTT step's pieces and the fused loss on CUDA (CPU runs stay eager); false = eager."""
    loss_chunk_tokens: int = Field(4096, ge=0)
    """Fused soft cross-entropy over this many tokens at a time (no fp32 [T, Vd] tensors); 0 = plain log_softmax."""
    reuse_block_mask: bool = False
    """flex: one block mask per micro-batch for all TTT steps; false = one per step (measured faster on the H200)."""


class ExportConfig(Section):
    formats: list[Literal["sglang", "speculators"]] = ["sglang", "speculators"]
    """Layouts to write under {run}/export/: sglang (official EAGLE-3, SGLang and vLLM) and speculators (vLLM)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the exported weights (d2t is always int64 and t2d always bool)."""
    checkpoint: Annotated[str | None, AfterValidator(_relative_inside)] = None
    """Checkpoint folder to export, relative to {run}/train (e.g. checkpoints/step-500); None = train.select's."""
    verifier_name_or_path: str | None = None
    """Verifier id or path written into the speculators config; None = target.path (hf) or the target folder."""
    speculative_tokens: int = Field(3, ge=1)
    """Draft tokens per step that the speculators config proposes to vLLM (greedy chain)."""


class EvaluateConfig(Section):
    """Offline speculative decoding with the exported drafter: a fixed prompt set, fixed baseline settings."""

    datasets: list[Literal["mtbench", "humaneval", "gsm8k"]] = ["mtbench"]
    """Prompt sets (installed packages): MT-Bench first turns, HumanEval, GSM8K; rendered with the chat template."""
    num_prompts: int | None = Field(10, ge=1)
    """Prompts per dataset: the first N in file order (None = all: 80 / 164 / 1319)."""
    num_prompts_by_dataset: dict[Literal["mtbench", "humaneval", "gsm8k"], int] = {}
    """Prompts of the named datasets (first N in file order), replacing num_prompts for them."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens generated per prompt by every method (fewer when the target emits a stop token)."""
    methods: list[Literal["chain", "tree", "ngram"]] = ["chain", "ngram"]
    """Drafting methods, each checked against one shared plain-greedy reference per prompt."""
    chain_steps: list[int] = [3]
    """Chain lengths to measure (topk 1; steps + 1 tokens verified per step)."""
    tree_steps: int = Field(5, ge=1)
    """Tree depth: draft tokens on the longest branch."""
    tree_topk: int = Field(4, ge=1)
    """Tree: children proposed per expanded node, and nodes expanded per depth."""
    tree_num_draft_tokens: int = Field(8, ge=2)
    """Tree: tokens verified per step, the root included (SGLang's --speculative-num-draft-tokens)."""
    ngram_max: int = Field(3, ge=1)
    """Prompt lookup baseline: the longest n-gram, tried first."""
    ngram_min: int = Field(1, ge=1)
    """Prompt lookup baseline: the shortest n-gram tried."""
    ngram_num_tokens: int = Field(3, ge=1)
    """Prompt lookup baseline: tokens proposed after a match (the lookup window is the whole context)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where target and drafter run: auto = cuda when available, else cpu."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of target and drafter (fp32 keeps verify and single-token logits within rounding)."""
    num_workers: int = Field(1, ge=1)
    """Processes evaluating prompt slices in parallel on one device (their wall times then include contention)."""
    static_cache: Literal["auto", "on", "off"] = "auto"
    """Fixed-size KV caches and fixed-width forwards for target and drafter: auto = on for cuda, off for cpu."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the fixed-width forwards (CUDA graphs on cuda): auto = on for cuda with the static cache."""
    near_tie_logit_gap: float = Field(1e-3, ge=0)
    """A differing token within this logit gap of the reference's top-1 is a numerical near-tie, not a bug."""

    def limit_for(self, dataset: str) -> int | None:
        """How many prompts of ``dataset`` are measured (None = all)."""
        return self.num_prompts_by_dataset.get(dataset, self.num_prompts)  # type: ignore[call-overload]

    @model_validator(mode="after")
    def _consistent(self) -> EvaluateConfig:
        if not self.datasets or not self.methods:
            raise ValueError("evaluate.datasets and evaluate.methods must not be empty")
        if "chain" in self.methods and (not self.chain_steps or min(self.chain_steps) < 1):
            raise ValueError(f"evaluate.chain_steps {self.chain_steps} must hold steps >= 1 when chain is measured")
        unused = sorted(set(self.num_prompts_by_dataset) - set(self.datasets))
        if unused or any(n < 1 for n in self.num_prompts_by_dataset.values()):
            raise ValueError(f"evaluate.num_prompts_by_dataset {self.num_prompts_by_dataset}: counts must be >= 1 "
                             f"and name datasets in evaluate.datasets (not {unused})")
        if self.compile == "on" and self.static_cache == "off":
            raise ValueError("evaluate.compile=on needs the static cache (evaluate.static_cache auto or on)")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"evaluate.ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        most = 1 + self.tree_topk + (self.tree_steps - 1) * self.tree_topk**2
        if "tree" in self.methods and self.tree_num_draft_tokens > most:
            raise ValueError(f"evaluate.tree_num_draft_tokens {self.tree_num_draft_tokens} exceeds the {most} nodes "
                             f"a tree of depth {self.tree_steps} and topk {self.tree_topk} proposes (root included)")
        return self


class ServeConfig(Section):
    """Deploy + benchmark: a baseline and an EAGLE-3 SGLang server, identical but for the --speculative-* flags."""

    enabled: bool = False
    """Start SGLang servers and benchmark them (only where a GPU host with sglang is configured)."""
    model_path: str | None = None
    """Target the servers load (HF directory or hub id); default the target's prepared HF directory."""
    python: str = "python"
    """Interpreter that has sglang installed (runs `-m {launch_module}`)."""
    launch_module: str = "sglang.launch_server"
    """Module that starts a server; tests substitute tests.fakes.sglang_server (a fake)."""
    host: str = "127.0.0.1"
    """Interface the servers bind to (the benchmark client connects there)."""
    allow_remote_host: bool = False
    """Let the servers bind a non-loopback host (reachable from other machines; they always get an API key)."""
    port: int = Field(30000, ge=1, le=65534)
    """Port of the baseline server; the speculative server gets port + 1."""
    api_key_env: str | None = "EAGLE3_SGLANG_API_KEY"
    """Env var holding the servers' API key; generated per launch when unset."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of both servers."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """--dtype of both servers."""
    mem_fraction_static: float | None = Field(0.8, gt=0, lt=1)
    """--mem-fraction-static of both servers (None = SGLang's choice, which may differ between them)."""
    max_running_requests: int = Field(32, ge=1)
    """--max-running-requests of both servers (explicit: SGLang resets a speculative server's to 48)."""
    cuda_graph_max_bs_decode: int | None = Field(32, ge=1)
    """--cuda-graph-max-bs-decode of both servers (0.5.23's name for the old --cuda-graph-max-bs)."""
    attention_backend: str | None = None
    """--attention-backend of both servers (None = SGLang's choice)."""
    extra_args: list[str] = []
    """Extra launch flags for both servers, appended verbatim."""
    num_steps: int = Field(3, ge=1)
    """--speculative-num-steps: draft steps per verify step."""
    eagle_topk: int = Field(1, ge=1)
    """--speculative-eagle-topk: branches per draft step (1 = a chain)."""
    num_draft_tokens: int = Field(4, ge=2)
    """--speculative-num-draft-tokens: tokens verified per step (must be num_steps + 1 when eagle_topk is 1)."""
    concurrency_levels: list[int] = [1, 4, 16]
    """Requests in flight per measured level (1 = latency, more = throughput)."""
    num_prompts: int = Field(32, ge=1)
    """Measured requests per level: fixed prompts, the same for both servers."""
    max_new_tokens: int = Field(256, ge=2)
    """Tokens generated per request (ignore_eos, so every request produces exactly this many)."""
    num_warmup: int = Field(4, ge=0)
    """Unmeasured warmup requests before each level (/flush_cache follows them)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one benchmark request."""
    startup_timeout_s: float = Field(1800.0, gt=0)
    """How long a server may take to pass the readiness probe."""
    allow_shared_gpus: bool = False
    """Start even when other processes hold GPU memory (the benchmark would measure them too)."""

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"serve.num_draft_tokens must be num_steps + 1 = {self.num_steps + 1} with eagle_topk 1 "
                             f"(SGLang forces it), not {self.num_draft_tokens}")
        levels = self.concurrency_levels
        if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
            raise ValueError(f"serve.concurrency_levels {levels} must be distinct values >= 1")
        if max(levels) > min(self.max_running_requests, self.num_prompts):
            raise ValueError(f"serve.concurrency_levels {levels}: the highest level exceeds max_running_requests "
                             f"({self.max_running_requests}) or num_prompts ({self.num_prompts}), so it would "
                             "measure queueing instead of that concurrency")
        return self


class RunConfig(Section):
    """The whole run: one section per stage."""

    run: RunSection = RunSection()
    """Run identity: workdir, name, seed."""
    target: TargetConfig = TargetConfig()
    """The target model."""
    data: DataConfig = DataConfig()
    """Chat sources and merge policy."""
    regenerate: RegenerateConfig = RegenerateConfig()
    """Answer regeneration with the target."""
    tokenize: TokenizeConfig = TokenizeConfig()
    """Chat-template rendering and loss masks."""
    vocab: VocabConfig = VocabConfig()
    """Draft vocabulary map."""
    capture: CaptureConfig = CaptureConfig()
    """Hidden-state capture."""
    drafter: DrafterConfig = DrafterConfig()
    """Drafter architecture."""
    train: TrainConfig = TrainConfig()
    """Training loop."""
    export: ExportConfig = ExportConfig()
    """Export formats."""
    evaluate: EvaluateConfig = EvaluateConfig()
    """Offline acceptance evaluation."""
    serve: ServeConfig = ServeConfig()
    """SGLang serving."""

    @property
    def run_dir(self) -> Path:
        """The run directory <workdir>/<name>."""
        return Path(self.run.workdir) / self.run.name

    @property
    def target_cache_dir(self) -> Path:
        """Where converted or generated targets are cached."""
        return Path(self.target.cache_dir) if self.target.cache_dir else Path(self.run.workdir) / "_targets"


def list_presets() -> list[str]:
    """Names of the presets in configs/."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_preset(preset: str) -> dict[str, Any]:
    path = Path(preset) if preset.endswith((".yaml", ".yml", ".json")) else PRESETS_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset {preset!r} not found (looked for {path}); presets: {', '.join(list_presets())}")
    return read_config_file(path)


def _parse_config_text(path: Path, text: str) -> Any:
    """The parsed file; a syntax error becomes a ConfigError naming the file, line and column."""
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}, line {exc.lineno} column {exc.colno}: invalid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    except (RecursionError, ValueError) as exc:  # nesting past the recursion limit, huge integers
        raise ConfigError(f"{path}: cannot be parsed: {str(exc).split(';')[0]}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML preset or JSON config as a dict (ConfigError naming the file on unreadable or bad content)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    data = _parse_config_text(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=1e-4' -> (['train', 'lr'], 1e-4); the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from exc
    return key.strip().split("."), value


def _child(node: Any, key: str, item: str) -> Any:
    """Step into a dict key or a list index ('data.sources.0.path')."""
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise ConfigError(f"override {item!r}: {key!r} is not an index of a list of {len(node)}")
        return node[int(key)]
    child = node.setdefault(key, {})
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"override {item!r}: {key!r} is not a section")
    return child


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (creating sections; digits index into lists)."""
    for item in overrides:
        keys, value = parse_override(item)
        node: Any = data
        for key in keys[:-1]:
            node = _child(node, key, item)
        last = keys[-1]
        if isinstance(node, list):
            _child(node, last, item)
            node[int(last)] = value
        else:
            node[last] = value
    return data


def _format_validation_error(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)


def validate_config(data: dict[str, Any], origin: str) -> RunConfig:
    """Validate a raw dict, turning pydantic errors into a ConfigError that names each field."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None


def load_config(preset: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset (name in configs/ or a YAML/JSON path) and apply dotted overrides."""
    overrides = list(overrides or [])
    data = apply_overrides(_read_preset(preset), overrides)
    origin = f"preset {preset}" + (f" with overrides {overrides}" if overrides else "")
    return validate_config(data, origin)


def save_config(cfg: RunConfig, path: Path) -> Path:
    """Write the resolved config as JSON (atomically)."""
    from infra.storage import atomic_write_text

    return atomic_write_text(path, cfg.model_dump_json(indent=2) + "\n")


def section_dict(cfg: RunConfig, *names: str) -> dict[str, Any]:
    """JSON-able dump of some sections, used in stage keys."""
    return {name: getattr(cfg, name).model_dump(mode="json") for name in names}
