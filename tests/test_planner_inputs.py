"""``hf-demo plan`` against bad and odd inputs: every one is refused with one line on stderr naming the problem and
the fix, exit status 2, before anything is planned or printed; DeMo settings are refused exactly as ``hf_demo.DeMo``
refuses them; good inputs still plan, with valid JSON, the memory fit, the start-up broadcast and the measured
DeMo overhead; a reader that closes the pipe early ends the command quietly."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_demo.ops import cli, prices
from hf_demo.ops.methods import DEMO_OVERHEAD
from hf_demo.settings import DeMoSettings

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--nodes", "2", "--inter-node", "1gbit", "--compute-s", "1", "--steps-per-epoch", "10"]
SHAPES = ["--shapes", "64x64"]
NO_EPOCH = PLAN[:-2]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 100}  # fmt: skip
CONFIGS = {  # file name -> what config.json holds
    "vocab": {**LLAMA, "vocab_size": -5},
    "heads": {**LLAMA, "num_attention_heads": 5},
    "string": {**LLAMA, "hidden_size": "64"},
    "fraction": {**LLAMA, "hidden_size": 64.5},
    "boolean": {**LLAMA, "hidden_size": True},
    "layers": {**LLAMA, "num_hidden_layers": -1},
    "deep": {**LLAMA, "num_hidden_layers": 100_000},
    "wide": {**LLAMA, "hidden_size": 10**12, "intermediate_size": 10**12},
    "list": [1, 2, 3],
    "good": LLAMA,
}
TOMLS = {  # file name -> a price table's text
    "scalar_compute": "compute = 5\n[traffic]\nper_gb = 0.02\n",
    "negative": "[compute]\ndevice_per_hour = -2.5\n[traffic]\nper_gb = 0.02\n",
    "nan": "[compute]\ndevice_per_hour = nan\n[traffic]\nper_gb = 0.02\n",
    "inf": "[compute]\ndevice_per_hour = 2.5\n[traffic]\nper_gb = inf\n",
    "bool": "[compute]\ndevice_per_hour = true\n[traffic]\nper_gb = 0.02\n",
    "string": '[compute]\ndevice_per_hour = "2.5"\n[traffic]\nper_gb = 0.02\n',
    "both": "[compute]\ndevice_per_hour = 2.5\nnode_per_hour = 20\n[traffic]\nper_gb = 0.02\n",
    "typo": "[compute]\ndevice_per_hour = 2.5\n[traffic]\nper_GB = 0.02\n",
    "unknown": "region = 'eu'\n[compute]\ndevice_per_hour = 2.5\n[traffic]\nper_gb = 0.02\n",
    "currency": "currency = 5\n[compute]\ndevice_per_hour = 2.5\n[traffic]\nper_gb = 0.02\n",
    "scalar_traffic": '[compute]\ndevice_per_hour = 2.5\ntraffic = "cheap"\n',
    "huge": "[compute]\ndevice_per_hour = 1e300\n[traffic]\nper_gb = 0.02\n",
    "bad_toml": "[compute\n",
}


def _files(tmp: Path) -> None:
    for name, config in CONFIGS.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    for name, text in TOMLS.items():
        (tmp / f"{name}.toml").write_text(text)
    (tmp / "folder.json").mkdir()


# case -> (arguments, "{tmp}" the test's folder; a text the one-line message holds: the flag, key or field)
BAD = {
    # DeMo settings: refused as hf_demo.DeMo refuses them
    "topk -1": ([*PLAN, *SHAPES, "--demo", "compression_topk=-1"], "compression_topk"),
    "topk 0": ([*PLAN, *SHAPES, "--demo", "compression_topk=0"], "compression_topk"),
    "topk 100000": ([*PLAN, *SHAPES, "--demo", "compression_topk=100000"], "chunk*chunk"),
    "topk above a small chunk": ([*PLAN, *SHAPES, "--demo", "compression_chunk=4"], "compression_topk"),
    "chunk 0": ([*PLAN, *SHAPES, "--demo", "compression_chunk=0"], "compression_chunk"),
    "chunk 300": ([*PLAN, *SHAPES, "--demo", "compression_chunk=300"], "compression_chunk"),
    "decay 1.5": ([*PLAN, *SHAPES, "--demo", "compression_decay=1.5"], "compression_decay"),
    "decay nan": ([*PLAN, *SHAPES, "--demo", "compression_decay=nan"], "compression_decay"),
    "timeout inf": ([*PLAN, *SHAPES, "--demo", "comm_timeout=inf"], "comm_timeout"),
    "budget 1": ([*PLAN, *SHAPES, "--demo", "comm_budget=1"], "comm_budget"),
    "sync_every 0": ([*PLAN, *SHAPES, "--demo", "sync_every=0"], "sync_every"),
    "all_reduce with sign values": (
        [*PLAN, *SHAPES, "--demo", "exchange=all_reduce", "--demo", "value_format=sign"],
        "all_reduce",
    ),  # fmt: skip
    "overlap with local steps": ([*PLAN, *SHAPES, "--demo", "overlap=true", "--demo", "sync_every=4"], "overlap"),
    "an inner rule that never runs": ([*PLAN, *SHAPES, "--demo", "inner_rule=orthogonal"], "inner_rule"),
    "a setting given twice": (
        [*PLAN, *SHAPES, "--demo", "compression_topk=16", "--demo", "compression_topk=64"],
        "given twice",
    ),  # fmt: skip
    "a retired setting": ([*PLAN, *SHAPES, "--demo", "hierarchy=node"], "hierarchy"),
    "an unknown setting": ([*PLAN, *SHAPES, "--demo", "speed=11"], "--demo"),
    "a word for a number": ([*PLAN, *SHAPES, "--demo", "compression_topk=many"], "compression_topk"),
    "not NAME=VALUE": ([*PLAN, *SHAPES, "--demo", "compression_topk"], "--demo"),
    # the model's config
    "vocab_size -5": ([*PLAN, "--model", "{tmp}/vocab"], "vocab_size"),
    "heads not dividing the hidden size": ([*PLAN, "--model", "{tmp}/heads"], "attention heads"),
    "hidden_size as a string": ([*PLAN, "--model", "{tmp}/string"], "hidden_size"),
    "hidden_size with a fraction": ([*PLAN, "--model", "{tmp}/fraction"], "hidden_size"),
    "hidden_size true": ([*PLAN, "--model", "{tmp}/boolean"], "hidden_size"),
    "negative layers": ([*PLAN, "--model", "{tmp}/layers"], "num_hidden_layers"),
    "100000 layers": ([*PLAN, "--model", "{tmp}/deep"], "num_hidden_layers"),
    "a trillion-wide model": ([*PLAN, "--model", "{tmp}/wide"], "--model"),
    "a config that is a list": ([*PLAN, "--model", "{tmp}/list"], "JSON object"),
    "no such model": ([*PLAN, "--model", "{tmp}/nowhere"], "--model"),
    # a parameter count or shapes
    "params 1e30": ([*PLAN, "--params", "1e30"], "--params"),
    "params 1e13 (596,047 tensors)": ([*PLAN, "--params", "1e13"], "tensors"),
    "params inf": ([*PLAN, "--params", "inf"], "--params"),
    "params nan": ([*PLAN, "--params", "nan"], "--params"),
    "params negative": ([*PLAN, "--params=-5e9"], "--params"),
    "params below 1": ([*PLAN, "--params", "0.5"], "--params"),
    "params true": ([*PLAN, "--params", "true"], "--params"),
    "layer shape without params": ([*PLAN, *SHAPES, "--layer-shape", "64x64"], "--layer-shape"),
    "layer shape with a zero": ([*PLAN, "--params", "1e6", "--layer-shape", "0x5"], "--layer-shape"),
    "a billion matrices": ([*PLAN, "--shapes", "4096x4096*1000000000"], "tensors"),
    "a negative count": ([*PLAN, "--shapes", "4096x4096*-1"], "--shapes"),
    "a dimension above 2**40": ([*PLAN, "--shapes", "99999999999999x99999999999999"], "--shapes"),
    "no shapes": ([*PLAN, "--shapes", ","], "--shapes"),
    "a float dimension": ([*PLAN, "--shapes", "1e3x5"], "--shapes"),
    "two models": ([*PLAN, *SHAPES, "--params", "100"], "--model"),
    "no model": ([*PLAN], "--model"),
    # the cluster
    "nodes 1e9": ([*PLAN, *SHAPES, "--nodes", "1e9"], "--nodes"),
    "devices 1e9": ([*PLAN, *SHAPES, "--devices-per-node", "1e9"], "--devices-per-node"),
    "nodes and devices 1e9": ([*PLAN, *SHAPES, "--nodes", "1e9", "--devices-per-node", "1e9"], "--nodes"),
    "nodes 0.5": ([*PLAN, *SHAPES, "--nodes", "0.5"], "--nodes"),
    "nodes true": ([*PLAN, *SHAPES, "--nodes", "true"], "--nodes"),
    "nodes inf": ([*PLAN, *SHAPES, "--nodes", "inf"], "--nodes"),
    "many devices and many tensors": (
        [*PLAN, "--shapes", "64x64*19000", "--devices-per-node", "1024"],
        "--devices-per-node",
    ),  # fmt: skip
    "an overflowing rate": ([*PLAN, *SHAPES, "--inter-node", "1e999gbit"], "--inter-node"),
    "a nan rate": ([*PLAN, *SHAPES, "--inter-node", "nan"], "--inter-node"),
    "a rate above a petabit": ([*PLAN, *SHAPES, "--inter-node", "1e20gbit"], "--inter-node"),
    "a rate below a bit": ([*PLAN, *SHAPES, "--intra-node", "0.5bit"], "--intra-node"),
    "an overflowing latency": ([*PLAN, *SHAPES, "--inter-latency", "1e999ms"], "--inter-latency"),
    "a latency of two minutes": ([*PLAN, *SHAPES, "--inter-latency", "120s"], "--inter-latency"),
    "a latency in hours": ([*PLAN, *SHAPES, "--inter-latency", "1h"], "--inter-latency"),
    "an infinite collective overhead": ([*PLAN, *SHAPES, "--collective-overhead", "inf"], "--collective-overhead"),
    "no memory": ([*PLAN, *SHAPES, "--device-memory", "0"], "--device-memory"),
    "memory in unknown units": ([*PLAN, *SHAPES, "--device-memory", "80XB"], "--device-memory"),
    "memory nan": ([*PLAN, *SHAPES, "--device-memory", "nanGB"], "--device-memory"),
    # the compute
    "compute inf": ([*PLAN, *SHAPES, "--compute-s", "inf"], "--compute-s"),
    "compute nan": ([*PLAN, *SHAPES, "--compute-s", "nan"], "--compute-s"),
    "compute 1e30": ([*PLAN, *SHAPES, "--compute-s", "1e30"], "--compute-s"),
    "demo overhead nan": ([*PLAN, *SHAPES, "--demo-overhead", "nan"], "--demo-overhead"),
    "demo overhead 1e6": ([*PLAN, *SHAPES, "--demo-overhead", "1e6"], "--demo-overhead"),
    "negative orthogonal overhead": ([*PLAN, *SHAPES, "--orthogonal-overhead=-1"], "--orthogonal-overhead"),
    "negative adamw step": ([*PLAN, *SHAPES, "--adamw-s=-1"], "--adamw-s"),
    "infinite powersgd overhead": ([*PLAN, *SHAPES, "--powersgd-overhead", "inf"], "--powersgd-overhead"),
    "3 bytes a parameter": ([*PLAN, *SHAPES, "--param-bytes", "3"], "--param-bytes"),
    "negative tolerance": ([*PLAN, *SHAPES, "--tolerance=-0.1"], "--tolerance"),
    "infinite tolerance": ([*PLAN, *SHAPES, "--tolerance", "inf"], "--tolerance"),
    # the epoch
    "half a step per epoch": ([*PLAN, *SHAPES, "--steps-per-epoch", "0.5"], "--steps-per-epoch"),
    "1e13 steps per epoch": ([*PLAN, *SHAPES, "--steps-per-epoch", "1e13"], "--steps-per-epoch"),
    "steps and samples": ([*PLAN, *SHAPES, "--epoch-samples", "1000", "--batch-size", "8"], "--steps-per-epoch"),
    "samples without a batch size": ([*NO_EPOCH, *SHAPES, "--epoch-samples", "1000"], "--batch-size"),
    "a batch size without samples": ([*PLAN, *SHAPES, "--batch-size", "8"], "--batch-size"),
    "half a sample": ([*NO_EPOCH, *SHAPES, "--epoch-samples", "0.5", "--batch-size", "1"], "--epoch-samples"),
    "a fractional batch": ([*NO_EPOCH, *SHAPES, "--epoch-samples", "10", "--batch-size", "1.5"], "--batch-size"),
    "no epoch": ([*NO_EPOCH, *SHAPES], "--steps-per-epoch"),
    # price tables
    "a price table's compute = 5": ([*PLAN, *SHAPES, "--prices", "{tmp}/scalar_compute.toml"], "compute"),
    "a negative price": ([*PLAN, *SHAPES, "--prices", "{tmp}/negative.toml"], "device_per_hour"),
    "a nan price": ([*PLAN, *SHAPES, "--prices", "{tmp}/nan.toml"], "device_per_hour"),
    "an infinite price": ([*PLAN, *SHAPES, "--prices", "{tmp}/inf.toml"], "per_gb"),
    "a price of true": ([*PLAN, *SHAPES, "--prices", "{tmp}/bool.toml"], "device_per_hour"),
    "a price in quotes": ([*PLAN, *SHAPES, "--prices", "{tmp}/string.toml"], "device_per_hour"),
    "both hourly prices": ([*PLAN, *SHAPES, "--prices", "{tmp}/both.toml"], "node_per_hour"),
    "a misspelt key": ([*PLAN, *SHAPES, "--prices", "{tmp}/typo.toml"], "per_GB"),
    "an unknown key": ([*PLAN, *SHAPES, "--prices", "{tmp}/unknown.toml"], "region"),
    "a currency that is a number": ([*PLAN, *SHAPES, "--prices", "{tmp}/currency.toml"], "currency"),
    "traffic that is not a table": ([*PLAN, *SHAPES, "--prices", "{tmp}/scalar_traffic.toml"], "traffic"),
    "a price of 1e300": ([*PLAN, *SHAPES, "--prices", "{tmp}/huge.toml"], "device_per_hour"),
    "TOML that does not parse": ([*PLAN, *SHAPES, "--prices", "{tmp}/bad_toml.toml"], "--prices"),
    "a price table that is a folder": ([*PLAN, *SHAPES, "--prices", "{tmp}"], "--prices"),
    # where the JSON goes
    "json naming a folder": ([*PLAN, *SHAPES, "--json", "{tmp}/folder.json"], "--json"),
    "json into no folder": ([*PLAN, *SHAPES, "--json", "{tmp}/nowhere/plan.json"], "--json"),
    # failures
    "infinite MTBF": ([*PLAN, *SHAPES, "--mtbf-hours", "inf"], "--mtbf-hours"),
    "a restart of 1e30 s": ([*PLAN, *SHAPES, "--mtbf-hours", "9", "--restart-s", "1e30"], "--restart-s"),
    "checkpoints every 0 steps": (
        [*PLAN, *SHAPES, "--mtbf-hours", "9", "--checkpoint-every", "0"],
        "--checkpoint-every",
    ),
    "a failure's cost without a rate": ([*PLAN, *SHAPES, "--detect-s", "60"], "--mtbf-hours"),
}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("planner_inputs")
    _files(tmp)
    return tmp


def test_the_table_holds_enough_cases():
    assert len(BAD) >= 59


@pytest.mark.parametrize("case", BAD)
def test_a_bad_input_is_one_line_on_stderr_with_exit_status_2(files, capsys, case):
    argv, names = BAD[case]
    started = time.perf_counter()
    code, out, err = _run([a.format(tmp=files) for a in argv], capsys)
    assert code == 2, (case, code, out[-300:], err)
    assert out == "", (case, out[:300])  # nothing printed: no plan from nonsense
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, (case, err)
    assert names in err and err.startswith("hf-demo"), (case, err)
    assert time.perf_counter() - started < 60, case  # refused from the inputs, before anything is built


@pytest.mark.parametrize(
    "chosen",
    [
        {"compression_topk": -1},
        {"compression_topk": 0},
        {"compression_topk": 100000},
        {"compression_chunk": 0},
        {"compression_chunk": 8, "compression_topk": 65},
        {"exchange": "all_reduce", "value_format": "sign"},
        {"overlap": True, "comm_budget": 0.1},
        {"compression_topk": 64, "compression_chunk": 16},
        {"value_format": "sign"},
        {"exchange": "all_reduce", "compression_topk": 128},
    ],
)
def test_the_planner_refuses_the_demo_settings_demo_refuses_and_no_others(capsys, chosen):
    """One source of truth: the planner's verdict on --demo is hf_demo.DeMo's, with DeMo's own message."""
    from hf_demo import DeMo

    try:
        DeMo([torch.nn.Parameter(torch.zeros(4, 4))], lr=1e-3, **chosen)
        refused = None
    except ValueError as exc:
        refused = str(exc).splitlines()[0]
    assert cli.demo_refusal(chosen) == refused
    code, out, err = _run([*PLAN, *SHAPES, *(x for k, v in chosen.items() for x in ("--demo", f"{k}={v}"))], capsys)
    assert code == (2 if refused else 0), (chosen, err)
    assert (refused in err) if refused else ("Recommended:" in out), (chosen, err)


def test_demo_settings_themselves_refuse_the_block_sizes_demo_refuses():
    for chosen in ({"compression_topk": -1}, {"compression_topk": 0}, {"compression_topk": 100000},
                   {"compression_chunk": 257}, {"compression_chunk": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="DeMo: invalid compression_"):
            DeMoSettings(**chosen)
    assert DeMoSettings(compression_chunk=256, compression_topk=65536).compression_topk == 65536


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_good_inputs_plan_and_write_strict_json(files, capsys):
    out = files / "plan.json"
    code, printed, err = _run([*PLAN, "--model", str(files / "good"), "--json", str(out), "--prices",
                               str(ROOT / "benchmarks" / "prices.toml"), "--mtbf-hours", "0.001"], capsys)  # fmt: skip
    assert code == 0 and err == "", err
    plan = _strict_json(out.read_text())  # failures that never end, refused rows: null, not Infinity or NaN
    assert plan["recommended"] in {m["method"] for m in plan["methods"]} and "Recommended:" in printed
    assert any(m["restart_lost_h"] is None for m in plan["failures"]["methods"])
    assert plan["demo_overhead"] == DEMO_OVERHEAD and "the measured default" in printed


def test_the_epoch_samples_and_batch_size_count_the_steps(capsys):
    code, out, _ = _run([*NO_EPOCH, *SHAPES, "--devices-per-node", "4", "--epoch-samples", "1000", "--batch-size",
                         "8"], capsys)  # fmt: skip
    assert code == 0
    assert "1,000 samples / (8 devices x batch 8) = 16 steps" in out  # ceil(1000 / 64)


def test_a_70b_model_on_two_single_device_nodes_fits_nowhere_and_is_not_recommended(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [*PLAN, "--params", "70e9", "--layer-shape", "8192x8192", "--json", str(out)]
    code, printed, _ = _run(argv, capsys)
    assert code == 0
    plan = _strict_json(out.read_text())
    assert plan["recommended"] is None and "Recommended: none: no method fits 80 GB per device" in printed
    planned = [m for m in plan["methods"] if m["memory_gb"] is not None]
    assert planned and all(not m["fits"] and m["note"].startswith("does not fit") for m in planned)


@pytest.mark.parametrize("memory", ["80GB", "192GiB", "1.5TB"])
@pytest.mark.parametrize("devices", ["1", "8"])
def test_the_recommendation_always_fits_the_device(tmp_path, capsys, memory, devices):
    out = tmp_path / "plan.json"
    argv = [*PLAN, "--params", "2e10", "--layer-shape", "8192x8192", "--devices-per-node", devices,
            "--device-memory", memory, "--json", str(out)]  # fmt: skip
    assert _run(argv, capsys)[0] == 0
    plan = _strict_json(out.read_text())
    rows = {m["method"]: m for m in plan["methods"]}
    gb = plan["cluster"]["device_memory_gb"]
    for m in rows.values():
        if m["memory_gb"] is not None:
            assert m["fits"] == (m["memory_gb"] <= gb) and ("does not fit" in m["note"]) == (not m["fits"])
    if plan["recommended"] is not None:
        assert rows[plan["recommended"]]["fits"]
    else:
        assert not any(m["fits"] for m in rows.values())
    if memory == "1.5TB":
        assert plan["recommended"] is not None  # every method fits 1500 GB: the plan still recommends


def test_every_plan_gives_the_start_up_broadcast(tmp_path, capsys):
    """SmolLM2-135M's 134,515,008 fp32 parameters from rank 0: 538 MB, 3.6 minutes at 20 Mbit/s."""
    out = tmp_path / "plan.json"
    argv = [*PLAN, "--params", "134515008", "--layer-shape", "576x1536", "--inter-node", "20mbit", "--json", str(out)]
    code, printed, _ = _run(argv, capsys)
    assert code == 0
    startup = _strict_json(out.read_text())["startup_broadcast"]
    assert startup["bytes"] == 538_060_032 and startup["seconds"] == pytest.approx(215.2, rel=1e-3)
    assert "Start-up broadcast: 538 MB of parameters from rank 0, 3.59 min on the link between nodes" in printed


def test_the_default_demo_overhead_is_the_measured_one(capsys):
    """The default is DeMo defaults' own compute against forward+backward in the recorded runs, and its help says
    where it comes from."""
    ratios = []
    for path in sorted((ROOT / "benchmarks" / "results" / "wan_headline").glob("run*/wan_summary.json")):
        for methods in json.loads(path.read_text()).values():
            r = methods["demo-bf16"]
            ratios.append((r["opt_s"] - r["comm_s"]) / r["fwd_bwd_s"])
    assert len(ratios) == 6 and round(statistics.median(ratios), 2) == DEMO_OVERHEAD
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"Default {DEMO_OVERHEAD:g}:" in text and "benchmarks/results/wan_headline" in text


def test_the_shipped_price_tables_still_load():
    for path in sorted((ROOT / "benchmarks").glob("prices*.toml")):
        table = prices.load(path)
        assert table.per_gb >= 0 and table.per_device_hour(8) > 0


def test_a_ten_trillion_parameter_plan_runs_from_shapes_in_seconds(capsys):
    started = time.process_time()
    argv = [*PLAN, "--params", "1e13", "--layer-shape", "65536x65536"]  # 2,329 matrices
    code, out, _ = _run(argv, capsys)
    assert code == 0 and "parameters in 2329 tensors" in out
    assert time.process_time() - started < 60  # CPU seconds: ~5 on an idle core


def test_a_closed_pipe_ends_the_plan_quietly(tmp_path):
    """``hf-demo plan ... | head``: the reader is gone before the plan prints; the command stops without a word."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "hf_demo.ops.cli", *PLAN, *SHAPES, "--json", str(tmp_path / "plan.json")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # as head does once it has its lines
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 141 and err.decode() == "", (proc.returncode, err.decode()[-2000:])
    assert json.loads((tmp_path / "plan.json").read_text())["recommended"]  # written before the plan printed


def test_refusals_are_seen_by_callers_in_the_same_process(capsys):
    with pytest.raises(SystemExit, match="give the model once") as stopped:
        cli.main(PLAN)
    assert stopped.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_no_figure_in_a_plan_is_infinite_or_nan(tmp_path, capsys):
    """A link of one bit per second and a 1e7-second step: every figure stays finite, the JSON strict."""
    out = tmp_path / "plan.json"
    argv = [*PLAN, *SHAPES, "--inter-node", "1bit", "--compute-s", "1e7", "--json", str(out)]
    assert _run(argv, capsys)[0] == 0
    plan = _strict_json(out.read_text())
    for m in plan["methods"]:
        assert all(not isinstance(v, float) or math.isfinite(v) for v in m.values())


def test_backend_gloo_plans_a_round_trip_per_hop(tmp_path, capsys):
    """gloo over TCP pays two latencies per ring hop (measured behind a delaying relay): a latency-bound DeMo
    exchange is planned at twice NCCL's one-latency figure; a wrong backend is refused with exit 2."""
    waits = {}
    for backend in ("nccl", "gloo"):
        out = tmp_path / f"{backend}.json"
        argv = [*PLAN, *SHAPES, "--nodes", "4", "--inter-latency", "50ms", "--backend", backend, "--json", str(out)]
        assert _run(argv, capsys)[0] == 0
        rows = {m["label"]: m for m in _strict_json(out.read_text())["methods"]}
        waits[backend] = rows["DeMo (defaults: all_gather)"]["exchange_s"]
    assert waits["nccl"] == pytest.approx(3 * 0.05, rel=1e-3) and waits["gloo"] == pytest.approx(6 * 0.05, rel=1e-3)
    code, _, err = _run([*PLAN, *SHAPES, "--backend", "mpi"], capsys)
    assert code == 2 and "--backend" in err
