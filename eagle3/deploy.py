"""The deploy stage: the target served by SGLang with and without the exported drafter, benchmarked and compared.

    python -m eagle3.deploy --config runs/<run>/config.json            # needs serve.enabled: a GPU host with SGLang
    python -m eagle3.deploy --preset llama31-8b --set serve.enabled=true --set 'serve.concurrency_levels=[1,8,32]'

First the export's own strict check (SGLang skips unknown keys silently) and the target the servers load. Then
the baseline server and after it the speculative ones (one per EAGLE-3 setting; with drafter.family=dflash a DFLASH
server of the export's block size, docs/dflash.md; with serve.ngram SGLang's n-gram server last), one at a time
(they would share the GPUs): check that
no other process holds GPU memory, launch it (infra.sglang.ManagedServer: readiness = model_info,
health_generate, server_info, then a checked greedy smoke generation; a speculative server must also report
verify steps), benchmark every concurrency level (infra.sglang_bench) and stop it, also when the benchmark
fails. Last, compare the two runs (MeasurementError when a speedup exceeds the acceptance length) and write
<run>/deploy/results.json and report.md (eagle3.deploy_report; ``--report-only`` builds them again from the
recorded runs); server logs are <run>/deploy/sglang-{baseline,speculative}.log.

A benchmark that passed its checks writes deploy/deploy.manifest.json last (key: the serve section, the export
manifest, the target), so a re-run with the same export and settings is skipped like any stage's; ``--force``
measures again.
The export and the offline evaluation are stages of their own (eagle3.export, eagle3.evaluate.stage).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.config import ConfigError, RunConfig
from eagle3.deploy_checks import NGRAM, SAMPLING_FIELDS, dflash_trio, draft_dir, setting_label
from eagle3.deploy_records import DeployReport, Role, ServerRun
from eagle3.deploy_report import recorded_runs, write_report
from eagle3.export import stage as export
from eagle3.run.layout import DEPLOY_DIR
from eagle3.run.progress import Progress, ProgressFn
from eagle3.run.stage import StageId, StageOutcome

if TYPE_CHECKING:
    from infra.sglang import ProbeExpectations
    from infra.sglang_bench import BenchSettings
    from infra.sglang_spec import NgramSettings, ServerSpec

log = logging.getLogger(__name__)

STAGE = StageId("deploy", DEPLOY_DIR)
SECTION = "serve"
DESCRIPTION = "benchmark the target served by SGLang with and without the drafter (serve.enabled)"
NOT_ENABLED = "serve.enabled is false: no GPU host with SGLang configured, so no server was started"


def deploy_dir(cfg: RunConfig) -> Path:
    """<run>/deploy: results.json, report.md and the server logs."""
    return cfg.run_dir / STAGE.folder


def trios(cfg: RunConfig) -> list[str]:
    """The EAGLE-3 settings to benchmark, 'steps-topk-draft_tokens': serve's own trio, then extra_speculative; a
    DFlash drafter's one (its export's block size: eagle3.deploy_checks.dflash_trio)."""
    if cfg.drafter.family == "dflash":
        return [dflash_trio(cfg)]
    sv = cfg.serve
    main = f"{sv.num_steps}-{sv.eagle_topk}-{sv.num_draft_tokens}"
    return [main, *(t for t in sv.extra_speculative if t != main)]


def speculative_settings(cfg: RunConfig) -> list[str]:
    """Every speculative server benchmarked against the one baseline, in order: the drafter's settings (trios),
    then 'ngram' (SGLang's drafter-free n-gram speculation) with serve.ngram."""
    return [*trios(cfg), *([NGRAM] if cfg.serve.ngram else [])]


def ngram_settings(cfg: RunConfig) -> NgramSettings:
    """serve.ngram_* as the n-gram server's settings."""
    from infra.sglang_spec import NgramSettings

    sv = cfg.serve
    return NgramSettings(
        sv.ngram_num_draft_tokens,
        sv.ngram_min_bfs_breadth,
        sv.ngram_max_bfs_breadth,
        sv.ngram_max_trie_depth,
        sv.ngram_match_type,
    )


def server_specs(
    cfg: RunConfig, model_path: str, draft_path: str, api_key: str | None, trio: str | None = None
) -> tuple[ServerSpec, ServerSpec]:
    """(baseline, speculative) ServerSpecs from cfg.serve and cfg.server: equal flags except --speculative-* and
    the port (a DFlash drafter: a DFLASH server verifying ``trio``'s draft tokens, its block size; ``trio`` 'ngram':
    SGLang's n-gram server with serve.ngram_*)."""
    from eagle3.config_sglang import parse_trio
    from infra.sglang import dflash_serving_pair, ngram_serving_pair, serving_pair

    sv, server = cfg.serve, cfg.server
    shared: dict[str, Any] = dict(
        port=sv.port,
        host=server.host,
        allow_remote=server.allow_remote_host,
        tp_size=server.tp_size,
        dtype=sv.dtype,
        mem_fraction_static=sv.mem_fraction_static,
        max_running_requests=sv.max_running_requests,
        cuda_graph_max_bs_decode=sv.cuda_graph_max_bs_decode,
        attention_backend=server.attention_backend,
        extra_args=tuple(server.extra_args),
        api_key=api_key,
        python=server.python,
        module=server.launch_module,
    )
    if trio == NGRAM:
        return ngram_serving_pair(model_path, ngram=ngram_settings(cfg), **shared)
    steps, topk, tokens = parse_trio(trio or trios(cfg)[0])
    if cfg.drafter.family == "dflash":
        return dflash_serving_pair(model_path, draft_path, block_size=tokens, **shared)
    rejection = topk == 1 and cfg.evaluate.temperature > 0 and cfg.evaluate.chain_sampling == "rejection"
    return serving_pair(
        model_path,
        draft_path,
        num_steps=steps,
        topk=topk,
        num_draft_tokens=tokens,
        rejection_sampling=rejection,
        **shared,
    )


def bench_settings(cfg: RunConfig) -> BenchSettings:
    """cfg.serve -> infra.sglang_bench.BenchSettings (evaluation prompts stop at end of turn, as eagle3 eval does);
    requests sample as eagle3 eval does (evaluate.temperature, top_p, top_k), so the accept lengths compare."""
    from infra.sglang_bench import BenchSettings

    sv, e = cfg.serve, cfg.evaluate
    return BenchSettings(
        tuple(sv.concurrency_levels),
        sv.num_prompts,
        sv.max_new_tokens,
        sv.num_warmup,
        sv.request_timeout_s,
        ignore_eos=sv.prompts == "fixed",
        temperature=e.temperature,
        top_p=e.top_p,
        top_k=e.top_k,
    )


@dataclass(frozen=True)
class DeployPrompts:
    """What every server is sent: text or token ids, and each prompt's group (its dataset, or 'fixed')."""

    prompts: list[str] | list[list[int]]
    groups: list[str]


def deploy_prompts(cfg: RunConfig, model_path: str) -> DeployPrompts:
    """serve.prompts: the fixed English set, or the evaluation's rendered prompts (count must equal num_prompts)."""
    from infra.sglang_bench import fixed_prompts

    sv = cfg.serve
    if sv.prompts == "fixed":
        return DeployPrompts(fixed_prompts(sv.num_prompts), ["fixed"] * sv.num_prompts)
    from eagle3.evaluate.prompts import load_prompts
    from eagle3.target.load import load_tokenizer

    e = cfg.evaluate
    items = load_prompts(e.datasets, {name: e.limit_for(name) for name in e.datasets}, load_tokenizer(Path(model_path)))
    if len(items) != sv.num_prompts:
        raise ValueError(
            f"serve.prompts is evaluation: evaluate.datasets give {len(items)} prompts, so set "
            f"serve.num_prompts={len(items)} (it is {sv.num_prompts})"
        )
    return DeployPrompts([ids for _, ids in items], [p.dataset for p, _ in items])


def probe_expectations(model_path: str) -> ProbeExpectations:
    """Architectures and vocab size from a local target's config.json (nothing to compare for a hub id)."""
    from infra.sglang import ProbeExpectations

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return ProbeExpectations()
    doc = json.loads(config.read_text())
    return ProbeExpectations(
        architectures=tuple(doc.get("architectures") or ()) or None, vocab_size=doc.get("vocab_size")
    )


def check_draft(path: Path, family: str = "eagle3") -> None:
    """The export's own strict check for the drafter family (SGLang skips unknown keys silently); say which step is
    missing first."""
    from eagle3.export.dflash import check_dflash_export
    from eagle3.export.sglang import check_sglang_export

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no exported drafter at {path} (no config.json): run the export step first")
    (check_dflash_export if family == "dflash" else check_sglang_export)(path)


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
    check_draft(draft_dir(cfg), cfg.drafter.family)
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
    """The servers' API key: from the environment variable server.api_key_env names, else a fresh random one."""
    env_name = cfg.server.api_key_env
    return (os.environ.get(env_name) if env_name else None) or secrets.token_hex(16)


def benchmark_server(
    cfg: RunConfig,
    role: Role,
    plan: ServingPlan,
    progress: ProgressFn | None = None,
    logger: logging.Logger | logging.LoggerAdapter = log,
    trio: str | None = None,
) -> ServerRun:
    """Launch one server (a speculative one with ``trio``, default serve's own; 'ngram': SGLang's n-gram server),
    wait until it passes readiness, benchmark every level, always stop it."""
    from infra.process import RestartPolicy
    from infra.sglang import ManagedServer
    from infra.sglang_bench import run_benchmark

    api_key = api_key_for(cfg)
    trio = (trio or trios(cfg)[0]) if role == "speculative" else None
    spec = server_specs(cfg, plan.model_path, plan.draft_model_path, api_key, trio)[role == "speculative"]
    settings = bench_settings(cfg)
    sent = deploy_prompts(cfg, plan.model_path)
    check_gpus(cfg)  # the other servers must be gone, and nobody else on the GPUs
    name = role if trio is None else f"{role}-{trio}"
    # No restart: a server that died once has not been measured under the same conditions.
    server = ManagedServer(
        spec,
        deploy_dir(cfg) / f"sglang-{name}.log",
        expect=probe_expectations(plan.model_path),
        startup_timeout_s=cfg.server.startup_timeout_s,
        policy=RestartPolicy(max_restarts=0),
    )
    logger.info("starting %s server: %s", name, server.process.printable_argv)
    try:
        ready = server.start()
        result = run_benchmark(
            spec.base_url, sent.prompts, settings, speculative=role == "speculative", api_key=api_key, progress=progress
        )
    finally:
        server.stop()
    return ServerRun(
        role,
        server.process.printable_argv,
        str(server.log_path),
        server.pid,
        {"smoke": ready.smoke, "elapsed_s": ready.elapsed_s, "version": ready.version},
        result,
        trio,
        tuple(sent.groups),
    )


def finish_deploy(cfg: RunConfig, baseline: ServerRun, speculative: ServerRun | Sequence[ServerRun]) -> DeployReport:
    """The stage's last step: the report (eagle3.deploy_report.write_report: results.json, report.md,
    MeasurementError when the figures fail their checks), then, its figures checked, the manifest."""
    from eagle3.run.stage import MissingInputError, write_manifest

    runs = [speculative] if isinstance(speculative, ServerRun) else list(speculative)
    report = write_report(cfg, baseline, runs)
    try:
        stage_key = key(cfg)
    except MissingInputError as exc:  # a drafter carried in without its run's export manifest: nothing to key
        log.info("deploy: no manifest written (%s)", exc)
        return report
    write_manifest(
        STAGE.manifest(cfg.run_dir),
        STAGE,
        stage_key,
        {"results": report.results, "report": report.report},
        {"valid": True, "trios": [run.trio for run in runs]},
    )
    return report


def run_deploy(cfg: RunConfig, show_bar: bool | None = None) -> DeployReport:
    """The whole stage without an orchestrator: prepare, baseline server, each speculative server, report."""
    if not cfg.serve.enabled:
        raise ConfigError(f"{NOT_ENABLED}; set serve.enabled=true on a GPU host with SGLang")
    plan = prepare_serving(cfg)
    with _progress_bar(cfg, "baseline", show_bar) as bar:
        baseline = benchmark_server(cfg, "baseline", plan, progress=_advance(bar))
    runs = []
    for trio in speculative_settings(cfg):
        with _progress_bar(cfg, setting_label(cfg, trio), show_bar) as bar:
            runs.append(benchmark_server(cfg, "speculative", plan, progress=_advance(bar), trio=trio))
    return finish_deploy(cfg, baseline, runs)


def report_again(cfg: RunConfig) -> DeployReport:
    """The report rebuilt from the server runs <run>/deploy/results.json recorded, checked against eagle3 eval's
    results as they are now: an evaluation run after the benchmark (or on another machine) is compared without
    serving again."""
    baseline, runs = recorded_runs(cfg)
    return finish_deploy(cfg, baseline, runs)


def _advance(bar: Progress) -> ProgressFn:
    return lambda done, total, info: bar.update(done - bar.done, **info)


def _progress_bar(cfg: RunConfig, role: str, show_bar: bool | None) -> Progress:
    """A bar over every request of one server's benchmark (warmups included), as infra.sglang_bench counts them."""
    sv = cfg.serve
    return Progress(len(sv.concurrency_levels) * (sv.num_prompts + sv.num_warmup), f"benchmark {role}", bar=show_bar)


# ------------------------------------------------------------------------------- the stage (eagle3.run.registry)


def skip_reason(cfg: RunConfig) -> str | None:
    """Why the stage has nothing to do for ``cfg`` (None: it runs): no SGLang host is configured."""
    return None if cfg.serve.enabled else NOT_ENABLED


def key(cfg: RunConfig) -> str:
    """The serve section (operational fields left out), the export manifest, the target, and the evaluation's
    sampling where it samples (greedy runs keep the key they had before the benchmark could sample)."""
    from eagle3.config import section_dict
    from eagle3.run.stage import stage_key
    from eagle3.target.load import fingerprint, prepare_target

    extra: dict[str, Any] = {"target": fingerprint(prepare_target(cfg))}
    if cfg.evaluate.temperature > 0:
        extra["sampling"] = {name: getattr(cfg.evaluate, name) for name in SAMPLING_FIELDS}
    return stage_key(STAGE, section_dict(cfg, SECTION), [export.STAGE.manifest(cfg.run_dir)], extra)


def skipped(cfg: RunConfig, known_key: str | None = None) -> StageOutcome | None:
    """The outcome recorded by a benchmark of these settings and this export, or None (it has to run)."""
    from eagle3.run.stage import MissingInputError, skipped_outcome

    try:
        known_key = known_key or key(cfg)
    except MissingInputError:  # a drafter carried in without its run's export manifest: nothing to match
        return None
    return skipped_outcome(STAGE, STAGE.manifest(cfg.run_dir), known_key)


def run(
    cfg: RunConfig,
    progress: ProgressFn | None = None,
    force: bool = False,
    known_key: str | None = None,
    show_bar: bool | None = None,
) -> StageOutcome | None:
    """The benchmark in this process (None without serve.enabled; skipped when its manifest matches)."""
    from eagle3.run.stage import read_manifest

    if skip_reason(cfg):
        return None
    done = None if force else skipped(cfg, known_key)
    if done is not None:
        return done
    run_deploy(cfg, show_bar=show_bar)
    manifest = STAGE.manifest(cfg.run_dir)
    doc = read_manifest(manifest)
    if doc is None:  # measured, but with no export manifest to key it (finish_deploy)
        return None
    return StageOutcome.from_manifest(STAGE.name, doc["key"], manifest, doc, computed=True)


def main(argv: list[str] | None = None) -> None:
    """python -m eagle3.deploy --preset X [--set a.b=c] | --config <run>/config.json [--force | --report-only]"""
    from eagle3.run.cli_args import add_config_args, stage_main

    parser = add_config_args(argparse.ArgumentParser(description=main.__doc__))
    parser.add_argument("--force", action="store_true", help="measure again even if the manifest matches")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="start no server: rebuild report.md and results.json from the recorded server runs, "
        "with the accept-length checks against eagle3 eval's results as they are now",
    )

    def run_cli(cfg: RunConfig, args: argparse.Namespace) -> DeployReport | StageOutcome:
        if args.report_only:
            return report_again(cfg)
        if not cfg.serve.enabled:
            raise ConfigError(f"{NOT_ENABLED}; set serve.enabled=true on a GPU host with SGLang")
        done = None if args.force else skipped(cfg)
        return done if done is not None else run_deploy(cfg, show_bar=True)

    stage_main(parser, argv, run_cli, lock_owner="python -m eagle3.deploy", show=_show_report)


def _show_report(report: DeployReport | StageOutcome) -> None:
    if isinstance(report, StageOutcome):  # up to date: nothing measured
        print(f"deploy up to date ({report.manifest}); --force measures again")
        print(json.dumps(report.to_json(), indent=2))
        return
    print(report.markdown)
    print(json.dumps(report.to_json(), indent=2))


if __name__ == "__main__":
    main()
