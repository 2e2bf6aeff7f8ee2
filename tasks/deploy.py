"""Prefect tasks of the deploy flow: export, offline evaluation, one benchmark per SGLang server, the report.

Export and evaluation are thin wrappers over ``eagle3.export.stage`` and ``eagle3.evaluate.stage`` (their stage
manifests make a re-run a no-op). A benchmark task owns a live server: it checks the GPUs, launches
the server (readiness = model_info, health_generate, server_info, then a checked greedy smoke
generation; a speculative server must also report verify steps), benchmarks it and stops it in
``finally``. Servers are never cached (NO_CACHE) and are tagged ``inference``.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import RunConfig
from tasks.artifacts import ProgressArtifact, artifact_key, publish_table

Role = Literal["baseline", "speculative"]


def deploy_dir(cfg: RunConfig) -> Path:
    """<run>/deploy: results.json, report.md and the server logs."""
    return cfg.run_dir / "deploy"


def draft_dir(cfg: RunConfig) -> Path:
    """The exported SGLang drafter (the folder the evaluate stage reads too)."""
    from eagle3.evaluate.stage import default_export_dir

    return default_export_dir(cfg)


def server_specs(cfg: RunConfig, model_path: str, draft_path: str, api_key: str | None):
    """(baseline, speculative) ServerSpecs from cfg.serve: equal flags except --speculative-* and the port."""
    from infra.sglang import serving_pair

    sv = cfg.serve
    return serving_pair(model_path, draft_path, port=sv.port, num_steps=sv.num_steps, topk=sv.eagle_topk,
                        num_draft_tokens=sv.num_draft_tokens, host=sv.host, allow_remote=sv.allow_remote_host,
                        tp_size=sv.tp_size, dtype=sv.dtype,
                        mem_fraction_static=sv.mem_fraction_static, max_running_requests=sv.max_running_requests,
                        cuda_graph_max_bs_decode=sv.cuda_graph_max_bs_decode, attention_backend=sv.attention_backend,
                        extra_args=tuple(sv.extra_args), api_key=api_key, python=sv.python, module=sv.launch_module)


def bench_settings(cfg: RunConfig):
    """cfg.serve -> infra.sglang_bench.BenchSettings."""
    from infra.sglang_bench import BenchSettings

    sv = cfg.serve
    return BenchSettings(tuple(sv.concurrency_levels), sv.num_prompts, sv.max_new_tokens, sv.num_warmup,
                         sv.request_timeout_s)


def probe_expectations(model_path: str):
    """Architectures and vocab size from a local target's config.json (nothing to compare for a hub id)."""
    from infra.sglang import ProbeExpectations

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return ProbeExpectations()
    doc = json.loads(config.read_text())
    return ProbeExpectations(architectures=tuple(doc.get("architectures") or ()) or None,
                             vocab_size=doc.get("vocab_size"))


def check_draft(path: Path) -> None:
    """The export's own strict check (SGLang skips unknown keys silently); say which step is missing first."""
    from eagle3.export.sglang import check_sglang_export

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no exported drafter at {path} (no config.json): run the export step first")
    check_sglang_export(path)


@task(name="export", task_run_name="export-{cfg.run.name}")
def export_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Export the trained drafter (no-op when its manifest matches)."""
    from eagle3.export.stage import run_export

    return run_export(cfg, force).to_json()


@task(name="evaluate", task_run_name="evaluate-{cfg.run.name}", tags=["gpu"])
def evaluate_task(cfg: RunConfig, force: bool = False) -> dict[str, Any]:
    """Offline speculative decoding with the target in PyTorch: acceptance and lossless check."""
    from eagle3.evaluate.stage import run_evaluate

    with ProgressArtifact(artifact_key(cfg, "evaluate"), f"offline evaluation ({cfg.run.name})") as progress:
        return run_evaluate(cfg, progress=progress.callback, force=force).to_json()


@task(name="serve-prepare", task_run_name="serve-prepare-{cfg.run.name}")
def prepare_serving_task(cfg: RunConfig) -> dict[str, str]:
    """Check the exported drafter and resolve the target the servers load: {model_path, draft_model_path}."""
    check_draft(draft_dir(cfg))
    model_path = cfg.serve.model_path
    if model_path is None:
        from eagle3.target.load import prepare_target

        model_path = str(prepare_target(cfg).resolve())
    return {"model_path": model_path, "draft_model_path": str(draft_dir(cfg).resolve())}


def _check_gpus(cfg: RunConfig) -> None:
    from infra.gpus import check_gpus_free, list_gpus

    gpus = list_gpus()
    if gpus:
        check_gpus_free([g.index for g in gpus], allow_shared=cfg.serve.allow_shared_gpus, gpus=gpus)


@task(name="serve-benchmark", task_run_name="benchmark-{role}-{cfg.run.name}", tags=["inference"],
      cache_policy=NO_CACHE)
def benchmark_server_task(cfg: RunConfig, role: Role, model_path: str, draft_model_path: str) -> dict[str, Any]:
    """Launch one server, wait until it passes readiness, benchmark every level, always stop it."""
    from infra.process import RestartPolicy
    from infra.sglang import ManagedServer
    from infra.sglang_bench import fixed_prompts, run_benchmark

    env_name = cfg.serve.api_key_env
    api_key = (os.environ.get(env_name) if env_name else None) or secrets.token_hex(16)
    spec = server_specs(cfg, model_path, draft_model_path, api_key)[role == "speculative"]
    settings = bench_settings(cfg)
    _check_gpus(cfg)  # the other server of the pair must be gone, and nobody else on the GPUs
    # No restart: a server that died once has not been measured under the same conditions.
    server = ManagedServer(spec, deploy_dir(cfg) / f"sglang-{role}.log", expect=probe_expectations(model_path),
                           startup_timeout_s=cfg.serve.startup_timeout_s, policy=RestartPolicy(max_restarts=0))
    get_run_logger().info("starting %s server: %s", role, server.process.printable_argv)
    try:
        ready = server.start()
        with ProgressArtifact(artifact_key(cfg, f"benchmark-{role}"), f"benchmark {role} ({cfg.run.name})") as pa:
            result = run_benchmark(spec.base_url, fixed_prompts(settings.num_prompts), settings,
                                   speculative=role == "speculative", api_key=api_key, progress=pa.callback)
    finally:
        server.stop()
    return {"role": role, "argv": server.process.printable_argv, "log": str(server.log_path), "pid": server.pid,
            "ready": {"smoke": ready.smoke, "elapsed_s": ready.elapsed_s, "version": ready.version},
            "result": result.to_json()}


def _context(cfg: RunConfig, baseline: dict[str, Any], speculative: dict[str, Any]) -> dict[str, str]:
    from infra.sglang import LAUNCH_MODULE

    context = {"run": cfg.run.name, "baseline server": baseline["argv"], "speculative server": speculative["argv"]}
    if cfg.serve.launch_module != LAUNCH_MODULE:
        context["NOTE"] = (f"servers launched by {cfg.serve.launch_module}, not {LAUNCH_MODULE}: "
                           "these figures are not SGLang measurements")
    return context


@task(name="deploy-report", task_run_name="deploy-report-{cfg.run.name}")
def report_task(cfg: RunConfig, baseline: dict[str, Any], speculative: dict[str, Any]) -> dict[str, Any]:
    """Compare the runs (MeasurementError if speedup > acceptance length), write results.json + report.md, publish."""
    from infra.sglang_bench import BenchResult, MeasurementError, compare, render_report
    from infra.storage import atomic_write_json, atomic_write_text

    out = deploy_dir(cfg)
    context = _context(cfg, baseline, speculative)
    doc: dict[str, Any] = {"context": context, "baseline": baseline, "speculative": speculative}
    base_run, spec_run = BenchResult.from_json(baseline["result"]), BenchResult.from_json(speculative["result"])
    try:
        rows = compare(base_run, spec_run)
    except MeasurementError as exc:
        atomic_write_json(out / "results.json", doc | {"valid": False, "error": str(exc)})
        raise
    report = render_report(rows, base_run, spec_run, context)
    comparison = [asdict(row) for row in rows]
    results_path = atomic_write_json(out / "results.json", doc | {"valid": True, "comparison": comparison})
    report_path = atomic_write_text(out / "report.md", report)
    publish_table(cfg, "deploy-benchmark", [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                                            for row in comparison], "baseline vs EAGLE-3 per concurrency level")
    create_markdown_artifact(markdown=report, key=artifact_key(cfg, "deploy-report"),
                             description="EAGLE-3 deploy benchmark")
    return {"results": str(results_path), "report": str(report_path), "comparison": comparison}
