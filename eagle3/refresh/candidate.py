"""A refresh round's data and candidate: the new prompts answered by the target, the data pool, and the drafter
trained on it from the promoted one's weights.

    <run>/refresh/rounds/<NNNN>/
        prompts.jsonl     the lines the round took from the source (eagle3.refresh.source), as merge input
        ingest/           a run directory: the merge of prompts.jsonl, then (refresh.regenerate) the target's answers
                          through the regenerate stage (journaled per conversation, so a killed round redoes none)
        candidate/        a run directory: the pool merged, tokenized, vocab, capture, train, export/sglang
        start.json        the promoted drafter the candidate trains from (fixed when the round first trains)
        gate/             eagle3.refresh.gate
        report.md         what the round did and why (eagle3.refresh.report)

The pool of round N is the run's own conversations (its regenerated.parquet, or merged.parquet without
regeneration) plus the answered conversations of rounds 1..N, each a Parquet source of the candidate's merge;
a round whose candidate was kept still adds its data to the later pools (nothing taken is skipped). The candidate
is the run's config with the pool as its sources, regeneration off (every answer is the target's already, or kept
on purpose), training bounded by refresh.max_steps from refresh.init_from = the promoted drafter.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from infra.storage import run_lock

if TYPE_CHECKING:
    from eagle3.config import RunConfig, SourceConfig

INGEST, CANDIDATE, PROMPTS = "ingest", "candidate", "prompts.jsonl"


def answered_file(cfg: RunConfig) -> Path:
    """The run's conversations as tokenize reads them: regenerated.parquet, or merged.parquet without regeneration."""
    from eagle3.run.layout import run_layout

    layout = run_layout(cfg)
    return layout.regenerated if cfg.regenerate.enabled else layout.merged


def _sub_run(cfg: RunConfig, round_dir: Path, name: str, update: dict) -> RunConfig:
    """``cfg`` as a run directory ``round_dir/name`` sharing the run's target cache, with ``update`` applied."""
    from eagle3.config import validate_config

    data = cfg.model_dump(mode="json")
    data["run"] |= {"workdir": str(round_dir), "name": name}
    data["target"]["cache_dir"] = str(cfg.target_cache_dir.resolve())
    for section, fields in update.items():
        data[section] = data[section] | fields
    return validate_config(data, f"refresh round {round_dir.name} ({name})")


def ingest_config(cfg: RunConfig, round_dir: Path) -> RunConfig:
    """The round's prompts as the one source of a run whose answers the target writes (refresh.regenerate)."""
    source = {"name": f"refresh-{round_dir.name}", "path": str((round_dir / PROMPTS).resolve()), "format": "openai"}
    return _sub_run(
        cfg,
        round_dir,
        INGEST,
        {"data": {"sources": [source], "min_rows": 1}, "regenerate": {"enabled": cfg.refresh.regenerate}},
    )


def run_all(cfg: RunConfig) -> None:
    """Every data stage of ``cfg`` under its run lock, config.json saved first (eagle3.run.registry)."""
    from eagle3.run.layout import write_run_config
    from eagle3.run.registry import run_data_block

    with run_lock(cfg.run_dir, owner="eagle3 refresh (data stages)"):
        write_run_config(cfg)
        run_data_block(cfg)


def ingest(cfg: RunConfig, round_dir: Path) -> Path | None:
    """Merge (and answer) the round's prompts; their conversations' Parquet file, or None when the merge kept none
    (every record rejected: the reasons are in ingest/data/rejects.jsonl)."""
    from eagle3.data.merge import MergeError

    sub = ingest_config(cfg, round_dir)
    try:
        run_all(sub)
    except MergeError:
        return None
    return answered_file(sub)


def pool_sources(cfg: RunConfig, answered: list[tuple[str, Path]]) -> list[SourceConfig]:
    """The run's conversations, then each round's (round id, Parquet file), as sources of the candidate's merge."""
    from eagle3.config import SourceConfig
    from eagle3.data.stages import merge, regenerate
    from eagle3.run.registry import get_stage

    base = answered_file(cfg)
    if not get_stage((regenerate if cfg.regenerate.enabled else merge).STAGE.name).is_complete(cfg):
        raise FileNotFoundError(f"{base} is not complete: run the pipeline's data stages on {cfg.run_dir} first")
    return [
        SourceConfig(name="run", path=str(base.resolve()), format="parquet"),
        *(SourceConfig(name=f"refresh-{rid}", path=str(path.resolve()), format="parquet") for rid, path in answered),
    ]


def candidate_config(cfg: RunConfig, round_dir: Path, sources: list[SourceConfig], init_from: Path) -> RunConfig:
    """The candidate's run: the pool, no regeneration, refresh.max_steps steps from the promoted drafter."""
    r = cfg.refresh
    return _sub_run(
        cfg,
        round_dir,
        CANDIDATE,
        {
            "data": {"sources": [s.model_dump(mode="json") for s in sources]},
            "regenerate": {"enabled": False},
            "train": {"max_steps": r.max_steps, "lr": r.lr or cfg.train.lr},
            "refresh": {"init_from": str(init_from.resolve()), "prompts": None},
        },
    )


def build_candidate(cand: RunConfig) -> Path:
    """Data stages, capture (offline features), training under torchrun, export; the SGLang export folder. Every
    stage skips what is complete, so a killed round resumes where it stopped."""
    from eagle3.export.stage import run_export
    from eagle3.features.capture import run_capture
    from eagle3.run.layout import run_layout

    run_all(cand)
    if cand.train.features == "offline":
        with run_lock(cand.run_dir, owner="eagle3 refresh (capture)"):
            run_capture(cand)
    train_candidate(cand)
    with run_lock(cand.run_dir, owner="eagle3 refresh (export)"):
        run_export(cand)
    return run_layout(cand).sglang_export


def train_candidate(cand: RunConfig) -> None:
    """python -m eagle3.train under torchrun on this node's GPUs (one process without GPUs); it resumes from its
    latest checkpoint and does nothing when its manifest is up to date. A refresh trains on one node."""
    from eagle3.run.layout import run_layout, write_run_config
    from infra.gpus import list_gpus
    from infra.torchrun import TorchrunSpec, run_torchrun

    gpus = [] if cand.train.device == "cpu" else list_gpus()
    spec = TorchrunSpec(
        module="eagle3.train",
        args=("--config", str(write_run_config(cand).resolve())),
        nproc_per_node=cand.train.nproc_per_node or max(1, len(gpus)),
        rdzv_id=f"refresh-{cand.run.name}",
        env={} if gpus else {"OMP_NUM_THREADS": "1"},
    )
    run_torchrun(spec, run_layout(cand).train / "torchrun.log", timeout_s=cand.train.timeout_s)
