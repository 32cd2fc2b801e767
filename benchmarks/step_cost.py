"""Step-cost benchmark: aten ops, host reads and host<->device copies of one ``optimizer.step()``, as a function of
the number of parameter tensors, for hf_demo.DeMo in its main modes, pytorch_optimizer.DeMo and torch AdamW.

Every aten call of one step (after warm-up steps) is counted under a ``TorchDispatchMode``. One process (world
size 1): the exchange's collectives are skipped, but every other part of the step runs (encoding, decoding,
payload checks, CRC32, the header), so the count is the step's math and its host reads, without the collectives'
own cost. A host read is one of:

- ``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)`` of a tensor (a device sync on a GPU);
- an op whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``: :data:`DATA_DEPENDENT`),
  which on a GPU waits for the device too;
- a copy between two devices (``aten._to_copy`` / ``aten.copy_`` whose source and destination differ, e.g.
  ``.cpu()`` of a CUDA tensor, or ``.tolist()`` of one), counted with its bytes;
- on a CPU run, ``.tolist()`` / ``.numpy()`` of a tensor: free on a CPU, but where a GPU run copies to the host.

Reads of the step counters that stay on the host on every device (hf-demo's ``rule_step``, AdamW's ``step``:
:data:`HOST_COUNTER_SITES`) are not host reads; the table lists them apart. On ``meta`` and ``cuda`` only reads of
tensors on that device count.

Devices: ``cpu``; ``meta`` (no data: an optimizer whose step reads values back cannot run there, and the table
says why); ``cuda`` when present, with wall times (median of synchronised steps, not counted).

    python benchmarks/step_cost.py                      # 8/32/128/512 tensors, cpu and meta (and cuda)
    python benchmarks/step_cost.py --small --sizes 8,32 # tiny shapes: seconds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHAPES = ((256, 256), (256,), (256, 688), (688, 256))  # cycled: the mixed shapes
SMALL_SHAPES = ((16, 16), (16,), (16, 24), (24, 16))
SIZES = (8, 32, 128, 512)
RESULTS = Path(__file__).resolve().parent / "results" / "step_cost.md"
PEER_INSTALL = "pip install pytorch-optimizer einops"
SITE_PACKAGES = ("hf_demo", "pytorch_optimizer", os.path.join("torch", "optim"))
# ops whose output shape depends on the data: on a GPU the host waits for the device to know it (a sync)
DATA_DEPENDENT = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount")
# reads of step counters the optimizers keep on the host on every device (no device sync there): listed, not counted
HOST_COUNTER_SITES = (  # hf-demo's rule_step (one parameter, many at once), AdamW's step
    "update_rules.py:next_step",
    "update_rules.py:next_steps",
    "optimizer.py:_get_value",
)

# name -> (label, DeMo settings or a builder name); a sync_every mode is counted at a synchronising and a local step
METHODS = {
    "demo": ("hf-demo DeMo (defaults)", {}),
    "demo-sign": ("hf-demo DeMo value_format=sign", {"value_format": "sign"}),
    "demo-allreduce": ("hf-demo DeMo exchange=all_reduce", {"exchange": "all_reduce"}),
    "demo-sync4": ("hf-demo DeMo sync_every=4", {"sync_every": 4}),
    "demo-overlap": ("hf-demo DeMo overlap=True", {"overlap": True}),
    "peer": ("pytorch-optimizer DeMo", "peer"),
    "adamw": ("torch AdamW(foreach=True)", "adamw"),
}


# ---------------------------------------------------------------------------------------------- counting
@dataclass
class StepCount:
    """What one step did: aten ops by name, host reads by kind and call site, cross-device copies and bytes."""

    ops: collections.Counter = field(default_factory=collections.Counter)
    scalar_reads: int = 0  # aten._local_scalar_dense
    counter_reads: int = 0  # of a host step counter (HOST_COUNTER_SITES): not a host read
    shape_reads: int = 0  # DATA_DEPENDENT ops on the parameters' device (nonzero, ...)
    list_reads: int = 0  # .tolist() / .numpy() of a tensor (counted on CPU runs only)
    d2h: int = 0  # copies from the parameters' device to the host
    d2h_bytes: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    sites: collections.Counter = field(default_factory=collections.Counter)  # host reads by call site

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return self.scalar_reads + self.shape_reads + self.list_reads + self.d2h


def _call_site() -> str:
    """The innermost frame in an optimizer's package (hf_demo, pytorch_optimizer, torch.optim) that is not here."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename != __file__ and any(part in frame.filename for part in SITE_PACKAGES):
            tail = frame.filename.split("site-packages" + os.sep)[-1].split(os.sep + "hf_demo" + os.sep)[-1]
            return f"{Path(tail).name}:{frame.name}"
    return "?"


class StepCounter(TorchDispatchMode):
    """Counts every aten call while active (``with StepCounter(on_cpu=...) as c: opt.step()``)."""

    def __init__(self, on_cpu: bool):
        super().__init__()
        self.count = StepCount()
        self.on_cpu = on_cpu  # a CPU run: every tensor is on the host; elsewhere a CPU tensor's read is no sync
        self._patches: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.count.ops[name] += 1
        if name == "_local_scalar_dense" and (self.on_cpu or args[0].device.type != "cpu"):
            site = _call_site()
            if site in HOST_COUNTER_SITES:
                self.count.counter_reads += 1
            else:
                self.count.scalar_reads += 1
                self.count.sites[site] += 1
        elif name in DATA_DEPENDENT and (self.on_cpu or args[0].device.type != "cpu"):
            self.count.shape_reads += 1
            self.count.sites[_call_site() + f" ({name})"] += 1
        elif name in ("_to_copy", "copy_"):
            src, dst = (args[0], kwargs.get("device")) if name == "_to_copy" else (args[1], args[0].device)
            if isinstance(src, torch.Tensor) and dst is not None and torch.device(dst) != src.device:
                nbytes = src.numel() * src.element_size()
                if torch.device(dst).type == "cpu":
                    self.count.d2h += 1
                    self.count.d2h_bytes += nbytes
                    self.count.sites[_call_site()] += 1
                else:
                    self.count.h2d += 1
                    self.count.h2d_bytes += nbytes
        return func(*args, **kwargs)

    def _wrap(self, method: str) -> None:
        original = getattr(torch.Tensor, method)
        count = self.count

        def read(tensor, *args, **kwargs):
            site = _call_site()
            if site in HOST_COUNTER_SITES:  # the step counters: on the host on every device
                count.counter_reads += 1
            elif tensor.device.type == "cpu":
                count.list_reads += 1
                count.sites[site] += 1
            return original(tensor, *args, **kwargs)

        self._patches.append((method, original))
        setattr(torch.Tensor, method, read)

    def __enter__(self):
        if self.on_cpu:
            for method in ("tolist", "numpy"):
                self._wrap(method)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, original in self._patches:
                setattr(torch.Tensor, method, original)
            self._patches.clear()


# ---------------------------------------------------------------------------------------------- setup
def make_params(n: int, device: str, small: bool = False, seed: int = 0):
    """``n`` parameter tensors cycling through the shapes, and a fixed gradient for each."""
    gen = torch.Generator().manual_seed(seed)
    shapes = SMALL_SHAPES if small else SHAPES
    params, grads = [], []
    for i in range(n):
        shape = shapes[i % len(shapes)]
        params.append(torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device)))
        grads.append(torch.randn(shape, generator=gen).to(device))
    return params, grads


def peer_missing() -> str | None:
    """None when pytorch_optimizer.DeMo can run here, else why not."""
    for module in ("pytorch_optimizer", "einops"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (`{PEER_INSTALL}`, the `bench` extra)"
    try:
        from pytorch_optimizer import DeMo  # noqa: F401
    except ImportError as exc:
        return f"pytorch_optimizer has no DeMo ({exc})"
    return None


def _one_process_group() -> None:
    """pytorch_optimizer.DeMo asks torch.distributed for the world size: a gloo group of one process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def build(method: str, params, lr: float = 1e-3):
    spec = METHODS[method][1]
    if spec == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if spec == "peer":
        from pytorch_optimizer import DeMo as PeerDeMo

        _one_process_group()
        return PeerDeMo(params, lr=lr, compression_decay=0.999, compression_top_k=32, compression_chunk=64)
    from hf_demo import DeMo

    return DeMo(params, lr=lr, **spec)


def _phase(opt) -> str | None:
    """For hf-demo with local steps: whether the step just taken synchronised ("sync") or not ("local")."""
    counters = getattr(opt, "counters", None)
    if counters is None or getattr(opt.settings, "sync_every", 1) <= 1:
        return None
    return "local" if counters.unsynced else "sync"


def _step(opt, params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def count_steps(method: str, n: int, device: str, small: bool = False, warmup: int = 1) -> dict[str, StepCount]:
    """The counts of one step after ``warmup`` steps, keyed by phase ("step", or "sync" and "local")."""
    params, grads = make_params(n, device, small)
    opt = build(method, params)
    for _ in range(warmup):
        _step(opt, params, grads)
    counts: dict[str, StepCount] = {}
    wanted = {"sync", "local"} if _phase(opt) is not None else {"step"}
    for _ in range(8):  # sync_every=4: a synchronising and a local step come within 4 steps
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with StepCounter(on_cpu=device == "cpu") as counter:
            opt.step()
        counts.setdefault(_phase(opt) or "step", counter.count)
        if wanted <= counts.keys():
            break
    return counts


def wall_ms(method: str, n: int, device: str, small: bool, steps: int = 5) -> float:
    """Median wall time of ``steps`` synchronised steps after a warm-up (CUDA)."""
    params, grads = make_params(n, device, small)
    opt = build(method, params)
    _step(opt, params, grads)
    times = []
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- report
def _why(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if any(s in f.filename for s in SITE_PACKAGES)]
    where = f" (in {Path(frames[-1].filename).name}:{frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}{where}"


def measure(methods, sizes, device: str, small: bool, wall: bool) -> tuple[dict, dict]:
    """rows[(method, phase)][n] = StepCount (plus wall ms), and the methods that could not run, with why."""
    rows: dict[tuple[str, str], dict[int, StepCount]] = {}
    walls: dict[tuple[str, str], dict[int, float]] = {}
    failed: dict[str, str] = {}
    for method in methods:
        for n in sizes:
            try:
                counts = count_steps(method, n, device, small)
            except Exception as exc:  # a method that cannot run on this device: the report says why
                failed[method] = _why(exc)
                break
            for phase, count in counts.items():
                rows.setdefault((method, phase), {})[n] = count
            if wall and "step" in counts:
                walls.setdefault((method, "step"), {})[n] = wall_ms(method, n, device, small)
            print(f"  {device} {method} {n}: " + ", ".join(f"{k} {c.total_ops} ops" for k, c in counts.items()))
    return {"rows": rows, "walls": walls}, failed


def table(result: dict, failed: dict, sizes, device: str) -> list[str]:
    rows, walls = result["rows"], result["walls"]
    top = max(sizes)
    mid = 128 if 128 in sizes else top
    slash = " / ".join(str(n) for n in sizes)
    head = [
        f"| optimizer | aten ops at {slash} tensors | ops per tensor at {mid} | ops {top}/{mid} |",
        f" host reads at {slash} | host reads per tensor at {top} | `_local_scalar_dense` at {top} |",
        f" device->host copies (bytes) at {top} | host counter reads at {top} |",
    ]
    if walls:
        head.append(f" wall ms at {slash} |")
    lines = ["".join(head), "|" + "---|" * (9 + bool(walls))]
    for (method, phase), by_n in rows.items():
        label = METHODS[method][0] + ("" if phase == "step" else f", {phase} step")
        ops = " / ".join(f"{by_n[n].total_ops:,}" for n in sizes if n in by_n)
        reads = " / ".join(str(by_n[n].host_reads) for n in sizes if n in by_n)
        t, m = by_n.get(top), by_n.get(mid)
        cells = [
            label,
            ops,
            f"{m.total_ops / mid:.1f}" if m else "",
            f"{t.total_ops / m.total_ops:.2f}x" if t and m and top != mid else "",
            reads,
            f"{t.host_reads / top:.3f}" if t else "",
            str(t.scalar_reads) if t else "",
            f"{t.d2h} ({t.d2h_bytes:,} B)" if t else "",
            str(t.counter_reads) if t else "",
        ]
        if walls:
            w = walls.get((method, phase), {})
            cells.append(" / ".join(f"{w[n]:.2f}" for n in sizes if n in w))
        lines.append("| " + " | ".join(cells) + " |")
    for method, why in failed.items():
        reason = "a meta tensor holds no data, and this step reads values back or makes a shape from them: " * (
            device == "meta"
        )
        lines.append(f"| {METHODS[method][0]} | does not run on {device}: {reason}{why} |" + " |" * (7 + bool(walls)))
    return lines


def sites(result: dict, sizes) -> list[str]:
    """The host reads of the largest size, by call site, for every row that has any."""
    top = max(sizes)
    lines = [f"Host reads at {top} tensors by call site (module:function):", ""]
    for (method, phase), by_n in result["rows"].items():
        count = by_n.get(top)
        if count is None or not count.sites:
            continue
        label = METHODS[method][0] + ("" if phase == "step" else f", {phase} step")
        listed = ", ".join(f"`{site}` {k}" for site, k in count.sites.most_common())
        lines.append(f"- {label}: {listed}")
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="numbers of parameter tensors")
    ap.add_argument("--devices", default=None, help="comma-separated; default cpu,meta and cuda when present")
    ap.add_argument("--only", default=",".join(METHODS), help=f"methods among {', '.join(METHODS)}")
    ap.add_argument("--small", action="store_true", help=f"tiny shapes {SMALL_SHAPES} instead of {SHAPES}")
    ap.add_argument("--out", default=str(RESULTS), help="where the Markdown table goes ('' for nowhere)")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    devices = args.devices.split(",") if args.devices else ["cpu", "meta"] + ["cuda"] * torch.cuda.is_available()
    methods = args.only.split(",")
    notes = []
    if "peer" in methods and (why := peer_missing()):
        print(f"pytorch_optimizer.DeMo skipped: {why}", file=sys.stderr)
        notes.append(f"pytorch-optimizer DeMo not run: {why}.")
        methods.remove("peer")
    shapes = SMALL_SHAPES if args.small else SHAPES
    out = [
        "# Step cost: aten ops and host reads per optimizer step",
        "",
        f"`python benchmarks/step_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"torch {torch.__version__}, one process (world size 1: the collectives are skipped, every other part of the "
        f"step runs), parameters cycling through shapes {', '.join('x'.join(map(str, s)) for s in shapes)}; one step "
        "counted after a warm-up step. Host reads: `_local_scalar_dense` (`.item()`, `bool(t)`), ops whose output "
        "shape depends on the data (`nonzero`, ...), copies to the host from another device, and on the CPU "
        "`.tolist()`/`.numpy()` (free there; where a GPU copies to the host). Reads of the host step counters "
        "(hf-demo's `rule_step`, AdamW's `step`) are not host reads: their own column.",
        *([""] + notes if notes else []),
    ]
    for device in devices:
        print(f"{device}:")
        result, failed = measure(methods, sizes, device, args.small, wall=device == "cuda")
        out += ["", f"## {device}", "", *table(result, failed, sizes, device), "", *sites(result, sizes)]
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
