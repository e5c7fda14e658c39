"""`tokenfactory eval`: perplexity as transformers computes it, greedy agreement and the verdict, baselines
saved and compared, the bundled public-domain text and the user's own files, and clear errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.reference import hf_model_from_loaded, tiny_gguf_file
from tokenfactory.cli import main
from tokenfactory.models.loader import load_model
from tokenfactory.quality import eval as ev
from tokenfactory.quality.texts import (
    SQLITE_HEADER,
    bundled_prompts,
    bundled_text,
    read_prompts,
    read_texts,
    sqlite_header_prose,
)
from tokenfactory.types import ParameterError


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "tiny-q8_0.gguf"
    tiny_gguf_file(path, ggml_type="Q8_0")
    return path


@pytest.mark.slow
def test_perplexity_matches_transformers(tiny_path) -> None:
    loaded = load_model(tiny_path)
    engine, _ = ev.load_engine(loaded, "none", dtype="float32", max_model_len=128)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (70, 33)]
    ppl, num_scored = ev.perplexity(engine, docs, window=32)
    hf = hf_model_from_loaded(loaded)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for ids in docs:
            for start in range(0, len(ids) - 1, 32):
                chunk = torch.tensor([ids[start:start + 32]])
                if chunk.shape[1] < 2:
                    continue
                out = hf(chunk, labels=chunk)
                nll += out.loss.item() * (chunk.shape[1] - 1)
                count += chunk.shape[1] - 1
    assert num_scored == count == 31 + 31 + 5 + 31  # windows of 32 tokens score 31 each; the rest of each doc
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-4)


def result(ppl: float, tokens: list[list[int]], **changes: object) -> ev.EvalResult:
    base = ev.EvalResult(model="m", quantization="none", dtype="bfloat16", text_source="t", text_sha256="abc",
                         num_scored_tokens=100, perplexity=ppl, max_tokens=3, prompts=["a", "b"],
                         greedy_tokens=tokens, decode_weight_bytes=1, elapsed_s=0.1)
    return replace(base, **changes)


def test_compare_and_verdict() -> None:
    base = result(10.0, [[1, 2, 3], [4, 5, 6]])
    same = ev.compare(result(10.2, [[1, 2, 3], [4, 5, 6]]), base, "bf16", ev.Thresholds())
    assert same.passed and same.agreement == 1.0 and same.perplexity_change == pytest.approx(0.02)
    worse = ev.compare(result(11.0, [[1, 2, 9], [7, 5, 6]]), base, "bf16", ev.Thresholds(0.05, 0.5))
    assert not worse.passed and worse.verdict == "FAIL" and worse.agreement == 0.0
    assert worse.mean_common_prefix == 1.0  # 2 tokens, then 0 tokens
    assert any("perplexity rose +10.0%" in r for r in worse.reasons)
    assert any("greedy agreement 0% is below the 50% required" in r for r in worse.reasons)
    with pytest.raises(ValueError, match="measured with other prompts"):
        ev.compare(result(10.0, [[1, 2, 3]], prompts=["x"]), base, "bf16", ev.Thresholds())
    with pytest.raises(ParameterError, match="min_agreement must be in"):
        ev.Thresholds(min_agreement=2)


def test_baselines_are_saved_and_named(tmp_path) -> None:
    r = result(9.5, [[1, 2, 3], [4, 5, 6]])
    path = ev.save_baseline(r, tmp_path, "bf16-v1")
    assert path == tmp_path / "bf16-v1.json" and ev.load_baseline(tmp_path, "bf16-v1") == r
    with pytest.raises(FileNotFoundError, match=r"no saved baseline 'int4' .*saved: bf16-v1"):
        ev.load_baseline(tmp_path, "int4")
    with pytest.raises(ParameterError, match="a baseline name is letters"):
        ev.baseline_path(tmp_path, "../etc/passwd")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a saved evaluation"):
        ev.load_baseline(tmp_path, "junk")


def test_bundled_text_and_prompts() -> None:
    text = bundled_text()
    assert 20_000 < len(text) <= 24_000 and "SQLite" in text and "/*" not in text
    assert len(bundled_prompts()) >= 16


@pytest.mark.skipif(not SQLITE_HEADER.is_file() or '"3.40.1"' not in SQLITE_HEADER.read_text(),
                    reason="the bundled text was generated from SQLite 3.40.1's sqlite3.h (Debian libsqlite3-dev)")
def test_bundled_text_regenerates_from_the_public_domain_header() -> None:
    assert sqlite_header_prose(SQLITE_HEADER.read_text()) == bundled_text()


def test_users_files(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello there")
    assert read_texts(tmp_path / "a.txt") == ["hello there"]
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert read_texts(tmp_path / "b.jsonl") == ["one", "two"]
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: each line needs a string field \"text\""):
        read_texts(tmp_path / "c.jsonl")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\nnot json\n')
    with pytest.raises(ValueError, match="p.jsonl:2: not valid JSON"):
        read_prompts(tmp_path / "p.jsonl")
    (tmp_path / "p.json").write_text(json.dumps(["x", "y"]))
    assert read_prompts(tmp_path / "p.json") == ["x", "y"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")


@pytest.mark.slow
def test_eval_cli_save_then_compare(tiny_path, tmp_path, capsys) -> None:
    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 40)
    (tmp_path / "prompts.json").write_text(json.dumps(["the cat", "on the", "a hat"]))
    common = ["eval", "--model", str(tiny_path), "--baseline-dir", str(tmp_path / "bl"), "--text",
              str(tmp_path / "text.txt"), "--prompts", str(tmp_path / "prompts.json"), "--max-tokens", "6",
              "--window", "64"]
    assert main([*common, "--quantization", "none", "--save", "ref"]) == 0
    assert "saved as baseline 'ref'" in capsys.readouterr().out
    code = main([*common, "--quantization", "auto", "--baseline", "ref", "--json", "--min-agreement", "0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["comparison"]["verdict"] == "PASS" and out["result"]["quantization"] == "auto"
    # The same Q8_0 weights: perplexity within bf16 noise of the unquantized run.
    assert abs(out["comparison"]["perplexity_change"]) < 0.01
    # An impossible gate fails with exit code 1 and says why.
    assert main([*common, "--quantization", "int4", "--baseline", "ref", "--max-ppl-increase", "0"]) == 1
    assert "verdict      FAIL" in capsys.readouterr().out


def test_eval_cli_errors(tiny_path, tmp_path, capsys) -> None:
    assert main(["eval", "--model", str(tiny_path), "--quantization", "int5"]) == 2
    assert "quantization must be one of" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_path), "--baseline", "nope", "--baseline-dir", str(tmp_path)]) == 2
    assert "no saved baseline 'nope'" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_path), "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_of_a_calibrated_folder_compares_with_its_source_and_rounding(tmp_path, capsys) -> None:
    # What `quantize --method` leaves (a compressed-tensors folder, calibration.json, heldout.jsonl) sets eval's
    # defaults: the source unquantized is the baseline, its int4-g32 rounding the second reference, the held-out
    # prompts the text. The folder here is packed by compressed-tensors itself from the same float weights.
    pytest.importorskip("compressed_tensors")
    from tests.models.test_hf_quant import compressed_tensors_dir
    from tests.reference import tiny_random_model_dir
    from tokenfactory.quality.calibrate import CalibrationRecord, CalibrationSpec

    (tmp_path / "quant").mkdir()
    folder = compressed_tensors_dir(tmp_path / "quant", name="ct", symmetric=False)
    # The same seeded random weights, unquantized: the folder's source.
    float_dir = tiny_random_model_dir(tmp_path, "llama", hidden_size=128, intermediate_size=256, num_heads=4,
                                      num_kv_heads=2, name="orig")
    spec = CalibrationSpec("gptq", group_size=32)
    record = CalibrationRecord(str(float_dir), dataclasses_asdict(spec), "cal.jsonl", "0" * 64, 10, list(range(8)),
                               [8, 9], "llmcompressor test")
    (folder / "calibration.json").write_text(json.dumps(dataclasses_asdict(record)))
    (folder / "heldout.jsonl").write_text("".join(json.dumps({"text": "the cat sat on the mat " * 30}) + "\n"
                                                  for _ in range(2)))
    code = main(["eval", "--model", str(folder), "--max-tokens", "4", "--window", "64", "--json",
                 "--max-ppl-increase", "100", "--min-agreement", "0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["comparison"]["verdict"] == "PASS"
    assert out["result"]["text_source"] == str(folder / "heldout.jsonl")
    # Rounded with its LM head float, as the folder's recipe left it: the same layers quantized, the same bytes.
    rtn = out["round_to_nearest"]
    assert rtn["quantization"] == "int4-g32 (LM head float)" and rtn["model"] == str(float_dir)
    assert rtn["decode_weight_bytes"] == out["result"]["decode_weight_bytes"], (rtn, out["result"])
    assert out["comparison"]["baseline"].startswith(f"none ({float_dir}")


def dataclasses_asdict(obj: object) -> dict:
    from dataclasses import asdict

    return asdict(obj)
