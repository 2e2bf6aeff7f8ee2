"""Why a ServerSpec (infra/sglang_spec.py) would launch a wrong or ambiguous SGLang server: one list of problems,
raised together by the spec's constructor. The rules follow SGLang's own argument handling (its
arg_groups/speculative_hook.py for the speculative modes, argparse's prefix matching for extra_args)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from infra.sglang_modes import MODES

if TYPE_CHECKING:
    from infra.sglang_spec import ServerSpec

# Flags a caller must not pass in extra_args: the probe depends on the warmup forward.
FORBIDDEN_EXTRA = {
    "--skip-server-warmup": "readiness relies on SGLang's warmup forward; drop it",
    "--api-key": "the key would be readable by every local user in the process list; set api_key "
    "(it travels in a 0600 --config file)",
    "--config": "the launch passes its own --config (the API key file) and SGLang reads only one",
}


def spec_problems(spec: ServerSpec, managed: set[str]) -> list[str]:
    """Every reason ``spec`` would launch a wrong or ambiguous server; ``managed``: the flags its argv sets itself."""
    problems = _basic_problems(spec) + _aux_problems(spec) + _speculative_problems(spec)
    return problems or _extra_arg_problems(spec, managed)


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


def _extra_arg_problems(spec: ServerSpec, managed: set[str]) -> list[str]:
    """Managed or forbidden flags in extra_args, spelled as SGLang's parser reads them: argparse's allow_abbrev is on
    there, so ``--flag=value`` and a prefix of a long flag (``--api-k``, ``--por``) are the full flag. A prefix of
    several of these flags is refused for each (argparse calls it ambiguous, or reads it as one of them)."""
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
