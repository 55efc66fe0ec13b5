"""Fixtures every test module may use."""

import pytest

import zoo


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test at 1 and at 2 OpenMP threads, restoring the count after."""
    n = zoo.get_threads()
    zoo.set_threads(request.param)
    yield request.param
    zoo.set_threads(n)
