"""The parameter schema the UI form is built from: every flow parameter explained, no text the UI would eat."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prefect.utilities.callables import parameter_schema_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINTS = sorted({d["entrypoint"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]})


def _descriptions(node, where: str = ""):
    """(json path, text) of every "description" string in a JSON-schema tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                yield where, value
            else:
                yield from _descriptions(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _descriptions(value, f"{where}/{i}")


def _schema(entrypoint: str) -> dict:
    """The schema `prefect deploy` registers (built from the source, as the deploy command does)."""
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return parameter_schema_from_entrypoint(entrypoint).model_dump_for_openapi()
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
def test_every_flow_parameter_has_a_description(entrypoint):
    """Each parameter of each deployed flow carries help text; `overrides`, where a flow has it, shows an example."""
    props = _schema(entrypoint)["properties"]
    missing = [name for name, prop in props.items() if not prop.get("description")]
    assert missing == [], f"{entrypoint}: parameters without a description: {missing}"
    overrides = props.get("overrides", {"description": "e.g. a=b"})  # eagle3-train-node takes a full config only
    assert "e.g." in overrides["description"] and "=" in overrides["description"]


@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
def test_no_description_holds_a_raw_angle_bracket(entrypoint):
    """The UI renders descriptions as HTML, where '<workdir>' would vanish: no description reachable from a
    flow's parameter schema (the RunConfig tree included) contains '<'."""
    found = [(where, text) for where, text in _descriptions(_schema(entrypoint)) if "<" in text]
    assert found == []
    assert sum(1 for _ in _descriptions(_schema(entrypoint))) > 50  # the RunConfig field docs were walked too
