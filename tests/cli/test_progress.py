"""Progress bars in the long commands (tokenfactory/progress.py): shown on a terminal, silent when piped."""

import os
import pty
import subprocess
import sys

import pytest

from tokenfactory.progress import PROGRESS_ENV, enabled, track

SCRIPT = "from tokenfactory.progress import track\nfor _ in track(range(3), 'counting sheep'): pass\nprint('done')"


def run_with_stderr_on_a_terminal(code: str, env: dict[str, str]) -> str:
    """Run `code` with standard error on a pseudo-terminal; what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != PROGRESS_ENV}


def test_a_bar_on_a_terminal_and_nothing_when_piped():
    shown = run_with_stderr_on_a_terminal(SCRIPT, clean_env())
    assert "counting sheep" in shown and "3/3" in shown
    piped = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert piped.stdout == "done\n" and piped.stderr == ""


def test_the_environment_forces_it_either_way(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "0")
    items = [1, 2]
    assert not enabled() and track(items, "x") is items  # off: the iterable itself, no wrapper
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert enabled() and list(track(iter(items), "x")) == items
    quiet = run_with_stderr_on_a_terminal(SCRIPT, {**clean_env(), PROGRESS_ENV: "0"})
    assert "counting sheep" not in quiet


@pytest.mark.slow
def test_loading_the_real_model_shows_a_bar_only_on_a_terminal():
    # The GGUF's weights are read lazily: the time, and the bar, are in placing them layer by layer.
    code = ("import torch\nfrom tokenfactory.engine.placement import place_model\n"
            "from tokenfactory.models.loader import load_model\nm = load_model(None)\n"
            "place_model(m.config, m.weights, device=torch.device('cpu'), dtype=torch.bfloat16)")
    shown = run_with_stderr_on_a_terminal(code, clean_env())
    assert "loading weights" in shown
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert piped.returncode == 0 and "loading weights" not in piped.stderr


def test_simulate_shows_a_bar_only_on_a_terminal():
    code = ("import sys\nfrom tokenfactory.cli import main\n"
            "sys.exit(main(['simulate', '--duration', '60', '--rate', '2', '--replicas', '1,2']))")
    shown = run_with_stderr_on_a_terminal(code, clean_env())
    assert "simulating" in shown
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert piped.returncode == 0 and "simulating" not in piped.stderr and "/Mtok" in piped.stdout
