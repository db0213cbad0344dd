"""pytest plugin for bench/gpu_check.py: keep only the tests that need CUDA, and write their outcomes.

A test is kept when its name says ``cuda``, or a ``skipif``/``skip`` mark on it gives CUDA, a GPU or NCCL as
its reason (the way tests/ mark what cannot run on the development machine). Everything else is
deselected, so one pytest run on the device costs only what the CUDA tests cost. Outcomes (and collection
errors) go as JSON to the path in ``RAYZERO_GPU_PYTEST_REPORT``.
"""

from __future__ import annotations

import json
import os
import re

NEEDS_DEVICE = re.compile(r"cuda|gpu|nccl", re.IGNORECASE)

_outcomes: dict[str, str] = {}
_collect_errors: list[dict] = []
_selected: list[str] = []


def _needs_device(item) -> bool:
    if "cuda" in item.name.lower():
        return True
    for name in ("skipif", "skip"):
        for mark in item.iter_markers(name):
            if NEEDS_DEVICE.search(str(mark.kwargs.get("reason", ""))):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if _needs_device(i)]
    drop = [i for i in items if not _needs_device(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    _selected.extend(i.nodeid for i in keep)


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append({"nodeid": report.nodeid, "error": str(report.longrepr)[-600:]})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        # a failed set-up or tear-down counts as the test's outcome; a skip shows up at set-up
        if report.nodeid not in _outcomes or report.outcome != "passed":
            reason = ""
            if report.skipped and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2]
            _outcomes[report.nodeid] = report.outcome + (f": {reason}" if reason else "")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("RAYZERO_GPU_PYTEST_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"selected": _selected, "outcomes": _outcomes, "collect_errors": _collect_errors,
                       "exitstatus": int(exitstatus)}, f, indent=1)
