"""The train split's supervised token counts of a run, saved as .npy (int64 [target vocab]) for
``lab/sglang_levers.py --token-counts`` where the run's tokenized data is not (a drafter carried to another host).

    python lab/token_counts.py --tokenized runs/<run>/data/tokenized.parquet \\
        --export runs/<run>/export/sglang --out .curve/token-counts.npy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from eagle3.data.vocab import count_train_tokens  # noqa: E402
from eagle3.export.checks import CONFIG_FILE  # noqa: E402


def save_counts(tokenized: Path, export: Path, out: Path) -> tuple[int, int]:
    """Count over ``tokenized``'s train rows in the export's target vocab, save to ``out``; (tokens, train rows)."""
    vocab_size = int(json.loads((export / CONFIG_FILE).read_text())["vocab_size"])
    counts, rows = count_train_tokens(tokenized, vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, counts)
    return int(counts.sum()), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenized", type=Path, required=True, help="the run's data/tokenized.parquet")
    parser.add_argument("--export", type=Path, required=True, help="the drafter's SGLang export (its target vocab)")
    parser.add_argument("--out", type=Path, required=True, help="the .npy to write")
    args = parser.parse_args(argv)
    tokens, rows = save_counts(args.tokenized, args.export, args.out)
    print(f"{args.out}: {tokens} supervised tokens over {rows} train rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
