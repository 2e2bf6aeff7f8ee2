"""Carry a curve's files between GPU hosts and this machine: xz tars in parts of bounded size.

A lent GPU host starts bare and returns at most 8 files of 16 MiB per call, and everything on it is lost with it.
Two things have to travel:
- **journals** (``pack_journals`` / ``unpack_journals``): the generation journals (regeneration and synthesis) of
  a data run, the text the target took a stretch's minutes to write; restored into a data run elsewhere, its data
  stages generate only what the journals lack. A synthetic source's records file is left behind: the synthesize
  stage writes it again from the journal without generating, and it is as large as the journal.
- **results** (``pack_results`` / ``unpack_results``): what every run of a curve measured (its config, training
  metrics, export metadata and model card, evaluation results and prompt records), and with ``weights`` the
  exported drafters, so a later host can evaluate one again without training it, and ``quality_curve.py report``
  can draw the curve here from sizes measured on different hosts.
``lab/quality_curve.py pack-journals|unpack-journals|pack-results|unpack-results DIR`` call these.
"""

from __future__ import annotations

import functools
import io
import lzma
import tarfile
from pathlib import Path


@functools.cache
def _carried() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """What travels, as paths relative to a run, from the names the stages write (imported when first needed: the
    export's names come with torch): (journals: where the generated text of a data run is journaled, the
    regeneration journal and the synthetic sources' folder (``journal_files``), from which a rerun rebuilds its data;
    results: what each run of a curve measured, a path through a link such as a size's data/ excepted;
    weights: the exported drafter, in the SGLang layout the other layout is exported from). The evaluation journal
    travels too: an evaluation cut short by a stretch's end leaves only it, and ``eagle3.evaluate.stage``'s
    ``write_partial_report`` reads it here."""
    from eagle3.data.regenerate import JOURNAL_NAME
    from eagle3.data.synthetic import SYNTHETIC_DIR
    from eagle3.evaluate.stage import JOURNAL_NAME as EVAL_JOURNAL
    from eagle3.export.checks import CONFIG_FILE, INFO_FILE, WEIGHTS_FILE
    from eagle3.export.model_card import CARD_FILE
    from eagle3.run.layout import MERGE_STATS_FILE, PROMPTS_FILE, REPLAYED_FILE, REPORT_FILE, RunLayout
    from eagle3.run.registry import get_stage

    run = RunLayout(Path())
    export = run.sglang_export
    journals = (run.data / JOURNAL_NAME, run.data / SYNTHETIC_DIR)
    train, exported, evaluated = (get_stage(name).manifest(run.root) for name in ("train", "export", "evaluate"))
    results = (
        run.config,
        run.data / MERGE_STATS_FILE,
        run.appendix,
        run.metrics,
        run.progress,
        train,
        exported,
        export / CARD_FILE,
        export / CONFIG_FILE,
        export / INFO_FILE,
        run.eval_results,
        run.eval / REPORT_FILE,
        run.eval / PROMPTS_FILE,
        evaluated,
        run.eval / REPLAYED_FILE,
        run.eval / EVAL_JOURNAL,
    )
    return tuple(tuple(p.as_posix() for p in group) for group in (journals, results, (export / WEIGHTS_FILE,)))


RESULTS_XZ_PRESET = 0
"""xz preset of the results' parts: mostly drafter weights, which barely compress. Two drafters and two prompt files
(59.4 MB) took 53.8 s at xz's default preset 6 and 7.5 s at 0 on a 2-core CPU, for 41.5 against 43.2 MB; the parts
are repacked after every phase (``--pack-results-to``), so the default cost every phase that long."""


def _write_parts(members: list[tuple[Path, str]], out: Path, stem: str, part_mib: float, preset: int = 6) -> list[Path]:
    """``members`` ((file or folder, name in the archive)) as ``out``/<stem>.tar.xz.NN of at most part_mib MiB, xz at
    ``preset``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{stem}.tar.xz.*"):
        old.unlink()  # parts of an earlier, longer archive would join this one
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=preset) as tar:
        for path, name in members:
            tar.add(path, arcname=name)
    data, size, parts = buffer.getvalue(), int(part_mib * (1 << 20)), []
    for i in range(0, len(data), size):
        parts.append(out / f"{stem}.tar.xz.{i // size:02d}")
        parts[-1].write_bytes(data[i : i + size])
    return parts


def _read_parts(root: Path, folder: Path, stem: str) -> list[str]:
    """Join ``folder``/<stem>.tar.xz.* and extract them under ``root``; returns the member names written."""
    parts = sorted(folder.glob(f"{stem}.tar.xz.*"))
    if not parts:
        raise SystemExit(f"error: no {stem}.tar.xz.* parts in {folder}")
    try:
        with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:xz") as tar:
            names = tar.getnames()
            tar.extractall(root, filter="data")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as err:  # a part missing or cut short
        raise SystemExit(
            f"error: the {stem} parts in {folder} ({', '.join(p.name for p in parts)}) do not "
            f"form a whole archive: {err}"
        ) from None
    return names


def _through_link(run_dir: Path, rel: str) -> bool:
    """Whether ``rel`` under ``run_dir`` passes through a symbolic link (a size's data/ and vocab/ are links)."""
    path = run_dir
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


JOURNALS_XZ_PRESET = 1
"""xz preset of the journals' parts. On a 2-core CPU smollm2-quality's journals (regeneration 17.6 MB, synthesis 7.1
MB) packed to 4.05 MB in 1.1 CPU seconds at preset 1, 3.03 MB in 12.2 at the default 6; a data build of ~150K
synthetic records has ~300 MB of journals, whose packing at preset 6 would take minutes of every lease."""


def journal_files(run_dir: Path) -> list[str]:
    """The generation journals under ``run_dir``, relative to it: the regeneration's and each synthetic source's."""
    from eagle3.data.synthetic import JOURNAL_SUFFIX

    regenerate, synthetic = _carried()[0]
    found = [regenerate] if (run_dir / regenerate).is_file() else []
    journals = (run_dir / synthetic).glob(f"*{JOURNAL_SUFFIX}")
    return found + sorted(p.relative_to(run_dir).as_posix() for p in journals if p.is_file())


def pack_journals(run_dir: Path, out: Path, part_mib: float = 15.0) -> list[Path]:
    """The journals under ``run_dir`` as ``out``/journals.tar.xz.NN parts of at most ``part_mib`` MiB each."""
    present = journal_files(run_dir)
    if not present:
        raise SystemExit(f"error: no generation journal under {run_dir} ({', '.join(_carried()[0])})")
    return _write_parts([(run_dir / rel, rel) for rel in present], out, "journals", part_mib, JOURNALS_XZ_PRESET)


def unpack_journals(run_dir: Path, folder: Path) -> list[str]:
    """Restore pack_journals' parts from ``folder`` into ``run_dir``; returns the member names written."""
    return _read_parts(run_dir, folder, "journals")


def curve_runs(run_dir: Path) -> list[Path]:
    """The data run and every run named after it (runs/<name>-<size>[-<variant>]) that exists."""
    return [run_dir, *sorted(p for p in run_dir.parent.glob(f"{run_dir.name}-*") if p.is_dir())]


def pack_results(run_dir: Path, out: Path, weights: bool = False, part_mib: float = 15.0) -> list[Path]:
    """What every run of the curve of ``run_dir`` measured as ``out``/results.tar.xz.NN, names relative to
    runs/ (e.g. smollm2-curve-3M/eval/results.json)."""
    _, results, drafter = _carried()
    wanted = (*results, *(drafter if weights else ()))
    members = [
        (run / rel, f"{run.name}/{rel}")
        for run in curve_runs(run_dir)
        for rel in wanted
        if (run / rel).exists() and not _through_link(run, rel)
    ]
    if not members:
        raise SystemExit(f"error: nothing measured under {run_dir.parent} for {run_dir.name}")
    return _write_parts(members, out, "results", part_mib, RESULTS_XZ_PRESET)


def unpack_results(runs_root: Path, folder: Path) -> list[str]:
    """Restore pack_results' parts from ``folder`` under ``runs_root`` (runs/); returns the member names written."""
    return _read_parts(runs_root, folder, "results")


def sglang_only_exports(runs_root: Path, names: list[str]) -> list[str]:
    """The runs among unpacked ``names`` whose exported drafter came in the SGLang layout alone (the speculators layout
    is exported from it and is too large to carry), made readable by the stages after export: the export manifest's
    entries for files that did not come move under its ``left_behind`` (their recorded size and sha256 kept), since
    evaluate and deploy check every output the manifest lists. Returns one note per run."""
    weights = _carried()[2][0]
    runs = sorted({name.split("/", 1)[0] for name in names if name.split("/", 1)[-1] == weights})
    speculators = Path(weights).parent.parent / "speculators"
    notes = []
    for run in runs:
        if (runs_root / run / speculators).exists():
            continue
        left = _drop_left_behind(runs_root / run / _export_manifest())
        notes.append(
            f"{run}: the drafter came in the SGLang layout only; its export manifest lists that layout alone now "
            f"({', '.join(left) or 'nothing else was listed'} under left_behind), so evaluate and deploy read it"
        )
    return notes


def _export_manifest() -> Path:
    """The export stage's manifest, relative to a run."""
    from eagle3.run.layout import RunLayout
    from eagle3.run.registry import get_stage

    return get_stage("export").manifest(RunLayout(Path()).root)


def _drop_left_behind(manifest: Path) -> list[str]:
    """Move the outputs of ``manifest`` whose files are absent under its "left_behind"; their names."""
    import json

    doc = json.loads(manifest.read_text())
    outputs = doc.get("outputs", {})
    left = {name: entry for name, entry in outputs.items() if not (manifest.parent / entry["path"]).is_file()}
    if left:
        doc["outputs"] = {name: entry for name, entry in outputs.items() if name not in left}
        doc["left_behind"] = {**doc.get("left_behind", {}), **left}
        manifest.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return sorted(left)


PHASES = ("pack-journals", "unpack-journals", "pack-results", "unpack-results")
"""quality_curve.py's phases that carry files; each takes a folder."""


def run(phase: str, run_dir: Path, folder: Path, weights: bool) -> list[str]:
    """One of PHASES for the data run ``run_dir``; what it wrote (parts packed, or member names unpacked)."""
    if phase == "pack-journals":
        return [str(p) for p in pack_journals(run_dir, folder)]
    if phase == "unpack-journals":
        return unpack_journals(run_dir, folder)
    if phase == "pack-results":
        return [str(p) for p in pack_results(run_dir, folder, weights)]
    names = unpack_results(run_dir.parent, folder)
    return names + [f"note: {hint}" for hint in sglang_only_exports(run_dir.parent, names)]
