"""Regeneration through a managed SGLang server vs in-process HF generation: speed and answer identity.

Regenerates the first ``--rows`` rows of RUN/data/merged.parquet twice with the project's regenerate code
(``eagle3.data.regenerate.regenerate``), greedy (temperature 0), one user turn per row (max_user_turns 1), the
same max_new_tokens, each into its own folder (cleared first) under RUN/bench-regen/:
  openai/  backend openai against an SGLang server this script starts (``infra.sglang.ManagedServer``,
           ``ServerSpec(target dir, "serve")``, an API key generated per launch and handed to
           OpenAIChatBackend; endpoint = base_url + "/v1", model name = the served model path,
           ``--concurrency`` conversations in flight); ``--endpoint URL/v1`` uses an existing endpoint instead;
  hf/      backend hf, generation_backend static, on ``--device`` (default cfg's regenerate.device).
Reports per backend: wall time of ``regenerate`` (server start excluded and reported on its own), new tokens
(the answers re-tokenized with the target's tokenizer, the same count for both), tokens/s, successes and
errors by kind; between them: the share of rows whose answers are identical text, and the share identical
in the first 32 tokens. JSON (atomic) + a printed table; exit 1 when either backend recorded errors.

GPU host (sglang 0.5.16 behind the wrapper server.python names; RUN's config with regenerate.device cuda):
    python lab/sglang_regenerate.py --config RUN/config.json --rows 200 --device cuda \\
        --out RUN/bench-regen.json --server-args="--attention-backend triton --sampling-backend pytorch"

CPU dry runs (tiny preset; tests/fakes/ are TEST DOUBLES, not SGLang):
  1. the managed server path with the fake SGLang server, which has no /v1/chat/completions: the server
     starts and passes its probe, every openai row fails with http_404, reported as errors (exit 1):
    python lab/sglang_regenerate.py --config /tmp/sglab/tiny/config.json --rows 20 \\
        --module tests.fakes.sglang_server --python .venv/bin/python --max-new-tokens 16
  2. the openai path end to end against the fake OpenAI endpoint (tests/fakes/openai_server.py) with --endpoint.

Verified where: only on this CPU machine against the fakes and the tiny preset. Not verified: a real SGLang's
/v1/chat/completions (its chat template, stop tokens and special-token handling against HF's), and speed.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RegenerateConfig, RunConfig, read_config_file, validate_config  # noqa: E402
from lab.sglang_lab import (  # noqa: E402
    add_server_args,
    device_name,
    new_flags,
    run_and_record,
    say,
)

OUT_MARKER = ".sglang-bench-regen"
FIRST_TOKENS = 32


# ---------------------------------------------------------------- pure comparison


def identity_shares(
    a: dict[str, list[str]],
    b: dict[str, list[str]],
    tokenize: Callable[[str], list[int]],
    first_tokens: int = FIRST_TOKENS,
) -> dict[str, Any]:
    """Over the rows both sides answered: the share with identical answers, and identical in the first N tokens.

    ``a`` and ``b`` map row id -> that row's assistant answers in order; a row counts as identical only when
    every answer is (the same number of answers, each equal).
    """
    common = [i for i in a if i in b]
    same_text = sum(a[i] == b[i] for i in common)
    same_head = sum(_same_heads(a[i], b[i], tokenize, first_tokens) for i in common)
    num = len(common)
    return {
        "rows_compared": num,
        "only_a": len(a) - num,
        "only_b": sum(i not in a for i in b),
        "identical_text": same_text,
        "identical_text_share": same_text / num if num else None,
        f"identical_first_{first_tokens}_tokens": same_head,
        f"identical_first_{first_tokens}_tokens_share": same_head / num if num else None,
    }


def _same_heads(x: list[str], y: list[str], tokenize: Callable[[str], list[int]], n: int) -> bool:
    return len(x) == len(y) and all(tokenize(p)[:n] == tokenize(q)[:n] for p, q in zip(x, y))


def answers(rows: list[dict[str, Any]], ids: set[str]) -> dict[str, list[str]]:
    """Row id -> assistant contents, for the rows in ``ids`` (the regenerated ones, not those copied past the limit)."""
    return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows if r["id"] in ids}


# ---------------------------------------------------------------- one regeneration


@dataclass
class RegenResult:
    """One backend's regeneration of the rows."""

    name: str
    out_dir: Path
    elapsed_s: float
    stats: dict[str, Any]
    answers: dict[str, list[str]]
    new_tokens: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    start_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "elapsed_s": round(self.elapsed_s, 3),
            "new_tokens": self.new_tokens,
            "tokens_per_s": round(self.new_tokens / max(self.elapsed_s, 1e-9), 1),
            "start_s": self.start_s,
            "success": self.stats.get("success"),
            "error": self.stats.get("error"),
            "errors_by_kind": self.errors_by_kind,
            "finish_reasons": self.stats.get("finish_reasons"),
            "num_requests": self.stats.get("num_requests"),
            "num_retries": self.stats.get("num_retries"),
        } | self.extra


def fresh_dir(path: Path) -> Path:
    """An empty output folder (a journal left there would make regenerate skip every row)."""
    if path.exists():
        if not (path / OUT_MARKER).is_file():
            raise RuntimeError(f"{path} exists and was not made by this benchmark (no {OUT_MARKER}): move it away")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / OUT_MARKER).write_text("made by lab/sglang_regenerate.py; safe to delete\n")
    return path


def regen_config(cfg: RunConfig, args: argparse.Namespace, **update: Any) -> RegenerateConfig:
    """cfg's regenerate section for the benchmark: N rows, 1 user turn, greedy, no loop cutting, no key env."""
    base = dict(
        enabled=True,
        max_conversations=args.rows,
        max_user_turns=1,
        temperature=0.0,
        max_new_tokens=args.max_new_tokens or cfg.regenerate.max_new_tokens,
        api_key_env=None,
        cut_loops=False,
        loop_stop_tokens=0,
        straggler_rows=0,
    )
    return RegenerateConfig.model_validate(cfg.regenerate.model_dump() | base | update)


def run_regenerate(
    name: str, merged: Path, out_dir: Path, rcfg: RegenerateConfig, backend: Any, ids: set[str]
) -> RegenResult:
    """regenerate() into a fresh folder, timed; answers and error kinds read back from its outputs."""
    import pyarrow.parquet as pq

    from eagle3.data.regenerate import ERRORS_NAME, regenerate

    fresh_dir(out_dir)
    say(f"{name}: regenerating {len(ids)} rows into {out_dir}")
    t0 = time.perf_counter()
    paths, stats = regenerate(merged, out_dir, rcfg, backend)
    elapsed = time.perf_counter() - t0
    rows = pq.read_table(out_dir / Path(paths["regenerated"]).name).to_pylist() if "regenerated" in paths else []
    kinds: dict[str, int] = {}
    errors = out_dir / ERRORS_NAME
    for line in errors.read_text().splitlines() if errors.is_file() else []:
        kind = str(json.loads(line).get("error_type"))
        kinds[kind] = kinds.get(kind, 0) + 1
    say(f"{name}: {stats['success']} answered, {stats['error']} errors in {elapsed:.1f} s")
    return RegenResult(name, out_dir, elapsed, stats, answers(rows, ids), errors_by_kind=kinds)


def first_ids(merged: Path, num: int) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(merged, columns=["id"])["id"].to_pylist()[:num]


# ---------------------------------------------------------------- the two backends


def openai_run(
    cfg: RunConfig, args: argparse.Namespace, model_dir: Path, merged: Path, bench: Path, ids: set[str]
) -> RegenResult:
    """Backend openai: against --endpoint, or a managed SGLang server started (and timed) here."""
    from eagle3.data.chat_backends import OpenAIChatBackend

    if args.endpoint:
        rcfg = regen_config(cfg, args, backend="openai", endpoint=args.endpoint, max_concurrency=args.concurrency)
        return run_regenerate("openai", merged, bench / "openai", rcfg, OpenAIChatBackend(rcfg, api_key=None), ids)
    server, start_s = start_server(cfg, args, model_dir, bench)
    try:
        rcfg = regen_config(
            cfg,
            args,
            backend="openai",
            endpoint=server.base_url + "/v1",
            model=str(model_dir),
            max_concurrency=args.concurrency,
        )
        result = run_regenerate(
            "openai", merged, bench / "openai", rcfg, OpenAIChatBackend(rcfg, api_key=server.api_key), ids
        )
    finally:
        server.stop()
    result.start_s = round(start_s, 3)
    result.extra = {
        "sglang_version": server.report.version if server.report else None,
        "server_log": str(server.log_path),
        "argv": server.process.printable_argv,
        "num_restarts": server.num_restarts,
    }
    return result


def start_server(cfg: RunConfig, args: argparse.Namespace, model_dir: Path, bench: Path) -> tuple[Any, float]:
    """A serve-mode ManagedServer on the target (cfg's serve.port, target dtype), ready; its start time."""
    from eagle3.target.load import target_info
    from infra.gpus import check_gpus_free
    from infra.sglang import ManagedServer, ServerSpec
    from infra.sglang_probe import ProbeExpectations

    check_gpus_free([0], allow_shared=cfg.capture.allow_shared_gpus)
    dtype = cfg.target.dtype if cfg.target.dtype in ("bfloat16", "float16", "float32") else None
    spec = ServerSpec(
        str(model_dir),
        "serve",
        port=cfg.serve.port,
        host="127.0.0.1",
        api_key=secrets.token_hex(16),
        dtype=dtype,
        mem_fraction_static=args.mem_fraction_static or cfg.serve.mem_fraction_static,
        attention_backend=cfg.server.attention_backend,
        extra_args=(*cfg.server.extra_args, *new_flags(cfg, args.server_args)),
        python=args.python,
        module=args.module,
    )
    expect = ProbeExpectations(vocab_size=target_info(model_dir, cfg.target).vocab_size)
    server = ManagedServer(
        spec, bench / "logs" / "sglang-serve.log", expect=expect, cwd=REPO, startup_timeout_s=args.startup_timeout_s
    )
    say(f"openai: starting SGLang ({args.python} -m {args.module}, port {spec.port})")
    t0 = time.perf_counter()
    try:
        server.start()
    except Exception as exc:
        raise RuntimeError(
            f"SGLang serve server did not start (log {server.log_path}): {type(exc).__name__}: {exc}"
        ) from exc
    start_s = time.perf_counter() - t0
    say(f"openai: server ready after {start_s:.1f} s ({server.report.smoke}, version {server.report.version})")
    return server, start_s


def hf_run(
    cfg: RunConfig, args: argparse.Namespace, model_dir: Path, merged: Path, bench: Path, ids: set[str]
) -> RegenResult:
    """Backend hf, generation_backend static, on args.device (model load timed on its own)."""
    from eagle3.data.chat_backends import make_backend
    from eagle3.target.load import load_model, load_tokenizer

    rcfg = regen_config(
        cfg,
        args,
        backend="hf",
        generation_backend="static",
        device=args.device,
        batch_size_conversations=args.hf_batch_size or cfg.regenerate.batch_size_conversations,
    )
    say(f"hf: loading the target on {args.device} ({cfg.target.dtype})")
    t0 = time.perf_counter()
    model, tok = load_model(model_dir, cfg.target.dtype, args.device), load_tokenizer(model_dir)
    load_s = time.perf_counter() - t0
    result = run_regenerate("hf", merged, bench / "hf", rcfg, make_backend(rcfg, model, tok), ids)
    result.start_s = round(load_s, 3)
    result.extra = {
        "device": device_name(args.device),
        "generation_backend": "static",
        "batch_size_conversations": rcfg.batch_size_conversations,
    }
    return result


# ---------------------------------------------------------------- report


def count_tokens(result: RegenResult, tokenize: Callable[[str], list[int]]) -> None:
    result.new_tokens = sum(len(tokenize(text)) for texts in result.answers.values() for text in texts)


def print_table(results: list[RegenResult], shares: dict[str, Any]) -> None:
    print(
        f"{'backend':<8} {'rows ok':>7} {'errors':>6} {'new tokens':>10} {'wall s':>8} {'tok/s':>9} {'start s':>8}",
        flush=True,
    )
    for r in results:
        j = r.to_json()
        print(
            f"{r.name:<8} {j['success']:>7} {j['error']:>6} {r.new_tokens:>10} {r.elapsed_s:>8.2f} "
            f"{j['tokens_per_s']:>9.1f} {r.start_s if r.start_s is not None else '-':>8}",
            flush=True,
        )
    if not shares:
        return
    print(
        f"identical answers: {shares['identical_text']}/{shares['rows_compared']}; identical first "
        f"{FIRST_TOKENS} tokens: {shares[f'identical_first_{FIRST_TOKENS}_tokens']}/{shares['rows_compared']}",
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="RUN/config.json (merge done)")
    parser.add_argument("--rows", type=int, default=200, help="first N merged rows (default 200)")
    parser.add_argument("--out", type=Path, help="results JSON (default RUN/bench-regen/results.json)")
    add_server_args(parser, "cfg's server.python")
    parser.add_argument("--endpoint", help="an existing OpenAI-compatible endpoint (.../v1) instead of a server")
    parser.add_argument("--concurrency", type=int, default=64, help="openai conversations in flight (default 64)")
    parser.add_argument("--device", help="hf device (default cfg's regenerate.device)")
    parser.add_argument("--hf-batch-size", type=int, help="hf conversations per batch (default cfg's)")
    parser.add_argument("--max-new-tokens", type=int, help="default cfg's regenerate.max_new_tokens")
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        help="the server's share of GPU memory (default cfg's serve.mem_fraction_static)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="only the openai side (no identity figures)")
    args = parser.parse_args(argv)
    args.server_args = shlex.split(args.server_args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.config.is_file():
        raise FileNotFoundError(f"config {args.config} not found (the run's config.json)")
    cfg = validate_config(read_config_file(args.config), str(args.config))
    args.python, args.device = args.python or cfg.server.python, args.device or cfg.regenerate.device
    bench = cfg.run_dir / "bench-regen"
    out = args.out or bench / "results.json"
    results: dict[str, Any] = {
        "config": str(args.config),
        "module": args.module,
        "python": args.python,
        "rows_asked": args.rows,
        "server_args": args.server_args,
    }
    return run_and_record(out, results, lambda: compare(cfg, args, bench, results))


def compare(cfg: RunConfig, args: argparse.Namespace, bench: Path, results: dict[str, Any]) -> list[str]:
    """Both regenerations, the token counts and the identity shares; returns the failures (errors recorded)."""
    from eagle3.run.layout import run_layout
    from eagle3.target.load import load_tokenizer, prepare_target

    merged = run_layout(cfg).merged
    if not merged.is_file():
        raise FileNotFoundError(f"{merged} not found: run the merge stage first")
    model_dir = prepare_target(cfg)
    ids = set(first_ids(merged, args.rows))
    results |= {
        "rows": len(ids),
        "max_new_tokens": args.max_new_tokens or cfg.regenerate.max_new_tokens,
        "max_user_turns": 1,
        "temperature": 0.0,
    }
    runs = [openai_run(cfg, args, model_dir, merged, bench, ids)]  # the server first: the GPU must be free
    if not args.skip_hf:
        runs.append(hf_run(cfg, args, model_dir, merged, bench, ids))
    tok = load_tokenizer(model_dir)

    def tokenize(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    for run in runs:
        count_tokens(run, tokenize)
        results[run.name] = run.to_json()
    shares = identity_shares(runs[0].answers, runs[-1].answers, tokenize) if len(runs) == 2 else {}
    results["identity"] = shares
    print_table(runs, shares)
    return [f"{r.name}: {r.stats['error']} rows failed ({r.errors_by_kind})" for r in runs if r.stats.get("error")]


if __name__ == "__main__":
    sys.exit(main())
