"""Each package declares a small, sorted public surface, and everything in it exists."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name", ["dataserver", "statestore", "trainer_client"])
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol} is exported but missing"
