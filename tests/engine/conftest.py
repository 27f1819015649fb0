"""Fixtures for engine tests: a tiny random model and an engine factory over it."""
from __future__ import annotations

import pytest
from engine_helpers import ByteTokenizer

from mimw.engine.backends.reference import ReferenceBackend
from mimw.engine.engine import Engine, EngineConfig
from mimw.models.spec import get_preset
from mimw.models.weights import random_weights


@pytest.fixture(scope="session")
def tiny_weights():
    return random_weights(get_preset("tiny-llama"), seed=0)


@pytest.fixture
def make_engine(tiny_weights):
    def make(**cfg) -> Engine:
        return Engine(ReferenceBackend(tiny_weights), ByteTokenizer(), EngineConfig(**cfg))
    return make
