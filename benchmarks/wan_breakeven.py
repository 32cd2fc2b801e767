"""From the measured figures to a real cluster: the link speed below which DeMo wins, for a 1B model.

Inputs (all written by the other scripts, nothing is re-measured here):

- ``results/scaling.json``: DeMo's payload s in bytes/param/step for Llama-3.2-1B shapes (exact, from DeMo's
  own layout code, checked against measured ``comm_stats``), per setting;
- ``results/wan_summary.json``: from the 2-node run on the fastest link, DeMo's steps to the target loss over
  AdamW's (f, interpolated between evaluations) and DeMo's optimizer compute overhead relative to
  forward+backward (o = (optimizer step - time in collectives) / forward+backward, on this CPU).

Model of one step on W workers, each behind a link of R bit/s (the bottleneck is the busiest link; a ring
all-reduce puts 2(W-1)/W·4·N bytes on every rank's link, a ring all-gather (W-1)·s·N; PowerSGD rank r
all-reduces 4r(n+m) bytes per n×m matrix and every vector whole):

    T_ddp  = c + B_ddp / R                 (no overlap of communication with the backward pass)
    T_demo = c·(1 + o) + B_demo / R

DeMo reaches the target first when f·T_demo < T_ddp, i.e. below

    R* = (B_ddp - f·B_demo) / ((f - 1)·c + f·o·c)          (any R when the denominator is <= 0)

With perfect overlap DDP's step is max(c, B_ddp/R); the **compute-bound** column R_c = B/c is the speed below
which even perfect overlap cannot hide a method's communication, and the last column is R* against such a
perfectly overlapped DDP: R* = (B_ddp - f·B_demo) / (f·c·(1 + o)).

    python benchmarks/wan_breakeven.py --workers 8 --compute-s 0.5,1,2
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchlib.baselines import powersgd_bytes

HERE = Path(__file__).resolve().parent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--workers", default="8,64")
    p.add_argument("--compute-s", default="0.5,1,2", help="compute time per step c (forward+backward), s")
    p.add_argument("--config", default=None, help="wan_summary.json key (default: the 2-node 1gbit run)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument(
        "--overhead",
        type=float,
        default=None,
        help="override o (DeMo optimizer compute / forward+backward), e.g. for a GPU with a big batch",
    )
    p.add_argument("--steps-ratio", type=float, default=None, help="override f (DeMo steps / AdamW steps)")
    p.add_argument("--out", default="breakeven.md")
    args = p.parse_args(argv)
    res = Path(args.results)
    scaling = json.loads((res / "scaling.json").read_text())
    summary = json.loads((res / "wan_summary.json").read_text())
    key = args.config or next((k for k in summary if k.startswith("2 nodes, 1gbit")), None)
    runs = summary.get(key, {}) if key else {}
    missing = [m for m in ("demo-bf16", "demo-sign", "adamw") if m not in runs or runs[m].get("failed")]
    if missing:
        raise SystemExit(
            f"wan_breakeven.py: needs a wan_summary.json configuration with demo-bf16, demo-sign and adamw "
            f"(default: the 2-node 1gbit run); {key or 'no 2-node 1gbit run'} lacks {', '.join(missing)}. Run "
            f"e.g. `wan.py --configs 2:1gbit --methods demo-bf16,demo-sign,adamw --append`, or pass --config "
            f"(available: {', '.join(summary)})."
        )
    from scaling import LLAMA_1B, llama_shapes

    shapes = llama_shapes(**LLAMA_1B)
    n = sum(math.prod(s) for s in shapes)
    s_by = {e["setting"]: e["s_1b"] for e in scaling["exact"]}
    methods = {
        "DeMo bf16": ("demo-bf16", s_by["bf16, top-32/64×64"]),
        "DeMo sign": ("demo-sign", s_by["sign, top-32/64×64"]),
    }
    base = runs["adamw"]
    lines = [
        f"Measured inputs (from `{key}`): AdamW reached the target at step "
        f"{base['step_target_interp']:.1f} (interpolated)."
    ]
    fo = {}
    for name, (m, s) in methods.items():
        r = runs[m]
        f = r["step_target_interp"] / base["step_target_interp"]
        o = (r["opt_s"] - r["comm_s"]) / r["fwd_bwd_s"]
        lines.append(
            f"{name}: measured f = {f:.2f} (steps to target vs AdamW), o = {o:.2f} (optimizer compute / "
            f"forward+backward on this CPU), s = {s:.4f} B/param/step (1.24B model)."
        )
        f = args.steps_ratio if args.steps_ratio is not None else f
        o = args.overhead if args.overhead is not None else o
        fo[name] = (f, o, s)
    if args.overhead is not None or args.steps_ratio is not None:
        lines.append(
            f"**Used below instead of the measured values:** f = {args.steps_ratio or 'measured'}, "
            f"o = {args.overhead if args.overhead is not None else 'measured'}."
        )
    s_psgd = powersgd_bytes(shapes, args.powersgd_rank) / n
    lines += [
        f"PowerSGD rank {args.powersgd_rank}: {s_psgd:.4f} B/param/step all-reduced (1.24B model).",
        "",
        "| W | c s | B per link, DDP | B DeMo bf16 | B DeMo sign | B PowerSGD | R_c DDP | R_c DeMo bf16 "
        "| R* DeMo bf16 vs DDP | R* DeMo sign vs DDP | R* DeMo bf16 vs overlapped DDP |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def gbit(b):
        return f"{b * 8 / 1e9:.2f} Gbit"

    def rstar(bddp, bdemo, f, o, c, overlap=False):
        # overlap: DDP's step is max(c, B_ddp/R); below R_c that is B_ddp/R
        den = f * c * (1 + o) if overlap else (f - 1) * c + f * o * c
        if den <= 0:
            return "any speed"
        r = (bddp - f * bdemo) * 8 / den
        if overlap:
            r = min(r, bddp * 8 / c)
        return f"{r / 1e9:.1f} Gbit/s" if r > 0 else "never"

    for w in [int(x) for x in args.workers.split(",")]:
        b_ddp = 2 * (w - 1) / w * 4 * n
        b_psgd = 2 * (w - 1) / w * s_psgd * n
        b_bf = (w - 1) * fo["DeMo bf16"][2] * n
        b_sg = (w - 1) * fo["DeMo sign"][2] * n
        for c in [float(x) for x in args.compute_s.split(",")]:
            lines.append(
                f"| {w} | {c:g} | {gbit(b_ddp)} | {gbit(b_bf)} | {gbit(b_sg)} | {gbit(b_psgd)} | "
                f"{b_ddp * 8 / c / 1e9:.1f} Gbit/s | {b_bf * 8 / c / 1e9:.2f} Gbit/s | "
                f"{rstar(b_ddp, b_bf, *fo['DeMo bf16'][:2], c)} | "
                f"{rstar(b_ddp, b_sg, *fo['DeMo sign'][:2], c)} | "
                f"{rstar(b_ddp, b_bf, *fo['DeMo bf16'][:2], c, overlap=True)} |"
            )
    text = "\n".join(lines)
    (res / args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
