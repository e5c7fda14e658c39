"""Shared fixtures: the real bundled model (loaded once per session) and its float32 HF reference."""

from __future__ import annotations

import pytest

from tokenfactory.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="session")
def hf_reference(bundled: LoadedModel):
    from tests.reference import hf_model_from_loaded

    return hf_model_from_loaded(bundled)
