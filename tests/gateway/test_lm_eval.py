"""lm-evaluation-harness against our server: `local-completions` (loglikelihoods from `echo` + `logprobs` on
/v1/completions, token ids as prompts) on a tiny multiple-choice task whose data this test writes, compared with
lm-eval's own `hf` model on the same weights (the bundled model written as a float32 Hugging Face folder, which
the server loads too): the same accuracy, each choice's loglikelihood to 1e-3 and whether it is the greedy continuation.

lm-eval is not in the dev extra: it pins python-dateutil below 3, which would downgrade the dev environment's.
It runs from a virtualenv of its own: LMEVAL_PYTHON (default the checkout's .venv-lmeval, which `make test` makes
with `make lmeval`); the test is skipped, saying so, where that interpreter is absent. Slow: two lm-eval runs
and a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server

pytestmark = pytest.mark.slow

LMEVAL_PYTHON = Path(os.environ.get("LMEVAL_PYTHON", Path(__file__).parents[2] / ".venv-lmeval" / "bin" / "python"))
TASK = "tf_tiny_mc"
QUESTIONS = [  # (question, choices, answer index): easy enough that a 135M model gets some, not all
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The color of the sky on a clear day is", ["green", "blue", "red", "black"], 1),
    ("Two plus two equals", ["three", "five", "four", "ten"], 2),
    ("A baby cat is called a", ["puppy", "calf", "foal", "kitten"], 3),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Newton", "Pascal"], 0),
    ("The opposite of hot is", ["warm", "cold", "loud", "fast"], 1),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
]


def write_task(folder: Path) -> None:
    folder.mkdir(parents=True)
    with (folder / "data.jsonl").open("w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "data.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
""")


def lm_eval(out: Path, tasks: Path, model: str, model_args: str) -> tuple[float, list[list[tuple[float, str]]]]:
    """One lm-eval run: the task's accuracy and, per document, each choice's (loglikelihood, is greedy)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # lm-eval's venv, not ours
    cmd = [str(LMEVAL_PYTHON), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(tasks), "--batch_size", "1", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    return (json.loads(results.read_text())["results"][TASK]["acc,none"],
            [[(float(r[0]), r[1]) for r in doc["filtered_resps"]] for doc in docs])


@pytest.mark.skipif(not LMEVAL_PYTHON.exists(), reason=f"lm-eval's own venv is absent ({LMEVAL_PYTHON}; set "
                    "LMEVAL_PYTHON, or run `make lmeval`): it is kept out of the dev extra since it would "
                    "downgrade python-dateutil")
def test_local_completions_matches_lm_evals_hf_model(tmp_path) -> None:
    folder = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "tokenfactory.models.hf_export", str(folder)], check=True,
                   capture_output=True)
    write_task(tmp_path / "tasks")
    server = start_server(tmp_path, "--model", str(folder), "--dtype", "float32", "--machine-profile", "off",
                          "--power-source", "modelled", timeout=600)
    try:
        name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        served_acc, served = lm_eval(tmp_path / "served", tmp_path / "tasks", "local-completions",
                                     f"model={name},base_url={server.url}/v1/completions,tokenizer={folder},"
                                     "tokenized_requests=True,num_concurrent=1,max_retries=1")
        rows = server.ledger_rows()
    finally:
        server.stop()
    hf_acc, hf = lm_eval(tmp_path / "hf-run", tmp_path / "tasks", "hf", f"pretrained={folder},dtype=float32")
    assert served_acc == hf_acc and 0 < hf_acc  # the model gets some right, so agreement is not trivial
    assert len(served) == len(hf) == len(QUESTIONS)
    for ours, theirs in zip(served, hf, strict=True):  # fp32 both sides: measured within 2e-5
        assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-3)
        assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert len(rows) >= len(QUESTIONS) * 4 and all(r["status"] == "finished" for r in rows)  # each metered
