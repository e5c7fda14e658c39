"""The Prometheus alert rules and the Grafana dashboard in deploy/: every metric they name is one the
server exports (checked against a live registry, always), and each rule fires where it should
(`promtool test rules`, when promtool is on PATH: Debian's `prometheus` package)."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fake_engine import FAKE_MODEL_CONFIG
from tests.gateway.test_dashboard import stats
from tokenfactory.engine.client import SpeculativeMetrics
from tokenfactory.gateway.metrics import ServerMetrics
from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.ledger import Ledger
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.service.admission import Admission

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES, RULE_TESTS = DEPLOY / "prometheus" / "alerts.yml", DEPLOY / "prometheus" / "alerts_test.yml"
GRAFANA = DEPLOY / "grafana" / "tokenfactory.json"
REQUIRED_ALERTS = {"TokenfactoryKVCacheNearFull", "TokenfactoryTTFTSLOBreach", "TokenfactoryJoulesPerTokenRegression",
                   "TokenfactoryLedgerJournalling", "TokenfactoryReplicaDown"}
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself
_OURS = re.compile(r"tokenfactory:[A-Za-z0-9_:]+")


class SpecEngine:
    """Just enough of an engine client for the collectors: a snapshot with speculative metrics."""

    def stats(self):
        spec = SpeculativeMetrics("ngram", 4, 1, 4, 2, 3, (1, 1, 0, 0), (1, 1, 1, 1), 0.0, True, 0.5, 0.3, 8, 1,
                                  0.01, 0.001, 0.0001, 0)
        return stats(speculative=spec)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Every sample name a server's /metrics shows (histograms observed once so their series exist)."""
    from prometheus_client import generate_latest

    ledger = Ledger.open(tmp_path_factory.mktemp("alerts"))
    meter = Meter(ConstantSource(50.0), FAKE_MODEL_CONFIG, load_prices(), MeterConfig(tick_interval_s=None))
    metrics = ServerMetrics(SpecEngine(), "m", meter, ledger, admission=Admission(ledger), baseline=("cpu-c8", 0.05))
    for h in (metrics.ttft, metrics.itl, metrics.e2e, metrics.queue, metrics.prompt_len, metrics.gen_len):
        h.labels("m").observe(0.1)
    metrics.success.labels("m", "stop").inc()
    metrics.errors.labels("m", "400").inc()
    text = generate_latest(metrics.registry).decode()
    ledger.close()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def unknown_names(expr: str, known: set[str]) -> set[str]:
    """Metric names in a PromQL expression that nothing exports."""
    return {n for n in _OURS.findall(expr) if n not in known}


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def recorded() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def test_the_name_check_catches_a_misspelt_metric(exported):
    assert "tokenfactory:kv_cache_usage_perc" in exported and "tokenfactory:device_busy_seconds_total" in exported
    assert unknown_names("tokenfactory:kv_cache_usage > 0.9", exported) == {"tokenfactory:kv_cache_usage"}
    assert unknown_names("rate(tokenfactory:num_preemptions_total[5m])", exported) == set()


def test_every_alert_rule_names_exported_metrics(exported):
    known = exported | recorded()
    alerts = [r for g in rule_groups() for r in g["rules"] if "alert" in r]
    assert {r["alert"] for r in alerts} >= REQUIRED_ALERTS
    for rule in alerts:
        assert unknown_names(rule["expr"], known) == set(), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "page") and rule["annotations"]["summary"], rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        others = {n for n in re.findall(r"(?<![\w:])([a-z_]+)\{", rule["expr"])} - {"by", "on"}
        assert others <= PROMETHEUS_OWN, (rule["alert"], others)
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_every_alert_has_a_promtool_unit_test():
    tested = {a["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for a in t["alert_rule_test"]}
    assert tested == {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}


def test_the_grafana_dashboard_names_exported_metrics(exported):
    dashboard = json.loads(GRAFANA.read_text())
    known = exported | recorded()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 14 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for expr in exprs:
        assert unknown_names(expr, known) == set(), expr
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for topic in ("Tokens/s", "Power", "Joules per output token", "$ per million", "busy", "KV cache", "TTFT",
                  "Prefix", "Speculative"):
        assert topic in titles, topic
    [instance] = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"]
    assert "engine_steps_total" in instance["definition"]  # one view per replica


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not on PATH (Debian: apt-get install prometheus); the Python checks ran")
def test_promtool_checks_and_unit_tests_the_rules():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(["promtool", "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=60)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_a_servers_baseline_comes_from_a_saved_bench_run(tmp_path) -> None:
    from tokenfactory.serve.flags import read_baseline

    run = tmp_path / "cpu-c8.json"
    run.write_text(json.dumps({"figures": {"joules_per_output_token": 0.02}}))
    assert read_baseline(str(run)) == ("cpu-c8", 0.02)
    run.write_text(json.dumps({"figures": {"joules_per_output_token": None}}))
    with pytest.raises(ValueError, match="no joules_per_output_token"):
        read_baseline(str(run))
    with pytest.raises(ValueError, match="cannot read"):
        read_baseline(str(tmp_path / "missing.json"))
