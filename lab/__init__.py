"""The lab: benchmarks, quality curves and GPU-host tooling, with their tests (lab/tests/).

It imports the core (eagle3, infra, flows, tasks) and the tests' fakes; nothing there imports it
(tests/unit/test_architecture.py checks), and it is not installed (pyproject.toml lists the packages).
Its scripts run from a checkout: ``python lab/<script>.py`` or ``python -m lab.<module>``.
"""
