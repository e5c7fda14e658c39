"""`tokenfactory quantize --method gptq|awq --calibration FILE` as a user runs it: the samples read and split, bad
input refused before minutes of work, and the whole command run by a virtualenv with the `calibrate` extra
(llm-compressor pins its own transformers, so it is not the dev venv: `make quant-fixtures` installs tokenfactory
into its llm-compressor venv, or TOKENFACTORY_CALIBRATE_PYTHON names one). The folder it writes is then loaded
and evaluated here, in the dev venv (serving such folders over HTTP: tests/models/test_hf_quant_tools.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.reference import tiny_random_model_dir
from tokenfactory.cli import main
from tokenfactory.models.loader import load_model
from tokenfactory.quality.calibrate import CalibrationSpec, check_group_size, read_calibration, split
from tokenfactory.types import ParameterError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("TOKENFACTORY_QUANT_FIXTURES", ROOT / ".quant-fixtures"))
CALIBRATE_PYTHON = Path(os.environ.get("TOKENFACTORY_CALIBRATE_PYTHON", FIXTURES / "venv-llmcompressor/bin/python"))
SENTENCES = ["The journal is written before the page.", "A checkpoint folds the log into the file.",
             "Readers see the last committed state.", "A crash leaves the journal to roll back.",
             "Locks are taken in a fixed order.", "The cache keeps recent pages in memory.",
             "An index is a tree of keys.", "A vacuum rewrites the file without free pages.",
             "Each statement is compiled to bytecode.", "The pager owns every read and write.",
             "A savepoint nests inside a transaction.", "Triggers run inside the statement's transaction."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Inputs of 128 and 256: groups of 32, 64 and 128 all divide them.
    return tiny_random_model_dir(tmp_path_factory.mktemp("cal"), hidden_size=128, intermediate_size=256,
                                 num_heads=4, num_kv_heads=2)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_samples_are_read_from_jsonl_fields_and_text_paragraphs(tiny: Path, tmp_path: Path) -> None:
    loaded = load_model(tiny)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": "a b"}, {"prompt": "c d"}, {"messages": chat}])
    samples = read_calibration(jsonl, loaded)
    assert samples[:2] == ["a b", "c d"] and "hello" in samples[2] and samples[2] != "hello"  # the template's
    text = tmp_path / "c.txt"
    text.write_text("first paragraph\nstill first\n\n\nsecond\n\n  \nthird\n")
    assert read_calibration(text, loaded) == ["first paragraph\nstill first", "second", "third"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"completion": "no text field"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line needs a string \"text\""):
        read_calibration(bad, loaded)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        read_calibration(tmp_path / "broken.jsonl", loaded)
    (tmp_path / "one.txt").write_text("only one\n")
    with pytest.raises(ValueError, match="at least 2"):
        read_calibration(tmp_path / "one.txt", loaded)


def test_the_split_holds_out_a_fifth_whatever_num_samples_asks() -> None:
    calibration, heldout = split(62, 50, seed=0)
    assert (len(calibration), len(heldout)) == (50, 12) and not set(calibration) & set(heldout)
    assert split(62, 50, seed=0) == (calibration, heldout) and split(62, 50, seed=1) != (calibration, heldout)
    calibration, heldout = split(10, 64, seed=0)  # asks for more than the file has
    assert (len(calibration), len(heldout)) == (8, 2)


def test_a_group_size_that_does_not_divide_the_layers_is_refused_naming_the_fit() -> None:
    loaded = load_model(None)  # the bundled SmolLM2: 576 inputs
    with pytest.raises(ParameterError, match="group size 128 does not divide the 576 inputs.*pick 32 or 64") as e:
        check_group_size(loaded, CalibrationSpec("gptq", group_size=128))
    assert e.value.param == "group_size"
    check_group_size(loaded, CalibrationSpec("awq", group_size=64))
    check_group_size(loaded, CalibrationSpec("gptq", group_size=0))


@pytest.mark.parametrize(("args", "message"), [
    (["--method", "gptq"], "--method gptq needs --calibration FILE"),
    (["--method", "awq", "--bits", "8", "--calibration", "c.jsonl"], "bits must be 4 or 8 (AWQ: 4)"),
    (["--method", "gptq", "--group-size", "48", "--calibration", "c.jsonl"], "group size must be 32, 64, 128"),
    (["--method", "awq", "--awq-grid", "1", "--calibration", "c.jsonl"], "awq_grid must be >= 2"),
    (["--method", "gptq", "--quantization", "int4", "--calibration", "c.jsonl"], "pass --quantization SCHEME"),
])
def test_bad_calibration_flags_get_one_clear_sentence(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      args: list[str], message: str) -> None:
    assert main(["quantize", str(tiny), str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def calibrate_python() -> Path:
    if not CALIBRATE_PYTHON.exists():
        pytest.skip(f"no virtualenv with the calibrate extra at {CALIBRATE_PYTHON}: `make quant-fixtures` makes one "
                    "(or set TOKENFACTORY_CALIBRATE_PYTHON)")
    probe = subprocess.run([str(CALIBRATE_PYTHON), "-c", "import llmcompressor, tokenfactory.quality.calibrate"],
                           capture_output=True, text=True, cwd=ROOT)
    if probe.returncode:
        pytest.skip(f"{CALIBRATE_PYTHON} cannot import llm-compressor and tokenfactory: {probe.stderr[-300:]}")
    return CALIBRATE_PYTHON


@pytest.mark.slow
@pytest.mark.parametrize(("method", "symmetric"), [("gptq", True), ("awq", False)])
def test_quantize_calibrated_then_loaded_and_evaluated(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       method: str, symmetric: bool) -> None:
    python = calibrate_python()
    calibration = write_jsonl(tmp_path / "mine.jsonl", [{"text": s} for s in SENTENCES])
    out = tmp_path / f"tiny-{method}"
    cmd = [str(python), "-m", "tokenfactory.cli", "quantize", str(tiny), str(out), "--method", method,
           "--calibration", str(calibration), "--num-samples", "9", "--group-size", "32", "--seed", "3",
           *(["--awq-grid", "4"] if method == "awq" else [])]
    # From the checkout's root, so this checkout's tokenfactory is the one run; no hub, no torch.compile.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "it/s" in proc.stderr or "s/it" in proc.stderr  # llm-compressor's per-layer progress bars
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, symmetric)
    assert "lm_head" in config["ignore"]
    record = json.loads((out / "calibration.json").read_text())
    assert len(record["calibration_ids"]) == 9 and len(record["heldout_ids"]) == 3  # 12 lines, a fifth held out
    assert record["library"].startswith("llmcompressor ") and record["spec"]["method"] == method
    assert record["spec"]["awq_grid"] == (4 if method == "awq" else 20)
    heldout = [json.loads(x)["text"] for x in (out / "heldout.jsonl").read_text().splitlines()]
    assert heldout == [SENTENCES[i] for i in record["heldout_ids"]]
    # Loaded with its codes kept, by the loader everything else uses; eval compares it with its source and with
    # round to nearest of the same shape, on the held-out lines.
    loaded = load_model(out)
    assert loaded.quantized and all(n.endswith("_proj.weight") for n in loaded.quantized)
    capsys.readouterr()
    code = main(["eval", "--model", str(out), "--json", "--max-tokens", "4", "--max-ppl-increase", "100",
                 "--min-agreement", "0"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["result"]["text_source"] == str(out / "heldout.jsonl")
    assert report["round_to_nearest"]["quantization"] == "int4-g32 (LM head float)"
    assert report["comparison"]["baseline"].startswith(f"none ({tiny}")
    assert report["result"]["num_scored_tokens"] > 0


def test_without_llm_compressor_the_command_says_how_to_install_it(tiny: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    try:
        import llmcompressor  # noqa: F401
        pytest.skip("llm-compressor is installed in this venv")
    except ImportError:
        pass
    calibration = write_jsonl(tmp_path / "mine.jsonl", [{"text": s} for s in SENTENCES])
    code = main(["quantize", str(tiny), str(tmp_path / "out"), "--method", "gptq", "--calibration", str(calibration)])
    assert code == 2 and "pip install 'tokenfactory[calibrate]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
