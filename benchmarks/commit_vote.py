"""What a step's round trips cost: DeMo's optimizer step with three (the header, the payload, the vote), two (the
header with the payload, the vote: the default) and one (``commit_vote="off"``), side by side, on 2 gloo ranks
over links of growing latency.

    python benchmarks/commit_vote.py [--delays-ms 0 5 20 50] [--steps 30]

Latency is emulated in the application, as ``wan.py`` does (this kernel has no netem): before each of DeMo's
collectives every rank sleeps ``(W-1) * D`` ms, the sequential hops of a ring (``register_collective_hook``).
The vote is one more collective of 8 bytes per rank, so it costs one more latency per step and no bandwidth; the
header riding with the payload saves one. Prints the median optimizer-step time of each (``--repeats`` runs
of each, taken in turn), and the ratios to the default; writes the table to ``--out`` (Markdown).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchlib.ranks import expect_ok, run_ranks

ROUND_TRIPS = {3: ("on", False), 2: ("on", True), 1: ("off", True)}  # round trips: (commit_vote, payload rides)


def _steps(rank, world, trips: int, delay_ms: float, steps: int, size: int) -> list[float]:
    import hf_demo
    from hf_demo.exchange.transport import register_collective_hook
    from hf_demo.wire import agreement

    vote, agreement.RIDE = ROUND_TRIPS[trips]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(size, size), torch.nn.Linear(size, size))
    opt = hf_demo.DeMo(model.parameters(), lr=1e-3, commit_vote=vote)
    handle = register_collective_hook(lambda name, n: time.sleep((world - 1) * delay_ms / 1000.0))
    seconds = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        started = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - started)
    handle.remove()
    return seconds[3:]  # past the first steps (groups, the DDP guard, caches)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0, 50.0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, taken in turn; the median step")
    parser.add_argument("--size", type=int, default=512, help="the side of the two square layers (2 x size^2)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/commit_vote.md"))
    args = parser.parse_args(argv)
    rows = ['| one-way latency per hop | 3 round trips | 2 (default) | 1 (`commit_vote="off"`) | 3 / 2 | 1 / 2 |']
    rows.append("|---:|---:|---:|---:|---:|---:|")
    for delay in args.delays_ms:
        pooled = {trips: [] for trips in ROUND_TRIPS}
        for _ in range(args.repeats):  # the three in turn, so that a change of the machine's load hits each alike
            for trips in ROUND_TRIPS:
                per_rank = expect_ok(run_ranks(_steps, 2, trips, delay, args.steps, args.size, timeout=600))
                pooled[trips] += [max(s) for s in zip(*per_rank)]  # a step ends when its slowest rank's does
        median = {trips: statistics.median(times) for trips, times in pooled.items()}
        rows.append(
            f"| {delay:g} ms | {median[3] * 1000:.1f} ms | {median[2] * 1000:.1f} ms | {median[1] * 1000:.1f} ms | "
            f"{median[3] / median[2]:.3f}x | {median[1] / median[2]:.3f}x |"
        )
        print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    params = 2 * (args.size * args.size + args.size)
    args.out.write_text(
        f"# What a step's round trips cost\n\n2 gloo ranks, {params:,} parameters (two {args.size}x{args.size} "
        f"layers), DeMo's defaults, the median of {args.repeats} x {args.steps - 3} steps (each run's first 3 left "
        "out; the three kinds of step run in turn), latency emulated before each collective.\n"
        f"Command: `python benchmarks/commit_vote.py`\n\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    main()
