"""Where an EAGLE-3 round's time goes in SGLang, and which of SGLang's levers move it (lab; GPU host).

One speculative server per variant, each on the same evaluation prompts at concurrency 1, stopped before the next
starts; per variant the accept length (SGLang's verify counts), output tok/s and **ms per round** (wall time of
the level / verify steps). A baseline variant gives ms per target step, so a round's cost reads in target steps and
the speed-up a setting can reach is accept length / (round ms / step ms). Variants (``--variants``):

  baseline        no speculation (ms per target step)
  3-1-4           the run's export, chain 3 (the control every lever is compared with; 3-1-4#2 repeats it)
  7-1-8           chain 7: what draft depth costs
  vocab-K         chain 3 with the export cut to its K most frequent draft tokens (train split's counts): the
                  draft lm_head and SGLang's per-step top-k work shrink K/V_draft (e.g. vocab-4096)
  attn-decode     chain 3, ``--speculative-attention-mode decode`` (verify and draft extend on decode kernels)
  compile         chain 3, ``--enable-torch-compile --torch-compile-max-bs 4``
  ngram           SGLang's n-gram server (no drafter; the run's serve.ngram_* settings), the drafter-free rival
  A+B             levers combined, e.g. 7-1-8+vocab-4096: the trio of the one that sets it, every flag, the cut;
                  compared with its own trio's plain variant (7-1-8 here)

``--profile VARIANT`` runs SGLang's own profiler (``/start_profile``, torch profiler, CPU and GPU) on that
variant after its benchmark, over ``--profile-steps`` scheduler steps of one request, and copies the chrome trace
beside ``--out``; ``lab/sglang_trace.py`` reads it (GPU busy share, kernels by time, graph launches).

    python lab/sglang_levers.py --config runs/<run>/config.json --out runs/<run>/bench-levers.json \\
        --variants baseline,3-1-4,vocab-4096,7-1-8,attn-decode --profile 3-1-4
(server flags come from the run's server and serve sections; --server-args adds flags they do not set)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.config import RunConfig, read_config_file, validate_config  # noqa: E402
from lab.sglang_lab import add_server_args, new_flags, run_and_record, say, write_results  # noqa: E402

SUBSET = {"mtbench": 20, "humaneval": 10, "gsm8k": 10}  # 40 of the 160 evaluation prompts, all three datasets


@dataclass(frozen=True)
class Variant:
    """One server to measure: its EAGLE-3 trio (None: baseline), extra flags, and the export it loads."""

    name: str
    trio: str | None = "3-1-4"
    extra_args: tuple[str, ...] = ()
    draft_vocab: int | None = None  # cut the export to this many draft tokens


def parse_variant(name: str) -> Variant:
    """A variant by name (see the module doc); ``NAME#2`` measures NAME again under its own name (a second
    server of the same setting, later in the lease: the spread between them says which differences are real).
    ValueError naming the known ones otherwise."""
    if "#" in name:
        base, _, tag = name.partition("#")
        return replace(parse_variant(base), name=f"{base}-{tag}")
    if "+" in name:
        return combine(name, [parse_variant(part) for part in name.split("+")])
    fixed = {
        "baseline": Variant("baseline", trio=None),
        "3-1-4": Variant("3-1-4"),
        "7-1-8": Variant("7-1-8", trio="7-1-8"),
        "attn-decode": Variant("attn-decode", extra_args=("--speculative-attention-mode", "decode")),
        "compile": Variant("compile", extra_args=("--enable-torch-compile", "--torch-compile-max-bs", "4")),
        "ngram": Variant("ngram", trio="ngram"),  # SGLang's drafter-free n-gram server (serve.ngram_* settings)
    }
    if name in fixed:
        return fixed[name]
    if name.startswith("vocab-") and name[6:].isdigit():
        return Variant(name, draft_vocab=int(name[6:]))
    raise ValueError(f"unknown variant {name!r}: one of {sorted(fixed)} or vocab-<K>")


def combine(name: str, parts: list[Variant]) -> Variant:
    """Levers applied together: at most one part names a trio other than the control's 3-1-4 (a baseline part
    cannot combine), flags are concatenated, at most one draft vocab cut. ValueError naming the clash otherwise."""
    if any(p.trio in (None, "ngram") for p in parts):
        raise ValueError(f"variant {name!r}: the baseline and the n-gram server have no drafter to apply levers to")
    trios = {p.trio for p in parts} - {"3-1-4"}
    vocabs = {p.draft_vocab for p in parts} - {None}
    if len(trios) > 1 or len(vocabs) > 1:
        raise ValueError(f"variant {name!r}: its parts name two trios or two draft vocab sizes")
    return Variant(
        name,
        trio=trios.pop() if trios else "3-1-4",
        extra_args=tuple(a for p in parts for a in p.extra_args),
        draft_vocab=vocabs.pop() if vocabs else None,
    )


def train_token_counts(tokenized: Path, saved: Path | None, vocab_size: int) -> np.ndarray:
    """int64 [V]: the train split's supervised token counts, from ``saved`` (an .npy of them, for a run whose
    tokenized data stayed on another host) or counted from ``tokenized``."""
    from eagle3.data.vocab import count_train_tokens

    if saved is None:
        return count_train_tokens(tokenized, vocab_size)[0]
    counts = np.load(saved)
    if counts.shape != (vocab_size,) or counts.dtype != np.int64:
        raise ValueError(f"{saved}: expected int64 counts [{vocab_size}], got {counts.dtype} {list(counts.shape)}")
    return counts


def shrink_export(src: Path, dst: Path, tokenized: Path, keep: int, saved_counts: Path | None = None) -> dict[str, Any]:
    """Copy an SGLang export keeping only its ``keep`` most frequent draft tokens (by the train split's counts):
    lm_head rows [keep, H], d2t [keep], t2d with ``keep`` trues. Returns what was kept."""
    import torch
    from safetensors.torch import load_file

    from eagle3.data.vocab import maps_from_used
    from eagle3.export.checks import CONFIG_FILE, INFO_FILE, WEIGHTS_FILE
    from eagle3.export.folder import write_folder
    from eagle3.export.sglang import check_sglang_export

    config = json.loads((src / CONFIG_FILE).read_text())
    tensors = load_file(str(src / WEIGHTS_FILE))
    d2t = tensors["d2t"]
    used = d2t + torch.arange(len(d2t))  # int64 [Vd]: target ids, ascending
    if keep >= len(used):
        raise ValueError(f"export has {len(used)} draft tokens: nothing to cut to {keep}")
    counts = train_token_counts(tokenized, saved_counts, int(config["vocab_size"]))
    order = sorted(range(len(used)), key=lambda i: (-int(counts[int(used[i])]), int(used[i])))
    rows = torch.tensor(sorted(order[:keep]))  # draft ids kept, ascending (so target ids stay ascending)
    new_d2t, new_t2d = maps_from_used(used[rows].numpy(), int(config["vocab_size"]))
    tensors |= {"lm_head.weight": tensors["lm_head.weight"][rows].contiguous(), "d2t": new_d2t, "t2d": new_t2d}
    info = json.loads((src / INFO_FILE).read_text()) if (src / INFO_FILE).is_file() else {}
    total = int(counts.sum())
    kept_share = float(counts[used[rows].numpy()].sum()) / total if total else 0.0
    all_share = float(counts[used.numpy()].sum()) / total if total else 0.0
    write_folder(
        dst,
        config | {"draft_vocab_size": keep},
        tensors,
        info | {"shrunk_from": str(src), "draft_vocab_kept": keep},
        None,
    )
    check_sglang_export(dst)
    return {"draft_vocab": keep, "from": len(used), "coverage_kept": kept_share, "coverage_full": all_share}


def lever_config(cfg: RunConfig, num_prompts: int) -> RunConfig:
    """cfg for the lever runs: the evaluation subset, concurrency 1, small CUDA-graph range (faster starts)."""
    e = cfg.evaluate.model_copy(update={"num_prompts_by_dataset": dict(SUBSET)})
    sv = cfg.serve.model_copy(
        update={
            "prompts": "evaluation",
            "num_prompts": num_prompts,
            "concurrency_levels": [1],
            "max_running_requests": 4,
            "cuda_graph_max_bs_decode": 4,
            "extra_speculative": [],
        }
    )
    return cfg.model_copy(update={"evaluate": e, "serve": sv})


def profile_once(base_url: str, api_key: str, prompt: list[int], out_dir: Path, steps: int) -> Path:
    """SGLang's torch profiler over ``steps`` scheduler steps of one greedy request; the trace file it wrote."""
    import httpx

    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json.gz"))
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        body = {"output_dir": str(out_dir), "num_steps": steps, "activities": ["CPU", "GPU"], "profile_id": "levers"}
        resp = client.post("/start_profile", json=body)
        resp.raise_for_status()
        for _ in range(3):  # enough decode steps for num_steps, then the profiler stops itself
            client.post(
                "/generate",
                json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True},
                },
            ).raise_for_status()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = sorted(set(out_dir.glob("*.trace.json.gz")) - before)
        if new and new[-1].stat().st_size > 0:
            time.sleep(2)  # the exporter writes then closes: let it finish
            return new[-1]
        time.sleep(1)
    raise RuntimeError(f"SGLang wrote no trace into {out_dir} within 120 s of the profiled requests")


def measure_variant(cfg: RunConfig, variant: Variant, plan: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Start the variant's server, benchmark it at concurrency 1, profile it when asked, always stop it."""
    from eagle3.deploy import api_key_for, bench_settings, deploy_prompts, probe_expectations, server_specs
    from eagle3.run.layout import run_layout
    from infra.process import RestartPolicy
    from infra.sglang import ManagedServer
    from infra.sglang_bench import run_benchmark

    extra = [*cfg.server.extra_args, *new_flags(cfg, args.server_args), *variant.extra_args]
    vcfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"extra_args": extra})})
    draft = plan.draft_model_path
    record: dict[str, Any] = {"variant": variant.name, "trio": variant.trio}
    if variant.draft_vocab:
        dst = Path(args.out).parent / f"export-{variant.name}"
        record["shrink"] = shrink_export(
            Path(draft), dst, run_layout(cfg).tokenized, variant.draft_vocab, args.token_counts
        )
        draft = str(dst.resolve())
    key = api_key_for(vcfg)
    spec = server_specs(vcfg, plan.model_path, draft, key, variant.trio or "3-1-4")[variant.trio is not None]
    sent = deploy_prompts(vcfg, plan.model_path)
    log_path = Path(args.out).parent / f"sglang-lever-{variant.name}.log"
    server = ManagedServer(
        spec,
        log_path,
        expect=probe_expectations(plan.model_path),
        startup_timeout_s=vcfg.server.startup_timeout_s,
        policy=RestartPolicy(max_restarts=0),
    )
    say(f"{variant.name}: starting {server.process.printable_argv}")
    t0 = time.monotonic()
    try:
        ready = server.start()
        record["startup_s"] = round(time.monotonic() - t0, 1)
        result = run_benchmark(
            spec.base_url, sent.prompts, bench_settings(vcfg), speculative=variant.trio is not None, api_key=key
        )
        level = result.levels[0]
        record |= {
            "version": ready.version,
            "tok_per_s": level.output_tok_per_s,
            "accept_length": level.accept_length,
            "server_accept_length": level.server_accept_length,
            "median_tpot_ms": level.median_tpot_ms,
            "completion_tokens": level.completion_tokens,
            "verify_ct": level.spec_verify_ct,
            "duration_s": level.duration_s,
            "ms_per_round": 1000 * level.duration_s / (level.spec_verify_ct or level.completion_tokens),
            "output_digests": list(level.output_digests),
        }
        if args.profile == variant.name:
            try:  # a profiler that fails loses the trace, not the variant's figures
                trace = profile_once(
                    spec.base_url, key, list(sent.prompts[0]), Path(args.out).parent / "profile", args.profile_steps
                )
                record["trace"] = str(trace)
            except Exception as exc:
                record["profile_error"] = f"{type(exc).__name__}: {exc}"
                say(f"{variant.name}: profile failed: {record['profile_error']}")
    finally:
        server.stop()
    say(
        f"{variant.name}: {record.get('ms_per_round', float('nan')):.3f} ms per round, accept "
        f"{record.get('accept_length')}, {record.get('tok_per_s', 0):.1f} tok/s"
    )
    return record


def summarize(records: list[dict[str, Any]]) -> list[str]:
    """Per variant: round cost in target steps and the speed-up it gives, against baseline and control."""
    by = {r["variant"]: r for r in records if "ms_per_round" in r}
    step = by.get("baseline", {}).get("ms_per_round")
    lines = []
    for r in records:
        if "ms_per_round" not in r:
            lines.append(f"{r['variant']}: FAILED {r.get('error')}")
            continue
        steps = f"{r['ms_per_round'] / step:.2f} target steps" if step else "no baseline"
        # a lever against its own trio's plain server (the first one; a repeat #2 shows the spread)
        trio = r.get("trio") or "3-1-4"
        control = by.get(trio, {}).get("ms_per_round")
        vs = (
            f", {r['ms_per_round'] / control - 1:+.1%} vs {trio}"
            if control and r["variant"] not in (trio, "baseline")
            else ""
        )
        speed = f", speed-up {step / (r['ms_per_round'] / (r['accept_length'] or 1)):.2f}x" if step else ""
        lines.append(
            f"{r['variant']}: {r['ms_per_round']:.3f} ms per round ({steps}{vs}), accept "
            f"{r['accept_length'] or 1:.3f}, {r['tok_per_s']:.1f} tok/s{speed}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's config.json (its export and tokenized data)")
    parser.add_argument("--out", required=True, help="results JSON (server logs, exports and traces beside it)")
    parser.add_argument("--variants", default="baseline,3-1-4,vocab-4096,7-1-8,attn-decode")
    parser.add_argument("--profile", default="", help="profile this variant after its benchmark")
    parser.add_argument("--profile-steps", type=int, default=60)
    parser.add_argument(
        "--token-counts",
        type=Path,
        default=None,
        help="vocab-K: the train split's token counts as .npy (int64 [V], eagle3.data.vocab.count_train_tokens), "
        "for a run whose tokenized data is not on this host; default: counted from the run's tokenized data",
    )
    add_server_args(parser, python_default="server.python")
    args = parser.parse_args(argv)
    args.server_args = args.server_args.split()
    cfg = validate_config(read_config_file(Path(args.config)), args.config)
    if cfg.drafter.family != "eagle3":  # before any server starts: its trios and vocab cuts are EAGLE-3's
        raise SystemExit(
            f"the levers are EAGLE-3's (chain/tree trios, draft-vocab cuts); {args.config} trains a "
            f"{cfg.drafter.family} drafter: skip this step (lab/sglang_lease.sh: LEASE_SKIP=levers)"
        )
    server = {"launch_module": args.module} | ({"python": args.python} if args.python else {})
    cfg = lever_config(
        cfg.model_copy(update={"server": cfg.server.model_copy(update=server)}),
        sum(SUBSET[d] for d in cfg.evaluate.datasets),
    )
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    out = Path(args.out)
    results: dict[str, Any] = {"variants": [v.name for v in variants], "subset": SUBSET, "records": []}

    def body() -> list[str]:
        from eagle3.deploy import prepare_serving

        plan = prepare_serving(cfg)
        failures = []
        for variant in variants:
            try:
                results["records"].append(measure_variant(cfg, variant, plan, args))
            except Exception as exc:  # one lever failing says why and the others still run
                results["records"].append({"variant": variant.name, "error": f"{type(exc).__name__}: {exc}"})
                failures.append(f"{variant.name}: {type(exc).__name__}: {exc}")
            write_results(out, results)
        results["summary"] = summarize(results["records"])
        for line in results["summary"]:
            say(line)
        return failures

    return run_and_record(out, results, body)


if __name__ == "__main__":
    sys.exit(main())
