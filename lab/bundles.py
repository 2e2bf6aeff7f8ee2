"""Carry files to a bare GPU host in bundles that each fit one call's transfer limit.

A lent GPU host has no network and takes at most 64 MiB of working tree per call; files outside the repository
survive between consecutive calls while it stays warm. ``pack`` cuts files into chunks over numbered bundle folders
(text files travel xz-compressed), each with the same manifest; ``unpack``, once per bundle there, assembles a file
into the site folder as soon as all its chunks have arrived and checks its sha256 (a mismatch is an error naming the
file). ``pip_install`` installs carried wheels without an index. lab/curve_assets.py (the curve's target and data)
and lab/sglang_assets.py (SGLang's wheels) carry their files this way. Standard library only: the host may lack
everything else.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "assets.json"
COMPRESSED_SUFFIXES = (".json", ".jsonl", ".txt", ".md")
"""Files with these suffixes travel xz-compressed (text compresses ~5x; quantized weights do not)."""


@dataclass(frozen=True)
class Chunk:
    """One piece of a carried file: its name in a bundle and the bundle's number."""

    name: str
    bundle: int


@dataclass(frozen=True)
class CarriedFile:
    """A file as carried: where it goes in the site folder, its hash and size, how it was encoded."""

    dest: str
    sha256: str
    size: int
    xz: bool
    chunks: list[Chunk]


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def encoded(src: Path, dest: str, work: Path) -> tuple[Path, bool]:
    """The bytes that travel: an xz copy of a text file, the file itself otherwise."""
    if not dest.endswith(COMPRESSED_SUFFIXES):
        return src, False
    out = work / (hashlib.sha256(dest.encode()).hexdigest()[:16] + ".xz")
    with src.open("rb") as fin, lzma.open(out, "wb", preset=9) as fout:
        shutil.copyfileobj(fin, fout, 1 << 24)
    return out, True


def pack(files: dict[str, Path], out: Path, limit: int) -> list[Path]:
    """Write bundles ``out/bundle-1..K`` (each at most ``limit`` bytes of chunks) and a manifest in each."""
    if out.exists():
        shutil.rmtree(out)
    work = out / "work"
    work.mkdir(parents=True)
    carried, bundle, room = [], 1, limit
    for dest, src in files.items():
        if not src.is_file():
            raise FileNotFoundError(f"{src} (for {dest}) does not exist")
        data, xz = encoded(src, dest, work)
        chunks, offset, size = [], 0, data.stat().st_size
        with data.open("rb") as fh:
            while offset < size or not chunks:
                if room == 0:
                    bundle, room = bundle + 1, limit
                take = min(room, size - offset)
                name = f"{hashlib.sha256(dest.encode()).hexdigest()[:16]}.{len(chunks):03d}"
                folder = out / f"bundle-{bundle}"
                folder.mkdir(exist_ok=True)
                (folder / name).write_bytes(fh.read(take))
                chunks.append(Chunk(name, bundle))
                offset, room = offset + take, room - take
        carried.append(CarriedFile(dest, sha256_of(src), src.stat().st_size, xz, chunks))
    shutil.rmtree(work)
    manifest = json.dumps([asdict(f) for f in carried], indent=1)
    bundles = sorted(out.glob("bundle-*"))
    for folder in bundles:
        (folder / MANIFEST).write_text(manifest)
    return bundles


def assemble(entry: CarriedFile, stage: Path, site: Path) -> Path:
    """Join a file's chunks (decompressing an xz one) into the site folder and check its sha256."""
    target = site / entry.dest
    target.parent.mkdir(parents=True, exist_ok=True)
    joined = stage / (entry.chunks[0].name + ".joined")
    with joined.open("wb") as out:
        for chunk in entry.chunks:
            with (stage / chunk.name).open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 24)
    tmp = target.with_name(target.name + ".tmp")
    if entry.xz:
        with lzma.open(joined, "rb") as fin, tmp.open("wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 24)
        joined.unlink()
    else:
        joined.replace(tmp)
    if sha256_of(tmp) != entry.sha256:
        tmp.unlink()
        raise ValueError(
            f"{entry.dest}: sha256 of the assembled file differs from the packed one "
            "(a chunk is damaged or from another pack); pack and carry the bundles again"
        )
    tmp.replace(target)
    return target


def unpack(bundle: Path, stage: Path, site: Path) -> list[str]:
    """Copy one bundle's chunks into ``stage``; assemble every file now complete into ``site``; returns the files
    still missing."""
    entries = [
        CarriedFile(e["dest"], e["sha256"], e["size"], e["xz"], [Chunk(**c) for c in e["chunks"]])
        for e in json.loads((bundle / MANIFEST).read_text())
    ]
    stage.mkdir(parents=True, exist_ok=True)
    for path in bundle.iterdir():
        if path.name != MANIFEST:
            shutil.copyfile(path, stage / path.name)
    missing = []
    for entry in entries:
        target = site / entry.dest
        if target.is_file() and target.stat().st_size == entry.size:
            continue
        if all((stage / c.name).is_file() for c in entry.chunks):
            assemble(entry, stage, site)
            print(f"assembled {entry.dest} ({entry.size:,} bytes, sha256 checked)")
        else:
            missing.append(entry.dest)
    return missing


def pip_install(wheels: Sequence[Path], site: Path) -> None:
    """Install wheels into ``site`` without an index or dependencies."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            str(site),
            *map(str, wheels),
        ],
        check=True,
    )
