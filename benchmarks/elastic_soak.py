"""Elastic DeMo soak: replica groups SIGKILLed at random steps and restarted, the run never restarted.

Three replica groups of ``examples/elastic.py`` (one gloo process each, DeMo over torchft's managed group) on
loopback around an in-process torchft Lighthouse train a small byte-level Llama on the Python stdlib sources for
``--steps`` committed steps. At ``--kills`` random steps (the last one by ``--quiet-tail`` of the run) a random
replica in the quorum is SIGKILLed and at once started again, as its launcher (``torchrun --max-restarts``) would;
it joins the quorum and receives the agreed state from a live peer. The run ends at ``--steps`` once every
restarted replica is back in the quorum (a few steps later where a restart took longer: ``steps_committed``).
Then the same run without faults (as many steps) gives ``loss_fault_free``. Prints one JSON line:

    failures, full_restarts, steps_committed, replicas_identical, replicas_finished, rejoins, loss_final,
    loss_fault_free, loss_gap, seconds_lost_per_failure (mean, max), batches_committed (and fault-free's),
    samples_lost, seconds, seconds_fault_free

``loss_*``: the held-out loss of the final parameters (``--eval-batches`` batches never trained on).
``seconds_lost_per_failure``: the time the survivors lost per failure (each failure's ``loss`` event: the refused
step in flight, the detection and the new quorum; the largest over the survivors). ``full_restarts``: the times no
replica was left to hold the state (a restart from a checkpoint would follow); the soak never kills the last one.

    nice -n 5 .venv/bin/python benchmarks/elastic_soak.py                       # 300 steps, >= 20 kills
    .venv/bin/python benchmarks/elastic_soak.py --model mlp --steps 40 --kills 2 --no-baseline   # the suite's
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from benchlib.elastic import Replicas  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kills", type=int, default=24, help="SIGKILLs to deliver (fewer if --max-seconds runs out)")
    ap.add_argument("--model", default="llama", choices=["llama", "mlp"])
    ap.add_argument("--step-seconds", type=float, default=0.7, help="added to each step (a restart spans steps)")
    ap.add_argument("--timeout", type=float, default=10.0, help="the replicas' collective/commit timeout")
    ap.add_argument("--quiet-tail", type=float, default=0.15, help="the last fraction of steps without kills")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=1500.0, help="bound on each run's wall time")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    ap.add_argument("--out", default=None, help="folder for the replicas' logs (default: a temporary one)")
    return ap.parse_args(argv)


def _args(a, steps_file: Path) -> list[str]:
    return ["--model", a.model, "--steps", str(10**9), "--steps-file", str(steps_file), "--seed", "0",
            "--timeout", str(a.timeout),
            "--step-seconds", str(a.step_seconds), "--eval-batches", str(a.eval_batches)]  # fmt: skip


def _in_quorum(reps: Replicas) -> list[str]:
    """The live replicas that have committed a step since they were (re)started: killing one is a failure."""
    return [rid for rid, r in reps.live.items() if any(x.get("committed") for x in r.lines if "step" in x)]


def _kill_loop(reps: Replicas, a, rng: random.Random, deadline: float) -> tuple[int, int]:
    """SIGKILL a random replica of the quorum at each of ``a.kills`` random steps, and start it again; returns
    (kills, full restarts). Never kills the last replica holding the state."""
    last = int(a.steps * (1 - a.quiet_tail))
    plan = sorted(rng.sample(range(3, last), a.kills)) if a.kills else []
    kills = full = 0
    for at in plan:
        while time.monotonic() < deadline:
            joined = _in_quorum(reps)
            if max((r.step() for r in reps.live.values()), default=-1) >= at and len(joined) >= 2:
                break
            if not reps.live or all(r.proc.poll() is not None for r in reps.live.values()):
                full += 1  # nobody left to hold the state: would be a restart from a checkpoint
                return kills, full
            time.sleep(0.02)
        else:
            break
        victim = rng.choice(joined)
        reps.kill(victim)
        reps.start(victim)
        kills += 1
    return kills, full


def _end(reps: Replicas, a, steps_file: Path, deadline: float) -> None:
    """Once every restarted replica is back in the quorum (or the time is up), every replica's last step:
    ``a.steps``, or a few steps on where the rejoins took longer (written once: the replicas end together)."""
    while time.monotonic() < deadline and len(_in_quorum(reps)) < len(reps.live):
        time.sleep(0.05)
    steps_file.write_text(str(max(a.steps, max(r.step() for r in reps.live.values()) + 5)))


def _finish(reps: Replicas, a, deadline: float) -> dict[str, dict]:
    """The records of the replicas that finished; a restarted replica still outside the quorum when the others
    are done is ended (it is a restart in progress, not a replica of the run)."""
    while time.monotonic() < deadline and any(
        r.proc.poll() is None for rid, r in reps.live.items() if rid in _in_quorum(reps)
    ):
        time.sleep(0.1)
    records = {}
    for rid, r in list(reps.live.items()):
        if r.proc.poll() == 0 and (reps.out / f"replica{rid}.json").exists():
            records[rid] = json.loads((reps.out / f"replica{rid}.json").read_text())
    return records


def run(a, out: Path, kills: int, rng: random.Random) -> dict:
    started = time.monotonic()
    deadline = started + a.max_seconds
    steps_file = out / "steps"
    reps = Replicas(a.replicas, out, _args(a, steps_file))
    originals = {id(r) for r in reps.live.values()}
    try:
        done, full = _kill_loop(reps, a, rng, deadline)
        _end(reps, a, steps_file, deadline)
        records = _finish(reps, a, deadline)
        incarnations = reps.dead + list(reps.live.values())
    finally:
        reps.close()
    losses, samples = {}, {}  # per failure (the step it hit): the most any survivor lost, in seconds and samples
    for r in incarnations:
        for x in r.lines:
            e = x.get("event")
            if e and e["kind"] == "loss":
                losses[e["step"]] = max(losses.get(e["step"], 0.0), e["seconds"])
                samples[e["step"]] = max(samples.get(e["step"], 0), e["samples_lost"])
    finals = [rec for rec in records.values() if rec["steps"] >= a.steps]
    # every replica that finished ended at the same step: the last one written to the steps file
    return {
        "failures": done,
        "full_restarts": full,
        "steps_committed": max((rec["steps"] for rec in finals), default=0),
        "replicas_identical": len(finals) >= 1 and len({rec["digest"] for rec in finals}) == 1,
        "replicas_finished": len(finals),
        "rejoins": sum(
            1
            for r in incarnations
            if id(r) not in originals and any(x.get("committed") for x in r.lines if "step" in x)
        ),
        "loss_final": finals[0]["eval_loss"] if finals else None,
        "seconds_lost_per_failure": round(sum(losses.values()) / len(losses), 3) if losses else 0.0,
        "seconds_lost_max": round(max(losses.values()), 3) if losses else 0.0,
        "batches_committed": max((rec["batches_committed"] for rec in finals), default=0),  # samples trained / batch
        "samples_lost": sum(samples.values()),  # the refused steps' samples, trained again at the next step
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv=None) -> dict:
    a = parse(argv)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="elastic_soak_") as tmp:
        out = Path(a.out or tmp)
        result = run(a, out / "faults", a.kills, rng)
        if not a.no_baseline:
            steps = max(a.steps, result["steps_committed"])  # the same number of steps, without faults
            clean = run(argparse.Namespace(**{**vars(a), "kills": 0, "steps": steps}), out / "fault_free", 0, rng)
            result["loss_fault_free"] = clean["loss_final"]
            result["seconds_fault_free"] = clean["seconds"]
            result["batches_committed_fault_free"] = clean["batches_committed"]
            if result["loss_final"] is not None and clean["loss_final"]:
                result["loss_gap"] = round(result["loss_final"] / clean["loss_final"] - 1, 4)
    result.update(model=a.model, steps=a.steps, replicas=a.replicas, kills_asked=a.kills)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
