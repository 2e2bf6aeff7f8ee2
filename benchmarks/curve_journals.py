"""Carry a data run's generated text between GPU hosts: its generation journals as an xz tar in parts.

A lent GPU host starts bare and returns at most 16 MiB per file, while the text the target generated takes a
stretch's minutes to make again. ``pack`` writes the journals (regeneration and synthesis) of a data run as parts
of one xz tar; ``unpack`` restores them into a data run elsewhere, after which its data stages generate only what
the journals lack. ``benchmarks/quality_curve.py pack-journals DIR`` / ``unpack-journals DIR`` call these.
"""

from __future__ import annotations

import io
import lzma
import tarfile
from pathlib import Path

JOURNALS = ("data/regenerate.journal.jsonl", "data/synthetic")
"""What is carried, relative to the data run: the generated text, from which a rerun rebuilds the data."""
PART_GLOB = "journals.tar.xz.*"


def pack(run_dir: Path, out: Path, part_mib: float = 15.0) -> list[Path]:
    """The journals under ``run_dir`` as ``out``/journals.tar.xz.NN parts of at most ``part_mib`` MiB each."""
    present = [rel for rel in JOURNALS if (run_dir / rel).exists()]
    if not present:
        raise SystemExit(f"error: no generation journal under {run_dir} ({', '.join(JOURNALS)})")
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for rel in present:
            tar.add(run_dir / rel, arcname=rel)
    data, size, parts = buffer.getvalue(), int(part_mib * (1 << 20)), []
    for i in range(0, len(data), size):
        parts.append(out / f"journals.tar.xz.{i // size:02d}")
        parts[-1].write_bytes(data[i:i + size])
    return parts


def unpack(run_dir: Path, folder: Path) -> list[str]:
    """Restore pack's parts from ``folder`` into ``run_dir``; returns the member names written."""
    parts = sorted(folder.glob(PART_GLOB))
    if not parts:
        raise SystemExit(f"error: no {PART_GLOB} parts in {folder}")
    try:
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:xz") as tar:
            names = tar.getnames()
            tar.extractall(run_dir, filter="data")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as err:  # a part missing or cut short
        raise SystemExit(f"error: the journal parts in {folder} ({', '.join(p.name for p in parts)}) do not "
                         f"form a whole archive: {err}") from None
    return names
