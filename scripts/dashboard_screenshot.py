"""docs/dashboard.png: the dashboard under load, admin view, taken by headless Chromium (Playwright).

    .venv/bin/python scripts/dashboard_screenshot.py [--seconds 120] [--out docs/dashboard.png]

Starts `tokenfactory serve --auth` (the bundled SmolLM2) on a fresh data directory with two tenants
(acme: 0.05 USD/month, globex: 20 kJ/month), runs `tokenfactory bench serve` as acme (shared-prefix
prompts) and a request every 5 s as globex, watches /dashboard with an admin key, and after --seconds
saves the screenshot, the page's points (--out with .json) and prints /metrics' device series, the
utilisation rollup and acme's statement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
TF = str(REPO / ".venv" / "bin" / "tokenfactory")


def cli(data_dir: Path, *args: str) -> str:
    return subprocess.run([TF, *args, "--data-dir", str(data_dir)], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout


def new_key(data_dir: Path, *args: str) -> str:
    return json.loads(cli(data_dir, "keys", "create", *args, "--format", "json"))[0]["key"]


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become healthy")


def watch(url: str, admin: str, acme: str, globex: str, args: argparse.Namespace, work: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "chromium",
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1400})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(url + "/dashboard")
        page.fill("#key", admin)
        page.click("#login button")
        time.sleep(6)  # an idle stretch before the load
        bench = subprocess.Popen(
            [TF, "bench", "serve", "--base-url", url, "--api-key", acme, "--dataset", "shared-prefix", "--num-prompts",
             "2000", "--concurrency", str(args.concurrency), "--input-len", "96", "--prefix-len", "64", "--output-len",
             "48", "--warmup", "1", "--no-progress", "--results-dir", str(work / "results")],
            stdout=(work / "bench.log").open("w"), stderr=subprocess.STDOUT, cwd=REPO)
        client = openai.OpenAI(base_url=url + "/v1", api_key=globex, max_retries=0, timeout=120)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end - 20:
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="The factory floor hums because",
                                      max_tokens=32)
            time.sleep(5)
        time.sleep(max(end - time.monotonic(), 0.0))
        page.screenshot(path=str(args.out), full_page=True)
        state = {"points": page.evaluate("window.tfDashboard.points"),
                 "tenants": page.evaluate("window.tfDashboard.tenants"), "console_errors": errors}
        args.out.with_suffix(".json").write_text(json.dumps(state))
        print("console errors (the 401 before the key is expected):", errors)
        bench.send_signal(signal.SIGINT)
        bench.wait(60)
        browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=8518)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tf-dashboard-"))
    data_dir = work / "data"
    cli(data_dir, "tenants", "add", "acme", "--budget", "0.05USD/month")
    cli(data_dir, "tenants", "add", "globex", "--budget", "20kJ/month")
    admin, acme, globex = new_key(data_dir, "--admin"), new_key(data_dir, "--tenant", "acme"), \
        new_key(data_dir, "--tenant", "globex")
    server = subprocess.Popen([TF, "serve", "--auth", "--port", str(args.port), "--data-dir", str(data_dir),
                               "--log-level", "warning"], stdout=(work / "serve.log").open("w"),
                              stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url)
        watch(url, admin, acme, globex, args, work)
        print("\n".join(line for line in httpx.get(url + "/metrics").text.splitlines()
                        if line.startswith("tokenfactory:device_")))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    print(cli(data_dir, "usage", "--utilisation"))
    print(cli(data_dir, "usage", "--invoice", "--tenant", "acme", "--month", time.strftime("%Y-%m", time.gmtime()),
              "--out", str(work)))
    print("work directory:", work)


if __name__ == "__main__":
    main()
