"""The data-scaling curve on one GPU, without Prefect: data once, then train, export and evaluate per size.

    python3 lab/quality_curve.py PHASE [--preset smollm2-curve] [--sizes 3M,10M,20M] [--set k=v ...]
    PHASE: data | train-N | export-N | eval-N | replay-N | size-N (train, export, eval) | sweep[-VARIANT] |
           report | all  (N: 3M, 10M, ...; train-N-VARIANT etc. run one step of a sweep variant at the largest
           size N; replay-N: chain and n-gram acceptance replayed on greedy texts, seconds instead of a decode)

``data`` runs every data stage (synthesize, merge, regenerate, tokenize, vocab) in the preset's run
(runs/<name>). Each size N is its own run, runs/<name>-N, whose data/ and vocab/ are links to that run's and
whose config adds ``train.max_train_tokens=N`` (the first rows of the shuffled train split up to N tokens, so
the sizes are nested). Every size after the first leaves n-gram out of its methods: the baseline uses no
drafter, so one measurement stands for all (``--ngram-every-size`` measures it each time, sweep variants too:
the four methods of a full quality run). ``report`` writes runs/<name>/curve/{curve.md,curve.png,curve.json}
from the sizes' eval/results.json (lab/curve_report.py); ``--size-run 20M=PRESET`` takes a size from another
preset's run after checking that it trained exactly that size. ``sweep`` trains, exports and measures recipe variants
at the largest size (``sweep_variants``), each in runs/<name>-<largest>-<variant> (the vocab variant maps its own
vocab/ from the linked data); the report puts them in a table beside the baseline.
``all`` does not run the sweep. Phases joined by commas (``data,train-14.2M,export-14.2M,eval-14.2M``) run in order
under one ``--deadline-s``, every name checked first, and stop at the first one cut short.

Every phase skips what its manifests (and the regeneration, synthesis and evaluation journals, and the
training checkpoints) say is done, and runs under a time budget (``--budget-s phase=seconds``; phases:
data, train, export, eval): past it the phase gets SIGTERM (training checkpoints and exits, the journals are
fsynced per record), then SIGKILL after a grace period, and the script exits 3: the same command continues.

Time on one H200 (every stretch's figures and commands: docs/evaluate.md): data ~90 s with the generated text
carried in (``pack-journals`` there, ``unpack-journals`` here), 743-790 s generating it on a bare host; six epochs
of 20M tokens trained online in 795 s with 96 GiB of feature cache holding all their states on the GPU (``--set
train.feature_cache_gib=96``; 1,064 s with 80 GiB); export ~5 s; the 160-prompt evaluation with all four methods
265-350 s, alone on the GPU (a decode beside a training runs ~3x slower). So a stretch holds the data (generated
text carried in) and the largest size, or the data and a few smaller sizes, but not the data generated afresh and
six epochs of the largest size; ``pack-results`` carries what each measured back, ``unpack-results`` restores it
here, and ``report`` draws the sizes of every stretch.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.data.stages import vocab as vocab_stage  # noqa: E402
from eagle3.evaluate import stage as evaluate_stage  # noqa: E402
from eagle3.export import stage as export_stage  # noqa: E402
from eagle3.run.layout import PROMPTS_FILE, REPLAYED_FILE  # noqa: E402
from eagle3.run.registry import STAGES  # noqa: E402
from eagle3.train import stage as train_stage  # noqa: E402
from lab import curve_carry  # noqa: E402
from lab.curve_report import write_curve_report  # noqa: E402
from lab.curve_runs import (  # noqa: E402
    Size,
    Variant,
    base_config,
    parse_tokens,
    prepare_size_run,
    run_name,
    size_config,
    sweep_variants,
)

DEFAULT_PRESET, DEFAULT_SIZES = "smollm2-curve", "3M,10M,20M"
DEFAULT_BUDGETS_S = {"data": 650.0, "train": 240.0, "export": 90.0, "eval": 500.0}
"""Seconds per phase (the default train budget plus N x epochs / TRAIN_TOKENS_PER_S s for size N); see the module
docstring."""
TRAIN_TOKENS_PER_S = 90_000
"""Online training's rate for the default budgets: the H200's median step ran at 106-107K tok/s (docs/evaluate.md,
seventh and eighth stretches), less a margin for validation and checkpoints."""
GRACE_S = 90.0
"""After SIGTERM, how long a phase may take to checkpoint and exit before SIGKILL."""
MIN_PHASE_S = 30.0
"""Under --deadline-s, a phase is not started with less budget than this."""
CUT_SHORT = 3
"""Exit status when a phase ran out of its budget (run the same command again to continue)."""


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


def phase_steps(c: Curve, phase: str) -> list[Callable[[], bool]]:
    """What one phase runs, as steps (each False when cut short); an unknown phase, size or variant is an error
    here, before anything runs."""
    name, _, label = phase.partition("-")
    if phase == "data":
        return [lambda: phase_data(c)]
    if phase == "report":
        return [lambda: bool(phase_report(c))]
    if name == "sweep":  # sweep (every variant) or sweep-<variant>, at the largest size
        variants = [c.variant(label)] if label else c.variants()
        return [lambda f=f, v=v: f(c, c.sizes[-1], v) for v in variants for f in per_run_phases(c.replay_smaller)]
    if name in ("train", "export", "eval", "replay", "size") and label:
        size_label, _, variant_label = label.partition("-")  # 6.7M or 6.7M-epochs-3 (a sweep variant's run)
        size, variant = c.size(size_label), c.variant(variant_label) if variant_label else None
        if variant is not None and size != c.sizes[-1]:
            raise SystemExit(f"error: the sweep's variants run at the largest size, {c.sizes[-1].label}")
        fns = {"train": phase_train, "export": phase_export, "eval": phase_eval, "replay": phase_replay}
        chosen = per_run_phases() if name == "size" else [fns[name]]
        return [lambda f=f: f(c, size, variant) for f in chosen]
    raise SystemExit(f"error: unknown phase {phase!r}")


def run_phase(c: Curve, phase: str, steps: list[Callable[[], bool]] | None = None) -> bool:
    """One phase by name (or its steps, already built); False when it was cut short."""
    t0 = time.monotonic()
    steps = phase_steps(c, phase) if steps is None else steps
    print(f"== {phase} ==", flush=True)
    done = all(step() for step in steps)
    if c.pack_to is not None:  # so a GPU call can take the results so far, whatever happens to the host later
        try:
            parts = curve_carry.pack_results(base_config(c.preset, c.overrides).run_dir, c.pack_to, c.pack_weights)
            print(f"results packed to {c.pack_to} ({len(parts)} parts)", flush=True)
        except SystemExit as err:  # nothing measured yet: not a reason to stop the phases
            print(f"results not packed: {err}", flush=True)
    if not done:
        print(f"== {phase} cut short by its budget after {time.monotonic() - t0:.0f} s: run it again ==")
        return False
    print(f"== {phase} took {time.monotonic() - t0:.0f} s ==", flush=True)
    return True


def run_phases(c: Curve, phases: list[str]) -> bool:
    """Phases in order under the one --deadline-s, every name checked before the first runs; stops at the first
    cut short (False): the same command continues there, the finished ones skipping what their manifests hold."""
    steps = [phase_steps(c, phase) for phase in phases]
    return all(run_phase(c, phase, s) for phase, s in zip(phases, steps))


def all_phases(c: Curve) -> list[str]:
    """What ``all`` runs: data, every size (train, export, eval), the report; with --replay-smaller the largest
    size is decoded first and the smaller ones replayed on its greedy texts (minutes less per size)."""
    if not c.replay_smaller:
        return ["data", *[f"size-{s.label}" for s in c.sizes], "report"]
    smaller = [f"{step}-{s.label}" for s in c.sizes[:-1] for step in ("train", "export", "replay")]
    return ["data", f"size-{c.sizes[-1].label}", *smaller, "report"]


def _size_run(sizes: list[Size], item: str) -> tuple[int, str]:
    """--size-run N=PRESET as (tokens, preset); N must be one of --sizes."""
    label, _, preset = item.partition("=")
    tokens = parse_tokens(label) if label and preset else None
    if tokens not in [s.tokens for s in sizes]:
        raise SystemExit(f"error: --size-run {item!r}: want N=PRESET with N one of --sizes")
    return tokens, preset


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the phases; exit status 3 when one was cut short."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "phase",
        help="data | train-N | export-N | eval-N | replay-N | size-N | sweep | "
        "sweep-VARIANT | report | all | pack-journals DIR | unpack-journals DIR | "
        "pack-results DIR | unpack-results DIR; "
        "several phases comma-separated (data,train-14.2M,...) run in order",
    )
    parser.add_argument("folder", nargs="?", type=Path, help="pack-* / unpack-*: the folder of the parts")
    parser.add_argument("--preset", default=DEFAULT_PRESET)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="token budgets, ascending (e.g. 3M,10M,20M)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--budget-s",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help=f"phase budgets (defaults {DEFAULT_BUDGETS_S}; the default train budget adds "
        f"N x epochs / {TRAIN_TOKENS_PER_S} for size N, a given one is the whole budget)",
    )
    parser.add_argument(
        "--ngram-every-size", action="store_true", help="measure n-gram at every size and sweep variant"
    )
    parser.add_argument(
        "--variants",
        default="",
        help="sweep: only these variants (comma-separated labels, e.g. lr-x2,vocab-32768); default all",
    )
    parser.add_argument(
        "--with-weights",
        action="store_true",
        help="pack-results: the exported drafters too (to evaluate one again on another host)",
    )
    parser.add_argument("--pack-results-to", type=Path, help="pack-results into this folder after every phase")
    parser.add_argument(
        "--size-run",
        action="append",
        default=[],
        metavar="N=PRESET",
        help="report: take size N from PRESET's run (checked to be that size's run under another name)",
    )
    parser.add_argument("--in-process", action="store_true", help="run stages in this process, no budgets")
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="end every phase within this many seconds from now (a GPU "
        "command's limit); the same command continues later",
    )
    parser.add_argument(
        "--replay-smaller",
        action="store_true",
        help="all: decode the largest size only (with n-gram), replay the smaller sizes on its texts; "
        "sweep: replay the variants",
    )
    parser.add_argument(
        "--greedy-texts",
        type=Path,
        help="replay-N: an evaluation's prompts.jsonl of the same target and prompts (default: the first size's)",
    )
    args = parser.parse_args(argv)
    budgets = dict(DEFAULT_BUDGETS_S)
    for item in args.budget_s:
        key, _, value = item.partition("=")
        if key not in budgets:
            raise SystemExit(f"error: --budget-s {item!r}: phase must be one of {', '.join(budgets)}")
        budgets[key] = float(value)
    sizes = [Size(parse_tokens(s)) for s in args.sizes.split(",")]
    if [s.tokens for s in sizes] != sorted({s.tokens for s in sizes}):
        raise SystemExit(f"error: --sizes {args.sizes} must be distinct and ascending")
    curve = Curve(
        args.preset,
        args.overrides,
        sizes,
        budgets,
        in_process_runner if args.in_process else subprocess_runner,
        args.ngram_every_size,
        int(os.environ.get("NPROC", "1")),
        tuple(v for v in args.variants.split(",") if v),
        frozenset(item.partition("=")[0] for item in args.budget_s),
        args.greedy_texts,
        args.replay_smaller,
        None if args.deadline_s is None else time.monotonic() + args.deadline_s,
        tuple(_size_run(sizes, item) for item in args.size_run),
        args.pack_results_to,
        args.with_weights,
    )
    if args.phase in curve_carry.PHASES:
        if args.folder is None:
            raise SystemExit(f"error: {args.phase} needs a folder")
        print(
            "\n".join(
                curve_carry.run(
                    args.phase, base_config(curve.preset, curve.overrides).run_dir, args.folder, args.with_weights
                )
            )
        )
        return 0
    if args.phase != "all":
        return 0 if run_phases(curve, args.phase.split(",")) else CUT_SHORT
    for phase in all_phases(curve):
        if not run_phase(curve, phase):
            if phase != "report":
                run_phase(curve, "report")  # what is measured so far
            return CUT_SHORT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
