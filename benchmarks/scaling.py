"""How DeMo's traffic grows with the number of workers, against a dense ring all-reduce.

DeMo all-gathers every rank's compressed payload, so what each rank *receives* grows as (W-1) x payload. A
ring all-reduce of fp32 gradients moves 2(W-1)/W x 4 bytes per parameter per rank in each direction, which
tends to 8 B/param and never exceeds it. With s = DeMo's payload in bytes per parameter, the ratio is

    received_DeMo / received_ring = (W-1)·s / (2(W-1)/W · 4) = s·W / 8     ->   DeMo stops paying at W* = 8 / s

(plus the 64-byte header per rank, negligible).

Part 1 (measured): for W = 2, 4, 8 local gloo processes (127.0.0.1, one torch thread each; this measures
bytes, not time), every setting in ``--settings`` builds ``hf_demo.DeMo`` on the model of ``wan_worker.py``
(same shapes, ~3.3M parameters), feeds random gradients and takes ``--steps`` steps; each rank reports
``opt.comm_stats`` (``bytes_sent``: the buffers it handed to the collectives; ``bytes_received``: the other
ranks' payloads). The launcher checks that every rank reports the same and tabulates rank 0.

Part 2 (exact, no tensors): the payload a setting produces for bigger models is a function of the parameter
shapes only (``hf_demo.blocks.plan`` + ``hf_demo.codec.segment_bytes``, the functions DeMo itself sizes its
payload with), so s and W* are also computed for a 1.2B Llama (Llama-3.2-1B shapes) and the measured model
(which checks the computation against Part 1).

    .venv/bin/python benchmarks/scaling.py                      # W = 2, 4, 8; ~2 min on 2 cores
    .venv/bin/python benchmarks/scaling.py --worlds 2,4,8,16    # more processes (bytes only)
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from common import expect_ok, run_ranks

HERE = Path(__file__).resolve().parent

DEFAULT_SETTINGS = "bf16:32:64,sign:32:64,fp32:32:64,bf16:16:64,bf16:8:64,sign:8:64,sign:4:64"

# Llama-3.2-1B shapes (hidden 2048, 16 layers, MLP 8192, 32 heads / 8 KV heads of 64, vocab 128256, tied)
LLAMA_1B = dict(vocab=128256, hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, tied=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated value_format:topk:chunk")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    return p.parse_args(argv)


def parse_settings(s: str):
    out = []
    for item in s.split(","):
        fmt, k, c = item.strip().split(":")
        out.append((fmt, int(k), int(c)))
    return out


def label(fmt, k, c):
    return f"{fmt}, top-{k}/{c}×{c}"


# ------------------------------------------------------------------ measured part
def small_model(args):
    from wan_worker import build_model

    ns = argparse.Namespace(
        hidden=args.hidden, layers=args.layers, heads=args.heads, intermediate=args.intermediate, seq_len=128, seed=0
    )
    return build_model(ns)


def _rank(rank, world, args, settings):
    """One rank (run by ``run_ranks``): the traffic every setting counted, in ``settings`` order."""
    import torch

    from hf_demo import DeMo

    model = small_model(args)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    res = []
    for fmt, k, c in settings:
        opt = DeMo(params, lr=1e-3, compression_topk=k, compression_chunk=c, value_format=fmt)
        for _ in range(args.steps):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        cs = opt.comm_stats
        res.append(
            dict(
                fmt=fmt,
                topk=k,
                chunk=c,
                sent=cs.bytes_sent,
                received=cs.bytes_received,
                collectives=cs.collectives,
                dense=cs.dense_bytes,
            )
        )
    return dict(n_params=sum(p.numel() for p in params), res=res)


def measure(world, args, settings):
    ranks = expect_ok(
        run_ranks(_rank, world, args, settings, timeout=1800, collective_timeout=600, start_method="spawn")
    )
    out = dict(world=world, n_params=ranks[0]["n_params"], ranks=[r["res"] for r in ranks])
    for r, rr in enumerate(out["ranks"]):
        for a, b in zip(rr, out["ranks"][0]):
            if (a["sent"], a["received"]) != (b["sent"], b["received"]):
                raise RuntimeError(f"world {world}: rank {r} counted {a} but rank 0 {b}")
    return out


# ------------------------------------------------------------------ exact part
def llama_shapes(vocab, hidden, layers, intermediate, heads, kv_heads, tied):
    hd = hidden // heads
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (heads * hd, hidden),
            (kv_heads * hd, hidden),
            (kv_heads * hd, hidden),
            (hidden, heads * hd),
            (intermediate, hidden),
            (intermediate, hidden),
            (hidden, intermediate),
            (hidden,),
            (hidden,),
        ]
    shapes.append((hidden,))
    if not tied:
        shapes.append((vocab, hidden))
    return shapes


def payload_bytes(shapes, fmt, k, c) -> int:
    from hf_demo import codec
    from hf_demo.blocks import plan

    return sum(codec.segment_bytes(plan(tuple(s), c, k), fmt) for s in shapes)


def ring_allreduce_per_rank(n_params, world) -> float:
    return 2 * (world - 1) / world * 4 * n_params


# ------------------------------------------------------------------ main
def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = parse_settings(args.settings)
    worlds = [int(w) for w in args.worlds.split(",")]
    measured = {w: measure(w, args, settings) for w in worlds}
    n = measured[worlds[0]]["n_params"]
    from hf_demo.codec import HEADER_BYTES

    lines = [
        "# DeMo traffic vs number of workers (generated by benchmarks/scaling.py)",
        "",
        f"Measured with `hf_demo.DeMo.comm_stats` on {len(worlds)} local gloo worlds "
        f"({', '.join(map(str, worlds))} processes), model of `wan_worker.py` ({n / 1e6:.2f}M parameters), "
        f"random gradients, per rank per step. **ring AR** = fp32 ring all-reduce, 2(W-1)/W·4 B/param per "
        f"rank each way (formula; "
        f"the WAN runs' wire counters confirm it for W=2 and 4). All ranks counted the same bytes.",
        "",
        "| setting | W | sent / rank | received / rank | ring AR / rank | received ÷ ring AR |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for i, (fmt, k, c) in enumerate(settings):
        for w in worlds:
            r = measured[w]["ranks"][0][i]
            ar = ring_allreduce_per_rank(n, w)
            rows.append(
                dict(
                    setting=label(fmt, k, c),
                    world=w,
                    sent=r["sent"],
                    received=r["received"],
                    ring=ar,
                    ratio=r["received"] / ar,
                    collectives=r["collectives"],
                )
            )
            lines.append(
                f"| {label(fmt, k, c)} | {w} | {r['sent'] / 1e3:.1f} kB | {r['received'] / 1e3:.1f} kB | "
                f"{ar / 1e6:.2f} MB | {r['received'] / ar:.4f} |"
            )
    small_shapes = [tuple(p.shape) for p in small_model(args).parameters()]
    big_shapes = llama_shapes(**LLAMA_1B)
    n_big = sum(math.prod(s) for s in big_shapes)
    lines += [
        "",
        "## Where DeMo stops paying",
        "",
        "s = payload bytes per parameter per step that one rank contributes (header included for the small "
        "model). DeMo's received bytes per rank = (W-1)·s·N, a ring all-reduce's 2(W-1)/W·4·N, so they are "
        "equal at **W\\* = 8/s** workers; beyond it DeMo receives more than the dense all-reduce. "
        "(With gloo's ring all-gather every rank also *forwards* (W-1) payloads, so the bytes a rank puts "
        "on its link grow the same way.) Exact sizes from DeMo's own layout code; the small-model column "
        "equals the measured `bytes_sent` above.",
        "",
        f"| setting | s, {n / 1e6:.2f}M model (B/param) | W\\* | s, Llama 1B ({n_big / 1e9:.2f}B) "
        f"(B/param) | W\\* | DeMo ÷ ring AR at W=64, 1B |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    exact = []
    for i, (fmt, k, c) in enumerate(settings):
        ps = payload_bytes(small_shapes, fmt, k, c) + HEADER_BYTES
        meas = measured[worlds[0]]["ranks"][0][i]["sent"]
        assert ps == meas, (ps, meas)
        pb = payload_bytes(big_shapes, fmt, k, c) + HEADER_BYTES
        s_small, s_big = ps / n, pb / n_big
        exact.append(
            dict(setting=label(fmt, k, c), s_small=s_small, w_star_small=8 / s_small, s_1b=s_big, w_star_1b=8 / s_big)
        )
        lines.append(
            f"| {label(fmt, k, c)} | {s_small:.4f} | {8 / s_small:.0f} | {s_big:.4f} | {8 / s_big:.0f} | "
            f"{63 * s_big / ring_allreduce_per_rank(1, 64):.3f} |"
        )
    lines.append("")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.md").write_text("\n".join(lines))
    (out / "scaling.json").write_text(
        json.dumps(dict(n_params=n, n_params_1b=n_big, rows=rows, exact=exact, llama_1b=LLAMA_1B), indent=1)
    )
    print("\n".join(lines))
    plot(rows, worlds, out / "scaling.png")


def plot(rows, worlds, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        rs = [r for r in rows if r["setting"] == setting]
        ax.plot([r["world"] for r in rs], [r["received"] / 1e6 for r in rs], "o-", label=f"DeMo {setting}")
    ring = {r["world"]: r["ring"] for r in rows}
    ax.plot(worlds, [ring[w] / 1e6 for w in worlds], "k--", label="fp32 ring all-reduce")
    ax.set_yscale("log")
    ax.set_xlabel("workers W")
    ax.set_ylabel("MB received per rank per step")
    ax.set_xticks(worlds)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
