"""The run configuration: one strict pydantic tree, one section per stage.

A run is described by a preset (``configs/<name>.yaml``) plus dotted overrides
(``--set train.lr=1e-4``). The resolved tree is written to ``<run>/config.json`` and is
the only thing a stage reads; Prefect flows take the same model as a parameter, so the
UI form, ``prefect.yaml`` and ``python -m eagle3.<stage>`` share one schema.

Every field has a one-line doc (the attribute docstring below it); a test enforces it.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError, model_validator

from eagle3.config_base import PRESETS_DIR, Added, ConfigError, PlainName, Section, _folder_path
from eagle3.config_data import CharsOf as CharsOf  # re-exported ("as"): every section type is in eagle3.config
from eagle3.config_data import DataConfig, RegenerateConfig, TargetConfig, TokenizeConfig, VocabConfig
from eagle3.config_data import SourceConfig as SourceConfig
from eagle3.config_data import SyntheticConfig as SyntheticConfig
from eagle3.config_data import TinyTargetConfig as TinyTargetConfig
from eagle3.config_refresh import RefreshConfig
from eagle3.config_renames import keyed_as_before, migrate, renamed_override
from eagle3.config_sglang import ServeConfig, SGLangServerConfig
from eagle3.config_stages import CaptureConfig, DrafterConfig, EvaluateConfig, ExportConfig, TrainConfig


class RunSection(Section):
    workdir: Annotated[str, AfterValidator(_folder_path)] = "runs"
    """Directory that holds one sub-directory per run (relative paths are relative to the CWD)."""
    name: PlainName = "demo"
    """Run name; the run directory is {workdir}/{name}. A plain folder name of at most 100 characters."""
    seed: int = 0
    """Seed for shuffling, the train/val split, model init and training."""


class RunConfig(Section):
    """The whole run: one section per stage."""

    run: RunSection = RunSection()
    """Run identity: workdir, name, seed."""
    target: TargetConfig = TargetConfig()
    """The target model."""
    data: DataConfig = DataConfig()
    """Chat sources and merge policy."""
    regenerate: RegenerateConfig = RegenerateConfig()
    """Answer regeneration with the target."""
    tokenize: TokenizeConfig = TokenizeConfig()
    """Chat-template rendering and loss masks."""
    vocab: VocabConfig = VocabConfig()
    """Draft vocabulary map."""
    capture: CaptureConfig = CaptureConfig()
    """Hidden-state capture."""
    drafter: DrafterConfig = DrafterConfig()
    """Drafter architecture."""
    train: TrainConfig = TrainConfig()
    """Training loop."""
    export: ExportConfig = ExportConfig()
    """Export formats."""
    evaluate: EvaluateConfig = EvaluateConfig()
    """Offline acceptance evaluation."""
    serve: ServeConfig = ServeConfig()
    """SGLang serving."""
    server: SGLangServerConfig = SGLangServerConfig()
    """How this host launches SGLang servers: settings capture's (backend sglang) and deploy's servers share."""
    refresh: RefreshConfig = Added(RefreshConfig())
    """Scheduled refresh: new prompts, a warm-started candidate, the promotion gate (eagle3.refresh)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Old key names (eagle3.config_renames.RENAMES) read under their new ones, one warning each."""
        return migrate(data, cls)

    @property
    def run_dir(self) -> Path:
        """The run directory <workdir>/<name>."""
        return Path(self.run.workdir) / self.run.name

    @property
    def target_cache_dir(self) -> Path:
        """Where converted or generated targets are cached."""
        return Path(self.target.cache_dir) if self.target.cache_dir else Path(self.run.workdir) / "_targets"


def list_presets() -> list[str]:
    """Names of the presets in configs/."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


BASE_KEY = "base"
"""A preset's optional key naming the preset it extends: that one's settings, with this file's merged over them
(sections key by key, any other value, lists included, replaced), so a preset states only what it changes."""


def _read_preset(preset: str, extending: tuple[str, ...] = ()) -> dict[str, Any]:
    path = Path(preset) if preset.endswith((".yaml", ".yml", ".json")) else PRESETS_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ConfigError(f"preset {preset!r} not found (looked for {path}); presets: {', '.join(list_presets())}")
    data = read_config_file(path)
    cycle = _self_reference(data)
    if cycle is not None:
        raise ConfigError(
            f"{path}: a YAML anchor refers to itself at {cycle or 'the top level'}; "
            "write the value out instead of aliasing its own anchor"
        )
    data = migrate(data, RunConfig)  # old key names, before a base preset is merged under this file's
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: {BASE_KEY} must name a preset, got {base!r}")
    if base in (*extending, preset):
        raise ConfigError(f"{path}: presets extend each other in a cycle: {' -> '.join((*extending, preset, base))}")
    return _merged(_read_preset(base, (*extending, preset)), data)


def _self_reference(node: Any, path: tuple[str, ...] = (), inside: frozenset[int] = frozenset()) -> str | None:
    """The dotted key path where a YAML alias repeats a container it sits in (``&r {self: *r}``), else None."""
    if not isinstance(node, (dict, list)):
        return None
    if id(node) in inside:
        return ".".join(path)
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        found = _self_reference(value, (*path, str(key)), inside | {id(node)})
        if found is not None:
            return found
    return None


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: dicts key by key, everything else replaced."""
    out = dict(base)
    for key, value in over.items():
        both_dicts = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_dicts else value
    return out


def _parse_config_text(path: Path, text: str) -> Any:
    """The parsed file; a syntax error becomes a ConfigError naming the file, line and column."""
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}, line {exc.lineno} column {exc.colno}: invalid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: invalid YAML: {problem}") from None
    except (RecursionError, ValueError) as exc:  # nesting past the recursion limit, huge integers
        raise ConfigError(f"{path}: cannot be parsed: {str(exc).split(';')[0]}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML preset or JSON config as a dict (ConfigError naming the file on unreadable or bad content)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    data = _parse_config_text(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=1e-4' -> (['train', 'lr'], 1e-4); the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from exc
    return key.strip().split("."), value


def _child(node: Any, key: str, item: str) -> Any:
    """Step into a dict key or a list index ('data.sources.0.path')."""
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise ConfigError(f"override {item!r}: {key!r} is not an index of a list of {len(node)}")
        return node[int(key)]
    child = node.setdefault(key, {})
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"override {item!r}: {key!r} is not a section")
    return child


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict (creating sections; digits index into lists)."""
    for item in overrides:
        keys, value = parse_override(item)
        keys = renamed_override(keys)
        node: Any = data
        for key in keys[:-1]:
            node = _child(node, key, item)
        last = keys[-1]
        if isinstance(node, list):
            _child(node, last, item)
            node[int(last)] = value
        else:
            node[last] = value
    return data


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the section class a field holds, whether it holds a list of them): Optional, Annotated and list unwrapped."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        model, listed = _nested_model(arg)
        if model is not None:
            return model, listed or origin in (list, tuple)
    return None, False


def config_field_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted field path of the config tree, sections included, in declaration order; a list of sections
    is stepped into by ``*`` (``data.sources.*.max_records``)."""
    paths = []
    for name, field in (model or RunConfig).model_fields.items():
        paths.append(prefix + name)
        nested, listed = _nested_model(field.annotation)
        if nested is not None:
            paths += config_field_paths(nested, f"{prefix}{name}.{'*.' if listed else ''}")
    return paths


def _abbreviates(short: str, long: str) -> bool:
    """'lr' abbreviates 'learning_rate': the initials of the words of ``long``."""
    return "_" in long and "".join(word[:1] for word in long.split("_")) == short


def _closeness(bad: str, known: str) -> float:
    """How alike two dotted paths are (difflib ratio of the paths; of the last names between siblings, where an
    abbreviation counts as a match; a known name in another section counts as close)."""
    bad_parent, _, bad_leaf = bad.rpartition(".")
    parent, _, leaf = known.rpartition(".")
    score = difflib.SequenceMatcher(None, bad, known).ratio()
    if bad_parent == parent:
        if _abbreviates(bad_leaf, leaf) or _abbreviates(leaf, bad_leaf):
            return 1.0
        score = max(score, difflib.SequenceMatcher(None, bad_leaf, leaf).ratio())
    elif bad_leaf == leaf:
        score = max(score, 0.9)
    return score


def did_you_mean(loc: tuple[Any, ...] | list[Any] | str, cutoff: float = 0.6) -> str | None:
    """The config field path closest to the unknown key at ``loc`` ('train.learning_rate' -> 'train.lr';
    list indices kept: 'data.sources.0.max_record' -> 'data.sources.0.max_records'), or None when none is close."""
    parts = [str(p) for p in (loc.split(".") if isinstance(loc, str) else loc)]
    indices = [p for p in parts if p.isdigit()]
    bad = ".".join("*" if p.isdigit() else p for p in parts)
    scored = [(_closeness(bad, known), known) for known in config_field_paths() if known != bad]
    score, best = max(scored, key=lambda pair: pair[0], default=(0.0, ""))
    if score < cutoff:
        return None
    fill = iter(indices)
    return ".".join(next(fill, "0") if p == "*" else p for p in best.split("."))


def _format_validation_error(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            guess = did_you_mean(err["loc"])
            lines.append(f"  {field}: unknown key" + (f"; did you mean {guess}?" if guess else ""))
        else:
            lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)


def validate_config(data: dict[str, Any], origin: str) -> RunConfig:
    """Validate a raw dict, turning pydantic errors into a ConfigError that names each field."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None


def load_config(preset: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset (name in configs/ or a YAML/JSON path) and apply dotted overrides."""
    overrides = list(overrides or [])
    data = apply_overrides(_read_preset(preset), overrides)
    origin = f"preset {preset}" + (f" with overrides {overrides}" if overrides else "")
    return validate_config(data, origin)


def intended_run_name(preset: str, overrides: list[str] | None = None) -> str:
    """The run name a preset with overrides asks for, read without validating anything else, so that a run whose
    config is invalid can still be reported under its name; the default name when none can be read."""
    default: str = RunSection.model_fields["name"].default
    try:
        data = _read_preset(preset)
    except (ConfigError, RecursionError):
        data = {}
    for item in overrides or []:
        with contextlib.suppress(ConfigError):
            apply_overrides(data, [item])
    try:
        return RunSection.model_validate({"name": data["run"]["name"]}).name
    except (KeyError, TypeError, ValidationError):
        return default


def save_config(cfg: RunConfig, path: Path) -> Path:
    """Write the resolved config as JSON (atomically)."""
    from infra.storage import atomic_write_text

    return atomic_write_text(path, cfg.model_dump_json(indent=2) + "\n")


def section_dict(cfg: RunConfig, *names: str) -> dict[str, Any]:
    """JSON-able dump of some sections without their operational fields (config_base.key_fields), renamed fields
    under their old names (config_renames.keyed_as_before): what stage keys hash."""
    return {name: keyed_as_before(cfg, name) for name in names}
