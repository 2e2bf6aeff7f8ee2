"""Config sections of the SGLang servers the pipeline launches: ``server`` (how every server is launched on this
host, set once), ``capture.sglang`` (capture's servers) and ``serve`` (deploy's baseline and speculative servers).

A setting both roles need the same way (the interpreter, the launch module, the attention backend, extra flags, the
start-up timeout, the API key, the bind address, the tensor-parallel size) is in ``server``; a role keeps what is
its own: ports, memory share (capture splits it between its servers, serving reserves KV cache), serving limits,
the speculative settings and the benchmark. eagle3.config holds the rest of the tree and re-exports these.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3.config_base import Added, Section


class SGLangServerConfig(Section):
    """How this host launches an SGLang server: the settings capture's and deploy's servers share."""

    python: str = "python"
    """Interpreter that has sglang installed (runs `-m {launch_module}`)."""
    launch_module: str = "sglang.launch_server"
    """Module that starts a server; tests substitute tests.fakes.sglang_server (a fake)."""
    host: str = "127.0.0.1"
    """Interface the servers bind to (the pipeline's clients connect there)."""
    allow_remote_host: bool = False
    """Let the servers bind a non-loopback host (reachable from other machines; they always get an API key)."""
    api_key_env: str | None = "EAGLE3_SGLANG_API_KEY"
    """Env var holding the servers' API key; generated per launch when unset."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of every server (the GPUs one copy of the target needs)."""
    attention_backend: str | None = None
    """--attention-backend of every server (None = SGLang's choice)."""
    extra_args: list[str] = []
    """Extra launch flags for every server, appended verbatim (checked against SGLang's parser in tests)."""
    startup_timeout_s: float = Field(1800.0, gt=0)
    """How long a server may take to pass the readiness probe."""


class SGLangCaptureConfig(Section):
    """The SGLang capture backend: managed server(s) launched as ``server`` says, or existing endpoints."""

    server_mode: Literal["capture_packed", "capture_aux"] = "capture_packed"
    """capture_packed: aux and final states from one prefill via this project's SGLang model package (SGLang >= 0.5.14); capture_aux: 0.5.23's aux flags (+ capture_final servers for final_hidden)."""
    endpoints: list[str] = []
    """Existing capture servers (http://host:port) of server_mode; empty = launch managed servers."""
    final_endpoints: list[str] = []
    """Existing final-hidden servers (--enable-return-hidden-states) for final_hidden supervision."""
    port: int = Field(30100, ge=1, le=65535)
    """Port of a managed server (a second one, capture_final, gets port + 1)."""
    dp_size: int = Field(1, ge=1)
    """Data-parallel replicas inside a managed server."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """--mem-fraction-static for a managed server (None = SGLang's choice; 0.4 each when capture_aux and capture_final share the GPUs)."""
    max_concurrency: int = Field(4, ge=1)
    """Requests in flight per endpoint (each carries T x 3H floats as JSON)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one capture request."""
    max_restarts: int = Field(3, ge=0)
    """Restarts of a managed server that died, with backoff, before the capture fails."""


def parse_trio(text: str) -> tuple[int, int, int]:
    """'steps-topk-draft_tokens' -> (steps, topk, draft_tokens); ValueError naming the rule it breaks."""
    parts = text.split("-")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(
            f"serve.extra_speculative entry {text!r} is not 'steps-topk-draft_tokens' (three integers >= 1)"
        )
    steps, topk, tokens = map(int, parts)
    if topk == 1 and tokens != steps + 1:
        raise ValueError(
            f"serve.extra_speculative entry {text!r}: with topk 1 draft_tokens must be steps + 1 = "
            f"{steps + 1} (SGLang forces it)"
        )
    if tokens < 2:
        raise ValueError(f"serve.extra_speculative entry {text!r}: draft_tokens must be >= 2")
    return steps, topk, tokens


class ServeConfig(Section):
    """Deploy + benchmark: a baseline and an EAGLE-3 SGLang server (and optionally SGLang's n-gram one), identical but
    for the --speculative-* flags."""

    enabled: bool = False
    """Start SGLang servers and benchmark them (only where a GPU host with sglang is configured)."""
    model_path: str | None = None
    """Target the servers load (HF directory or hub id); default the target's prepared HF directory."""
    port: int = Field(30000, ge=1, le=65534)
    """Port of the baseline server; the speculative server gets port + 1."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """--dtype of both servers."""
    mem_fraction_static: float | None = Field(0.8, gt=0, lt=1)
    """--mem-fraction-static of both servers (None = SGLang's choice, which may differ between them)."""
    max_running_requests: int = Field(32, ge=1)
    """--max-running-requests of both servers (explicit: SGLang resets a speculative server's to 48)."""
    cuda_graph_max_bs_decode: int | None = Field(32, ge=1)
    """--cuda-graph-max-bs-decode of both servers (0.5.23's name for the old --cuda-graph-max-bs)."""
    num_steps: int = Field(3, ge=1)
    """--speculative-num-steps: draft steps per verify step."""
    eagle_topk: int = Field(1, ge=1)
    """--speculative-eagle-topk: branches per draft step (1 = a chain)."""
    num_draft_tokens: int = Field(4, ge=2)
    """--speculative-num-draft-tokens: tokens verified per step (must be num_steps + 1 when eagle_topk is 1)."""
    extra_speculative: list[str] = []
    """More EAGLE-3 settings benchmarked against the same baseline, each 'steps-topk-draft_tokens' (e.g. '7-1-8', '5-4-8')."""
    # Added: deploy keys of runs benchmarked before the n-gram server existed stay valid while it is off.
    ngram: bool = Added(False)
    """Also benchmark SGLang's drafter-free n-gram speculation (--speculative-algorithm NGRAM) against the same baseline, as one more server labelled n-gram (not checked against eagle3 eval: another algorithm)."""
    ngram_num_draft_tokens: int = Added(12, ge=2)
    """--speculative-num-draft-tokens of the n-gram server: tokens of the draft tree verified every step (SGLang's NGRAM default, 12)."""
    ngram_max_bfs_breadth: int = Added(10, ge=1)
    """--speculative-ngram-max-bfs-breadth: most branches of the n-gram draft tree (SGLang's default 10; SGLang also makes it speculative_eagle_topk)."""
    ngram_min_bfs_breadth: int = Added(1, ge=1)
    """--speculative-ngram-min-bfs-breadth: fewest branches of the n-gram draft tree (SGLang's default 1)."""
    ngram_max_trie_depth: int = Added(18, ge=2)
    """--speculative-ngram-max-trie-depth: longest token window SGLang's n-gram trie stores and matches (its default 18)."""
    ngram_match_type: Literal["BFS", "PROB"] = Added("BFS")
    """--speculative-ngram-match-type: how SGLang picks draft branches from its trie, BFS (its default) or PROB."""
    prompts: Literal["fixed", "evaluation"] = "fixed"
    """fixed: English prompts as text, exactly max_new_tokens each; evaluation: the evaluate stage's prompts as ids, stopping at end of turn, per dataset and checked against eagle3 eval."""
    accept_tolerance: float = Field(0.03, gt=0, lt=1)
    """Largest relative gap of SGLang's accept length from eagle3 eval's (same method, per dataset and overall); beyond it the stage fails after its report."""
    concurrency_levels: list[int] = [1, 4, 16]
    """Requests in flight per measured level (1 = latency, more = throughput)."""
    num_prompts: int = Field(32, ge=1)
    """Measured requests per level: fixed prompts, the same for every server (prompts: evaluation uses all of them)."""
    max_new_tokens: int = Field(256, ge=2)
    """Tokens generated per request (ignore_eos, so every request produces exactly this many)."""
    num_warmup: int = Field(4, ge=0)
    """Unmeasured warmup requests before each level (/flush_cache follows them)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one benchmark request."""
    allow_shared_gpus: bool = False
    """Start even when other processes hold GPU memory (the benchmark would measure them too)."""

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"serve.num_draft_tokens must be num_steps + 1 = {self.num_steps + 1} with eagle_topk 1 "
                f"(SGLang forces it), not {self.num_draft_tokens}"
            )
        for trio in self.extra_speculative:
            parse_trio(trio)
        if self.ngram_min_bfs_breadth > self.ngram_max_bfs_breadth:
            raise ValueError(
                f"serve.ngram_min_bfs_breadth {self.ngram_min_bfs_breadth} exceeds ngram_max_bfs_breadth "
                f"{self.ngram_max_bfs_breadth} (SGLang's n-gram corpus refuses it at start-up)"
            )
        levels = self.concurrency_levels
        if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
            raise ValueError(f"serve.concurrency_levels {levels} must be distinct values >= 1")
        if max(levels) > min(self.max_running_requests, self.num_prompts):
            raise ValueError(
                f"serve.concurrency_levels {levels}: the highest level exceeds max_running_requests "
                f"({self.max_running_requests}) or num_prompts ({self.num_prompts}), so it would "
                "measure queueing instead of that concurrency"
            )
        return self
