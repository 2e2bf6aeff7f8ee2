"""What each phase of the data-scaling curve runs (lab/quality_curve.py runs the phases by name).

``Curve`` holds what every phase needs (preset, overrides, sizes, budgets, how stages run); each ``phase_*`` runs
one run's stage commands (data, train, export, evaluate, replay) or writes the report, within the phase's time
budget: ``subprocess_runner`` gives a stage SIGTERM past it and SIGKILL after ``GRACE_S``, ``in_process_runner``
runs it here with no budget (tests, CPU smoke runs). Each returns False when the phase was cut short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.data.stages import vocab as vocab_stage
from eagle3.evaluate import stage as evaluate_stage
from eagle3.export import stage as export_stage
from eagle3.run.layout import PROMPTS_FILE, REPLAYED_FILE
from eagle3.run.registry import STAGES
from eagle3.train import stage as train_stage
from lab.curve_report import write_curve_report
from lab.curve_runs import (
    Size,
    Variant,
    base_config,
    parse_tokens,
    prepare_size_run,
    run_name,
    size_config,
    sweep_variants,
)

DEFAULT_BUDGETS_S = {"data": 650.0, "train": 240.0, "export": 90.0, "eval": 500.0}
"""Seconds per phase (the default train budget plus N x epochs / TRAIN_TOKENS_PER_S s for size N); see
lab/quality_curve.py's docstring."""
TRAIN_TOKENS_PER_S = 90_000
"""Online training's rate for the default budgets: the H200's median step ran at 106-107K tok/s (docs/evaluate.md,
seventh and eighth stretches), less a margin for validation and checkpoints."""
GRACE_S = 90.0
"""After SIGTERM, how long a phase may take to checkpoint and exit before SIGKILL."""
MIN_PHASE_S = 30.0
"""Under --deadline-s, a phase is not started with less budget than this."""


# ----------------------------------------------------------------------------------------------- runners

Runner = Callable[[str, list[str], float], bool]
"""(module, argv, budget_s) -> True when it finished, False when cut short by the budget."""


def subprocess_runner(module: str, argv: list[str], budget_s: float) -> bool:
    """``python -m module argv`` in its own process group; SIGTERM past the budget, SIGKILL after the grace."""
    cmd = [sys.executable, "-m", module, *argv]
    print(f"$ {' '.join(cmd)}  (budget {budget_s:.0f} s)", flush=True)
    repo = Path(__file__).resolve().parents[1]  # the stages import from this checkout, from any cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=repo, env=env)
    try:
        rc = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return False
    if rc != 0:
        raise SystemExit(f"error: {module} exited with status {rc}")
    return True


def in_process_runner(module: str, argv: list[str], budget_s: float) -> bool:
    """The module's main(argv) in this process (no budget): for tests and CPU smoke runs."""
    import importlib

    main = importlib.import_module(module).main
    try:
        main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise SystemExit(f"error: {module} exited with status {exc.code}") from None
    return True


# ------------------------------------------------------------------------------------------------ phases


@dataclass
class Curve:
    """What every phase needs: the preset, overrides, sizes, budgets and how stages are run."""

    preset: str
    overrides: list[str]
    sizes: list[Size]
    budgets: dict[str, float]
    runner: Runner
    ngram_every_size: bool = False
    nproc: int = 1
    variant_labels: tuple[str, ...] = ()
    explicit_budgets: frozenset[str] = frozenset()  # phases given --budget-s: the whole budget, nothing added
    greedy_texts: Path | None = None  # replay: an evaluation's prompts.jsonl (default: the first size's)
    replay_smaller: bool = False  # all: decode the largest size only (n-gram with it), replay the others
    deadline: float | None = None  # time.monotonic() by which every phase has ended (--deadline-s)
    size_runs: tuple[tuple[int, str], ...] = ()  # (tokens, preset): report takes that size from the preset's run
    pack_to: Path | None = None  # --pack-results-to: results packed there after every phase (see curve_carry)
    pack_weights: bool = False  # --with-weights: the drafters too

    def run(self, module: str, argv: list[str], budget_s: float) -> bool:
        """The runner within the phase's budget, cut to what --deadline-s leaves (a phase needs MIN_PHASE_S to start;
        the budget leaves GRACE_S for the SIGTERM exit); False when it was cut short or could not start."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic() - GRACE_S
            if left < MIN_PHASE_S:
                print(f"deadline: {left + GRACE_S:.0f} s left, not starting {module}", flush=True)
                return False
            budget_s = min(budget_s, left)
        return self.runner(module, argv, budget_s)

    def decode_order(self) -> list[Size]:
        """The order ``all`` decodes the sizes in: the first one measures n-gram and its greedy texts serve the
        replays (largest first with --replay-smaller)."""
        return self.sizes[::-1] if self.replay_smaller else list(self.sizes)

    def set_args(self) -> list[str]:
        """The overrides as --set arguments."""
        return [a for o in self.overrides for a in ("--set", o)]

    def size(self, label: str) -> Size:
        """The size named in a phase ('3M'), which must be one of --sizes."""
        tokens = parse_tokens(label)
        if tokens not in [s.tokens for s in self.sizes]:
            raise SystemExit(f"error: size {label} is not in --sizes ({', '.join(s.label for s in self.sizes)})")
        return Size(tokens)

    def size_run(self, size: Size, variant: Variant | None = None) -> tuple[object, Path]:
        """(config, config.json path) of one size's run (or of a recipe variant of it), prepared."""
        with_ngram = self.ngram_every_size or (variant is None and size == self.decode_order()[0])
        cfg = size_config(self.preset, self.overrides, size, with_ngram, variant)
        parts = ("data",) if variant and variant.own_vocab else ("data", "vocab")
        return cfg, prepare_size_run(base_config(self.preset, self.overrides), cfg, parts)

    def variant(self, label: str) -> Variant:
        """The sweep variant named in a phase ('epochs-3')."""
        every = sweep_variants(base_config(self.preset, self.overrides))
        for v in every:
            if v.label == label:
                return v
        raise SystemExit(f"error: no variant {label!r}; the sweep has {[v.label for v in every]}")

    def variants(self) -> list[Variant]:
        """The recipe sweep's variants (all, or those named by --variants)."""
        every = sweep_variants(base_config(self.preset, self.overrides))
        chosen = [v for v in every if not self.variant_labels or v.label in self.variant_labels]
        unknown = set(self.variant_labels) - {v.label for v in every}
        if unknown:
            raise SystemExit(f"error: unknown variants {sorted(unknown)}; the sweep has {[v.label for v in every]}")
        return chosen


def phase_data(c: Curve) -> bool:
    """Every data stage of the data run."""
    return c.run("eagle3.run.stages", ["all", "--preset", c.preset, *c.set_args()], c.budgets["data"])


def phase_train(c: Curve, size: Size, variant: Variant | None = None) -> bool:
    """Online training on the first N tokens (torchrun when NPROC > 1); a variant with its own draft vocab maps
    it first."""
    cfg, config = c.size_run(size, variant)
    if variant and variant.own_vocab and not c.run(vocab_stage.__name__, ["--config", str(config)], c.budgets["data"]):
        return False
    passes = size.tokens * cfg.train.num_epochs
    budget = c.budgets["train"] + (0 if "train" in c.explicit_budgets else passes / TRAIN_TOKENS_PER_S)
    if c.nproc > 1:
        return c.run(
            "torch.distributed.run",
            ["--standalone", f"--nproc-per-node={c.nproc}", "-m", train_stage.__name__, "--config", str(config)],
            budget,
        )
    return c.run(train_stage.__name__, ["--config", str(config)], budget)


def phase_export(c: Curve, size: Size, variant: Variant | None = None) -> bool:
    """Both export layouts of the size's selected checkpoint."""
    return c.run(export_stage.__name__, ["--config", str(c.size_run(size, variant)[1])], c.budgets["export"])


def phase_eval(c: Curve, size: Size, variant: Variant | None = None) -> bool:
    """The fixed prompts with every method of the size's config."""
    return c.run(evaluate_stage.__name__, ["--config", str(c.size_run(size, variant)[1])], c.budgets["eval"])


def eval_file(c: Curve, size: Size, name: str, variant: Variant | None = None) -> Path:
    """runs/<name>-N[-variant]/eval/<name>: where a size's evaluation files are."""
    base = base_config(c.preset, c.overrides)
    return base.run_dir.parent / run_name(base.run.name, size, variant) / "eval" / name


def greedy_texts(c: Curve) -> Path:
    """--greedy-texts, else the first size's evaluation prompts.jsonl that exists (every evaluation of the same
    target and prompts decodes the same greedy texts)."""
    if c.greedy_texts is not None:
        return c.greedy_texts
    for size in c.decode_order():
        if (path := eval_file(c, size, PROMPTS_FILE)).is_file():
            return path
    raise SystemExit("error: replay needs greedy texts: evaluate one size first, or pass --greedy-texts")


def phase_replay(c: Curve, size: Size, variant: Variant | None = None) -> bool:
    """Chain and n-gram acceptance of the size's exported drafter replayed on greedy texts (no decode):
    runs/<name>-N/eval/replayed.json, which the report uses for the methods its decode did not measure."""
    cfg, config = c.size_run(size, variant)
    return c.run(
        "lab.drafter_shift",
        [
            "--config",
            str(config),
            "--set",
            "evaluate.methods=[chain,ngram]",
            "--eval-prompts",
            str(greedy_texts(c)),
            "--replay-only",
            "--device",
            cfg.evaluate.device,
            "--out",
            str(eval_file(c, size, REPLAYED_FILE, variant)),
        ],
        c.budgets["eval"],
    )


def _differences(mine: object, theirs: object, where: str = "") -> list[str]:
    """The dotted keys at which two config dumps differ."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [
            d
            for k in sorted(set(mine) | set(theirs))
            for d in _differences(mine.get(k), theirs.get(k), f"{where}.{k}" if where else k)
        ]
    return [] if mine == theirs else [f"{where} ({mine!r} here, {theirs!r} there)"]


def borrowed_eval(c: Curve, size: Size, preset: str) -> Path:
    """The eval folder of ``preset``'s run, which must have trained size N exactly as the curve does (every
    setting but run.name and the evaluated methods), so that run is the point without training it twice. An error names
    the settings that differ."""
    from eagle3.config import load_config

    theirs_cfg = load_config(preset, c.overrides)
    dumps = [size_config(c.preset, c.overrides, size, True).model_dump(mode="json"), theirs_cfg.model_dump(mode="json")]
    for doc in dumps:
        doc["run"].pop("name")
        doc["evaluate"].pop("methods")
    if diff := _differences(*dumps):
        raise SystemExit(
            f"error: --size-run {size.label}={preset}: its run is not the curve's size {size.label}: " + "; ".join(diff)
        )
    return theirs_cfg.run_dir / "eval"


def phase_report(c: Curve) -> dict[str, Path]:
    """curve.md, curve.png and curve.json under runs/<name>/curve from every size measured so far."""
    from eagle3.run.layout import run_layout

    base = base_config(c.preset, c.overrides)
    results = {s.tokens: eval_file(c, s, "results.json") for s in c.sizes}
    results.update({tokens: borrowed_eval(c, Size(tokens), preset) / "results.json" for tokens, preset in c.size_runs})
    replayed = {s.tokens: eval_file(c, s, REPLAYED_FILE) for s in c.sizes}
    variants = sweep_variants(base)
    sweep = {v.label: eval_file(c, c.sizes[-1], "results.json", v) for v in variants}
    sweep_replayed = {v.label: eval_file(c, c.sizes[-1], REPLAYED_FILE, v) for v in variants}
    outputs = write_curve_report(results, run_layout(base).appendix, sweep, replayed, sweep_replayed)
    print(outputs["markdown"].read_text())
    return outputs


PhaseFn = Callable[[Curve, Size, Variant | None], bool]


def per_run_phases(replay: bool = False) -> list[PhaseFn]:
    """What one size's run does, in the registry's order of the stages: train, export, then evaluate (``replay``:
    replay on greedy texts instead of a decode)."""
    phases: dict[object, PhaseFn] = {
        train_stage: phase_train,
        export_stage: phase_export,
        evaluate_stage: phase_replay if replay else phase_eval,
    }
    return [phases[s.module] for s in STAGES if s.module in phases]
