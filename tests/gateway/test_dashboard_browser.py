"""/dashboard in a real Chromium (Playwright driving the system browser): the page loads with no console
error, its charts receive live points while `tokenfactory bench serve` runs against the server, an admin
sees the tenants and a tenant's key is refused, and it keeps working with JavaScript's clock paused.

No browser here? These tests skip, saying how to get one (`.ci/run` installs Debian's chromium).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import start_gateway
from tokenfactory.tenants.store import Tenant

HOW_TO_GET_ONE = ("no Chromium for the dashboard's browser tests: `apt-get install chromium` (Debian; .ci/run "
                  "does it), or set TOKENFACTORY_CHROMIUM=/path/to/chrome; and `pip install playwright` (the dev "
                  "extra). Playwright's own browser download is not needed.")


def chromium_path() -> str | None:
    explicit = os.environ.get("TOKENFACTORY_CHROMIUM")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason=HOW_TO_GET_ONE)
    path = chromium_path()
    if path is None:
        pytest.skip(HOW_TO_GET_ONE)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class Watched:
    """A page with its console errors and uncaught exceptions collected."""

    def __init__(self, browser, url: str, clock: bool = False) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        if clock:
            self.page.clock.install()
        self.page.goto(url + "/dashboard")

    def state(self, name: str):
        return self.page.evaluate(f"window.tfDashboard.{name}")

    def wait(self, expression: str, timeout_s: float = 20.0) -> None:
        self.page.wait_for_function(expression, timeout=timeout_s * 1000)

    def close(self) -> None:
        self.page.close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.003), tmp_path_factory.mktemp("browser"))
    yield g
    g.stop()


def test_the_page_loads_with_no_console_error_and_draws_every_chart(browser, gw):
    w = Watched(browser, gw.url)
    try:
        w.wait("window.tfDashboard.connected && window.tfDashboard.numPointMessages >= 2")
        assert w.page.locator(".chart").count() == 8 and w.page.locator(".chart canvas").count() == 8
        assert w.page.locator("#status").inner_text() == "live"
        assert w.page.locator("#tenant-section").is_hidden()  # no --auth: the operator view only
        assert w.errors == []
    finally:
        w.close()


@pytest.mark.slow
def test_charts_receive_live_points_while_a_bench_runs(browser, gw, tmp_path):
    w = Watched(browser, gw.url)
    try:
        w.wait("window.tfDashboard.connected")
        bench = subprocess.Popen(
            [sys.executable, "-m", "tokenfactory.cli", "bench", "serve", "--base-url", gw.url, "--num-prompts", "300",
             "--concurrency", "4", "--input-len", "8", "--output-len", "16", "--no-progress",
             "--power-source", "none", "--results-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            w.wait("window.tfDashboard.points.some(p => p.tokens_out_s > 0 && p.tokens_in_s > 0)", timeout_s=90)
            points = w.state("points")
        finally:
            out, _ = bench.communicate(timeout=120)
        assert bench.returncode == 0, out[-2000:]
        busy = [p for p in points if p["tokens_out_s"] > 0]
        assert busy and all(p["watts"] > 0 and p["joules_per_token"] > 0 and p["usd_per_mtok"] > 0 for p in busy)
        tokens_chart = int(w.page.locator("#chart-tokens").get_attribute("data-points"))
        assert tokens_chart >= len(busy) and w.page.locator("#tiles .tile .v").first.inner_text() != "–"
        assert w.errors == []
    finally:
        w.close()


def test_the_page_works_with_the_clock_paused_and_resumed(browser, gw):
    w = Watched(browser, gw.url, clock=True)
    try:
        w.wait("window.tfDashboard.connected && window.tfDashboard.numPointMessages >= 1")
        w.page.clock.pause_at(int(time.time() * 1000) + 60_000)  # timers and Date stand still from here
        before = w.state("numPointMessages")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model="fake-tiny", prompt="while paused", max_tokens=8)
        w.wait(f"window.tfDashboard.numPointMessages >= {before + 2}")  # points arrive: no timer needed
        w.page.clock.resume()
        resumed = w.state("numPointMessages")
        w.wait(f"window.tfDashboard.numPointMessages >= {resumed + 2}")
        assert w.page.locator("#status").inner_text() == "live" and w.errors == []
    finally:
        w.close()


@pytest.fixture(scope="module")
def authed(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.003), tmp_path_factory.mktemp("browser-auth"), auth=True)
    g.store.add_tenant(Tenant("acme"))
    keys = {"acme": g.store.create_key("acme")[0], "admin": g.store.create_key(None, is_admin=True)[0]}
    openai.OpenAI(base_url=g.url + "/v1", api_key=keys["acme"], max_retries=0, timeout=30).completions.create(
        model="fake-tiny", prompt="a billed request", max_tokens=8)
    yield g, keys
    g.stop()


def test_a_tenant_key_is_refused_and_an_admin_sees_tenants(browser, authed):
    gw, keys = authed
    w = Watched(browser, gw.url)
    try:
        w.wait("window.tfDashboard.lastError !== null")
        assert w.state("lastError.status") == 401 and w.page.locator("#login").is_visible()
        w.page.fill("#key", keys["acme"])
        w.page.click("#login button")
        w.wait("window.tfDashboard.lastError.status === 403")
        assert "admin API key" in w.page.locator("#login-reason").inner_text()
        assert w.page.locator("#tenant-section").is_hidden() and not w.state("connected")
        w.page.fill("#key", keys["admin"])
        w.page.click("#login button")
        w.wait("window.tfDashboard.tenants !== null")
        assert w.page.locator("#login").is_hidden() and w.page.locator("#tenant-section").is_visible()
        row = w.page.locator("#tenants tbody tr", has_text="acme")
        assert row.count() == 1 and row.locator("td").nth(1).inner_text() == "1"
        assert w.page.locator("#recent tbody tr").first.locator("td").nth(1).inner_text() == "acme"
        # the only console errors are the browser's own lines for the two refused responses
        assert len(w.errors) == 2 and all("401" in e or "403" in e for e in w.errors), w.errors
    finally:
        w.close()
