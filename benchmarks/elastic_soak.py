"""Elastic DeMo soak: replica groups SIGKILLed at random steps and restarted, the run never restarted.

Three replica groups of ``examples/elastic.py`` (one gloo process each, DeMo over torchft's managed group) on
loopback around an in-process torchft Lighthouse train a small byte-level Llama on the Python stdlib sources for
``--steps`` committed steps. At ``--kills`` random steps (the last one by ``--quiet-tail`` of the run) a random
replica in the quorum is SIGKILLed and its place taken at once by a warm standby (``--standbys``: processes that
have imported torch, transformers and torchft and built their model, waiting for an id; a new one starts warming
in the background), which joins the quorum and receives the agreed state from a live peer. A kill waits until a
standby is warm (``kills_waited``: how many did). With ``--standbys 0`` the killed replica is started again from
scratch instead, as ``torchrun --max-restarts`` would (its imports then keep it out of the quorum for tens of
seconds on a busy machine). The run ends at ``--steps`` once every replacement is in the quorum (a few steps later
where one took longer: ``steps_committed``). Then the same run without faults, as many committed steps, gives
``loss_fault_free``. Prints one JSON line:

    failures, full_restarts, steps_committed, replicas_identical, replicas_finished, rejoins, loss_final,
    loss_fault_free, loss_gap, seconds_lost_per_failure (mean, max), seconds_to_replace (mean, max),
    mean_quorum, batches_committed (and fault-free's), samples_lost, kills_waited, seconds, seconds_fault_free,
    timed_out

``seconds_to_replace``: from a SIGKILL to the replacement's recovery of the agreed state (it is in the quorum).
``mean_quorum``: the replicas per committed step (batches committed / steps committed). ``timed_out``: a run
went past ``--max-seconds`` (the script then exits with status 1).

``loss_*``: the held-out loss of the final parameters (``--eval-batches`` batches never trained on).
``seconds_lost_per_failure``: the time the survivors lost per failure (each failure's ``loss`` event: the refused
step in flight, the detection and the new quorum; the largest over the survivors). ``full_restarts``: the times no
replica was left to hold the state (a restart from a checkpoint would follow); the soak never kills the last one.

    nice -n 5 .venv/bin/python benchmarks/elastic_soak.py                       # 300 steps, 24 kills, 2 standbys
    .venv/bin/python benchmarks/elastic_soak.py --model mlp --steps 30 --kills 2 --no-baseline   # the suite's
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
    ap.add_argument("--standbys", type=int, default=2, help="warm standbys kept (0: restart a killed replica cold)")
    ap.add_argument("--max-seconds", type=float, default=1500.0, help="bound on each run's wall time")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fault-free run")
    ap.add_argument("--out", default=None, help="folder for the replicas' logs (default: a temporary one)")
    ap.add_argument(
        "--keep-momentum",
        action="store_true",
        help="each replica keeps its momentum on disk (Elastic's momentum_dir): a replacement resumes it",
    )
    return ap.parse_args(argv)


def _args(a, steps_file: Path) -> list[str]:
    keep = ["--momentum-dir", str(steps_file.parent / "momenta")] if a.keep_momentum else []
    return ["--model", a.model, "--steps", str(10**9), "--steps-file", str(steps_file), "--seed", "0",
            "--timeout", str(a.timeout),
            "--step-seconds", str(a.step_seconds), "--eval-batches", str(a.eval_batches), *keep]  # fmt: skip


def _in_quorum(reps: Replicas) -> list[str]:
    """The live replicas that have committed a step since they were (re)started: killing one is a failure."""
    return [rid for rid, r in reps.live.items() if any(x.get("committed") for x in r.lines if "step" in x)]


def _kill_loop(reps: Replicas, a, rng: random.Random, deadline: float) -> dict:
    """SIGKILL a random replica of the quorum at each of ``a.kills`` random steps, its place taken by a warm standby
    (or, ``a.standbys == 0``, itself started again); never kills the last replica holding the state. Returns
    ``kills``, ``full`` (restarts from a checkpoint that would follow), ``waited`` (kills that waited for a warm
    standby) and ``replaced``: (the kill's wall time, the replacement) per kill."""
    last = int(a.steps * (1 - a.quiet_tail))
    plan = sorted(rng.sample(range(3, last), a.kills)) if a.kills else []
    done = {"kills": 0, "full": 0, "waited": 0, "replaced": []}
    for at in plan:
        waited = False
        while time.monotonic() < deadline:
            joined = _in_quorum(reps)
            reached = max((r.step() for r in reps.live.values()), default=-1) >= at and len(joined) >= 2
            warm = not a.standbys or any(r.warm for r in reps.standbys)
            if reached and warm:
                break
            waited |= reached
            if not reps.live or all(r.proc.poll() is not None for r in reps.live.values()):
                done["full"] += 1  # nobody left to hold the state: would be a restart from a checkpoint
                return done
            time.sleep(0.02)
        else:
            break
        victim = rng.choice(joined)
        reps.kill(victim)
        killed = time.time()
        if a.standbys:
            new = reps.replace(victim) or reps.start(victim)
            reps.add_standby()  # the pool warms a new one in the background
        else:
            new = reps.start(victim)
        done["replaced"].append((killed, new))
        done["kills"] += 1
        done["waited"] += waited
    return done


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


def _losses(incarnations) -> tuple[dict, dict]:
    """Per failure (the step it hit): the most any survivor lost, in seconds and in samples (its ``loss`` event)."""
    seconds, samples = {}, {}
    for r in incarnations:
        for x in r.lines:
            e = x.get("event")
            if e and e["kind"] == "loss":
                seconds[e["step"]] = max(seconds.get(e["step"], 0.0), e["seconds"])
                samples[e["step"]] = max(samples.get(e["step"], 0), e["samples_lost"])
    return seconds, samples


def _replace_seconds(replaced) -> list[float]:
    """From each SIGKILL to its replacement's recovery of the agreed state (None-free: replacements that got it)."""
    out = []
    for killed, new in replaced:
        got = [x["event"]["time"] for x in new.lines if x.get("event", {}).get("kind") == "recovered"]
        if got:
            out.append(got[0] - killed)
    return out


def _mean_max(values) -> tuple[float, float]:
    return (round(sum(values) / len(values), 3), round(max(values), 3)) if values else (0.0, 0.0)


def run(a, out: Path, rng: random.Random) -> dict:
    started = time.monotonic()
    deadline = started + a.max_seconds
    steps_file = out / "steps"
    reps = Replicas(a.replicas, out, _args(a, steps_file), standbys=a.standbys if a.kills else 0)
    originals = {id(r) for r in reps.live.values()}
    try:
        done = _kill_loop(reps, a, rng, deadline)
        _end(reps, a, steps_file, deadline)
        records = _finish(reps, a, deadline)
        incarnations = reps.dead + list(reps.live.values())
        timed_out = time.monotonic() >= deadline
    finally:
        reps.close()
    losses, samples = _losses(incarnations)
    finals = [rec for rec in records.values() if rec["steps"] >= a.steps]
    steps = max((rec["steps"] for rec in finals), default=0)  # every replica that finished ended at the same step
    batches = max((rec["batches_committed"] for rec in finals), default=0)  # samples trained / batch
    lost, replace = _mean_max(list(losses.values())), _mean_max(_replace_seconds(done["replaced"]))
    return {
        "failures": done["kills"],
        "full_restarts": done["full"],
        "steps_committed": steps,
        "replicas_identical": len(finals) >= 1 and len({rec["digest"] for rec in finals}) == 1,
        "replicas_finished": len(finals),
        "rejoins": sum(
            1
            for r in incarnations
            if id(r) not in originals and any(x.get("committed") for x in r.lines if "step" in x)
        ),
        "loss_final": finals[0]["eval_loss"] if finals else None,
        "seconds_lost_per_failure": lost[0],
        "seconds_lost_max": lost[1],
        "seconds_to_replace": replace[0],
        "seconds_to_replace_max": replace[1],
        "mean_quorum": round(batches / steps, 3) if steps else 0.0,
        "batches_committed": batches,
        "samples_lost": sum(samples.values()),  # the refused steps' samples, trained again at the next step
        "kills_waited": done["waited"],
        "momentum_resumed": sum(  # replacements whose momentum came from the dead replica's snapshot
            1 for r in incarnations for x in r.lines if x.get("event", {}).get("kind") == "recovered" and x["momentum"]
        ),
        "seconds": round(time.monotonic() - started, 1),
        "timed_out": timed_out,
    }


def main(argv=None) -> dict:
    a = parse(argv)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="elastic_soak_") as tmp:
        out = Path(a.out or tmp)
        result = run(a, out / "faults", rng)
        if not a.no_baseline:
            steps = max(a.steps, result["steps_committed"])  # the same number of steps, without faults
            clean = run(argparse.Namespace(**{**vars(a), "kills": 0, "steps": steps}), out / "fault_free", rng)
            result["loss_fault_free"] = clean["loss_final"]
            result["seconds_fault_free"] = clean["seconds"]
            result["batches_committed_fault_free"] = clean["batches_committed"]
            result["timed_out"] |= clean["timed_out"]
            if result["loss_final"] is not None and clean["loss_final"]:
                result["loss_gap"] = round(result["loss_final"] / clean["loss_final"] - 1, 4)
    result.update(model=a.model, steps=a.steps, replicas=a.replicas, kills_asked=a.kills)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    if main()["timed_out"]:
        sys.exit("elastic_soak: a run went past --max-seconds; its figures above are of an unfinished run")
