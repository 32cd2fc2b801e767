"""The benchmark scripts still run end to end (a tiny model, two steps): their figures come from long runs,
but a refactor must not leave them broken. Each runs in its own interpreter, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch_utils import ROOT

pytestmark = pytest.mark.ranks


@pytest.mark.slow  # five methods' runs, ~40 s (test_orthogonal runs the convergence benchmark in the default run)
def test_convergence_benchmark_runs_every_method_on_a_tiny_model(tmp_path):
    tiny = "--hidden 32 --intermediate 64 --layers 1 --heads 2 --seq-len 32 --batch-size 2 --eval-batches 1".split()
    run = f"--tag smoke --results-dir {tmp_path} --steps 3 --eval-every 3 --warmup 1 --topk 4 --chunk 8".split()
    configs = "update_rule=sign;update_rule=adam;params=bf16,param_rounding=stochastic"
    methods = ["--methods", "adamw", "powersgd", "demo", "--demo-configs", configs]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), *run, *methods, *tiny]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "convergence_smoke.json").read_text())
    assert len(runs) == 5 and all(r["ok"] for r in runs), [r.get("error") for r in runs]
    assert (tmp_path / "convergence_smoke.md").exists()


def test_wan_worker_reads_demo_settings_like_the_convergence_benchmark():
    """``wan_worker.py --demo-settings`` and ``convergence.py --demo-configs`` share one key=value parser."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import wan_worker as w, convergence as c; "
        "a = w.parse_args(['--method', 'demo-bf16', '--out', 'x', '--demo-settings', 'decay=0.99,update_rule=adam,"
        "overlap=true,topk=64']); got = w.parse_overrides(a.demo_settings); "
        "want = {'compression_decay': 0.99, 'update_rule': 'adam', 'overlap': True, 'compression_topk': 64}; "
        "assert got == want, got; "
        "assert c.parse_method('demo:decay=0.99,update_rule=adam,overlap=true,topk=64').overrides == got; "
        "w.parse_overrides('decay')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "DeMo override 'decay' is not key=value" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_fsdp_memory_times_both_whole_matrix_schemes_against_the_unsharded_newton_schulz(tmp_path):
    """--newton-schulz: a row per model, both schemes bitwise alike; over shard groups of 2 the owner scheme's two
    all-to-alls move what the everywhere all-gather moves."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fsdp_memory.py"), "--newton-schulz", "--start-method", "fork"]
    cmd += ["--ns-sizes", "32x64x1", "--ns-reps", "1", "--results-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "fsdp_newton_schulz.json").read_text())["rows"]
    assert len(rows) == 1 and all(r["bitwise"] for r in rows[0]["ranks"])
    ranks = rows[0]["ranks"]
    assert sum(r["owner_sent"] + r["owner_received"] for r in ranks) == sum(
        r["everywhere_sent"] + r["everywhere_received"] for r in ranks
    )
    assert "| 32 x 64 x 1 | 7 |" in (tmp_path / "fsdp_newton_schulz.md").read_text()


@pytest.mark.slow  # every layout on 4 ranks, ~25 s
def test_fsdp_memory_benchmark_measures_every_layout_on_a_tiny_model(tmp_path):
    """The four layouts train and report; HSDP-DeMo holds half of DDP-DeMo's bytes per rank, FSDP2's HSDP hands
    the replicate all-reduce 2 bytes/param/step (fp32 gradient shards), DeMo far less."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fsdp_memory.py"), "--tiny", "--start-method", "fork"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, "--results-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "fsdp_memory.md").read_text()
    assert all(f"| {layout} | 3 |" in text for layout in ("ddp-demo", "hsdp-demo", "fsdp-adamw", "hsdp-adamw"))
    assert "hsdp-demo / ddp-demo (largest rank): 0.500" in text, text
    assert "hsdp-adamw: 2.0000 bytes/param/step" in text and "fsdp-adamw: 0.0000 bytes/param/step" in text, text


@pytest.mark.parametrize("method", ["muon", "demo-scratch", "demo-scratch-few"])
def test_wan_worker_trains_ddp_muon_and_the_from_scratch_presets_on_two_ranks(tmp_path, method):
    """The slow-link job's DDP-Muon and preset methods run under torchrun (loopback, latency emulated before each
    exchange, none on a local step), and every rank ends with the same parameters (the presets' evaluation reads
    rank 0's at a synchronisation)."""
    out = tmp_path / "run.json"
    tiny = "--hidden 32 --intermediate 64 --layers 1 --heads 2 --seq-len 32 --batch-size 2 --eval-batches 1".split()
    worker = [str(ROOT / "benchmarks" / "wan_worker.py"), "--method", method, "--out", str(out), *tiny]
    worker += ["--steps", "4", "--eval-every", "4", "--warmup", "1", "--delay-ms", "1", "--lr", "1e-2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *worker]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["world"] == 2 and run["method"] == method and len(run["ranks"]) == 2
    assert [e["step"] for e in run["evals"]] == [0, 4] and run["evals"][1]["loss"] < run["evals"][0]["loss"]
    assert run["params_digest"][0] == run["params_digest"][1]
    interval = {"muon": 1, "demo-scratch": 2, "demo-scratch-few": 4}[method]
    waited = [s["delay_s"] > 0 for s in run["ranks"][0]["steps"]]
    # the emulated latency at each exchange only (and at the first step, which agrees the run's settings)
    assert waited == [i == 0 or (i + 1) % interval == 0 for i in range(4)]


def test_the_slow_link_headline_tables_the_runs_with_the_planner_beside_them(tmp_path):
    """``wan_headline.py --report-only`` on kept ``wan.py`` runs: a row per method with its lr, time to target and
    ratio to DDP-AdamW's, and the planner's step for every method whose bytes the current library sends (checked
    against the run's), DDP-Muon's and the presets' with their Newton-Schulz runs."""
    kept = ROOT / "benchmarks" / "results" / "wan_headline_lr" / "lr1"
    (tmp_path / "run1").symlink_to(kept)
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import wan_headline as h; "
        f"rows = h.report(h.parse_args(['--report-only', '--out-dir', {str(tmp_path)!r}, '--target-loss', '2.9'])); "
        "import json; print(json.dumps(rows))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(proc.stdout.splitlines()[-1])}
    assert set(rows) == {"adamw", "muon", "powersgd", "demo-bf16", "demo-scratch", "demo-scratch-few"}
    assert rows["adamw"]["vs_adamw"] == 1.0 and rows["adamw"]["lr"] == 1e-3
    assert rows["demo-bf16"]["reached"] == 0 and rows["demo-bf16"]["vs_adamw"] is None  # 3.0071 > 2.9
    assert rows["demo-scratch"]["vs_adamw"] < 1.0 and rows["demo-scratch"]["step_target"] < 32
    # these kept runs sent what from_scratch_few_bytes sent before its settings changed: the planner, checking the
    # bytes, has no row for them; every other method has one
    assert rows["demo-scratch-few"]["predicted_step_s"] is None
    assert all(rows[m]["predicted_step_s"] > 0 for m in rows if m != "demo-scratch-few")
    # the Newton-Schulz run, measured here against a forward+backward, in the step of every method that takes it
    assert rows["muon"]["predicted_step_s"] > rows["adamw"]["predicted_step_s"]
    table = (tmp_path / "wan_headline.md").read_text()
    assert "| DDP-Muon | 0.004 |" in table and table.count("no planner row") == 1 and "0 of 1 runs reached 2.9" in table


def test_step_trace_counts_the_functions_and_files_of_one_steady_step():
    """``benchmarks/step_trace.py --json``: the measure of how much code a default step walks through."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_trace.py"), "--json", "--warmup", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["by_file"]) <= out["files"] and sum(out["by_file"].values()) == out["functions"]
    assert "optim/optimizer.py" in out["by_file"] and out["calls"] >= out["functions"]
    assert out["functions"] <= 90 and out["files"] <= 12, out["names"]  # the design's bound (docs/DESIGN.md)


def _plot_ranks(results: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "plot_ranks.py"), "--results-dir", str(results)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_plot_ranks_draws_its_plots_from_the_result_files_and_refuses_two_losses_for_one_seed(tmp_path):
    """The four plots from the result files; the outer-step figures the docs quote (docs/results.md, "The outer
    step scales with W") are what its loader computes; a seed found twice with different losses stops it."""
    results = ROOT / "benchmarks" / "results"
    patterns = ("convergence_ranks300_w*_*.json", "convergence_outerlr_*.json", "convergence_fewbytes_*.json")
    for pattern in (*patterns, "convergence_outerfourth_w*.json"):
        for path in results.glob(pattern):
            (tmp_path / path.name).write_bytes(path.read_bytes())
    for name in ("convergence_diag_outerlr_w8.json", "diagnose_levers.json"):
        (tmp_path / name).write_bytes((results / name).read_bytes())
    proc = _plot_ranks(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("ranks300_ratio_vs_w", "ranks300_loss_vs_bytes", "outer_lr_ratio_vs_w", "outer_lr_loss_vs_bytes"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plot_ranks
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    figures = plot_ranks.load_outer(tmp_path)
    c1, sqrt2 = plot_ranks.outer_series("from_scratch", 1.0), plot_ranks.outer_series("from_scratch", 2**0.5)
    ratios = {w: round(plot_ranks.outer_ratio(figures, c1, w)[0], 3) for w in (2, 4, 8)}
    assert ratios == {2: 1.059, 4: 1.045, 8: 1.040}
    assert [round(plot_ranks.outer_ratio(figures, sqrt2, w)[0], 3) for w in (2, 4, 8)] == [1.020, 1.037, 1.049]
    preset = plot_ranks.outer_series("from_scratch", ("fourth_root_world", 2**0.5))  # the same bits as sqrt2 at W=2
    assert preset == "from_scratch, the preset (× 1.41·(W/2)^¼)"
    assert [round(plot_ranks.outer_ratio(figures, preset, w)[0], 3) for w in (2, 4, 8, 16)] == [
        1.020,
        1.036,
        1.052,
        1.055,
    ]
    few = plot_ranks.outer_series("from_scratch_few_bytes", 2**0.5)
    assert few == "from_scratch_few_bytes, the preset (× 1.41·√(W/2))"  # the legend follows the preset's outer_lr
    assert [round(plot_ranks.outer_ratio(figures, few, w)[0], 3) for w in (2, 4, 8)] == [1.257, 1.242, 1.241]
    runs = json.loads((tmp_path / "convergence_outerlr_w8.json").read_text())
    runs[0]["final_loss"] += 0.01  # the same run (seed 2 of the preset at W = 8), another loss than convergence_...
    (tmp_path / "convergence_outerlr_c2_w4.json").write_text(json.dumps(runs))  # ...outerlr_w8.json's
    with pytest.raises(SystemExit, match="seed 2: two different losses in the result files"):
        plot_ranks.load_outer(tmp_path)  # what main() reads before it draws the outer-step plots


def test_gpu_quality_skips_with_77_without_a_gpu():
    if subprocess.run([sys.executable, "-c", "import torch; assert not torch.cuda.is_available()"]).returncode:
        pytest.skip("a CUDA GPU is visible: make gpu-quality would run the comparison")
    env = {**os.environ, "VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_quality.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 77 and "no CUDA GPU" in proc.stderr, proc.stderr


@pytest.mark.slow  # two instrumented runs on 2 ranks, ~30 s
def test_the_scaling_diagnosis_measures_the_real_run_and_its_metrics_hold_where_nothing_is_compressed(tmp_path):
    """``diagnose_scaling.py`` on two ranks and a tiny model: its instruments leave the run bit for bit what
    ``convergence.py`` trains (the same held-out loss), and with every coefficient sent in fp32 DeMo's applied change
    is the dense mean of the ranks' changes (cosine and norm ratio 1, top-k keeps all the energy)."""
    tiny = "--hidden 32 --intermediate 64 --layers 1 --heads 2 --seq-len 32 --batch-size 2 --eval-batches 1".split()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    configs = "from_scratch;from_scratch:topk=64,chunk=8,format=fp32"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "diagnose_scaling.py"), "--worlds", "2", "--steps", "4"]
    cmd += ["--eval-every", "4", "--warmup-skip", "0", "--tag", "t", "--results-dir", str(tmp_path), *tiny]
    proc = subprocess.run([*cmd, "--configs", configs], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["config"]: r for r in json.loads((tmp_path / "diagnose_t.json").read_text())}
    assert [s["step"] for s in runs["from_scratch"]["syncs"]] == [2, 4]
    full = runs["from_scratch:topk=64,chunk=8,format=fp32"]["syncs"]
    for s in full:
        assert s["cos_demo_mean"] == pytest.approx(1.0, abs=1e-5) and s["norm_demo_mean"] == pytest.approx(1.0, 1e-5)
        assert s["kept_rank"] == pytest.approx(1.0) and s["kept_mean"] == pytest.approx(1.0)
        assert s["distinct"] == pytest.approx(0.5) and 0 < s["drift"] < 1 and -1 <= s["cos_demo_ref"] <= 1
    conv = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--tag", "t", "--results-dir", str(tmp_path)]
    conv += ["--steps", "4", "--eval-every", "4", "--methods", "demo", "--lrs", "demo=2e-2", *tiny, "--shards"]
    conv += [
        "interleaved",
        "--demo-configs",
        "sync_every=2,topk=24,chunk=32,decay=0.999,format=sign,inner_rule=orthogonal",
    ]
    proc = subprocess.run(conv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (trained,) = json.loads((tmp_path / "convergence_t.json").read_text())
    assert trained["final_loss"] == runs["from_scratch"]["evals"][-1][1]


def test_confirm_10m_keeps_runs_on_another_corpus_apart_from_the_recorded_ones(tmp_path):
    """Other versions of the installed packages make another corpus and held-out split: ``run`` refuses to add
    such runs to the recorded results, and ``report`` refuses runs whose held-out losses at step 0 (one init)
    differ, with the recorded runs as they are accepted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import confirm_10m
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    recorded = str(ROOT / "benchmarks" / "results")
    confirm_10m.check_corpus(recorded, tokens=confirm_10m.RECORDED_TOKENS)
    confirm_10m.check_corpus(str(tmp_path), tokens=1)  # a series of its own elsewhere
    with pytest.raises(SystemExit, match="corpus of 1 tokens here.*not comparable"):
        confirm_10m.check_corpus(recorded, tokens=1)
    found = {
        name: json.loads(Path(recorded, f"convergence_confirm10m_{name}.json").read_text())[-1]
        for name in ("muon", "from_scratch")
    }
    confirm_10m.check_same_start(found)
    found["from_scratch"] = dict(found["from_scratch"], evals=[[0, 10.8235], *found["from_scratch"]["evals"][1:]])
    with pytest.raises(SystemExit, match="DDP-Muon 10.820216.*10.823500.*different corpora"):
        confirm_10m.check_same_start(found)
