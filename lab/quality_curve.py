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
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab import curve_carry  # noqa: E402
from lab.curve_phases import (  # noqa: E402
    DEFAULT_BUDGETS_S,
    TRAIN_TOKENS_PER_S,
    Curve,
    in_process_runner,
    per_run_phases,
    phase_data,
    phase_eval,
    phase_export,
    phase_replay,
    phase_report,
    phase_train,
    subprocess_runner,
)
from lab.curve_runs import Size, base_config, parse_tokens  # noqa: E402

DEFAULT_PRESET, DEFAULT_SIZES = "smollm2-curve", "3M,10M,20M"
CUT_SHORT = 3
"""Exit status when a phase ran out of its budget (run the same command again to continue)."""


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
