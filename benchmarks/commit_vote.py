"""What a step's round trips cost: DeMo's optimizer step with three (the header, the payload, the vote:
``commit_vote="separate"`` without the payload riding), two (the header with the payload, then the vote:
``commit_vote="separate"``), one with the all-ranks-or-none guarantee (the header with the payload, the verdict
settling in the next step's all-gather: ``commit_vote="on"``, the default) and one without it
(``commit_vote="off"``), side by side, on 2 gloo ranks over links of growing latency.

    python benchmarks/commit_vote.py [--delays-ms 0 5 20 50] [--steps 30]

Latency is emulated in the application, as ``wan.py`` does (this kernel has no netem): before each of DeMo's
collectives every rank sleeps ``(W-1) * D`` ms, the sequential hops of a ring (``register_collective_hook``).
The vote is one more collective of 16 bytes per rank, so it costs one more latency per step and no bandwidth; the
header riding with the payload saves one; a verdict settling in the next step saves the vote and costs the undo
log (a copy of the parameters each step, and the replaced state tensors kept by reference: its bytes are
printed). Prints the median optimizer-step time of each (``--repeats`` runs of each, taken in turn), and the
ratios to the two-round-trip step; writes the table to ``--out`` (Markdown).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchlib.ranks import expect_ok, run_ranks

# each kind of step: (commit_vote, payload rides)
KINDS = {"3": ("separate", False), "2": ("separate", True), "1": ("on", True), "1 off": ("off", True)}


def _steps(rank, world, kind: str, delay_ms: float, steps: int, size: int) -> tuple[list[float], int, int]:
    """Each step's seconds past the first 3; the undo log's cloned bytes and the state bytes it keeps referenced."""
    import hf_demo
    from hf_demo.exchange.transport import register_collective_hook
    from hf_demo.wire import agreement

    vote, agreement.RIDE = KINDS[kind]

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
    undo = opt.unsettled.undo if opt.unsettled is not None else None
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    opt.flush()
    return seconds[3:], (undo.nbytes if undo else 0), (state if undo else 0)  # past the first steps (groups, caches)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0, 50.0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, taken in turn; the median step")
    parser.add_argument("--size", type=int, default=512, help="the side of the two square layers (2 x size^2)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/commit_vote.md"))
    args = parser.parse_args(argv)
    rows = [
        '| one-way latency per hop | 3 round trips | 2 (`"separate"`) | 1 (`"on"`, the default) | 1 (`"off"`) '
        "| 3 / 2 | 1 on / 2 | 1 off / 2 |"
    ]
    rows.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    held = (0, 0)
    for delay in args.delays_ms:
        pooled = {kind: [] for kind in KINDS}
        for _ in range(args.repeats):  # the kinds in turn, so that a change of the machine's load hits each alike
            for kind in KINDS:
                per_rank = expect_ok(run_ranks(_steps, 2, kind, delay, args.steps, args.size, timeout=600))
                pooled[kind] += [max(s) for s in zip(*(r[0] for r in per_rank))]  # a step ends with its slowest rank
                held = max(held, per_rank[0][1:])
        m = {kind: statistics.median(times) for kind, times in pooled.items()}
        rows.append(
            f"| {delay:g} ms | {m['3'] * 1000:.1f} ms | {m['2'] * 1000:.1f} ms | {m['1'] * 1000:.1f} ms | "
            f"{m['1 off'] * 1000:.1f} ms | {m['3'] / m['2']:.3f}x | {m['1'] / m['2']:.3f}x | "
            f"{m['1 off'] / m['2']:.3f}x |"
        )
        print(rows[-1], flush=True)
    params = 2 * (args.size * args.size + args.size)
    memory = (
        f'The undo log of `commit_vote="on"`: {held[0]:,} bytes copied per step ({held[0] / params:.1f} bytes '
        f"per parameter: the parameters), and {held[1]:,} bytes of replaced state tensors kept by reference "
        "(the momenta) until the verdict is read."
    )
    print(memory, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# What a step's round trips cost\n\n2 gloo ranks, {params:,} parameters (two {args.size}x{args.size} "
        f"layers), DeMo's defaults, the median of {args.repeats} x {args.steps - 3} steps (each run's first 3 left "
        "out; the four kinds of step run in turn), latency emulated before each collective.\n"
        f"Command: `python benchmarks/commit_vote.py`\n\n" + "\n".join(rows) + "\n\n" + memory + "\n"
    )


if __name__ == "__main__":
    main()
