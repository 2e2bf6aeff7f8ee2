"""`eagle3`: the console script (the top of the house).

    eagle3 demo                      start/reuse the local Prefect server, run the demo pipeline, print stats
    eagle3 run --preset tiny --set data.val_fraction=0.2
    eagle3 server start|stop|status  the embedded Prefect server (SQLite under <workdir>/.prefect)
    eagle3 setup                     work pools, concurrency limits, crash-recovery automations
    eagle3 target --preset smollm2-demo   tokenizer sanity report
    eagle3 stage tokenize --preset tiny   one core stage without Prefect (= python -m eagle3.stages)
    eagle3 presets

Prefect is imported only after PREFECT_API_URL points at the local server, because Prefect
reads its settings once at import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from eagle3.cli_args import add_config_args, config_from_args, exit_on_user_error
from eagle3.config import list_presets
from flows import local_server


def _server_for(args: argparse.Namespace) -> local_server.LocalServer:
    workdir = getattr(args, "workdir", None) or os.environ.get("EAGLE3_WORKDIR", "runs")
    return local_server.for_workdir(workdir, getattr(args, "port", None))


def _use_server(server: local_server.LocalServer) -> None:
    state = local_server.start(server)
    os.environ.update(server.client_env())
    print(f"prefect server {state}: UI {server.ui_url}", flush=True)


def cmd_server(args: argparse.Namespace) -> int:
    """eagle3 server start|stop|status."""
    server = _server_for(args)
    if args.action == "start":
        t0 = time.monotonic()
        state = local_server.start(server)
        print(f"prefect server {state} in {time.monotonic() - t0:.1f} s: UI {server.ui_url}  API {server.api_url}")
    elif args.action == "stop":
        print("stopped" if local_server.stop(server) else "no server of this workdir was running")
    else:
        print(json.dumps(local_server.status(server), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the pipeline flow against the local server (started if needed) and print the stats."""
    cfg = config_from_args(args)
    args.workdir = cfg.run.workdir
    server = _server_for(args)
    _use_server(server)
    from flows.pipeline import eagle3_pipeline

    t0 = time.monotonic()
    result = eagle3_pipeline(config=cfg, force=args.force, until=args.until)
    print_summary(result, time.monotonic() - t0)
    print(f"\nPrefect UI: {server.ui_url}   run directory: {result['run_dir']}")
    return 0


def print_summary(result: dict[str, Any], wall_s: float) -> None:
    """The stats a user wants after a run, one block per stage."""
    print(f"\n== pipeline finished in {wall_s:.1f} s ==")
    for stage in ("merge", "regenerate", "tokenize", "vocab"):
        res = result.get(stage)
        if not res:
            continue
        state = "computed" if res["computed"] else "up to date, skipped"
        print(f"\n[{stage}] {state}")
        for key, value in _headline(res["stats"]).items():
            print(f"  {key:<28} {value}")
    if result.get("capture"):
        print("\n[capture]")
        for key in ("num_shards", "num_samples", "num_tokens", "num_bytes", "bytes_per_token", "aux_layer_ids"):
            print(f"  {key:<28} {result['capture']['stats'].get(key)}")
    if result.get("train"):
        _print_train(result["train"])


def _print_train(train: dict[str, Any]) -> None:
    """Train and validation accuracy per TTT step, and the acceptance-length estimate."""
    print("\n[train]")
    for name, rec in (("last train step", train.get("last_train")), ("last validation", train.get("last_eval"))):
        if not rec:
            continue
        accs = " ".join(f"acc_{k}={rec[f'acc_{k}']:.3f}" for k in range(16) if f"acc_{k}" in rec)
        print(f"  {name:<20} step {rec.get('step')}  loss {rec.get('loss', float('nan')):.4f}  {accs}")
    last_eval = train.get("last_eval") or {}
    if "accept_len_est" in last_eval:
        print(f"  {'accept_len_est (val)':<20} {last_eval['accept_len_est']:.3f}  "
              f"(unigram baseline acc_0 {last_eval.get('unigram_acc_0', float('nan')):.3f})")


def _headline(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict) and len(value) <= 12:
            out.update(_headline(value, f"{prefix}{key}."))
        elif not isinstance(value, (dict, list)):
            out[f"{prefix}{key}"] = f"{value:,.3f}" if isinstance(value, float) else value
    return out


def cmd_setup(args: argparse.Namespace) -> int:
    """Work pools, concurrency limits and crash-recovery automations on the local server (idempotent)."""
    _use_server(_server_for(args))
    from deployments.setup import setup

    print(json.dumps(setup(args.gpu_slots, args.inference_slots), indent=2))
    return 0


def cmd_target(args: argparse.Namespace) -> int:
    """Prepare the target and print its tokenizer report."""
    from eagle3 import target

    argv = (["--config", str(args.config)] if args.config else ["--preset", args.preset])
    target.main(argv + [f"--set={o}" for o in args.overrides])
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    """One core stage without Prefect."""
    from eagle3 import stages

    argv = [args.stage] + (["--config", str(args.config)] if args.config else ["--preset", args.preset])
    stages.main(argv + [f"--set={o}" for o in args.overrides] + (["--force"] if args.force else []))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the console script."""
    parser = argparse.ArgumentParser(prog="eagle3", description="EAGLE-3 drafter pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = add_config_args(sub.add_parser("demo", help="run the demo pipeline on the local Prefect server"))
    demo.set_defaults(preset="smollm2-demo")
    run = add_config_args(sub.add_parser("run", help="run the pipeline flow for a preset"))
    for p in (demo, run):
        p.add_argument("--until", choices=("vocab", "capture", "train"), default="train",
                       help="last stage to run (default: train)")
        p.add_argument("--force", action="store_true", help="recompute every stage")
        p.add_argument("--port", type=int, help="local Prefect server port (default 4200)")
        p.set_defaults(func=cmd_run)
    server = sub.add_parser("server", help="the embedded Prefect server")
    server.add_argument("action", choices=("start", "stop", "status"))
    server.add_argument("--workdir", default=None, help="workdir whose .prefect/ holds the server (default runs)")
    server.add_argument("--port", type=int)
    server.set_defaults(func=cmd_server)
    setup = sub.add_parser("setup", help="work pools, concurrency limits, automations (idempotent)")
    setup.add_argument("--workdir", default=None)
    setup.add_argument("--port", type=int)
    setup.add_argument("--gpu-slots", type=int, default=1)
    setup.add_argument("--inference-slots", type=int, default=4)
    setup.set_defaults(func=cmd_setup)
    target = add_config_args(sub.add_parser("target", help="tokenizer sanity report for the target"))
    target.set_defaults(func=cmd_target)
    stage = add_config_args(sub.add_parser("stage", help="run one core stage without Prefect"))
    stage.add_argument("stage", choices=("merge", "regenerate", "tokenize", "vocab", "all"))
    stage.add_argument("--force", action="store_true")
    stage.set_defaults(func=cmd_stage)
    sub.add_parser("presets", help="list presets").set_defaults(func=lambda a: print("\n".join(list_presets())) or 0)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `eagle3` console script."""
    args = build_parser().parse_args(argv)
    sys.exit(exit_on_user_error(args.func)(args))


if __name__ == "__main__":
    main()
