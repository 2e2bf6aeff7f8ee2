"""Renamed config keys: a preset, a saved ``<run>/config.json`` or a ``--set`` override that uses an old name still
loads, with one warning line per old key, and stage keys hash a renamed field under its old name, so a run keyed
before a rename resumes without redoing a stage.

Each preset or config.json file is migrated as it is read (before a ``base`` preset is merged under it), each
``--set`` key is renamed before it applies, and RunConfig migrates whatever else it validates (the flows'
parameters); ``section_dict`` builds stage keys through ``keyed_as_before``.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel

from eagle3.config_base import ConfigError, key_fields

SERVER_FIELDS = (
    "python",
    "launch_module",
    "host",
    "allow_remote_host",
    "api_key_env",
    "tp_size",
    "attention_backend",
    "extra_args",
    "startup_timeout_s",
)
"""The SGLang launch settings serve and capture.sglang each held, now the run's one server section."""

RENAMES: dict[str, str] = {
    "capture.max_tokens_per_batch": "capture.tokens_per_forward",
    "train.max_tokens_per_batch": "train.tokens_per_row",
    **{f"serve.{name}": f"server.{name}" for name in SERVER_FIELDS},
    **{
        f"capture.sglang.{name}": f"server.{name}"
        for name in SERVER_FIELDS
        if name not in ("launch_module", "attention_backend")
    },  # capture had no fields of these names
}
"""Old dotted key -> its new name. Several old keys may name one new key (settings two sections repeated): their
values must agree, or all but one hold the default."""


class RenamedKeyWarning(FutureWarning):
    """A config used an old key name; it was read under the new one."""


def _warn(message: str) -> None:
    warnings.warn(message, RenamedKeyWarning, stacklevel=2)


def renamed_override(keys: list[str]) -> list[str]:
    """The dotted key of an override (``--set``) under its new name (one warning when it had an old one): applied
    before the override, so it replaces the new key a preset sets instead of giving it a second value."""
    for old, new in RENAMES.items():
        depth = old.count(".") + 1
        if keys[:depth] == old.split("."):
            _warn(f"config key {old} is now {new} (read as {new}; rename it in the config)")
            return [*new.split("."), *keys[depth:]]
    return keys


def _copied(node: Any) -> Any:
    """``node`` with its dicts and lists copied (the caller's data is never changed)."""
    if isinstance(node, dict):
        return {key: _copied(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_copied(value) for value in node]
    return node


def _pop(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    """(found, value) of the dotted ``path`` in nested dicts, removed from them when found."""
    *parents, leaf = path.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return False, None
    return True, node.pop(leaf)


def _put(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{path}: {part!r} must be a section, got {type(child).__name__}")
        node = child
    node[leaf] = value


def default_of(model: type[BaseModel], path: str) -> Any:
    """The default value of the field at dotted ``path`` of ``model`` (sections stepped into)."""
    *parents, leaf = path.split(".")
    for part in parents:
        model = model.model_fields[part].annotation  # type: ignore[assignment]  # a section: a BaseModel subclass
    return model.model_fields[leaf].get_default(call_default_factory=True)


def _one_value(new: str, given: dict[str, Any], default: Any) -> Any:
    """The value of ``new`` from the keys that gave one (old names and the new one): equal values are one value; a
    value equal to the default gives way to another (a saved config.json holds every field, set or not)."""
    distinct = [v for i, v in enumerate(given.values()) if v not in list(given.values())[:i]]
    if len(distinct) > 1:
        distinct = [v for v in distinct if v != default]
    if len(distinct) > 1:
        named = ", ".join(f"{key}={value!r}" for key, value in given.items())
        raise ConfigError(f"{named} all set {new}, which takes one value: keep {new} only")
    return distinct[0] if distinct else default


def migrate(data: Any, model: type[BaseModel]) -> Any:
    """A copy of the raw config ``data`` with every old key moved to its new name (one warning each); ConfigError
    when old keys give one new key two values."""
    if not isinstance(data, dict):
        return data
    out = _copied(data)
    for new in dict.fromkeys(RENAMES.values()):
        olds = [old for old, target in RENAMES.items() if target == new]
        given = {old: value for old in olds for found, value in [_pop(out, old)] if found}
        if not given:
            continue
        for old in given:
            _warn(f"config key {old} is now {new} (read as {new}; rename it in the config)")
        found, value = _pop(out, new)
        _put(out, new, _one_value(new, given | ({new: value} if found else {}), default_of(model, new)))
    return out


def _section_of(keyed: dict[str, Any], parts: list[str]) -> dict[str, Any] | None:
    """The dict at ``parts`` inside a keyed section dump (None: not keyed, e.g. an operational subsection)."""
    node: Any = keyed
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def keyed_as_before(cfg: BaseModel, name: str) -> dict[str, Any]:
    """What a stage key hashes of section ``name`` (config_base.key_fields), every renamed field that the key hashes
    under its old name and place (RENAMES): keys computed before a rename stay valid."""
    keyed = key_fields(getattr(cfg, name))
    for old, new in RENAMES.items():
        old_section, *old_parts = old.split(".")
        new_section, *new_parts = new.split(".")
        target = _section_of(keyed, old_parts[:-1]) if old_section == name else None
        home = keyed if new_section == name else key_fields(getattr(cfg, new_section))
        source = _section_of(home, new_parts[:-1])
        if target is None or source is None or new_parts[-1] not in source:
            continue  # the old field was not hashed (operational), or the new one is not (operational, unset)
        value = source.pop(new_parts[-1]) if new_section == name else source[new_parts[-1]]
        target[old_parts[-1]] = value
    return keyed
