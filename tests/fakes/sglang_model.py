"""The FAKE SGLang server's pretend target and settings (a TEST DOUBLE, not SGLang): what it computes and what
it is launched with.

``fake_hidden_rows`` / ``fake_topk`` / ``fake_next_token`` are the made-up target (deterministic functions of
token id, position and layer), ``FakeModel`` its shape, ``LaunchArgs`` the subset of SGLang's launch flags the fake
understands (with SGLang's resolution of them), ``Faults`` what it gets wrong on purpose, ``FakeServing`` how it
pretends to decode; ``build_parser`` and ``merge_config`` turn a command line (and SGLang's ``--config FILE.yaml``)
into them. The server itself is tests/fakes/sglang_server.py.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

FAKE_VERSION = "0.5.23"


def fake_hidden_rows(input_ids: list[int], layer_ids: list[int], hidden_size: int) -> np.ndarray:
    """[T, len(layer_ids) * H] float32: layer blocks side by side in the order given."""
    tokens = np.asarray(input_ids, dtype=np.float64)[:, None]
    positions = np.arange(len(input_ids), dtype=np.float64)[:, None]
    cols = np.arange(hidden_size, dtype=np.float64)[None, :]
    blocks = [np.sin(0.37 * (tokens + 1) + 0.11 * positions + 1.3 * (layer + 1) + 0.05 * cols) for layer in layer_ids]
    return np.concatenate(blocks, axis=1).astype(np.float32)


def fake_topk(token_id: int, position: int, k: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """The fake target's top-K next-token (ids, logprobs) after ``token_id`` at ``position``, best first."""
    base = (token_id * 7 + position * 3) % vocab_size
    ids = [(base + 13 * j) % vocab_size for j in range(k)]
    return ids, [-0.25 * (j + 1) - 0.01 * (position % 5) for j in range(k)]


def fake_next_token(token_id: int, position: int, vocab_size: int) -> int:
    """Greedy next token of the fake target (its top-1)."""
    return fake_topk(token_id, position, 1, vocab_size)[0][0]


@dataclass
class FakeModel:
    """Shape of the pretend target; read from <model_path>/config.json when there is one."""

    hidden_size: int = 16
    num_layers: int = 8
    vocab_size: int = 256
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    model_type: str = "llama"

    @classmethod
    def from_path(cls, model_path: str) -> FakeModel:
        config = Path(model_path) / "config.json"
        if not config.is_file():
            return cls()
        data = json.loads(config.read_text())
        return cls(
            data.get("hidden_size", 16),
            data.get("num_hidden_layers", 8),
            data.get("vocab_size", 256),
            tuple(data.get("architectures") or ("LlamaForCausalLM",)),
            data.get("model_type", "llama"),
        )

    def default_aux_layers(self) -> list[int]:
        """SGLang's default EAGLE-3 capture, in the output-of-layer convention: [1, L//2 - 1, L - 4]."""
        return [1, self.num_layers // 2 - 1, self.num_layers - 4]


@dataclass
class Faults:
    """What the fake gets wrong on purpose (all off by default)."""

    short_rows: int = 0
    id_fault: str | None = None
    cached_tokens: int = 0
    nan: bool = False
    stall_s: float = 0.0
    die_after: int | None = None
    times: int | None = None
    spec_verify_ct_zero: bool = False
    short_completion: int = 0
    flush_fails: bool = False


@dataclass
class FakeServing:
    """How the fake pretends to decode (made up: see the module doc)."""

    accept_length: float = 2.5
    step_s: float = 0.0
    spec_step_cost: float = 1.5  # with accept 2.5: speedup ~1.5, well inside (1, accept)
    hold_until_in_flight: int = 0  # hold each /generate until this many were in flight at once (10 s at most)


@dataclass
class LaunchArgs:
    """The subset of SGLang's launch flags the fake understands (anything else is an error)."""

    model_path: str = "fake-model"
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    dtype: str = "auto"
    max_running_requests: int | None = None
    cuda_graph_max_bs_decode: int | None = None
    attention_backend: str | None = None
    enable_return_hidden_states: bool = False
    enable_return_aux_hidden_states: bool = False
    return_aux_hidden_state_layer_ids: list[int] | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_dflash_block_size: int | None = None
    speculative_use_rejection_sampling: bool = False
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_max_trie_depth: int = 18
    chunked_prefill_size: int | None = None
    disable_radix_cache: bool = False
    skip_tokenizer_init: bool = False
    disable_cuda_graph: bool = False

    def resolved(self, model: FakeModel) -> dict[str, Any]:
        """What SGLang's resolution would report in /server_info (as far as the fake models it)."""
        out = asdict(self) | {"return_hidden_states_mode": None, "aux_hidden_state_capture": None}
        if self.enable_return_aux_hidden_states:
            method = (self.speculative_algorithm or "").upper()
            if method not in ("EAGLE3", "DFLASH", "DSPARK"):
                raise ValueError(
                    "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3, DFLASH "
                    f"or DSPARK to name the capture convention, got {self.speculative_algorithm!r}."
                )
            out |= {"speculative_algorithm": None, "aux_hidden_state_capture": method.lower()}
        if self.enable_return_hidden_states or self.enable_return_aux_hidden_states:
            out["return_hidden_states_mode"] = "full"
        if out["speculative_algorithm"] == "EAGLE3":
            out |= _speculative_defaults(self, model)
            if self.speculative_use_rejection_sampling and out["speculative_eagle_topk"] != 1:
                raise ValueError("Chain speculative sampling supports only topk=1")  # eagle_worker_v2's assert
        if out["speculative_algorithm"] == "DFLASH":
            out |= _dflash_resolution(self)
        if out["speculative_algorithm"] == "NGRAM":
            out |= _ngram_resolution(self)
        if out["speculative_algorithm"] in SPECULATIVE_ALGORITHMS and self.max_running_requests is None:
            out["max_running_requests"] = 48  # SGLang's reset for speculative decoding
        return out


SPECULATIVE_ALGORITHMS = ("EAGLE3", "DFLASH", "NGRAM")
"""The algorithms the fake pretends to run (all verify drafts the same made-up way)."""
DFLASH_DEFAULT_BLOCK = 16
NGRAM_DEFAULT_TOKENS = 12


def _ngram_resolution(args: LaunchArgs) -> dict[str, Any]:
    """SGLang's _handle_ngram (arg_groups/speculative_hook.py, 0.5.16 and 0.5.23): top-k becomes the max BFS breadth,
    12 draft tokens unless given, steps = draft tokens // top-k unless given; its n-gram corpus (C++, ngram.cpp)
    refuses a trie depth below 2 and a min breadth below 1 or above the max at start-up."""
    low, high = args.speculative_ngram_min_bfs_breadth, args.speculative_ngram_max_bfs_breadth
    if args.speculative_ngram_max_trie_depth <= 1 or not 0 < low <= high:
        raise ValueError(
            f"ngram corpus: max_trie_depth {args.speculative_ngram_max_trie_depth} must be > 1 and "
            f"0 < min_bfs_breadth {low} <= max_bfs_breadth {high}"
        )
    tokens = args.speculative_num_draft_tokens or NGRAM_DEFAULT_TOKENS
    steps = args.speculative_num_steps if args.speculative_num_steps is not None else tokens // high
    return {"speculative_num_steps": steps, "speculative_eagle_topk": high, "speculative_num_draft_tokens": tokens}


def _dflash_resolution(args: LaunchArgs) -> dict[str, Any]:
    """SGLang's _handle_dflash (arg_groups/speculative_hook.py, 0.5.16 and 0.5.23): a draft folder is required; one
    step, top-1; the block size flag sets the verified tokens (equal to --speculative-num-draft-tokens when both are
    given), else the draft's config.json (dflash_config.block_size, then block_size), else 16."""
    if args.speculative_draft_model_path is None:
        raise ValueError("DFLASH speculative decoding requires setting --speculative-draft-model-path.")
    block, tokens = args.speculative_dflash_block_size, args.speculative_num_draft_tokens
    if block is not None:
        if block <= 0:
            raise ValueError(f"DFLASH requires --speculative-dflash-block-size to be positive, got {block}.")
        if tokens is not None and tokens != block:
            raise ValueError(
                "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set "
                "but they differ. For DFLASH they must match."
            )
        tokens = block
    if tokens is None:
        tokens = _draft_block_size(args.speculative_draft_model_path) or DFLASH_DEFAULT_BLOCK
    return {"speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": tokens}


def _draft_block_size(draft: str) -> int | None:
    config = Path(draft) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return (data.get("dflash_config") or {}).get("block_size") or data.get("block_size")


def _speculative_defaults(args: LaunchArgs, model: FakeModel) -> dict[str, Any]:
    trio = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if all(v is None for v in trio):
        trio = (5, 4, 8) if "LlamaForCausalLM" in model.architectures else (3, 1, 4)
    steps, topk, draft = trio
    if topk == 1:
        draft = steps + 1
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft}


def build_parser() -> argparse.ArgumentParser:
    """The fake's command line: SGLang's flag spellings for what it models, plus --fake-* knobs."""
    parser = argparse.ArgumentParser(prog="fake sglang.launch_server", allow_abbrev=False)
    for spec in fields(LaunchArgs):
        flag = "--" + spec.name.replace("_", "-")
        kind = str(spec.type).split(" ")[0]  # annotations are strings here: "int", "float | None", ...
        if kind == "bool":
            parser.add_argument(flag, action="store_true")
        elif kind == "list[int]":
            parser.add_argument(flag, type=int, nargs="+")
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str), default=spec.default)
    for spec in fields(Faults):
        flag = "--fake-" + spec.name.replace("_", "-")
        if spec.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=_parse_value)
    for spec in fields(FakeServing):
        parser.add_argument("--fake-" + spec.name.replace("_", "-"), type=float, default=spec.default)
    parser.add_argument("--fake-startup-s", type=float, default=0.0, help="sleep before binding (weights 'loading')")
    parser.add_argument("--fake-warmup-s", type=float, default=0.0, help="/health_generate answers 503 this long")
    parser.add_argument("--fake-lifetime-s", type=float, default=300.0, help="exit after this long, whatever happens")
    return parser


def _parse_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def merge_config(argv: list[str]) -> list[str]:
    """SGLang's --config FILE.yaml: each key becomes ``--key value`` (``--key`` for true), before the other args."""
    if "--config" not in argv:
        return argv
    import yaml

    at = argv.index("--config")
    path = argv[at + 1]
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"Config file must be YAML format, got: {path}")
    config_args: list[str] = []
    for key, value in (yaml.safe_load(Path(path).read_text()) or {}).items():
        if value is True:
            config_args.append(f"--{key}")
        elif value not in (False, None):
            config_args += [f"--{key}", str(value)]
    return config_args + argv[:at] + argv[at + 2 :]
