"""The planner's catalog: bundled data files (every number sourced and dated) and user extensions."""

import json
import tomllib

import pytest

from tokenfactory.planner.catalog import DATA_DIR, CatalogError, load_catalog

REQUIRED_DEVICES = ["RTX-4090", "L40S", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200",
                    "MI300X", "CPU-Xeon-8480-2S"]
REQUIRED_MODELS = ["Llama-2-7B", "Llama-2-13B", "Llama-2-70B", "Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-0.5B",
                   "Qwen2.5-72B", "Mistral-7B", "SmolLM2-135M", "SmolLM2-360M", "SmolLM2-1.7B"]


def _numbers(node, path=""):
    """Every {value, ...} inline table in a parsed catalog file."""
    if isinstance(node, dict):
        if "value" in node:
            yield path, node
            return
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.parametrize("name", ["devices.toml", "models.toml", "defaults.toml"])
def test_every_bundled_number_has_a_source_and_a_date(name):
    with (DATA_DIR / name).open("rb") as f:
        data = tomllib.load(f)
    numbers = list(_numbers({k: v for k, v in data.items() if k != "sources"}))
    assert len(numbers) > 10
    for path, item in numbers:
        assert str(item.get("source", "")).strip(), path
        assert len(str(item.get("date", ""))) >= 7, path  # YYYY-MM at least


def test_bundled_devices_and_models_are_present():
    catalog = load_catalog()
    for name in REQUIRED_DEVICES:
        assert catalog.device(name).name == name
    for name in REQUIRED_MODELS:
        assert catalog.model(name) is not None, name
    assert catalog.device("h100").name == "H100-SXM"  # aliases, case-insensitive
    assert catalog.model("meta-llama/Llama-3.1-8B-Instruct").name == "Llama-3.1-8B"


def test_peaks_are_dense_not_sparse():
    # Vendors headline 2:4-sparse figures (H100 SXM: 1,979 TFLOPS bf16); the catalog keeps dense ones.
    catalog = load_catalog()
    assert catalog.device("H100-SXM").peak_flops("bf16") == pytest.approx(989.4e12)
    assert catalog.device("A100-80GB").peak_flops("bf16") == pytest.approx(312e12)
    # An A100 has no FP8 units: fp8 work runs at the 16-bit rate.
    assert catalog.device("A100-80GB").peak_flops("fp8") == pytest.approx(312e12)
    assert catalog.device("H100-SXM").peak_flops("fp8") == pytest.approx(1978.9e12)


def test_sources_are_expanded_from_keys():
    dev = load_catalog().device("H100-SXM")
    assert "datasheet" in dev.memory_gib.source.lower()
    assert dev.memory_gib.date == "2023-09"


def test_user_catalog_file_adds_and_overrides(tmp_path):
    extra = tmp_path / "mine.toml"
    extra.write_text("""
[sources]
me = "my own nvidia-smi and STREAM run"

[[device]]
name = "Lab-Card"
kind = "gpu"
memory_gib = { value = 12, source = "me", date = "2026-01" }
bandwidth_gbps = { value = 500, source = "me", date = "2026-01" }
tflops_bf16 = { value = 50, source = "me", date = "2026-01" }
tdp_w = { value = 200, source = "me", date = "2026-01" }
idle_w = { value = 20, source = "me", date = "2026-01" }

[[device]]
name = "H100-SXM"
kind = "gpu"
memory_gib = { value = 80, source = "me", date = "2026-01" }
bandwidth_gbps = { value = 3350, source = "me", date = "2026-01" }
tflops_bf16 = { value = 989.4, source = "me", date = "2026-01" }
tdp_w = { value = 700, source = "me", date = "2026-01" }
idle_w = { value = 70, source = "me", date = "2026-01" }
rent_usd_per_hour = { value = 1.25, source = "my contract", date = "2026-01" }

[[efficiency]]
device = "Lab-Card"
bandwidth = { value = 0.55, source = "me", date = "2026-01" }
""")
    catalog = load_catalog([extra])
    lab = catalog.device("lab-card")
    assert lab.memory_gib.value == 12 and lab.memory_gib.source == "my own nvidia-smi and STREAM run"
    assert catalog.device("H100-SXM").rent_usd_per_hour.value == 1.25
    assert catalog.device_efficiency["lab-card"]["bandwidth"].value == 0.55
    assert load_catalog().device("H100-SXM").rent_usd_per_hour.value != 1.25  # bundled copy untouched


def test_user_catalog_directory_and_json(tmp_path):
    (tmp_path / "models.json").write_text(json.dumps({"model": [{
        "name": "Tiny-Test", "source": "https://example.org/config.json", "date": "2026-01",
        "architecture": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 512}]}))
    catalog = load_catalog([tmp_path])
    assert catalog.model("tiny-test").fields["num_kv_heads"] == 2


def test_a_number_without_source_or_date_is_rejected_with_its_location(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("""
[[device]]
name = "No-Source"
memory_gib = { value = 12, date = "2026-01" }
bandwidth_gbps = { value = 500, source = "x", date = "2026-01" }
tflops_bf16 = { value = 50, source = "x", date = "2026-01" }
tdp_w = { value = 200, source = "x", date = "2026-01" }
idle_w = { value = 20, source = "x", date = "2026-01" }
""")
    with pytest.raises(CatalogError, match=r"bad.toml: device\[No-Source\].memory_gib has no source"):
        load_catalog([bad])
    bad.write_text('[[device]]\nname = "Bare"\nmemory_gib = 12\n')
    with pytest.raises(CatalogError, match=r"device\[Bare\].memory_gib must be"):
        load_catalog([bad])


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(CatalogError, match="unknown device 'H900'.*H100-SXM"):
        load_catalog().device("H900")


def test_missing_catalog_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--catalog file"):
        load_catalog([tmp_path / "nope.toml"])
    with pytest.raises(CatalogError, match="cannot parse"):
        (tmp_path / "broken.toml").write_text("[[device]\n")
        load_catalog([tmp_path / "broken.toml"])
