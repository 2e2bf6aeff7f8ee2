"""`eagle3 eval`'s one-row greedy decode against SGLang's baseline server: same prompts, same tokens, same card.

    python lab/baseline_speed.py --preset smollm2-quality --out runs/baseline-speed.json \\
        --attention sdpa,matmul,flex [--set serve.num_prompts=160 ...] [--module ... --python ... --server-args ...]

First SGLang's baseline server (no speculation) decodes the evaluation prompts one request at a time
(``eagle3.deploy.benchmark_server``, the deploy stage's own launch and client: serve.prompts=evaluation, greedy,
serve.max_new_tokens); then, with the server gone, the evaluation's one-row static runner (the runner
``evaluate.speed_baseline: one_row`` times, built from the evaluate section: dtype, static cache, compile,
fuse_projections) decodes every prompt for exactly as many tokens as SGLang returned for it, once per
``--attention`` entry (``evaluate.baseline_attention``'s values; ``X+fused`` also fuses the MLP gate and up
products). Both rates include each prompt's prefill; both are output tokens over the decode's own wall time
(SGLang's from its client: HTTP included). Prints ``name: value`` lines, ``ratio[VARIANT]`` = eval's tok/s over
SGLang's, and how many of eval's outputs equal SGLang's token for token; writes them to ``--out``.

On a CPU with the fake server (``--module tests.fakes.sglang_server``, preset tiny) it is a smoke run of the
plumbing (lab/tests/test_baseline_speed.py), not a figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, cast, get_args

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig, load_config  # noqa: E402
from eagle3.evaluate.static_attention import MaskedAttention  # noqa: E402
from lab.sglang_lab import add_server_args, device_name, new_flags, run_and_record, say  # noqa: E402

PROMPT_MARGIN = 128  # cache entries past the longest prompt and output (as the evaluate stage sizes its cache)


def parse_variant(text: str) -> tuple[MaskedAttention, bool]:
    """'flex' -> ('flex', False); 'flex+fused' -> ('flex', True); SystemExit naming the entry otherwise."""
    attention, _, extra = text.partition("+")
    if attention not in get_args(MaskedAttention) or extra not in ("", "fused"):
        raise SystemExit(f"--attention {text}: use {', '.join(get_args(MaskedAttention))}, optionally +fused")
    return cast(MaskedAttention, attention), extra == "fused"


def sglang_baseline(cfg: RunConfig, model_path: str) -> dict[str, Any]:
    """SGLang's baseline server on the evaluation prompts at the first concurrency level: its tok/s, each prompt's
    output ids (as many tokens as it decoded) and its launch line."""
    from eagle3.deploy import ServingPlan, benchmark_server

    run = benchmark_server(cfg, "baseline", ServingPlan(model_path, model_path))  # no draft: the baseline's spec
    level = run.result.levels[0]
    return {
        "argv": run.argv,
        "concurrency": level.concurrency,
        "tok_per_s": level.output_tok_per_s,
        "duration_s": level.duration_s,
        "completion_tokens": level.completion_tokens,
        "median_tpot_ms": level.median_tpot_ms,
        "output_ids": [list(ids) for ids in level.output_ids_by_prompt],
    }


def eval_one_row(
    cfg: RunConfig, model_path: str, prompts: list[list[int]], outputs: list[list[int]], variant: str
) -> dict[str, Any]:
    """The evaluation's one-row runner decoding each prompt for len(SGLang's output) tokens with no stop test:
    tok/s over the summed decode walls, warm-up seconds, and how many outputs equal SGLang's."""
    import torch

    from eagle3.evaluate.fused_projections import fuse_projections
    from eagle3.evaluate.graphs import resolve_decode
    from eagle3.evaluate.speculate import greedy_decode
    from eagle3.evaluate.stage import resolve_device
    from eagle3.evaluate.static_target import StaticTargetRunner
    from eagle3.target.load import default_aux_layer_ids, load_model

    attention, fused = parse_variant(variant)
    device = resolve_device(cfg.evaluate.device)
    ecfg = cfg.evaluate.resolved(device)
    model = load_model(Path(model_path), ecfg.dtype, device)
    static, settings = resolve_decode(ecfg.static_cache, ecfg.compile, device)
    if not static:
        raise SystemExit(f"evaluate.static_cache resolved off on {device}: the one-row baseline is a static runner")
    if fused or ecfg.fuse_projections:
        fuse_projections(model)
    capacity = max(map(len, prompts)) + max(map(len, outputs), default=0) + PROMPT_MARGIN
    aux = default_aux_layer_ids(model.config.num_hidden_layers)
    start = time.perf_counter()
    runner = StaticTargetRunner(model, aux, capacity, settings, 1, name="one-row baseline", attention=attention)
    runner.warm_up_widths()
    greedy_decode(runner, prompts[0], 8)
    warm_s = time.perf_counter() - start
    walls, same = [], 0
    for ids, want in zip(prompts, outputs):
        out = greedy_decode(runner, ids, len(want), [])  # [] : no stop test, SGLang's token count
        walls.append(out.wall_s)
        same += out.tokens == want
    tokens = sum(map(len, outputs))
    runner.close()
    del runner, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "tok_per_s": tokens / max(sum(walls), 1e-9),
        "wall_s": sum(walls),
        "warmup_s": warm_s,
        "tokens": tokens,
        "identical_to_sglang": same,
        "dtype": ecfg.dtype,
        "compile": ecfg.compile,
        "fused": fused or ecfg.fuse_projections,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-quality", help="the run's preset (target, evaluate section)")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument(
        "--attention", default="sdpa", help="comma list: MaskedAttention values, each optionally +fused"
    )
    add_server_args(parser, python_default="server.python")
    args = parser.parse_args(argv)
    variants = [v for v in args.attention.split(",") if v]
    for variant in variants:
        parse_variant(variant)  # every entry checked before a server starts
    sets = ["serve.prompts=evaluation", *args.sets]
    cfg = load_config(args.preset, sets)
    server = {"launch_module": args.module} | ({"python": args.python} if args.python else {})
    extra = [*cfg.server.extra_args, *new_flags(cfg, args.server_args.split())]
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update=server | {"extra_args": extra})})
    results: dict[str, Any] = {"preset": args.preset, "sets": sets, "variants": variants}

    def body() -> list[str]:
        from eagle3.deploy import deploy_prompts
        from eagle3.target.load import prepare_target

        model_path = str(prepare_target(cfg).resolve())
        prompts = cast(list[list[int]], deploy_prompts(cfg, model_path).prompts)
        say(f"SGLang baseline on {len(prompts)} prompts")
        sglang = results["sglang"] = sglang_baseline(cfg, model_path)
        say(f"sglang_tok_s: {sglang['tok_per_s']:.1f}  ({sglang['completion_tokens']} tokens)")
        results["device"] = device_name(cfg.evaluate.device)  # after the server: the GPU check wants no CUDA context
        failures = []
        for variant in variants:
            try:
                row = results.setdefault("eval", {})[variant] = eval_one_row(
                    cfg, model_path, prompts, sglang["output_ids"], variant
                )
            except Exception as exc:  # one variant failing says why; the others still run
                failures.append(f"{variant}: {type(exc).__name__}: {exc}")
                continue
            row["ratio"] = row["tok_per_s"] / sglang["tok_per_s"]
            say(
                f"eval_one_row_tok_s[{variant}]: {row['tok_per_s']:.1f}  ratio[{variant}]: {row['ratio']:.3f}  "
                f"(warm-up {row['warmup_s']:.1f} s; {row['identical_to_sglang']}/{len(prompts)} outputs "
                "identical to SGLang's)"
            )
        return failures

    return run_and_record(args.out, results, body)


if __name__ == "__main__":
    raise SystemExit(main())
