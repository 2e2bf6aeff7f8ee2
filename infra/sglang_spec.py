"""An SGLang 0.5.23 server as data: ``ServerSpec`` builds the launch argv and says what /server_info must report.

Every argv built here is checked in tests against the own argument parser of each SGLang release of
infra/sglang_modes.py (the releases and modes as tables). infra/sglang_pairs.py builds a benchmark's baseline
and its EAGLE-3, DFlash or n-gram twin: identical flags except the ``--speculative-*`` ones (SGLang's
python/sglang/srt/arg_groups/fields/spec.py defines those).

Mode ``dflash`` serves a DFlash drafter (SGLang's ``DFlashDraftModel``): ``--speculative-algorithm DFLASH``, the
draft folder and ``--speculative-dflash-block-size K`` (0.5.16 and 0.5.23 both have it: an alias of
``--speculative-num-draft-tokens`` for DFLASH). SGLang's ``_handle_dflash`` (arg_groups/speculative_hook.py, the
same rules in both releases) then forces ``speculative_num_steps`` and ``speculative_eagle_topk`` to 1 and sets
``speculative_num_draft_tokens`` to K, so those three are never passed: /server_info reports them resolved. It
also refuses any device but CUDA, pipeline parallelism and (0.5.16) dp attention, which no flag here sets.

Mode ``ngram`` serves SGLang's drafter-free n-gram speculation: ``--speculative-algorithm NGRAM`` and its settings
(``NgramSettings``: the same flags and defaults in 0.5.16's server_args.py and 0.5.23's arg_groups/fields/spec.py),
always explicit. SGLang's ``_handle_ngram`` (arg_groups/speculative_hook.py, the same rules in both releases) sets
``speculative_eagle_topk`` to the max BFS breadth and ``speculative_num_steps`` to draft tokens // that breadth,
so neither is passed; it refuses dp attention, a device other than CUDA or CPU (0.5.23: or XPU) and, with a
breadth above 1, a page size above 1 on any attention backend but flashinfer (the page size is 1 by default on
CUDA); it turns mixed chunked prefill off. It needs no CUDA-graph flag: both releases capture its verify step.

The API key never goes on the command line, where ``ps`` and ``/proc/<pid>/cmdline`` show it to every
local user. SGLang 0.5.23 reads no environment variable for it, but its ``--config FILE.yaml`` flag
(``sglang/srt/server_args.py``: ``prepare_server_args`` merges the YAML keys into argv in-process)
accepts ``api-key: ...``; ``key_file_text`` is that file's content and ``launch_args(key_file)`` points
``--config`` at it. A server bound to a non-loopback host is refused unless ``allow_remote`` says so, and
then it must have an API key.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from infra.sglang_modes import MODES, SPECULATIVE_MODES, Mode

LAUNCH_MODULE = "sglang.launch_server"
# capture_packed: aux + final rows in one prefill from any SGLang >= 0.5.14 through our model package
# (infra/sglang_plugin/capture_models.py says how); capture_aux / capture_final: 0.5.23's own flags, two passes.
PLUGIN_PACKAGE = "infra.sglang_plugin"
PLUGIN_LAYERS_ENV = "EAGLE3_SGLANG_CAPTURE_LAYERS"
# Without explicit ids SGLang captures its default EAGLE-3 layers: three of them.
DEFAULT_NUM_AUX = 3
# Full prefill, one forward, rows == tokens: chunked prefill and the radix cache both truncate the block.
CAPTURE_COMMON_ARGS = ("--chunked-prefill-size", "-1", "--disable-radix-cache", "--skip-tokenizer-init")
# Serving limits a baseline and its speculative twin must share; SGLang's flags and ServerArgs fields by these names.
SERVING_FIELDS = ("max_running_requests", "cuda_graph_max_bs_decode", "attention_backend")
# Flags a caller must not pass in extra_args: the probe depends on the warmup forward.
FORBIDDEN_EXTRA = {
    "--skip-server-warmup": "readiness relies on SGLang's warmup forward; drop it",
    "--api-key": "the key would be readable by every local user in the process list; set api_key "
    "(it travels in a 0600 --config file)",
    "--config": "the launch passes its own --config (the API key file) and SGLang reads only one",
}


class ServerSpecError(ValueError):
    """A ServerSpec that would launch a wrong or ambiguous server."""


@dataclass(frozen=True)
class NgramSettings:
    """SGLang's n-gram speculation (``--speculative-algorithm NGRAM``), SGLang's defaults: a draft tree of
    ``num_draft_tokens`` tokens (all verified every step), min..max branches, built from a trie of token windows up
    to ``max_trie_depth`` long, branches picked by ``match_type`` (BFS or PROB)."""

    num_draft_tokens: int = 12  # --speculative-num-draft-tokens (SGLang sets 12 for NGRAM when it is not given)
    min_bfs_breadth: int = 1  # --speculative-ngram-min-bfs-breadth
    max_bfs_breadth: int = 10  # --speculative-ngram-max-bfs-breadth (SGLang makes it speculative_eagle_topk)
    max_trie_depth: int = 18  # --speculative-ngram-max-trie-depth
    match_type: Literal["BFS", "PROB"] = "BFS"  # --speculative-ngram-match-type

    def args(self) -> list[str]:
        """The flags after ``--speculative-algorithm NGRAM``."""
        return [
            "--speculative-num-draft-tokens",
            str(self.num_draft_tokens),
            "--speculative-ngram-min-bfs-breadth",
            str(self.min_bfs_breadth),
            "--speculative-ngram-max-bfs-breadth",
            str(self.max_bfs_breadth),
            "--speculative-ngram-max-trie-depth",
            str(self.max_trie_depth),
            "--speculative-ngram-match-type",
            self.match_type,
        ]

    def server_info(self) -> dict[str, Any]:
        """What /server_info reports once SGLang's _handle_ngram resolved these flags."""
        return {
            "speculative_num_draft_tokens": self.num_draft_tokens,
            "speculative_ngram_min_bfs_breadth": self.min_bfs_breadth,
            "speculative_ngram_max_bfs_breadth": self.max_bfs_breadth,
            "speculative_ngram_max_trie_depth": self.max_trie_depth,
            "speculative_ngram_match_type": self.match_type,
            "speculative_eagle_topk": self.max_bfs_breadth,
            "speculative_num_steps": self.num_draft_tokens // self.max_bfs_breadth,
        }

    def problems(self) -> list[str]:
        """SGLang's own refusals at start-up (its n-gram corpus, ngram.cpp), and fewer than two tokens per verify."""
        problems = []
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            problems.append(
                f"ngram breadth must be 1 <= min_bfs_breadth ({self.min_bfs_breadth}) <= max_bfs_breadth "
                f"({self.max_bfs_breadth})"
            )
        if self.max_trie_depth < 2:
            problems.append(f"ngram max_trie_depth {self.max_trie_depth} must be >= 2")
        if self.num_draft_tokens < 2:
            problems.append(f"ngram num_draft_tokens {self.num_draft_tokens} must be >= 2 (the anchor and a draft)")
        if self.match_type not in ("BFS", "PROB"):
            problems.append(f"ngram match_type {self.match_type!r} is not BFS or PROB")
        return problems


@dataclass(frozen=True)
class ServerSpec:
    """One SGLang server as data; ``argv()`` is the launch command. Layer ids: output-of-layer convention."""

    model_path: str
    mode: Mode = "serve"
    port: int = 30000
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    api_key: str | None = field(default=None, repr=False)
    allow_remote: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    mem_fraction_static: float | None = None
    dtype: str | None = None
    max_running_requests: int | None = None
    cuda_graph_max_bs_decode: int | None = None
    attention_backend: str | None = None
    draft_model_path: str | None = None
    num_steps: int | None = None
    topk: int | None = None
    num_draft_tokens: int | None = None
    block_size: int | None = None  # dflash: tokens verified per round (SGLang reads the draft's config when None)
    # speculative, topk 1: at temperature > 0 drafts drawn from the drafter and the rejection rule
    # (--speculative-use-rejection-sampling); off, SGLang keeps each top draft with the target's probability
    rejection_sampling: bool = False
    ngram: NgramSettings | None = None  # mode ngram: its settings (None there = SGLang's defaults, written out)
    extra_args: tuple[str, ...] = ()
    python: str = "python"
    module: str = LAUNCH_MODULE

    def __post_init__(self) -> None:
        # Accept lists from configs, store tuples so the spec stays hashable and immutable.
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if self.mode == "ngram" and self.ngram is None:  # explicit, as the EAGLE-3 trio: SGLang picks nothing silently
            object.__setattr__(self, "ngram", NgramSettings())
        problems = _spec_problems(self)
        if problems:
            raise ServerSpecError("invalid SGLang server spec:\n  " + "\n  ".join(problems))

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self, key_file: str | None = None) -> list[str]:
        """The full command: ``<python> -m <module> <launch_args>``."""
        return [self.python, "-m", self.module, *self.launch_args(key_file)]

    def launch_args(self, key_file: str | None = None) -> list[str]:
        """The flags SGLang's parser sees (everything after the module name); ``key_file`` holds ``key_file_text``."""
        if self.api_key and not key_file:
            raise ServerSpecError(
                "the API key goes in a --config file, never on the command line: pass key_file "
                "(ManagedServer writes it)"
            )
        key_args = ["--config", str(key_file)] if self.api_key else []
        return [*self._core_args(), *key_args, *_mode_args(self), *self.extra_args]

    def key_file_text(self) -> str:
        """The YAML SGLang's --config reads the key from (a JSON string is a YAML double-quoted scalar)."""
        if not self.api_key:
            raise ServerSpecError("this spec has no API key")
        return f"api-key: {json.dumps(self.api_key)}\n"

    def _core_args(self) -> list[str]:
        args = [
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
            "--dp-size",
            str(self.dp_size),
        ]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        return args + _serving_args(self)

    @property
    def speculative(self) -> bool:
        """Whether this server speculates (a drafter, or NGRAM's n-grams): its answers then report verify steps."""
        return self.mode in SPECULATIVE_MODES

    def launch_env(self) -> dict[str, str]:
        """Environment the server process needs beyond the caller's: the model package for capture_packed."""
        if self.mode != "capture_packed":
            return {}
        import infra

        root = str(Path(infra.__file__).resolve().parent.parent)
        return {
            "SGLANG_EXTERNAL_MODEL_PACKAGE": PLUGIN_PACKAGE,
            PLUGIN_LAYERS_ENV: ",".join(map(str, self.aux_layer_ids or ())),
            "PYTHONPATH": root,
        }

    @property
    def num_aux(self) -> int:
        """Aux layers a capture_aux or capture_packed server concatenates per row."""
        return len(self.aux_layer_ids) if self.aux_layer_ids else DEFAULT_NUM_AUX

    def row_width(self, hidden_size: int) -> int:
        """Values per hidden-state row: (num_aux + 1) * H (capture_packed: aux, then final), num_aux * H
        (capture_aux) or H (capture_final)."""
        if self.mode == "capture_packed":
            return (self.num_aux + 1) * hidden_size
        if self.mode == "capture_aux":
            return self.num_aux * hidden_size
        if self.mode == "capture_final":
            return hidden_size
        raise ServerSpecError(f"mode {self.mode!r} returns no hidden states")

    def expected_server_info(self) -> dict[str, Any]:
        """Resolved settings /server_info must report (SGLang's resolution applied, e.g. aux resets the algorithm)."""
        want: dict[str, Any] = {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "port": self.port,
        }
        if self.mem_fraction_static is not None:
            want["mem_fraction_static"] = self.mem_fraction_static
        for key in SERVING_FIELDS:
            if getattr(self, key) is not None:
                want[key] = getattr(self, key)
        return want | _mode_expectations(self)


def _serving_args(spec: ServerSpec) -> list[str]:
    args = []
    for key in SERVING_FIELDS:
        value = getattr(spec, key)
        if value is not None:
            args += ["--" + key.replace("_", "-"), str(value)]
    return args


def _mode_args(spec: ServerSpec) -> list[str]:
    if spec.mode == "capture_packed":
        # Prefill-only requests: CUDA graphs (decode) would only cost start-up time.
        return ["--enable-return-hidden-states", *CAPTURE_COMMON_ARGS, "--disable-cuda-graph"]
    if spec.mode == "capture_aux":
        ids = ["--return-aux-hidden-state-layer-ids", *map(str, spec.aux_layer_ids)] if spec.aux_layer_ids else []
        return ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3", *ids, *CAPTURE_COMMON_ARGS]
    if spec.mode == "capture_final":
        return ["--enable-return-hidden-states", *CAPTURE_COMMON_ARGS]
    if spec.mode == "speculative":
        args = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(spec.draft_model_path)]
        if spec.num_steps is not None:
            args += [
                "--speculative-num-steps",
                str(spec.num_steps),
                "--speculative-eagle-topk",
                str(spec.topk),
                "--speculative-num-draft-tokens",
                str(spec.num_draft_tokens),
            ]
        return args + (["--speculative-use-rejection-sampling"] if spec.rejection_sampling else [])
    if spec.mode == "dflash":
        block = ["--speculative-dflash-block-size", str(spec.block_size)] if spec.block_size is not None else []
        return [
            "--speculative-algorithm",
            "DFLASH",
            "--speculative-draft-model-path",
            str(spec.draft_model_path),
            *block,
        ]
    if spec.mode == "ngram":
        assert spec.ngram is not None  # __post_init__ fills it
        return ["--speculative-algorithm", "NGRAM", *spec.ngram.args()]
    return []


def _mode_expectations(spec: ServerSpec) -> dict[str, Any]:
    capture: dict[str, Any] = {"chunked_prefill_size": -1, "disable_radix_cache": True, "skip_tokenizer_init": True}
    if spec.mode == "capture_packed":  # 0.5.16 has no return_hidden_states_mode field; 0.5.23 derives it
        return capture | {"enable_return_hidden_states": True, "disable_cuda_graph": True}
    capture["return_hidden_states_mode"] = "full"  # capture_aux and capture_final are 0.5.23 modes
    if spec.mode == "capture_aux":
        want: dict[str, Any] = capture | {
            "enable_return_aux_hidden_states": True,
            "aux_hidden_state_capture": "eagle3",
            "speculative_algorithm": None,
        }
        if spec.aux_layer_ids:
            want["return_aux_hidden_state_layer_ids"] = list(spec.aux_layer_ids)
        return want
    if spec.mode == "capture_final":
        return capture | {"enable_return_hidden_states": True}
    if spec.mode == "speculative":
        want = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": spec.draft_model_path}
        if spec.num_steps is not None:
            want |= {
                "speculative_num_steps": spec.num_steps,
                "speculative_eagle_topk": spec.topk,
                "speculative_num_draft_tokens": spec.num_draft_tokens,
            }
        return want | ({"speculative_use_rejection_sampling": True} if spec.rejection_sampling else {})
    if spec.mode == "dflash":  # _handle_dflash: one step, top-1, K tokens verified
        want = {
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": spec.draft_model_path,
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 1,
        }
        if spec.block_size is not None:
            want |= {"speculative_dflash_block_size": spec.block_size, "speculative_num_draft_tokens": spec.block_size}
        return want
    if spec.mode == "ngram":  # _handle_ngram: top-k = max breadth, steps = tokens // top-k; no draft model
        assert spec.ngram is not None
        return {"speculative_algorithm": "NGRAM", "speculative_draft_model_path": None} | spec.ngram.server_info()
    return {"speculative_algorithm": None}


def _spec_problems(spec: ServerSpec) -> list[str]:
    problems = _basic_problems(spec) + _aux_problems(spec) + _speculative_problems(spec)
    return problems or _extra_arg_problems(spec)


def _basic_problems(spec: ServerSpec) -> list[str]:
    problems = []
    if spec.mode not in MODES:
        problems.append(f"mode {spec.mode!r} is not one of {', '.join(MODES)}")
    if not spec.model_path:
        problems.append("model_path is empty")
    if not is_loopback(spec.host) and not spec.allow_remote:
        problems.append(
            f"host {spec.host!r} is not a loopback address, so other machines could reach the server: "
            "set allow_remote (the config's allow_remote_host) if that is meant"
        )
    elif not is_loopback(spec.host) and not spec.api_key:
        problems.append(f"a server reachable from other machines (host {spec.host!r}) needs an API key")
    if not 1 <= spec.port <= 65535:
        problems.append(f"port {spec.port} is outside 1..65535")
    if spec.tp_size < 1 or spec.dp_size < 1:
        problems.append(f"tp_size ({spec.tp_size}) and dp_size ({spec.dp_size}) must be >= 1")
    if spec.mem_fraction_static is not None and not 0 < spec.mem_fraction_static < 1:
        problems.append(f"mem_fraction_static {spec.mem_fraction_static} must be in (0, 1)")
    for key in ("max_running_requests", "cuda_graph_max_bs_decode"):
        if getattr(spec, key) is not None and getattr(spec, key) < 1:
            problems.append(f"{key} {getattr(spec, key)} must be >= 1")
    return problems


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1); a hostname may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _aux_problems(spec: ServerSpec) -> list[str]:
    ids = spec.aux_layer_ids
    if ids is None:
        return ["mode capture_packed needs explicit aux_layer_ids"] if spec.mode == "capture_packed" else []
    if spec.mode not in ("capture_aux", "capture_packed"):
        return [
            f"aux_layer_ids only apply to modes capture_aux and capture_packed, not {spec.mode!r} "
            "(a speculative server takes its capture layers from the draft's config.json eagle_config)"
        ]
    if not ids:
        return ["aux_layer_ids is empty: give at least one id, or None for SGLang's default three layers"]
    problems = []
    if any(i < 0 for i in ids):
        problems.append(f"aux_layer_ids {list(ids)} must all be >= 0")
    if len(set(ids)) != len(ids):
        problems.append(f"aux_layer_ids {list(ids)} repeat a layer")
    elif list(ids) != sorted(ids):
        problems.append(f"aux_layer_ids {list(ids)} must be ascending (SGLang concatenates in ascending order)")
    return problems


def _speculative_problems(spec: ServerSpec) -> list[str]:
    trio = {"num_steps": spec.num_steps, "topk": spec.topk, "num_draft_tokens": spec.num_draft_tokens}
    given = [name for name, value in trio.items() if value is not None]
    if spec.rejection_sampling and spec.mode != "speculative":
        return [f"rejection_sampling only applies to mode speculative (EAGLE-3 chains), not {spec.mode!r}"]
    if spec.mode == "dflash":
        return _dflash_problems(spec, given)
    if spec.mode == "ngram":
        return _ngram_problems(spec, given)
    if spec.ngram is not None:
        return [f"ngram settings only apply to mode ngram, not {spec.mode!r}"]
    if spec.block_size is not None:
        return [f"block_size only applies to mode dflash, not {spec.mode!r}"]
    if spec.mode != "speculative":
        extra = given + (["draft_model_path"] if spec.draft_model_path else [])
        return (
            [f"{', '.join(extra)} only apply to mode speculative (draft_model_path also to dflash), not {spec.mode!r}"]
            if extra
            else []
        )
    problems = [] if spec.draft_model_path else ["mode speculative needs draft_model_path"]
    if spec.rejection_sampling and spec.topk != 1:
        problems.append(f"rejection_sampling needs topk 1 (SGLang samples chains only), not {spec.topk}")
    if given and len(given) != 3:
        missing = sorted(set(trio) - set(given))
        problems.append(
            f"num_steps, topk and num_draft_tokens go together (SGLang rejects a partial set): "
            f"missing {', '.join(missing)}"
        )
    elif given:
        problems += _trio_value_problems(spec)
    return problems


def _dflash_problems(spec: ServerSpec, trio_given: list[str]) -> list[str]:
    problems = [] if spec.draft_model_path else ["mode dflash needs draft_model_path"]
    if trio_given:
        problems.append(
            f"{', '.join(trio_given)} do not apply to mode dflash: SGLang runs DFLASH with one step, "
            "top-1 and block_size tokens verified (set block_size)"
        )
    if spec.block_size is not None and spec.block_size < 2:
        problems.append(f"block_size {spec.block_size} must be >= 2 (the anchor and at least one draft)")
    return problems


def _ngram_problems(spec: ServerSpec, trio_given: list[str]) -> list[str]:
    extra = trio_given + [name for name in ("draft_model_path", "block_size") if getattr(spec, name) is not None]
    problems = (
        [
            f"{', '.join(extra)} do not apply to mode ngram: it loads no draft model, and its draft tokens and "
            "breadth are in its ngram settings"
        ]
        if extra
        else []
    )
    assert spec.ngram is not None
    return problems + spec.ngram.problems()


def _trio_value_problems(spec: ServerSpec) -> list[str]:
    assert spec.num_steps is not None and spec.topk is not None and spec.num_draft_tokens is not None
    if min(spec.num_steps, spec.topk, spec.num_draft_tokens) < 1:
        return ["num_steps, topk and num_draft_tokens must be >= 1"]
    if spec.topk == 1 and spec.num_draft_tokens != spec.num_steps + 1:
        return [
            f"with topk 1 SGLang forces num_draft_tokens = num_steps + 1 = {spec.num_steps + 1}, "
            f"not {spec.num_draft_tokens}: set it so, or the server runs something else"
        ]
    return []


def _extra_arg_problems(spec: ServerSpec) -> list[str]:
    """Managed or forbidden flags in extra_args, spelled as SGLang's parser reads them: argparse's allow_abbrev is on
    there, so ``--flag=value`` and a prefix of a long flag (``--api-k``, ``--por``) are the full flag. A prefix of
    several of these flags is refused for each (argparse calls it ambiguous, or reads it as one of them)."""
    managed = {arg for arg in [*spec._core_args(), *_mode_args(spec)] if arg.startswith("--")}
    known = managed | set(FORBIDDEN_EXTRA)
    problems = []
    for arg in spec.extra_args:
        given = arg.split("=", 1)[0]
        exact = given in known or not given.startswith("--") or len(given) <= 2
        for flag in [given] if exact else sorted(k for k in known if k.startswith(given)):
            named = flag if flag == given else f"{given} (argparse reads it as {flag})"
            if flag in managed:
                problems.append(
                    f"extra_args repeats {named}, which the spec sets itself (argparse would silently "
                    "keep the last one): set the field instead"
                )
            elif flag in FORBIDDEN_EXTRA:
                problems.append(f"extra_args has {named}: {FORBIDDEN_EXTRA[flag]}")
    return problems
