"""Config sections of the model stages: capture, drafter, train, export, evaluate (eagle3.config holds the rest of
the tree and re-exports these; the SGLang server sections are in eagle3.config_sglang)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from eagle3.config_base import Added, Device, Operational, Section, Switch, _relative_inside, switch_on, whole_device
from eagle3.config_measured import MeasuredConfig
from eagle3.config_sglang import SGLangCaptureConfig


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
    tokens_per_forward: Annotated[int, Field(ge=1)] | Literal["auto"] = Operational("auto")
    """Token budget of one target forward (padded tokens, never a sample count), also of online training's target forwards (train.features=online runs this capture forward); auto: from free GPU memory, 4096 on CPU."""
    tokens_per_shard: int = Field(131_072, ge=1)
    """Target tokens per shard file (balanced by tokens; ~4 GB per shard for an 8B target)."""
    max_concurrent_shards: int = Operational(1, ge=1)
    """Shard tasks in flight in one flow run (they share the model or the servers)."""
    num_slices: int = Operational(1, ge=1)
    """Flow runs the capture flow splits the pending shards into, each on its own gpu-pool worker (1: capture in the flow itself)."""
    device: Device = Operational("auto")
    """HF backend device: auto (cuda if available), cpu, cuda, cuda:N."""
    device_map: str | None = Operational(None)
    """HF backend: 'auto' spreads a large model over all visible GPUs (accelerate)."""
    disk_margin_bytes: int = Operational(1 << 30, ge=0)
    """Free space that must remain after the planned bytes are written."""
    allow_shared_gpus: bool = Operational(False)
    """Start even when other processes hold GPU memory (default: stop and name them)."""
    stream_writes: bool = Operational(True)
    """Write each sample's rows as soon as it is captured (false: a whole shard after its last forward)."""
    num_writers: int = Operational(2, ge=1)
    """Writer threads: shards whose files are written (hashed, fsynced) at the same time."""
    write_queue_bytes: int = Operational(4 << 30, ge=1)
    """Captured bytes waiting for a writer before the forwards pause (host-memory bound, backpressure)."""
    early_writeback: bool = Operational(True)
    """Ask the kernel (Linux sync_file_range) to start writing shard pages early, so each fsync has little left."""
    pinned_handoff: bool = Operational(False)
    """HF on CUDA: writers read the pinned copy buffers directly instead of a pageable clone (pins more memory)."""
    per_sample_attention: bool | Literal["auto"] = Operational("auto")
    """HF: true = attention per sample (bitwise batch-invariant, for debugging); false = one padded SDPA per layer; auto = false on GPUs, true on CPU."""
    sglang: SGLangCaptureConfig = Operational(SGLangCaptureConfig())
    """SGLang backend settings of capture's own (how its servers are launched: the run's server section)."""


class DFlashConfig(Section):
    """A block-parallel DFlash drafter (drafter.family=dflash): SGLang's DFlashDraftModel, docs/dflash.md."""

    block_size: int = Field(16, ge=2)
    """Block size K: the last committed token plus K-1 mask tokens drafted in one forward; K tokens verified per round."""
    num_layers: int = Field(1, ge=1)
    """Draft decoder layers (each as wide as the target: its hidden size, heads and MLP width)."""
    target_layer_ids: list[int] | None = None
    """Target layers the drafter reads (output-of-layer ids, ascending); None = the aux layers capture stores."""
    mask_token_id: int | None = Field(None, ge=0)
    """Target vocab id whose frozen embedding fills the mask slots; None = the tokenizer's pad token, else its eos."""
    num_blocks: int = Field(16, ge=1)
    """Training: blocks (anchors) drawn per packed row, uniformly among the positions whose block has a target."""
    init: Literal["random", "target"] = Added("random")
    """Starting weights: random (seeded normal, as EAGLE-3's) or target = the target's own layers after the deepest one the drafter reads, fc picking that layer's states, the target's final norm (docs/dflash.md, "Starting from the target")."""
    labels: Literal["tokens", "target"] = Added("tokens")
    """Training labels: tokens = the row's tokens (the published DFlash recipe, made for answers the target wrote); target = the target's own next-token distribution at each drafted position (soft cross-entropy, as EAGLE-3 trains: what verification accepts). Accuracy counts the target's argmax either way."""
    loss_decay_gamma: float | None = Field(None, gt=0)
    """Training: slot k's loss weight exp(-(k-1)/gamma), favouring the first drafts; None = every slot alike."""

    @model_validator(mode="after")
    def _ascending(self) -> DFlashConfig:
        ids = self.target_layer_ids
        if ids is not None and (not ids or ids != sorted(set(ids)) or ids[0] < 0):
            raise ValueError(
                f"drafter.dflash.target_layer_ids {ids} must be distinct, ascending ids >= 0 (SGLang's "
                "target concatenates the layers it captures in layer order)"
            )
        return self


class DrafterConfig(Section):
    # Added: runs keyed before the DFlash family existed (EAGLE-3, default DFlash section) keep their train keys
    family: Literal["eagle3", "dflash"] = Added("eagle3")
    """Drafter family: eagle3 (one layer, a chain or tree of steps) or dflash (a block of tokens per forward)."""
    dflash: DFlashConfig = Added(DFlashConfig())
    """DFlash settings (family dflash only)."""
    ttt_steps: int = Field(7, ge=1)
    """Training-time-test unroll length."""
    step_decay: float = Field(0.8, gt=0)
    """Loss weight of TTT step k is step_decay**k (EAGLE, SpecForge: 0.8)."""
    attn_impl: Literal["auto", "dense", "flex"] = "auto"
    """Training attention kernel (EAGLE-3's TTT steps, DFlash's blocks): auto = compiled flex_attention on CUDA, dense elsewhere."""
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
    tokens_per_row: int = Field(4096, ge=8)
    """Tokens of one packed training row, a micro-batch (documents packed, then padded); longer samples are cut to it. Online, the target's forwards of a row keep to capture.tokens_per_forward."""
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
    nonfinite_loss_patience: int = Operational(0, ge=0)
    """Optimizer steps in a row whose loss or gradient norm is NaN/inf that are skipped (no update) before training stops with an error; 0 = stop at the first."""
    parallel: Literal["ddp", "fsdp"] = Operational("ddp")
    """Data parallelism under torchrun: DDP (replicated weights) or FSDP2 (fully_shard, sharded state)."""
    target_sharding: Literal["auto", "replicate", "fsdp"] = Operational("auto")
    """Online target per rank: a full copy, or FSDP2-sharded over the ranks; auto = fsdp on >1 GPU when it fills half their free memory."""
    online_forward: Literal["auto", "packed", "padded"] = Operational("auto")
    """Online target per row: packed = one forward, documents kept apart by a mask; padded = documents as padded batches; auto = packed where the target allows it."""
    feature_cache_gib: float = Operational(0.0, ge=0)
    """Online: GiB of the training device that keep the target's states of documents seen; later epochs and validations skip their forward (0 = off)."""
    feature_cache_host_gib: float = Operational(0.0, ge=0)
    """Online: GiB of pinned host memory that keep the states the device's feature cache has no room for (copied in per row; 0 = off)."""
    device: Device = Operational("auto")
    """Where to train: auto = cuda:LOCAL_RANK when CUDA is available, else cpu; cuda = cuda:LOCAL_RANK (not cuda:N)."""
    aux_noise: Literal["none", "uniform", "gaussian"] = "none"
    """Noise added to the aux features of train batches (never to val): U(-s, s) or N(0, s^2)."""
    aux_noise_std: float = Field(0.05, ge=0)
    """The noise scale s: half-width of the uniform noise, std of the gaussian noise."""
    # which steps are validated decides the best checkpoint the stage keeps and names: keyed (Added: keys made
    # before it was keyed, at the default, stay valid)
    eval_every_steps: int = Added(200, ge=0)
    """Validate on the val split every N optimizer steps (0 = only at the end); the best checkpoint is chosen among them."""
    checkpoint_every_steps: int = Operational(500, ge=0)
    """Write a full checkpoint every N optimizer steps (0 = only at the end and on SIGTERM)."""
    keep_checkpoints: int = Operational(2, ge=1)
    """Keep this many newest checkpoints (and the best one by validation); older ones are deleted."""
    # which checkpoint the export ships, not what training learns: the export's key reads it
    select: Literal["best", "last", "measured"] = Operational("best")
    """Checkpoint the export ships: best = highest validation accept_len_est, last = the final one, measured = highest train.measured acceptance."""
    progress_every_s: float = Operational(5.0, ge=0)
    """Rewrite train/progress.json at most this often (seconds)."""
    prefetch_rows: int = Operational(2, ge=0)
    """Rows collated ahead on a background thread (0 = load in the training thread)."""
    nproc_per_node: int | None = Operational(None, ge=1)
    """torchrun processes per node; None = one per visible GPU (1 without GPUs)."""
    nnodes: int = Operational(1, ge=1)
    """Nodes in the torchrun job (each node's worker runs the same task)."""
    node_rank: int = Operational(0, ge=0)
    """This node's rank in a multi-node job."""
    rdzv_endpoint: str | None = Operational(None)
    """host:port of the c10d rendezvous for multi-node jobs."""
    timeout_s: float = Operational(7 * 24 * 3600.0, gt=0)
    """Wall-clock limit of one torchrun launch; the group is killed past it (a retry resumes)."""
    compile: Switch = Operational("auto")
    """torch.compile (Inductor) of the TTT step's pieces and the fused loss on CUDA: auto and on compile there, off = eager; a CPU run stays eager (Inductor's CPU kernels would change the trained bytes, and this is an operational setting)."""
    # 0 (log_softmax) and the fused loss round differently, and compiled kernels per chunk shape may too: keyed
    loss_chunk_tokens: int = Added(4096, ge=0)
    """Fused soft cross-entropy over this many tokens at a time (no fp32 [T, Vd] tensors; DFlash: this many block slots per checkpointed lm_head chunk); 0 = plain log_softmax, all at once."""
    # what each TTT step is scored by (eagle3.drafter.acceptance); keyed once off the default soft cross-entropy
    loss: Literal["kl", "tv", "kl+tv", "lk_alpha", "lk_lambda"] = Added("kl")
    """EAGLE-3 step loss against the target's draft-vocab distribution p (draft q, acceptance a = sum_v min(p, q)): kl = soft cross-entropy (the default); tv = 1 - a; kl+tv = their mix by loss_tv_weight; lk_alpha = -log a; lk_lambda = kl and tv mixed by loss_lk_eta (docs/train.md, "The loss")."""
    loss_tv_weight: float = Added(0.5, ge=0, le=1)
    """train.loss=kl+tv: the loss is (1 - w) x soft cross-entropy + w x (1 - a)."""
    loss_lk_eta: float = Added(3.0, ge=0)
    """train.loss=lk_lambda: soft cross-entropy weighted by exp(-eta x a) per position (a not differentiated), 1 - a by the rest."""
    reuse_block_mask: bool = Operational(False)
    """flex: one block mask per micro-batch for all TTT steps; false = one per step (faster: docs/train.md)."""
    # which steps are measured decides the checkpoint select=measured ships and where patience stops: keyed once set
    measured: MeasuredConfig = Added(MeasuredConfig())
    """Measured acceptance during training: a short real chain decode every N steps (docs/train.md)."""

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> TrainConfig:
        whole_device("train.device", self.device)
        return self

    @model_validator(mode="after")
    def _measured_selectable(self) -> TrainConfig:
        if self.select == "measured" and not self.measured.every_steps:
            raise ValueError(
                "train.select=measured needs train.measured.every_steps > 0 (no measurement, nothing to select by)"
            )
        return self


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


def _check_datasets(datasets: list[str]) -> None:
    """Every entry a named set or a .jsonl path, none twice."""
    from eagle3.evaluate.prompts import DATASET_FILES, is_prompt_file

    bad = [d for d in datasets if d not in DATASET_FILES and not is_prompt_file(d)]
    if bad:
        raise ValueError(
            f"evaluate.datasets {bad}: each entry is one of {sorted(DATASET_FILES)} or a path to a "
            ".jsonl file of chat prompts"
        )
    if len(set(datasets)) != len(datasets):
        raise ValueError(f"evaluate.datasets {datasets} names a dataset twice")


class EvaluateConfig(Section):
    """Offline speculative decoding with the exported drafter: a fixed prompt set, fixed baseline settings."""

    datasets: list[str] = ["mtbench"]
    """Prompt sets: mtbench, humaneval, gsm8k (installed packages) or a path to a .jsonl of chat prompts (docs/evaluate.md)."""
    num_prompts: int | None = Field(10, ge=1)
    """Prompts per dataset: the first N in file order (None = all: 80 / 164 / 1319)."""
    num_prompts_by_dataset: dict[str, int] = {}
    """Prompts of the named datasets (first N in file order), replacing num_prompts for them."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens generated per prompt by every method (fewer when the target emits a stop token)."""
    methods: list[Literal["chain", "tree", "ngram"]] = ["chain", "ngram"]
    """Drafting methods, each checked against one shared plain-greedy reference per prompt (a DFlash drafter: chain/tree = its block)."""
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
    device: Device = "auto"
    """Where target and drafter run: auto = cuda when available, else cpu (not cuda:N)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of target and drafter: auto = bfloat16 on cuda (4x faster there), float32 on cpu."""
    num_workers: int = Field(1, ge=1)
    """Processes evaluating prompt slices in parallel on one device (their wall times then include contention)."""
    static_cache: Switch = "auto"
    """Fixed-size KV caches and fixed-width forwards for target and drafter: auto = on for cuda, off for cpu."""
    compile: Switch = "auto"
    """Static-path kernels: auto = CUDA graphs of the eager forwards on cuda; on = Inductor's (minutes to compile)."""
    decode_rows: int | Literal["auto"] | None = "auto"
    """Static path: rows of every target decode forward (bit-exact chains in bf16); auto = 16 in bf16/fp16 or gathered, else none."""
    decode_keys: Literal["masked", "gathered"] = "masked"
    """Static path: masked cache, or each row's keys gathered in order (trees equal greedy bit for bit); masked without it."""
    fuse_projections: bool = False
    """Static path: each target MLP's gate and up as one product (one kernel fewer per layer; rounding differs only)."""
    speed_baseline: Literal["auto", "one_row", "reference"] = Added("auto")
    """Speedups' baseline: one_row = greedy timed again one row a forward; reference = the reference's own time; auto = one_row when decode_rows > 1."""
    baseline_attention: Literal["sdpa", "packed", "matmul", "flex"] = Operational("matmul")
    """speed_baseline one_row: its attention (sdpa = transformers'; packed = query heads as rows of their key/value head; matmul = those rows' attention as matrix products and a softmax; flex = only the key blocks in use); times the baseline only."""
    near_tie_logit_gap: float = Field(1e-3, ge=0)
    """A differing token within this logit gap of the reference's top-1 is a numerical near-tie, not a bug."""
    temperature: float = Added(0.0, ge=0)
    """0 = greedy (outputs checked token for token); > 0 = speculative sampling, checked in distribution (docs/evaluate.md)."""
    top_p: float = Added(1.0, gt=0, le=1)
    """Sampling: keep the most likely tokens whose mass reaches top_p, in target and drafter alike (1 = all)."""
    top_k: int = Added(0, ge=0)
    """Sampling: keep the top_k most likely tokens, in target and drafter alike (0 = all)."""
    seed: int = Added(0, ge=0)
    """Sampling: seed of the random streams, one per prompt and method (the same whatever the workers)."""
    chain_sampling: Literal["rejection", "target_only"] = Added("rejection")
    """Sampling, EAGLE-3 chains: rejection = drafts drawn from the drafter, the rejection rule (SGLang's --speculative-use-rejection-sampling); target_only = its top token, kept with the target's probability (SGLang's default; trees always)."""

    def widest_verify(self) -> int:
        """Rows of the widest verify forward of the measured methods (the root included)."""
        return max(
            [s + 1 for s in self.chain_steps] * ("chain" in self.methods)
            + [self.tree_num_draft_tokens] * ("tree" in self.methods)
            + [self.ngram_num_tokens + 1] * ("ngram" in self.methods)
        )

    def resolved(self, device: str) -> EvaluateConfig:
        """This section with ``dtype``, ``static_cache``, ``decode_rows`` and ``speed_baseline`` decided for ``device``
        (cpu | cuda): no "auto" left in them (decode_rows is None without the static path, where it has no effect)."""
        cuda = device.startswith("cuda")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if cuda else "float32")
        static = switch_on(self.static_cache, cuda)
        rows = self.decode_rows
        if rows == "auto":  # gathered keys need one width for greedy and verifies, in any dtype
            one_width = dtype != "float32" or self.decode_keys == "gathered"
            rows = min(64, max(16, self.widest_verify())) if one_width else None
        rows = rows if static else None
        baseline = self.speed_baseline
        if baseline == "auto":  # a one-row decode is already what the reference runs without a decode width
            baseline = "one_row" if isinstance(rows, int) and rows > 1 else "reference"
        return self.model_copy(
            update={
                "dtype": dtype,
                "static_cache": "on" if static else "off",
                "decode_rows": rows,
                "decode_keys": self.decode_keys if static else "masked",
                "speed_baseline": baseline,
            }
        )

    def limit_for(self, dataset: str) -> int | None:
        """How many prompts of ``dataset`` are measured (None = all)."""
        return self.num_prompts_by_dataset.get(dataset, self.num_prompts)

    @model_validator(mode="after")
    def _one_gpu_per_worker(self) -> EvaluateConfig:
        whole_device("evaluate.device", self.device)
        return self

    @model_validator(mode="after")
    def _consistent(self) -> EvaluateConfig:
        if not self.datasets or not self.methods:
            raise ValueError("evaluate.datasets and evaluate.methods must not be empty")
        _check_datasets(self.datasets)
        if self.temperature == 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError("evaluate.top_p and evaluate.top_k apply only when sampling: set evaluate.temperature > 0")
        if "chain" in self.methods and (not self.chain_steps or min(self.chain_steps) < 1):
            raise ValueError(f"evaluate.chain_steps {self.chain_steps} must hold steps >= 1 when chain is measured")
        unused = sorted(set(self.num_prompts_by_dataset) - set(self.datasets))
        if unused or any(n < 1 for n in self.num_prompts_by_dataset.values()):
            raise ValueError(
                f"evaluate.num_prompts_by_dataset {self.num_prompts_by_dataset}: counts must be >= 1 "
                f"and name datasets in evaluate.datasets (not {unused})"
            )
        if self.compile == "on" and self.static_cache == "off":
            raise ValueError("evaluate.compile=on needs the static cache (evaluate.static_cache auto or on)")
        rows, widest = self.decode_rows, self.widest_verify()
        if isinstance(rows, int) and not widest <= rows <= 64:
            raise ValueError(
                f"evaluate.decode_rows {rows} must hold the widest verify ({widest} rows) and be at "
                f"most 64: change it, or set it to null for per-size widths"
            )
        if self.decode_keys == "gathered" and (self.static_cache == "off" or self.decode_rows is None):
            raise ValueError("evaluate.decode_keys=gathered needs the static cache and decode_rows (auto or a number)")
        if self.speed_baseline == "one_row" and self.static_cache == "off":
            raise ValueError(
                "evaluate.speed_baseline=one_row needs the static cache: without it every greedy forward is one "
                "row already (set speed_baseline to auto or reference)"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"evaluate.ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        most = 1 + self.tree_topk + (self.tree_steps - 1) * self.tree_topk**2
        if "tree" in self.methods and self.tree_num_draft_tokens > most:
            raise ValueError(
                f"evaluate.tree_num_draft_tokens {self.tree_num_draft_tokens} exceeds the {most} nodes "
                f"a tree of depth {self.tree_steps} and topk {self.tree_topk} proposes (root included)"
            )
        return self
