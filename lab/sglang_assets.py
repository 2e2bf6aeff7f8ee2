"""Get SGLang 0.5.16 onto a bare, offline GPU host (CPython 3.12, torch 2.11.0+cu130) in carried bundles.

The lent GPU host has no network and takes at most 64 MiB of working tree per call; files outside the repository
survive between consecutive calls while it stays warm. The 94 wheels SGLang needs there and a trimmed
sglang-kernel are pinned, with sha256 and size, in ``lab/sglang-0.5.16-host.lock``; this tool downloads them
here, trims the kernel, cuts everything into bundles with ``bundles.pack`` (lab/bundles.py) and installs them
there:

    # here, once (network to PyPI; ~550 MB downloaded into .whl/sglang-0.5.16, bundles in .sglang/, both ignored):
    python lab/sglang_assets.py all
    #   = download --lock lab/sglang-0.5.16-host.lock --dest .whl/sglang-0.5.16
    #     + trim + pack --dest .whl/sglang-0.5.16 --out .sglang --limit-mib 58
    # there, one call per bundle, back to back (carry: [".sglang/bundle-K"]):
    python3 lab/sglang_assets.py install .sglang/bundle-K --stage /tmp/sglang-stage --site /tmp/sglang-site
    # the call that completes the set installs it and prints: export PYTHONPATH=/tmp/sglang-site

``install`` assembles each file once all its chunks have arrived (sha256-checked by ``bundles.unpack``; a
damaged chunk is an error naming the file) and prints what is still missing. Once everything is there it runs
``pip install --no-index --no-deps --no-compile --target SITE`` on the wheels, untars the trimmed kernel into SITE
and checks ``import sglang`` with ``PYTHONPATH=SITE``. Running the last bundle again installs nothing new.

The kernel wheel (383 MB, 1.2 GB unpacked) is carried as ``sgl_kernel_trim.tar.xz`` without the paths in
``TRIMS``; each trim must match something in the wheel, so a kernel release that renamed them fails loudly:

- ``sgl_kernel/flash_ops.abi3.so``: FlashAttention-3 (1.12 GB unpacked). ``sgl_kernel/__init__`` does not import
  it; only ``sgl_kernel/flash_attn.py`` does, which SGLang's fa3 attention backend uses. Serve with
  ``--attention-backend triton`` (or flashinfer).
- ``sgl_kernel/sm100/``: the common_ops build that ``sgl_kernel.load_utils`` loads on any GPU other than compute
  capability 9.0; H100 and H200 (9.0) load ``sgl_kernel/sm90/``, which is kept. On another GPU, carry the full
  wheel instead.

``sgl_kernel/__init__.py`` and the ``infllm_ops`` extension (imported by ``sgl_kernel/__init__``) must survive
the trim. The tool itself needs only the standard library and pip, not torch.
"""

from __future__ import annotations

import argparse
import calendar
import hashlib
import json
import os
import string
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    from lab import bundles
except ImportError:  # run as a script: lab/ is sys.path[0]
    import bundles  # type: ignore[no-redef]

DEFAULT_LOCK = Path(__file__).with_name("sglang-0.5.16-host.lock")
DEFAULT_DEST = Path(".whl/sglang-0.5.16")
KERNEL = "sglang-kernel"
TRIMMED = "sgl_kernel_trim.tar.xz"
PREFIX = "_sglang/"
"""Carried files are stored under this prefix in the stage folder."""
MARKER = ".sglang_assets_installed"
"""Written into SITE after a complete install; holds the sha256 of the bundles' manifest."""
MANIFEST_ROOM = 1 << 16
"""Bytes of each bundle left for the bundles' manifest, so a whole bundle folder stays under --limit-mib."""
PYTHON_VERSION = "3.12"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
KEEP = "sgl_kernel/__init__.py"
PROTECTED = "infllm_ops"


@dataclass(frozen=True)
class Trim:
    """A path left out of the carried kernel (a folder ends in '/') and why that is safe."""

    path: str
    reason: str

    def matches(self, name: str) -> bool:
        """Whether a wheel member is this path (or lies under it, for a folder)."""
        return name.startswith(self.path) if self.path.endswith("/") else name == self.path


TRIMS = (
    Trim(
        "sgl_kernel/flash_ops.abi3.so",
        "FlashAttention-3, 1.12 GB unpacked; only sgl_kernel/flash_attn.py imports it (the fa3 attention backend); "
        "serve with --attention-backend triton or flashinfer",
    ),
    Trim(
        "sgl_kernel/sm100/",
        "the common_ops build loaded on GPUs other than compute capability 9.0; H100/H200 load sgl_kernel/sm90/",
    ),
)


@dataclass(frozen=True)
class Pin:
    """One locked file: the requirement that fetches it and the bytes it must have."""

    name: str
    version: str
    sha256: str
    size: int
    filename: str

    @property
    def requirement(self) -> str:
        """``name==version`` for pip."""
        return f"{self.name}=={self.version}"


def parse_lock(text: str) -> list[Pin]:
    """Lines ``name==version sha256 size filename``; '#' starts a comment. A malformed line is an error."""
    pins = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        requirement, _, rest = fields[0].partition("==")
        if (
            len(fields) != 4
            or not requirement
            or not rest
            or len(fields[1]) != 64
            or not set(fields[1]) <= set(string.hexdigits)
            or not fields[2].isdigit()
        ):
            raise ValueError(f"lock line {number}: expected 'name==version sha256 size filename', got {raw!r}")
        pins.append(Pin(requirement, rest, fields[1].lower(), int(fields[2]), fields[3]))
    if len({p.filename for p in pins}) != len(pins):
        raise ValueError("lock: a filename appears twice")
    return pins


def read_lock(path: Path) -> list[Pin]:
    """The pins of a lock file."""
    return parse_lock(path.read_text())


def kernel_pin(pins: Sequence[Pin]) -> Pin:
    """The sglang-kernel wheel's pin."""
    found = [p for p in pins if p.name == KERNEL]
    if len(found) != 1:
        raise ValueError(f"the lock must pin {KERNEL} exactly once, found {len(found)}")
    return found[0]


def problem(pin: Pin, dest: Path) -> str | None:
    """Why ``dest/filename`` is not the pinned file, or None if it is."""
    path = dest / pin.filename
    if not path.is_file():
        return f"{pin.filename}: missing (pip did not fetch it for {pin.requirement}, or fetched another file)"
    if path.stat().st_size != pin.size:
        return f"{pin.filename}: {path.stat().st_size} bytes, the lock says {pin.size}"
    if bundles.sha256_of(path) != pin.sha256:
        return f"{pin.filename}: sha256 differs from the lock's"
    return None


def verify(pins: Sequence[Pin], dest: Path) -> None:
    """Every pinned file is in ``dest`` with its size and sha256; otherwise an error naming each bad file."""
    problems = [p for p in (problem(pin, dest) for pin in pins) if p]
    if problems:
        raise ValueError("files that do not match the lock:\n  " + "\n  ".join(problems))


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """``pip download`` the requirements as py3.12/x86_64 binaries, without dependencies, into ``dest``."""
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            *platforms,
            "-d",
            str(dest),
            *requirements,
        ],
        check=True,
    )


def download(pins: Sequence[Pin], dest: Path) -> None:
    """Fetch the pinned files not already in ``dest`` with the right sha256, then verify all of them."""
    dest.mkdir(parents=True, exist_ok=True)
    todo = [pin for pin in pins if problem(pin, dest)]
    print(f"{len(pins) - len(todo)} of {len(pins)} files already in {dest}; downloading {len(todo)}")
    if todo:
        pip_download([pin.requirement for pin in todo], dest)
    verify(pins, dest)
    print(f"all {len(pins)} files match the lock")


def trimmed_members(names: Sequence[str], trims: Sequence[Trim] = TRIMS) -> list[str]:
    """The wheel members that stay; every trim must match a member, and KEEP and PROTECTED files must stay."""
    for trim in trims:
        if not any(trim.matches(name) for name in names):
            raise ValueError(
                f"trim {trim.path!r} matches nothing in the kernel wheel: the kernel's layout changed; "
                "check whether the trim is still safe and update TRIMS"
            )
    kept = [name for name in names if not any(trim.matches(name) for trim in trims)]
    if KEEP not in kept:
        raise ValueError(f"{KEEP} is not in the trimmed kernel (absent from the wheel, or trimmed)")
    dropped = sorted(set(names) - set(kept))
    if any(PROTECTED in name for name in dropped):
        raise ValueError(f"a trim drops {PROTECTED} (imported by {KEEP}): {dropped}")
    return kept


def trim(wheel: Path, out: Path, trims: Sequence[Trim] = TRIMS, preset: int = 6) -> list[str]:
    """Write the wheel's members minus ``trims`` to ``out`` (tar.xz, streamed member by member); returns the dropped."""
    with zipfile.ZipFile(wheel) as zf:
        infos = {info.filename: info for info in zf.infolist() if not info.is_dir()}
        kept = trimmed_members(sorted(infos), trims)
        tmp = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp, "w:xz", preset=preset) as tar:
            for name in kept:
                info = infos[name]
                member = tarfile.TarInfo(name)
                member.size = info.file_size
                member.mtime = calendar.timegm(info.date_time + (0, 0, 0))
                member.mode = (info.external_attr >> 16) & 0o777 or 0o644
                with zf.open(info) as fh:
                    tar.addfile(member, fh)
    tmp.replace(out)
    return sorted(set(infos) - set(kept))


def carried_files(pins: Sequence[Pin], dest: Path) -> dict[str, Path]:
    """What travels: every locked wheel except the kernel, plus the trimmed kernel, under PREFIX."""
    files = {PREFIX + pin.filename: dest / pin.filename for pin in pins if pin.name != KERNEL}
    files[PREFIX + TRIMMED] = dest / TRIMMED
    return files


def folder_size(folder: Path) -> int:
    """Bytes of the files in a folder (not recursive)."""
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def pack(pins: Sequence[Pin], dest: Path, out: Path, limit: int) -> list[Path]:
    """Bundles ``out/bundle-K`` of the verified wheels and the trimmed kernel, each folder at most ``limit`` bytes."""
    verify([pin for pin in pins if pin.name != KERNEL], dest)
    if not (dest / TRIMMED).is_file():
        raise FileNotFoundError(f"{dest / TRIMMED} does not exist; run trim first")
    packed = bundles.pack(carried_files(pins, dest), out, limit - MANIFEST_ROOM)
    for folder in packed:
        if folder_size(folder) > limit:
            raise ValueError(f"{folder}: {folder_size(folder)} bytes, over the limit of {limit}")
    return packed


def extract(tarball: Path, site: Path) -> None:
    """Untar the trimmed kernel into ``site``."""
    with tarfile.open(tarball, "r:xz") as tar:
        tar.extractall(site, filter="data")


def import_check(site: Path) -> int:
    """Run ``import sglang`` with PYTHONPATH=site; returns its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, "-c", "import sglang; print('sglang', sglang.__version__)"], env=env
    ).returncode


def install(bundle: Path, stage: Path, site: Path) -> tuple[list[str], bool]:
    """Take in one bundle; once all files are assembled, install them into ``site`` (once).

    Returns the files still missing and whether this call installed anything."""
    missing = bundles.unpack(bundle, stage, stage)
    if missing:
        return missing, False
    manifest = (bundle / bundles.MANIFEST).read_text()
    digest = hashlib.sha256(manifest.encode()).hexdigest()
    marker = site / MARKER
    if marker.is_file() and marker.read_text().strip() == digest:
        return [], False
    dests = [entry["dest"] for entry in json.loads(manifest) if entry["dest"].startswith(PREFIX)]
    site.mkdir(parents=True, exist_ok=True)
    bundles.pip_install([stage / d for d in dests if d.endswith(".whl")], site)
    extract(stage / (PREFIX + TRIMMED), site)
    marker.write_text(digest + "\n")
    return [], True


def run_install(bundle: Path, stage: Path, site: Path, check: bool = True) -> int:
    """The install subcommand: report progress, and once complete the PYTHONPATH advice and the import check."""
    missing, installed = install(bundle, stage, site)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        print(f"{len(missing)} files still missing (carry the next bundle): {shown}")
        return 0
    print(f"installed into {site}" if installed else f"already installed in {site} (nothing new)")
    print(f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}   # serve with --attention-backend triton")
    return import_check(site) if check else 0


def print_bundles(folders: Sequence[Path]) -> None:
    """One line per bundle: its folder and size."""
    for folder in folders:
        size = folder_size(folder)
        print(f"{folder}: {size / (1 << 20):.1f} MiB ({size:,} bytes, {len(list(folder.iterdir())) - 1} chunks)")


def main(argv: Sequence[str] | None = None) -> int:
    """download | trim | pack | all (here); install (on the GPU host, once per bundle)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    commands = {
        name: sub.add_parser(name, help=text)
        for name, text in [
            ("download", "fetch and verify the locked files"),
            ("trim", f"write {TRIMMED} from the kernel wheel"),
            ("pack", "write .sglang/bundle-K folders"),
            ("all", "download, trim and pack"),
            ("install", "take in one carried bundle on the GPU host"),
        ]
    }
    for name in ("download", "trim", "pack", "all"):
        commands[name].add_argument("--lock", type=Path, default=DEFAULT_LOCK)
        commands[name].add_argument("--dest", type=Path, default=DEFAULT_DEST, help="where the files are downloaded")
    for name in ("pack", "all"):
        commands[name].add_argument("--out", type=Path, default=Path(".sglang"))
        commands[name].add_argument(
            "--limit-mib",
            type=float,
            default=58.0,
            help="bytes per bundle folder; leave room for the repository under 64 MiB",
        )
    commands["install"].add_argument("bundle", type=Path)
    commands["install"].add_argument("--stage", type=Path, default=Path("/tmp/sglang-stage"))
    commands["install"].add_argument("--site", type=Path, default=Path("/tmp/sglang-site"))
    commands["install"].add_argument("--no-check", action="store_true", help="skip the 'import sglang' check")
    args = parser.parse_args(argv)
    if args.cmd == "install":
        return run_install(args.bundle, args.stage, args.site, check=not args.no_check)
    pins = read_lock(args.lock)
    if args.cmd in ("download", "all"):
        download(pins, args.dest)
    if args.cmd in ("trim", "all"):
        verify([kernel_pin(pins)], args.dest)
        wheel = args.dest / kernel_pin(pins).filename
        dropped = trim(wheel, args.dest / TRIMMED)
        size = (args.dest / TRIMMED).stat().st_size
        print(
            f"{args.dest / TRIMMED}: {size:,} bytes, sha256 {bundles.sha256_of(args.dest / TRIMMED)}; "
            f"dropped {', '.join(dropped)}"
        )
    if args.cmd in ("pack", "all"):
        print_bundles(pack(pins, args.dest, args.out, int(args.limit_mib * (1 << 20))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
