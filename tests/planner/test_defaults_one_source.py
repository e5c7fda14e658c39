"""One source for every default two commands share, one name per setting, and --help that shows each default with a
line of why (#30, findings 7 and 8). Reads every command's parser, the meter's prices, the planner's and the
simulator's dataclass defaults and the data files, and finds one definition for each."""

import argparse
import ast
import dataclasses
import tomllib
from pathlib import Path

import pytest

from tokenfactory.cli import build_parser
from tokenfactory.config import OFFLINE_BATCHING, EngineConfig
from tokenfactory.levers import LEVERS, OUTPUT_TOKENS, PROMPT_TOKENS, HelpFormatter
from tokenfactory.meter.prices import catalog_prices, load_price_table, load_prices, shared_defaults

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("serve", "plan", "doctor", "simulate", "batch run")
# dest -> the one definition of its default
ENGINE = {name: getattr(EngineConfig, name) for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                                         "block_size", "kv_cache_dtype", "dtype", "quantization")}
WORKLOAD = {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
# Commands with no server take the offline batching, itself defined once (config.OFFLINE_BATCHING, the LLM class's).
OFFLINE_COMMANDS = {"batch run": OFFLINE_BATCHING}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    top = _subparsers(build_parser())
    out = {name: top[name] for name in COMMANDS if " " not in name}
    out["batch run"] = _subparsers(top["batch"])["run"]
    return out


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}


def test_engine_levers_have_one_name_and_the_engines_default_everywhere(commands):
    seen: dict[str, set[str]] = {}
    for name, parser in commands.items():
        actions = _actions(parser)
        for dest, source in {**ENGINE, **WORKLOAD, **OFFLINE_COMMANDS.get(name, {})}.items():
            if dest not in actions:
                continue
            action, lever = actions[dest], LEVERS[dest]
            assert action.option_strings[0] == lever.flag, (name, dest)
            assert set(action.option_strings) <= {lever.flag, *lever.aliases}, (name, action.option_strings)
            assert action.default == source, f"{name} {lever.flag} defaults to {action.default!r}, not {source!r}"
            seen.setdefault(dest, set()).add(name)
    # The levers the issue names are in every command that plans or serves.
    for dest in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "quantization"):
        assert {"serve", "plan", "doctor"} <= seen[dest], dest
    assert {"serve", "plan", "simulate"} <= seen["max_num_seqs"] and {"plan", "simulate"} <= seen["prompt_tokens"]


def test_older_names_still_work_and_say_so(commands):
    """--concurrency, --precision and --kv-dtype (plan/doctor's old names) set the same setting as serve's names, and
    --help calls them older names."""
    plan = commands["plan"]
    old = plan.parse_args(["m", "--concurrency", "8", "--precision", "int8", "--kv-dtype", "fp8"])
    new = plan.parse_args(["m", "--max-num-seqs", "8", "--quantization", "int8", "--kv-cache-dtype", "fp8"])
    assert vars(old) == vars(new)
    for dest in ("max_num_seqs", "quantization", "kv_cache_dtype"):
        action = _actions(plan)[dest]
        for alias in LEVERS[dest].aliases:
            assert alias in action.option_strings and f"{alias}: older name" in action.help


def test_money_defaults_are_the_prices_files(commands, capsys):
    """PUE, PSU efficiency, electricity, lifetime and utilisation: the meter, plan, doctor's prices and simulate all
    take meter/prices.toml's, the one file that defines them."""
    from tokenfactory.cli import main
    from tokenfactory.fleet.simulator import SimConfig

    money = shared_defaults()
    meter = load_prices()
    assert (meter.pue, meter.psu_efficiency, meter.usd_per_kwh) == (money.pue, money.psu_efficiency,
                                                                     money.usd_per_kwh)
    sim = SimConfig(specs=[])
    assert (sim.pue, sim.psu_efficiency, sim.usd_per_kwh) == (money.pue, money.psu_efficiency, money.usd_per_kwh)
    simulate = _actions(commands["simulate"])
    assert simulate["pue"].default == money.pue and simulate["psu_efficiency"].default == money.psu_efficiency
    assert main(["plan", "Llama-2-7B", "--device", "A100-80GB", "--json"]) == 0
    import json

    prices = json.loads(capsys.readouterr().out)["prices"]
    assert prices["pue"] == money.pue and prices["psu_efficiency"] == money.psu_efficiency
    assert prices["electricity_per_kwh"] == money.usd_per_kwh and prices["lifetime_years"] == money.lifetime_years
    assert prices["utilisation"] == money.utilisation
    # Every money flag of plan and simulate is named once; the US$ spellings are the older names.
    for parser in (commands["plan"], commands["simulate"]):
        flags = [s for a in parser._actions for s in a.option_strings]
        assert len(flags) == len(set(flags))
        assert "--electricity-per-kwh" in flags and "--electricity-usd-per-kwh" in flags


def test_each_cards_rent_and_price_is_defined_once(capsys):
    """The meter bills a card at the rate the plan rents it at; the planner's device file carries no price."""
    from tokenfactory.planner.catalog import load_catalog

    devices = tomllib.loads((ROOT / "tokenfactory/planner/data/devices.toml").read_text())
    assert not any("rent_usd_per_hour" in d or "price_usd" in d for d in devices["device"])
    catalog = load_catalog()
    table = load_price_table()["devices"]
    for name, price in catalog_prices().items():
        device = catalog.device(name)
        metered = load_prices(device=price.profile).device
        assert device.rent_usd_per_hour is None or device.rent_usd_per_hour.value == metered.usd_per_hour
        assert device.price_usd.value == table[price.profile]["purchase_usd"]
    # The GPUs a server meets pick the same rate by name as the plan uses for that card.
    for nvml, card in (("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
                       ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
                       ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA H200", "H200")):
        rate = load_prices(device_name=nvml, device_type="cuda").device.usd_per_hour
        assert rate == catalog.device(card).rent_usd_per_hour.value, nvml


def test_no_second_definition_in_the_data_files():
    """pue, the PSU and electricity prices, lifetime and utilisation appear in meter/prices.toml only."""
    keys = {"pue", "psu_efficiency", "psu_loss_factor", "usd_per_kwh", "electricity_usd_per_kwh", "lifetime_years",
            "utilisation"}
    found: dict[str, set[str]] = {}

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in keys:
                    found.setdefault(k, set()).add(where)
                walk(v, where)

    for path in (ROOT / "tokenfactory").rglob("*.toml"):
        walk(tomllib.loads(path.read_text()), str(path.relative_to(ROOT)))
    assert found and all(files == {"tokenfactory/meter/prices.toml"} for files in found.values()), found


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(
        n.func, "id", None)) == name]


# The commands #30 names (the bench's and eval's flags are their own: bench's --concurrency counts clients).
COMMAND_SOURCES = ("tokenfactory/planner", "tokenfactory/serve", "tokenfactory/fleet/cli.py", "tokenfactory/meter")


def test_no_command_spells_a_lever_by_hand():
    """Every lever's flag (and older name) is added through levers.add_lever, whose help and name are the lever's;
    and no add_lever call hard-codes a numeric default (the engine, the workload or the prices file give it)."""
    flags = {f for lever in LEVERS.values() for f in (lever.flag, *lever.aliases)}
    flags -= {"--electricity-usd-per-kwh", "--usd-per-kwh"}  # the US$ spellings, converted: their own dest
    broken = []
    paths = [p for src in COMMAND_SOURCES
             for p in ([ROOT / src] if src.endswith(".py") else (ROOT / src).rglob("*.py"))]
    for path in sorted(paths):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "add_argument"):
            named = {a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
            if named & flags:
                broken.append(f"{path.relative_to(ROOT)}:{call.lineno} adds {sorted(named & flags)} by hand")
        for call in _calls(tree, "add_lever"):
            for kw in call.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value,
                                                                                              int | float):
                    broken.append(f"{path.relative_to(ROOT)}:{call.lineno} hard-codes default={kw.value.value}")
    assert not broken, "\n".join(broken)


def test_planner_and_simulator_dataclasses_default_to_the_engine():
    from tokenfactory.fleet.sim_model import ReplicaSpec
    from tokenfactory.planner.core import PlanRequest
    from tokenfactory.planner.perf import Workload

    for cls in (PlanRequest, ReplicaSpec):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert defaults["max_num_seqs"] == EngineConfig.max_num_seqs
        assert defaults["max_num_batched_tokens"] == EngineConfig.max_num_batched_tokens
    assert (Workload().prompt_tokens, Workload().output_tokens) == (PROMPT_TOKENS, OUTPUT_TOKENS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default_and_a_why_for_each_lever(commands, command):
    parser = commands[command]
    formatter = HelpFormatter("x")
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action)
        if action.default not in (None, False, [], argparse.SUPPRESS) and "%(default)" not in action.help:
            assert "(default: %(default)s)" in shown, f"{command} {action.option_strings[0]} hides its default"
        if action.dest in LEVERS:
            assert len(action.help.split()) >= 8, f"{command} {action.option_strings[0]}: say why, not just what"
    text = parser.format_help()  # formats without errors (a stray % in a help string would raise here)
    assert "(default:" in text


def test_serve_help_explains_the_essays_levers(commands):
    """Finding 8: the levers the essay is about, each with its default and what it trades."""
    text = " ".join(commands["serve"].format_help().split())
    for flag, words in (("--max-model-len", "fits more sequences in the KV cache"),
                        ("--max-num-seqs", "J/token"), ("--max-num-batched-tokens", "chunked prefill"),
                        ("--dtype", "bfloat16"), ("--block-size", "paged attention"),
                        ("--no-prefix-caching", "skip its prefill")):
        assert flag in text and words in text, flag
    assert "(default: 64)" in text and "(default: 1024)" in text and "(default: 16)" in text
