"""What completeness by content costs: sha256 of stage outputs, first time and cached, per MB.

Writes one file of ``--mb`` MB (random bytes) with a stage manifest naming it, lets it settle past the
cache's racy window, then times (a) a plain sha256 of the file, (b) the first ``manifest_matches`` of a
new process (one hash), (c) the next one (a stat: the per-process cache). The file is in the page cache
throughout, so (a) and (b) measure hashing, not the disk; a cold read adds the disk's read time.

    python lab/integrity.py --mb 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.run.stage import manifest_matches, write_manifest  # noqa: E402
from infra.storage import RACY_NS, forget_hashes, sha256_file  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Print seconds and MB/s for each of the three checks."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=512, help="size of the output file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "merged.parquet"
        with open(out, "wb") as fh:
            for _ in range(args.mb):
                fh.write(os.urandom(1 << 20))
        manifest = Path(tmp) / "merge.manifest.json"
        write_manifest(manifest, "merge", "k", {"merged": out}, {})
        time.sleep(RACY_NS / 1e9 + 0.1)  # a file younger than the racy window is never cached
        plain = _timed(lambda: sha256_file(out))
        forget_hashes()  # what a new process starts with
        first = _timed(lambda: manifest_matches(manifest, "k"))
        again = _timed(lambda: manifest_matches(manifest, "k"))
    print(
        json.dumps(
            {
                "mb": args.mb,
                "sha256_s": round(plain, 3),
                "sha256_mb_per_s": round(args.mb / plain, 1),
                "first_check_s": round(first, 3),
                "cached_check_s": round(again, 6),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
