"""Shared fixtures: the real bundled model (loaded once per session) and its float32 HF reference."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# The machine profile (engine/tuning.py) is measured once per test session into a private cache, never read from
# the developer's ~/.cache: every run measures what it tests. Set before any engine, child process or Ray starts.
if "TOKENFACTORY_PROFILE_CACHE" not in os.environ:
    os.environ["TOKENFACTORY_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="tokenfactory-profiles-")
    atexit.register(shutil.rmtree, os.environ["TOKENFACTORY_PROFILE_CACHE"], ignore_errors=True)

from tokenfactory.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def bundled() -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="session")
def hf_reference(bundled: LoadedModel):
    from tests.reference import hf_model_from_loaded

    return hf_model_from_loaded(bundled)


@pytest.fixture(scope="session")
def ray_address() -> str:
    """One real local Ray for the whole test session (the fleet's Ray replicas), shut down at its end."""
    import ray

    info = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20,
                    configure_logging=False)
    yield info.address_info["address"]
    ray.shutdown()
