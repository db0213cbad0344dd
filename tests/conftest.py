import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import shared_ray  # noqa: E402


def pytest_collection_modifyitems(session, config, items):
    """The modules on the shared Ray cluster (tests/shared_ray.py) run last, in their own order, so the
    cluster starts once; every other test keeps its place."""
    items[:] = sorted(items, key=lambda item: shared_ray.opted_in(item.module))


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_cluster_only_where_opted_in(request):
    if not shared_ray.opted_in(request.module):
        shared_ray.stop()  # a module that starts its own cluster, or none: the shared one is not left running
    yield


def pytest_sessionfinish(session, exitstatus):
    shared_ray.stop()
