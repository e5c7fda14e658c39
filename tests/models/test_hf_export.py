"""`python -m tokenfactory.models.hf_export OUT`, as scripts/quant_fixtures.sh runs it: a model we load written as a
plain Hugging Face folder that loads back to the same weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import tiny_random_model_dir
from tokenfactory.models.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two interpreters importing torch
def test_the_module_writes_a_folder_that_loads_back(tmp_path):
    source = tiny_random_model_dir(tmp_path)
    out = tmp_path / "copy"
    run = [sys.executable, "-m", "tokenfactory.models.hf_export", str(out), "--model", str(source)]
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(str(out))
    before, after = load_model(source), load_model(out)
    assert set(after.weights) == set(before.weights)
    for name, weight in before.weights.items():
        assert torch.equal(after.weights[name], weight), name
    again = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "already holds a model" in again.stderr
