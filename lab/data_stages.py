"""Wall time of the data stages (merge, tokenize, vocab) on N real ShareGPT conversations.

    .venv/bin/python lab/data_stages.py --num-conversations 2000 10000

Each size runs in a fresh run directory (the converted target is shared through target.cache_dir),
without Prefect, and prints one `name: value` line per figure.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eagle3.config import load_config
from eagle3.run.stages import run_merge, run_tokenize, run_vocab, write_run_config
from eagle3.target.load import prepare_target


def measure(num_conversations: int, preset: str, cache_dir: Path, overrides: list[str]) -> None:
    """Run the three stages once and print their wall times and headline figures."""
    with tempfile.TemporaryDirectory() as workdir:
        cfg = load_config(
            preset,
            [
                f"run.workdir={workdir}",
                f"target.cache_dir={cache_dir}",
                f"data.sources.0.max_records={num_conversations}",
                *overrides,
            ],
        )
        write_run_config(cfg)
        prepare_target(cfg)  # one-time conversion is not a data-stage cost
        timings, outcomes = {}, {}
        for name, fn in (("merge", run_merge), ("tokenize", run_tokenize), ("vocab", run_vocab)):
            t0 = time.perf_counter()
            outcomes[name] = fn(cfg, force=True)
            timings[name] = time.perf_counter() - t0
    n = num_conversations
    tok, voc = outcomes["tokenize"].stats, outcomes["vocab"].stats
    print(f"conversations[{n}].merged_rows: {outcomes['merge'].stats['total']['kept']}")
    for name, wall in timings.items():
        print(f"conversations[{n}].{name}_wall_s: {wall:.2f}")
    print(f"conversations[{n}].data_stages_wall_s: {sum(timings.values()):.2f}")
    print(f"conversations[{n}].tokenize_rows_per_s: {tok['rows_in'] / timings['tokenize']:.1f}")
    print(f"conversations[{n}].tokenize_tokens_per_s: {tok['num_tokens'] / timings['tokenize']:.0f}")
    for size, cov in sorted(voc.get("coverage_at", {}).items()):
        print(f"conversations[{n}].vocab_coverage_at_{size}: {cov:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-conversations", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--preset", default="smollm2-demo")
    parser.add_argument("--cache-dir", type=Path, default=Path("runs/_targets"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    for n in args.num_conversations:
        measure(n, args.preset, args.cache_dir.resolve(), args.overrides)


if __name__ == "__main__":
    main()
