"""The lab's tests share the default tests' environment and a few of their fixtures (the tiny runs they build)."""

from __future__ import annotations

import tests.conftest  # noqa: F401  (its environment: Hugging Face offline, quiet transformers)
from tests.unit.test_evaluate import tiny_run  # noqa: F401  (the evaluate stage on the tiny target, a drafter exported)
from tests.unit.test_report import data_only_run  # noqa: F401  (the tiny preset's data stages, without Prefect)
