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

# A Ray this session starts runs in Ray's single-machine mode (every server on 127.0.0.1): set before anything
# imports ray, which reads it once (fleet/ray_cluster.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

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
    """One real local Ray for the whole test session (the fleet's Ray replicas), started as `serve --ray`
    starts one (fleet/ray_cluster.py: 127.0.0.1 only, checked; token auth), shut down at its end."""
    import ray

    from tokenfactory.fleet.ray_cluster import connect

    session = connect(None, num_cpus=4, object_store_memory=256 << 20)
    yield session.address
    ray.shutdown()
