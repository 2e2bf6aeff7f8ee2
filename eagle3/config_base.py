"""Pieces every config module shares: the strict Section base, path-safe name validators, limits and errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

PRESETS_DIR = (Path(__file__).parent / "presets").resolve()
"""configs/ of the checkout (eagle3/presets links to it), or the copy a non-editable install ships in the package."""
MAX_NAME_BYTES = 100
"""Longest name (UTF-8 bytes) that becomes one path component (file systems allow 255 bytes; suffixes are added)."""
MAX_PATH_COMPONENT_BYTES = 255


class ConfigError(ValueError):
    """A preset, override or config file that cannot be turned into a valid RunConfig."""


def _plain_name(value: str) -> str:
    """A name that becomes one path component: no separators, '..', leading '.', control characters; bounded."""
    size = len(value.encode("utf-8"))  # file systems limit a name's bytes, and one character may take four
    if not value or size > MAX_NAME_BYTES:
        raise ValueError(f"must be 1 to {MAX_NAME_BYTES} bytes in UTF-8 (got {size})")
    if any(c in value for c in "/\\") or value.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{value[:40]!r} must be a plain name: no '/', '\\', control characters or leading '.'")
    return value


PlainName = Annotated[str, AfterValidator(_plain_name)]
"""A config value used as a file or folder name inside a folder the pipeline owns."""


def _folder_path(value: str) -> str:
    """A folder path whose components fit the file system and whose nearest existing ancestor is a folder."""
    if not value or "\0" in value:
        raise ValueError("must be a non-empty path without NUL characters")
    path = Path(value)
    too_long = [part for part in path.parts if len(os.fsencode(part)) > MAX_PATH_COMPONENT_BYTES]
    if too_long:
        raise ValueError(f"the component {too_long[0][:40]!r}... is longer than {MAX_PATH_COMPONENT_BYTES} bytes")
    for ancestor in (path, *path.parents):
        try:
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ValueError(f"{str(ancestor)!r} is a file, not a folder")
                break
        except OSError as exc:
            raise ValueError(f"cannot inspect {str(ancestor)!r}: {exc.strerror}") from None
    return value


def _relative_inside(value: str | None) -> str | None:
    """A path relative to a folder of the run that stays inside it (no absolute path, no '..')."""
    if value is not None and (not value or Path(value).is_absolute() or ".." in Path(value).parts or "\0" in value):
        raise ValueError(f"{value!r} must be a relative path inside its folder (no leading '/', no '..')")
    return value


def _switch_from_yaml(value: object) -> object:
    """YAML reads a bare on/off as true/false: take those as "on"/"off"."""
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else value


Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_switch_from_yaml)]
"""An auto | on | off setting (written bare in YAML, on and off arrive as booleans)."""


CudaIndex = Annotated[str, StringConstraints(pattern=r"^cuda:[0-9]+$")]
"""One GPU of several, cuda:N."""

Device = Literal["auto", "cpu", "cuda"] | CudaIndex
"""Where a stage's models run, one type in every section: auto (cuda when a GPU is visible, else cpu), cpu, cuda, or
cuda:N where the stage runs in one process (train and evaluate refuse it: see whole_device)."""


def whole_device(field: str, device: str) -> None:
    """Refuse cuda:N where a stage picks the GPU itself (each torchrun rank its LOCAL_RANK, evaluate's workers theirs)."""
    if device.startswith("cuda:"):
        raise ValueError(
            f"{field} takes auto, cpu or cuda, not {device!r}: the stage places its processes on the GPUs "
            "itself; choose them with CUDA_VISIBLE_DEVICES"
        )


def switch_on(value: str, cuda: bool) -> bool:
    """Whether a Switch is on: "on", or "auto" on CUDA."""
    return value == "on" or (value == "auto" and cuda)


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docs come from docstrings, and a float setting must be
    finite (inf or nan in a learning rate or a scale trains or samples garbage instead of failing)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


OPERATIONAL_MARK = "operational"
"""Key in a field's json_schema_extra (so the UI's form schema shows it too) marking an operational field."""


def Operational(default: Any, **constraints: Any) -> Any:  # noqa: N802 (reads as a field declaration, like Field)
    """A field that changes how fast or where a stage runs, never what it writes (batch sizes, devices, slices,
    writer threads): stage keys leave it out, so changing it redoes nothing. ``constraints`` go to Field."""
    return Field(default, json_schema_extra={OPERATIONAL_MARK: True}, **constraints)


def _marked(section: type[BaseModel], mark: str) -> dict[str, Any]:
    """{name: field} of the fields of ``section`` whose json_schema_extra carries ``mark``."""
    return {
        name: field
        for name, field in section.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(mark)
    }


def operational_fields(section: type[BaseModel]) -> frozenset[str]:
    """Names of the fields of ``section`` declared with ``Operational``."""
    return frozenset(_marked(section, OPERATIONAL_MARK))


ADDED_MARK = "keyed_when_set"
"""Key in a field's json_schema_extra marking a field that stage keys hash only once it leaves its default."""


def Added(default: Any, **constraints: Any) -> Any:  # noqa: N802 (reads as a field declaration, like Field)
    """A field added after runs were keyed whose default writes what those runs wrote: stage keys (and journal
    keys built from them) leave it out while it holds its default, so upgrading redoes nothing already done."""
    return Field(default, json_schema_extra={ADDED_MARK: True}, **constraints)


def unset_added_fields(section: BaseModel) -> frozenset[str]:
    """Names of the ``Added`` fields of ``section`` that hold their default."""
    return frozenset(
        name for name, field in _marked(type(section), ADDED_MARK).items() if getattr(section, name) == field.default
    )


def key_fields(section: BaseModel) -> dict[str, Any]:
    """The section as JSON without its operational fields and unset added ones, also in the sections it nests
    (data.sources): what a stage key hashes of it."""
    skip = set(operational_fields(type(section))) | unset_added_fields(section)
    dumped = section.model_dump(mode="json", exclude=skip)
    return {name: _nested_key(getattr(section, name), value) for name, value in dumped.items()}


def _nested_key(value: Any, dumped: Any) -> Any:
    """``dumped`` (the JSON of ``value``) with every section inside it keyed by key_fields."""
    if isinstance(value, BaseModel):
        return key_fields(value)
    if isinstance(value, list):
        return [_nested_key(item, d) for item, d in zip(value, dumped)]
    return dumped
