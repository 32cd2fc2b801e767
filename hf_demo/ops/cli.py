"""``hf-demo``: the operator's commands.

    hf-demo plan --model path/to/config.json --nodes 4 --devices-per-node 8 --inter-node 10gbit \\
        --inter-latency 20ms --intra-node 400gbit --compute-s 0.5 --epoch-samples 1e6 --batch-size 8 \\
        --prices benchmarks/prices.toml
    hf-demo report OUTPUT_DIR            # OUTPUT_DIR/hf-demo-report.html
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from hf_demo.settings import DeMoSettings


def _setting(text: str) -> tuple[str, object]:
    """``name=value`` -> a DeMo setting with its declared type."""
    name, sep, raw = text.partition("=")
    types = {n: t for n, t, *_ in DeMoSettings.describe()}
    if not sep or name not in types:
        raise argparse.ArgumentTypeError(f"{text!r}: write --demo NAME=VALUE with a DeMo setting ({', '.join(types)})")
    kind = types[name]
    if kind is bool:
        return name, raw.lower() in ("1", "true", "yes")
    return name, kind(raw)


def plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict bytes, step time, epoch time and cost of every method; recommend one")
    model = p.add_argument_group("the model (one of)")
    model.add_argument("--model", help="a Hub-style config.json (or its folder); needs transformers")
    model.add_argument("--shapes", help="parameter shapes, e.g. 50304x768,768x768*48,768*100")
    model.add_argument("--params", type=float, help="a parameter count (with --layer-shape)")
    model.add_argument("--layer-shape", default="4096x4096", help="the matrices --params is made of")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--devices-per-node", type=int, default=1)
    p.add_argument("--inter-node", required=True, help="bandwidth between nodes per node, e.g. 10gbit, 100mbit")
    p.add_argument("--inter-latency", default="0", help="one-way latency between nodes, e.g. 20ms")
    p.add_argument("--intra-node", default="100gbit", help="bandwidth between the devices of a node")
    p.add_argument("--intra-latency", default="5us")
    p.add_argument("--compute-s", type=float, required=True, help="forward+backward seconds per step per device")
    p.add_argument("--demo-overhead", type=float, default=0.1, help="DeMo's own compute / forward+backward")
    p.add_argument("--powersgd-overhead", type=float, default=0.15, help="PowerSGD's own compute / fwd+bwd")
    p.add_argument("--adamw-s", type=float, default=0.0, help="AdamW's step, seconds")
    p.add_argument("--param-bytes", type=int, default=4, help="bytes per parameter and gradient (fp32 4, bf16 2)")
    p.add_argument("--steps-per-epoch", type=float, help="optimizer steps per epoch")
    p.add_argument("--epoch-samples", type=float, help="samples per epoch (with --batch-size)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per device per step")
    p.add_argument("--prices", help="price table (TOML, as benchmarks/prices.toml)")
    p.add_argument("--demo", type=_setting, action="append", default=[], help="a DeMo setting for every variant")
    p.add_argument("--tolerance", type=float, default=0.1, help="step-time margin the recommendation may trade")
    p.add_argument("--json", help="also write the plan as JSON (DeMoHealthCallback reads its link from it)")


def run_plan(args) -> int:
    from hf_demo.ops import planner, prices, shapes
    from hf_demo.ops.links import Link
    from hf_demo.ops.methods import Cluster, Workload

    if sum(x is not None for x in (args.model, args.shapes, args.params)) != 1:
        raise SystemExit("hf-demo plan: give the model once: --model CONFIG, --shapes SPEC or --params N")
    if args.model:
        model_shapes = shapes.from_config(args.model)
    elif args.shapes:
        model_shapes = shapes.parse_shapes(args.shapes)
    else:
        model_shapes = shapes.from_count(args.params, shapes.parse_shapes(args.layer_shape)[0])
    cluster = Cluster(
        args.nodes,
        args.devices_per_node,
        Link.parse(args.intra_node, args.intra_latency),
        Link.parse(args.inter_node, args.inter_latency),
    )
    if args.steps_per_epoch is None and args.epoch_samples is None:
        raise SystemExit("hf-demo plan: give --steps-per-epoch, or --epoch-samples with --batch-size")
    steps = args.steps_per_epoch or math.ceil(args.epoch_samples / (cluster.world * args.batch_size))
    work = Workload(
        model_shapes,
        args.compute_s,
        demo_overhead=args.demo_overhead,
        powersgd_overhead=args.powersgd_overhead,
        adamw_s=args.adamw_s,
        param_bytes=args.param_bytes,
        demo_settings=dict(args.demo),
    )
    table = prices.load(args.prices) if args.prices else None
    rows = planner.evaluate(cluster, work, steps, table)
    pick, why = planner.recommend(rows, args.tolerance)
    print(planner.describe(cluster, work, steps) + "\n")
    print(planner.table(rows, table))
    if table is None:
        print("\n(no price table: --prices FILE gives the cost per epoch)")
    print(f"\nRecommended: {why}")
    if args.json:
        Path(args.json).write_text(planner.to_json(cluster, work, steps, rows, pick, why))
    return 0


def report_parser(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of a (finished or running) run's logs")
    p.add_argument("output_dir", help="the run's output_dir (trainer_state.json, checkpoints, ops/ logs)")
    p.add_argument("--out", help="where to write the page (default OUTPUT_DIR/hf-demo-report.html)")


def run_report(args) -> int:
    from hf_demo.ops import report

    path = report.write(args.output_dir, args.out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser(sub)
    report_parser(sub)
    args = parser.parse_args(argv)
    return {"plan": run_plan, "report": run_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
