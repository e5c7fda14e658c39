"""`bench offline`'s baseline runs in Hugging Face's fastest dtype on this machine, timed, not assumed."""

import argparse

import pytest

from tokenfactory.bench.offline import HF_PROBED, make_workload, probe_hf_dtypes


@pytest.mark.slow
def test_each_dtype_is_timed_on_the_real_model():
    args = argparse.Namespace(model=None, hf_batch_size=2)
    workload = make_workload(2, (8, 12), (4, 4), 49152, seed=0)
    rates, _, _ = probe_hf_dtypes(args, workload)
    assert set(rates) == set(HF_PROBED)
    assert all(rate > 0 for rate in rates.values())
