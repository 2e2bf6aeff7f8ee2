"""Fuzz the chat-source readers, the merge and the config loader with mutated valid inputs.

A seeded generator (no extra dependency) writes small valid inputs -- a ShareGPT JSON array, ShareGPT
JSONL, OpenAI 'messages' JSONL, a Parquet table, a preset YAML, a list of --set overrides -- and
mutates them: broken, NaN, huge-integer, deeply nested, wrongly typed or non-UTF-8 records, BOMs,
UTF-16/32 encodings, byte flips, truncation. For every input it checks:

- no exception but the project's user errors (SourceError, MergeError, ConfigError): anything else is
  a traceback the CLI would print;
- counts add up: read = kept + rejected per source, one valid JSON line per reject, one merged row per
  kept record; where the mutations keep record boundaries, read = the number of records written;
- nothing is written outside the run directory: a fresh folder holds only the input and run folders after.

    python -m lab.fuzz --inputs 10000 --seed 0      # prints one `name: value` line per figure
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import PRESETS_DIR, ConfigError, DataConfig, RunConfig, SourceConfig, load_config, save_config
from eagle3.data.merge import MergeError, merge_sources
from eagle3.data.sources import SourceError

USER_ERRORS = (SourceError, MergeError, ConfigError)
TEXTS = ["hi", "Hello?", "héllo ✓", "日本語", "😀 ok", " padded ", "", "a\nb", "tab\tx", "back\\slash", '"q"', "x" * 40]
GARBAGE = "abcdefghijklmnopqrstuvwxyz0123456789:;-+ "
RECORD_MUTATIONS = (
    "ok",
    "ok",
    "ok",
    "drop_char",
    "truncate",
    "garbage",
    "nan_id",
    "inf_value",
    "huge_int",
    "deep",
    "wrong_type",
    "unknown_role",
    "lone_surrogate",
    "bad_utf8",
    "control_char",
    "empty_object",
    "not_object",
    "bom",
    "no_answer",
)
ENCODINGS = ("utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le")
HOSTILE_VALUES = (
    "-1",
    "0",
    "1",
    "-64",
    "3",
    "1e400",
    ".nan",
    "-.inf",
    "99999999999999999999",
    "true",
    "null",
    "''",
    "../../x",
    "a/b",
    "..",
    ".hidden",
    "n" * 300,
    "[1, 2]",
    "{a: 1}",
    "'\\0'",
    "x: [",
    "ünï",
    "!!python/object:os.system x",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]",
)
BAD_MARK, CTRL_MARK = "\u2603BAD\u2603", "\u2603CTRL\u2603"


@dataclass
class FuzzReport:
    """What a fuzz run found; tracebacks and miscounts must both stay empty."""

    inputs: int = 0
    by_kind: Counter = field(default_factory=Counter)
    user_errors: Counter = field(default_factory=Counter)
    tracebacks: list[str] = field(default_factory=list)
    miscounts: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- valid records and their mutations


def _record(rng: random.Random, num: int, fmt: str) -> dict:
    turns = [("system", rng.choice(TEXTS))] if rng.random() < 0.2 else []
    for _ in range(rng.randint(1, 3)):
        turns += [("user", rng.choice(TEXTS) + str(num)), ("assistant", rng.choice(TEXTS))]
    rec: dict = {}
    if rng.random() < 0.7:
        rec["id"] = f"r{num}" if rng.random() < 0.6 else num
    if fmt == "sharegpt":
        names = {"system": "system", "user": rng.choice(["human", "user", "Human"]), "assistant": "gpt"}
        rec["conversations"] = [{"from": names[r], "value": t} for r, t in turns]
    else:
        rec["messages"] = [{"role": r, "content": t} for r, t in turns]
    return rec


def _turn_key(fmt: str) -> tuple[str, str, str]:
    return ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")


def _mutate_record(rng: random.Random, rec: dict, fmt: str, mutation: str) -> str:
    """The record's JSON text after one mutation (never holding a raw line break)."""
    key, role, content = _turn_key(fmt)
    turn = rng.choice(rec[key])
    if mutation == "nan_id":
        rec["id"] = float("nan")
    elif mutation == "inf_value":
        rec["score"] = float("-inf")
    elif mutation == "wrong_type":
        target = rng.choice(["list", "turn", "content"])
        if target == "list":
            rec[key] = rng.choice(["text", 5, None, {"a": 1}])
        else:
            rec[key][rec[key].index(turn)] = "text" if target == "turn" else {**turn, content: rng.choice([5, None])}
    elif mutation == "unknown_role":
        turn[role] = rng.choice(["tool", "narrator", 7])
    elif mutation in ("lone_surrogate", "bad_utf8", "control_char"):
        turn[content] += {"lone_surrogate": "\udc80", "bad_utf8": BAD_MARK, "control_char": CTRL_MARK}[mutation]
    elif mutation == "no_answer":
        rec[key] = [t for t in rec[key] if t[role] not in ("gpt", "assistant")]
    text = json.dumps(rec, ensure_ascii=rng.random() < 0.5)
    if mutation == "drop_char":
        cut = rng.randrange(len(text))
        text = text[:cut] + text[cut + 1 :]
    elif mutation == "truncate":
        text = text[: rng.randrange(1, len(text))]
    elif mutation == "garbage":
        text = rng.choice(GARBAGE[:36]) + "".join(rng.choice(GARBAGE) for _ in range(rng.randint(0, 20)))
    elif mutation == "huge_int":
        text = '{"id": ' + "7" * rng.randint(4400, 6000) + ", " + text[1:]
    elif mutation == "deep":
        depth = rng.randint(1100, 3000)
        text = '{"extra": ' + "[" * depth + "]" * depth + ", " + text[1:]
    elif mutation == "empty_object":
        text = "{}"
    elif mutation == "not_object":
        text = rng.choice(['"just text"', "42", "null", "[1, 2]", "true"])
    elif mutation == "bom":
        text = "\ufeff" + text
    return text


def _encode(texts: list[str], container: str, rng: random.Random, mutations: list[str]) -> bytes:
    """The file's bytes: one JSON array (one record per line, or pretty-printed records) or JSON Lines."""
    if container == "array":
        body = "[\n" + ",\n".join(texts) + "\n]\n"
    else:
        newline = "\r\n" if rng.random() < 0.2 else "\n"
        blank = newline if rng.random() < 0.2 else ""
        body = "".join(t + newline + blank for t in texts)
    encoding = rng.choice(ENCODINGS)
    if encoding != "utf-8":
        mutations.append(encoding)
    # Raw control characters (JSON forbids them in strings) and bytes that are not valid in the encoding.
    body = body.replace(CTRL_MARK, "\x01")
    if encoding.startswith("utf-8"):
        return body.encode(encoding, "surrogatepass").replace(BAD_MARK.encode(), b"\xff\xfe\xff")
    return body.replace(BAD_MARK, "\udc80").encode(encoding, "surrogatepass")


def _flip_bytes(rng: random.Random, data: bytes, mutations: list[str]) -> bytes:
    """Byte flips or a truncation: record boundaries are no longer known."""
    buf = bytearray(data)
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        mutations.append("byte_flips")
    else:
        del buf[rng.randrange(1, len(buf)) :]
        mutations.append("cut")
    return bytes(buf)


def make_json_source(rng: random.Random, folder: Path) -> tuple[SourceConfig, list[str], int | None]:
    """A mutated ShareGPT array / ShareGPT JSONL / OpenAI JSONL file; (source, mutations, expected read or None)."""
    fmt = rng.choice(["sharegpt", "openai"])
    container = "array" if fmt == "sharegpt" and rng.random() < 0.5 else "lines"
    num = rng.randint(1, 8)
    mutations = [rng.choice(RECORD_MUTATIONS) for _ in range(num)]
    texts = [_mutate_record(rng, _record(rng, n, fmt), fmt, m) for n, m in enumerate(mutations)]
    mutations = [m for m in mutations if m != "ok"]
    data = _encode(texts, container, rng, mutations)
    expected: int | None = num
    if rng.random() < 0.15:
        data, expected = _flip_bytes(rng, data, mutations), None
    path = folder / ("chats.json" if container == "array" else "chats.jsonl")
    path.write_bytes(data)
    forced = rng.choice(["auto", "auto", "auto", fmt, "sharegpt" if fmt == "openai" else "openai"])
    return SourceConfig(name="fz", path=str(path), format=forced), [container, fmt, forced, *mutations], expected


def make_parquet_source(rng: random.Random, folder: Path) -> tuple[SourceConfig, list[str], int | None]:
    """A Parquet table of records with nulls, bad roles, float/NaN ids, or flipped bytes."""
    fmt = rng.choice(["sharegpt", "openai"])
    key, role, content = _turn_key(fmt)
    num = rng.randint(1, 8)
    rows, mutations = [], []
    for n in range(num):
        rec = _record(rng, n, fmt)
        mutation = rng.choice(["ok", "ok", "null_list", "null_content", "unknown_role", "no_answer"])
        turn = rng.choice(rec[key])
        if mutation == "null_list":
            rec[key] = None
        elif mutation == "null_content":
            turn[content] = None
        elif mutation == "unknown_role":
            turn[role] = "tool"
        elif mutation == "no_answer":
            rec[key] = [t for t in rec[key] if t[role] not in ("gpt", "assistant")]
        mutations.append(mutation)
        rows.append({"id": str(rec.get("id", n)), key: rec[key]})
    table = pa.Table.from_pylist(rows)
    if rng.random() < 0.3:
        ids = [float("nan") if rng.random() < 0.5 else float(n) for n in range(num)]
        table = table.set_column(0, "id", pa.array(ids, pa.float64()))
        mutations.append("float_ids")
    path = folder / "chats.parquet"
    pq.write_table(table, path)
    expected: int | None = num
    if rng.random() < 0.3:
        path.write_bytes(_flip_bytes(rng, path.read_bytes(), mutations))
        expected = None
    return SourceConfig(name="fz", path=str(path)), ["parquet", fmt, *mutations], expected


# ---------------------------------------------------------------- checks


def _refuse(name: str) -> None:
    raise ValueError(f"bare {name}")


def _check_merge(stats: dict, out_dir: Path, expected: int | None) -> list[str]:
    """What does not add up in a finished (or min_rows-refused) merge."""
    problems = []
    for name, tally in [*stats["sources"].items(), ("total", stats["total"])]:
        if (
            tally["kept"] + tally["rejected"] != tally["read"]
            or sum(tally["rejected_by_reason"].values()) != tally["rejected"]
        ):
            problems.append(f"{name}: read {tally['read']} != kept {tally['kept']} + rejected {tally['rejected']}")
    data = (out_dir / "rejects.jsonl").read_bytes()
    lines = data.split(b"\n")[:-1]  # JSON Lines end at '\n' only (str.splitlines would also cut at U+2028)
    for num, line in enumerate(lines, 1):
        try:
            json.loads(line.decode("utf-8"), parse_constant=_refuse)
        except ValueError as exc:
            problems.append(f"rejects.jsonl line {num} is not JSON: {exc}")
    if len(lines) != stats["total"]["rejected"]:
        problems.append(f"{len(lines)} lines in rejects.jsonl for {stats['total']['rejected']} rejects")
    merged = out_dir / "merged.parquet"
    if merged.exists() and pq.ParquetFile(merged).metadata.num_rows != stats["total"]["kept"]:
        problems.append(f"merged.parquet rows != kept {stats['total']['kept']}")
    if expected is not None and stats["total"]["read"] != expected:
        problems.append(f"read {stats['total']['read']} of {expected} records written")
    return problems


def run_data_input(rng: random.Random, root: Path, report: FuzzReport) -> None:
    """One mutated source through merge_sources, in ``root`` (which must hold only in/ and run/ afterwards)."""
    (root / "in").mkdir()
    make = make_parquet_source if rng.random() < 0.25 else make_json_source
    src, what, expected = make(rng, root / "in")
    out_dir = root / "run" / "data"
    report.by_kind[what[0]] += 1
    try:
        _, stats = merge_sources(
            [src], DataConfig(max_chars=2000, min_rows=rng.choice([1, 1, 2])), 0, out_dir, progress=lambda *_: None
        )
    except USER_ERRORS as exc:
        report.user_errors[type(exc).__name__] += 1
        stats_path = out_dir / "stats.json"
        stats = json.loads(stats_path.read_text()) if isinstance(exc, MergeError) else None
    except Exception:  # noqa: BLE001 -- anything else is exactly what the fuzz is looking for
        report.tracebacks.append(f"{what}: {traceback.format_exc()}")
        return
    problems = _check_merge(stats, out_dir, expected) if stats is not None else []
    problems += _outside(root, {"in", "run"})
    report.miscounts += [f"{what}: {p}" for p in problems]


def _outside(root: Path, allowed: set[str]) -> list[str]:
    return [f"wrote {p} outside the run directory" for p in root.iterdir() if p.name not in allowed]


# ---------------------------------------------------------------- config overrides and presets


def _leaf_keys(model: type, prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            keys += _leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


CONFIG_KEYS = [k for k in _leaf_keys(RunConfig) if k not in ("run.workdir", "target.cache_dir")] + [
    "data.sources.0.name",
    "data.sources.0.max_records",
    "data.sources.0.format",
    "data.sources.5.path",
    "run",
    "run.name.x",
    "nope.field",
    "",
    "train..lr",
]
"""Every field, plus list indices and malformed keys (workdir and cache_dir are explicit locations: not fuzzed)."""


def _mutate_text(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 6)):
        at = rng.randrange(len(chars))
        op = rng.random()
        if op < 0.4:
            del chars[at]
        elif op < 0.8:
            chars.insert(at, rng.choice(":[]{}-#&*!|>'\"\t\n \\x"))
        else:
            chars[at] = rng.choice("ab0 :")
    return "".join(chars)


def run_config_input(rng: random.Random, root: Path, report: FuzzReport) -> None:
    """Hostile --set overrides (or a mutated preset YAML): a ConfigError or a config whose paths stay in the run."""
    workdir = root / "run"
    if rng.random() < 0.3:
        preset = root / "in" / "p.yaml"
        preset.parent.mkdir()
        preset.write_text(_mutate_text(rng, (PRESETS_DIR / "tiny.yaml").read_text()), encoding="utf-8")
        what, preset_name, overrides = ["preset"], str(preset), []
    else:
        overrides = [f"{rng.choice(CONFIG_KEYS)}={rng.choice(HOSTILE_VALUES)}" for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.05:
            overrides.append(rng.choice(["=", "novalue", "=x", "a.b"]))
        what, preset_name = ["overrides", *overrides], "tiny"
    report.by_kind[what[0]] += 1
    try:
        cfg = load_config(preset_name, [*overrides, f"run.workdir={workdir}", "target.cache_dir=null"])
        save_config(cfg, cfg.run_dir / "config.json")
        inside = cfg.run_dir.resolve().is_relative_to(workdir.resolve()) and (
            cfg.target_cache_dir / cfg.target.name
        ).resolve().is_relative_to(workdir.resolve())
    except USER_ERRORS as exc:
        report.user_errors[type(exc).__name__] += 1
        inside = True
    except Exception:  # noqa: BLE001
        report.tracebacks.append(f"{what}: {traceback.format_exc()}")
        return
    problems = ([] if inside else ["a config path leaves the workdir"]) + _outside(root, {"in", "run"})
    report.miscounts += [f"{what}: {p}" for p in problems]


# ---------------------------------------------------------------- the run


def fuzz(num_inputs: int, seed: int, scratch: Path | None = None) -> FuzzReport:
    """Generate and check ``num_inputs`` inputs (about 3 in 4 data files, 1 in 4 configs) from ``seed``."""
    report, rng, cwd_before = FuzzReport(), random.Random(seed), sorted(os.listdir("."))
    base = Path(tempfile.mkdtemp(prefix="eagle3-fuzz-", dir=scratch))
    try:
        for num in range(num_inputs):
            root = base / str(num)
            root.mkdir()
            (run_config_input if rng.random() < 0.25 else run_data_input)(rng, root, report)
            report.inputs += 1
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if sorted(os.listdir(".")) != cwd_before:
        report.miscounts.append("the working directory changed")
    return report


def main(argv: list[str] | None = None) -> None:
    """Run the fuzz and print its figures; exit 1 on any traceback or miscount."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=10_000, help="generated inputs (default 10,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scratch", type=Path, default=None, help="folder for the temp files (default: system temp)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = fuzz(args.inputs, args.seed, args.scratch)
    print(f"inputs: {report.inputs}")
    print(f"by_kind: {dict(sorted(report.by_kind.items()))}")
    print(f"user_errors: {dict(sorted(report.user_errors.items()))}")
    print(f"tracebacks: {len(report.tracebacks)}")
    print(f"miscounts: {len(report.miscounts)}")
    print(f"wall_s: {time.perf_counter() - start:.1f}")
    for problem in (report.tracebacks + report.miscounts)[:5]:
        print("---\n" + problem[-3000:])
    if report.tracebacks or report.miscounts:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
