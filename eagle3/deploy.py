"""The deploy stage: the target served by SGLang with and without the exported drafter, benchmarked and compared.

    python -m eagle3.deploy --config runs/<run>/config.json            # needs serve.enabled: a GPU host with SGLang
    python -m eagle3.deploy --preset llama31-8b --set serve.enabled=true --set 'serve.concurrency_levels=[1,8,32]'

First the export's own strict check (SGLang skips unknown keys silently) and the target the servers load. Then
the baseline server and after it the speculative one, never both at once (they would share the GPUs): check that
no other process holds GPU memory, launch it (infra.sglang.ManagedServer: readiness = model_info,
health_generate, server_info, then a checked greedy smoke generation; a speculative server must also report
verify steps), benchmark every concurrency level (infra.sglang_bench) and stop it, also when the benchmark
fails. Last, compare the two runs (MeasurementError when a speedup exceeds the acceptance length) and write
<run>/deploy/results.json and report.md; server logs are <run>/deploy/sglang-{baseline,speculative}.log.

Nothing here is skipped on a re-run: a live server is not a cacheable input, so every call measures again.
The export and the offline evaluation are stages of their own (eagle3.export, eagle3.evaluate.stage).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagle3.config import RunConfig
from eagle3.run.progress import Progress, ProgressFn

if TYPE_CHECKING:
    from infra.sglang import ProbeExpectations
    from infra.sglang_bench import BenchResult, BenchSettings, LevelComparison
    from infra.sglang_spec import ServerSpec

log = logging.getLogger(__name__)

Role = Literal["baseline", "speculative"]
NOT_ENABLED = "serve.enabled is false: no GPU host with SGLang configured, so no server was started"


def deploy_dir(cfg: RunConfig) -> Path:
    """<run>/deploy: results.json, report.md and the server logs."""
    return cfg.run_dir / "deploy"


def draft_dir(cfg: RunConfig) -> Path:
    """The exported SGLang drafter (the folder the evaluate stage reads too)."""
    from eagle3.evaluate.stage import default_export_dir

    return default_export_dir(cfg)


def server_specs(cfg: RunConfig, model_path: str, draft_path: str,
                 api_key: str | None) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, speculative) ServerSpecs from cfg.serve: equal flags except --speculative-* and the port."""
    from infra.sglang import serving_pair

    sv = cfg.serve
    return serving_pair(model_path, draft_path, port=sv.port, num_steps=sv.num_steps, topk=sv.eagle_topk,
                        num_draft_tokens=sv.num_draft_tokens, host=sv.host, allow_remote=sv.allow_remote_host,
                        tp_size=sv.tp_size, dtype=sv.dtype,
                        mem_fraction_static=sv.mem_fraction_static, max_running_requests=sv.max_running_requests,
                        cuda_graph_max_bs_decode=sv.cuda_graph_max_bs_decode, attention_backend=sv.attention_backend,
                        extra_args=tuple(sv.extra_args), api_key=api_key, python=sv.python, module=sv.launch_module)


def bench_settings(cfg: RunConfig) -> BenchSettings:
    """cfg.serve -> infra.sglang_bench.BenchSettings."""
    from infra.sglang_bench import BenchSettings

    sv = cfg.serve
    return BenchSettings(tuple(sv.concurrency_levels), sv.num_prompts, sv.max_new_tokens, sv.num_warmup,
                         sv.request_timeout_s)


def probe_expectations(model_path: str) -> ProbeExpectations:
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


@dataclass(frozen=True)
class ServingPlan:
    """What both servers load: the target (a folder or hub id) and the exported drafter's folder."""

    model_path: str
    draft_model_path: str

    def to_json(self) -> dict[str, str]:
        """JSON-able dict (what the Prefect task returns)."""
        return asdict(self)


def prepare_serving(cfg: RunConfig) -> ServingPlan:
    """Check the exported drafter and resolve the target the servers load (serve.model_path, else the run's)."""
    check_draft(draft_dir(cfg))
    model_path = cfg.serve.model_path
    if model_path is None:
        from eagle3.target.load import prepare_target

        model_path = str(prepare_target(cfg).resolve())
    return ServingPlan(model_path, str(draft_dir(cfg).resolve()))


def check_gpus(cfg: RunConfig) -> None:
    """No other process on the GPUs (serve.allow_shared_gpus to override); nothing to check without GPUs."""
    from infra.gpus import check_gpus_free, list_gpus

    gpus = list_gpus()
    if gpus:
        check_gpus_free([g.index for g in gpus], allow_shared=cfg.serve.allow_shared_gpus, gpus=gpus)


def api_key_for(cfg: RunConfig) -> str:
    """The servers' API key: from the environment variable serve.api_key_env names, else a fresh random one."""
    env_name = cfg.serve.api_key_env
    return (os.environ.get(env_name) if env_name else None) or secrets.token_hex(16)


@dataclass(frozen=True)
class ServerRun:
    """One server's benchmark: how it was launched, what its readiness probe saw, and the measured levels."""

    role: Role
    argv: str  # printable command line (the API key is in a file, never on it)
    log: str
    pid: int | None
    ready: dict[str, Any]  # {smoke, elapsed_s, version} of infra.sglang.ReadyReport
    result: BenchResult

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (round-trips through ``from_json``; results.json holds it per role)."""
        return {"role": self.role, "argv": self.argv, "log": self.log, "pid": self.pid, "ready": dict(self.ready),
                "result": self.result.to_json()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerRun:
        from infra.sglang_bench import BenchResult

        return cls(doc["role"], doc["argv"], doc["log"], doc["pid"], dict(doc["ready"]),
                   BenchResult.from_json(doc["result"]))


def benchmark_server(cfg: RunConfig, role: Role, plan: ServingPlan, progress: ProgressFn | None = None,
                     logger: logging.Logger | logging.LoggerAdapter = log) -> ServerRun:
    """Launch one server, wait until it passes readiness, benchmark every level, always stop it."""
    from infra.process import RestartPolicy
    from infra.sglang import ManagedServer
    from infra.sglang_bench import fixed_prompts, run_benchmark

    api_key = api_key_for(cfg)
    spec = server_specs(cfg, plan.model_path, plan.draft_model_path, api_key)[role == "speculative"]
    settings = bench_settings(cfg)
    check_gpus(cfg)  # the other server of the pair must be gone, and nobody else on the GPUs
    # No restart: a server that died once has not been measured under the same conditions.
    server = ManagedServer(spec, deploy_dir(cfg) / f"sglang-{role}.log", expect=probe_expectations(plan.model_path),
                           startup_timeout_s=cfg.serve.startup_timeout_s, policy=RestartPolicy(max_restarts=0))
    logger.info("starting %s server: %s", role, server.process.printable_argv)
    try:
        ready = server.start()
        result = run_benchmark(spec.base_url, fixed_prompts(settings.num_prompts), settings,
                               speculative=role == "speculative", api_key=api_key, progress=progress)
    finally:
        server.stop()
    return ServerRun(role, server.process.printable_argv, str(server.log_path), server.pid,
                     {"smoke": ready.smoke, "elapsed_s": ready.elapsed_s, "version": ready.version}, result)


def report_context(cfg: RunConfig, baseline: ServerRun, speculative: ServerRun) -> dict[str, str]:
    """The report's header lines: run, both command lines, and a NOTE when the servers were not SGLang."""
    from infra.sglang import LAUNCH_MODULE

    context = {"run": cfg.run.name, "baseline server": baseline.argv, "speculative server": speculative.argv}
    if cfg.serve.launch_module != LAUNCH_MODULE:
        context["NOTE"] = (f"servers launched by {cfg.serve.launch_module}, not {LAUNCH_MODULE}: "
                           "these figures are not SGLang measurements")
    return context


@dataclass(frozen=True)
class DeployReport:
    """The written comparison: results.json, report.md, one row per concurrency level and the report's text."""

    results: Path
    report: Path
    comparison: list[LevelComparison]
    markdown: str

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (what the Prefect task and the CLI return)."""
        return {"results": str(self.results), "report": str(self.report),
                "comparison": [asdict(row) for row in self.comparison]}


def write_report(cfg: RunConfig, baseline: ServerRun, speculative: ServerRun) -> DeployReport:
    """Compare the runs and write results.json + report.md; MeasurementError (after an invalid results.json)
    when the figures cannot be right (a speedup above the acceptance length, runs that differ in settings)."""
    from infra.sglang_bench import MeasurementError, compare, render_report
    from infra.storage import atomic_write_json, atomic_write_text

    out = deploy_dir(cfg)
    context = report_context(cfg, baseline, speculative)
    doc: dict[str, Any] = {"context": context, "baseline": baseline.to_json(), "speculative": speculative.to_json()}
    try:
        rows = compare(baseline.result, speculative.result)
    except MeasurementError as exc:
        atomic_write_json(out / "results.json", doc | {"valid": False, "error": str(exc)})
        raise
    markdown = render_report(rows, baseline.result, speculative.result, context)
    results = atomic_write_json(out / "results.json", doc | {"valid": True, "comparison": [asdict(r) for r in rows]})
    return DeployReport(results, atomic_write_text(out / "report.md", markdown), rows, markdown)


def run_deploy(cfg: RunConfig, show_bar: bool | None = None) -> DeployReport:
    """The whole stage without an orchestrator: prepare, baseline server, speculative server, report."""
    if not cfg.serve.enabled:
        raise ValueError(f"{NOT_ENABLED}; set serve.enabled=true on a GPU host with SGLang")
    plan = prepare_serving(cfg)
    runs = {}
    for role in ("baseline", "speculative"):
        with _progress_bar(cfg, role, show_bar) as bar:
            runs[role] = benchmark_server(cfg, role, plan, progress=lambda done, total, info: bar.update(
                done - bar.done, **info))
    return write_report(cfg, runs["baseline"], runs["speculative"])


def _progress_bar(cfg: RunConfig, role: Role, show_bar: bool | None) -> Progress:
    """A bar over every request of one server's benchmark (warmups included), as infra.sglang_bench counts them."""
    sv = cfg.serve
    return Progress(len(sv.concurrency_levels) * (sv.num_prompts + sv.num_warmup), f"benchmark {role}",
                    bar=show_bar)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.deploy --preset X [--set a.b=c] | --config <run>/config.json"""
    from eagle3.run.cli_args import add_config_args, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    stage_main(parser, argv, lambda cfg, args: run_deploy(cfg, show_bar=True), lock_owner="python -m eagle3.deploy",
               show=_show_report)


def _show_report(report: DeployReport) -> None:
    print(report.markdown)
    print(json.dumps(report.to_json(), indent=2))


if __name__ == "__main__":
    main()
