"""Memory per rank and bytes per link: DDP-DeMo, HSDP-DeMo, FSDP2-AdamW and HSDP-AdamW on 4 gloo ranks (issue 28).

One run trains the same byte-level Llama (``benchlib.toy.byte_llama``, random init, the stdlib corpus) a few real
steps in each layout, every layout in fresh spawned processes, and prints per rank:

- **held**: the bytes of parameters + gradients + optimizer state this rank holds: the sum of the local tensors'
  bytes (``p.to_local()`` of a DTensor; every tensor of ``optimizer.state``). Gradients are counted right after
  the last backward, parameters and state after the last step;
- **peak RSS** of the rank's process (``ru_maxrss``), and its growth over the RSS after the imports (the model,
  its activations, the collectives' buffers and the allocator's slack on top of what "held" counts);
- **bytes per step** handed to collectives, per link, averaged over the steps after the first: *across the
  replicate dimension* (between nodes: DeMo's own collectives from
  ``hf_demo.exchange.transport.register_collective_hook``, less the ``node_*`` ones; FSDP2's all-reduce for
  HSDP-AdamW) and *inside the shard group* (FSDP2's all-gathers and reduce-scatters, and DeMo's ``node_*`` step
  agreement). FSDP2's collectives are counted by patching ``torch.distributed`` in the worker outside
  ``optimizer.step()``; DeMo's, by its hook inside it.

Layouts (``--world`` ranks, ``--shard`` ranks per shard group):

- ``ddp-demo``: every rank holds the whole model; no DDP wrapper (DeMo replaces its all-reduce); DeMo over the world;
- ``hsdp-demo``: ``hf_demo.fsdp.shard_model`` on the shard dimension of a (replicate, shard) mesh, DeMo across
  the replicate dimension (``DeMo(..., device_mesh=mesh)``);
- ``fsdp-adamw``: FSDP2 over every rank (one dimension), torch AdamW;
- ``hsdp-adamw``: FSDP2's own HSDP (``fully_shard`` on the 2-D mesh: reduce-scatter inside the shard group, dense
  all-reduce of the gradient shards across the replicate dimension), torch AdamW.

    python benchmarks/fsdp_memory.py                    # ~51M parameters, 4 ranks, 2 x 2: a few minutes on 2 cores
    python benchmarks/fsdp_memory.py --tiny --results-dir /tmp/x   # a tiny model: seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.ranks import expect_ok, run_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_LAYOUTS = ("ddp-demo", "hsdp-demo", "fsdp-adamw", "hsdp-adamw")
# DeMo's best recipes on a layout: update_rule="orthogonal" (Muon-style groups), the from_scratch preset
RECIPES = {"orthogonal": {"update_rule": "orthogonal"}, "preset": {"preset": "from_scratch"}}
LAYOUTS = DEFAULT_LAYOUTS + tuple(f"{base}-{r}" for r in RECIPES for base in ("ddp-demo", "hsdp-demo"))


def split_layout(layout: str) -> tuple[str, dict]:
    """("hsdp-demo", {"update_rule": "orthogonal"}) for "hsdp-demo-orthogonal"; a plain layout has no recipe."""
    for name, settings in RECIPES.items():
        if layout.endswith(f"-{name}"):
            return layout.removesuffix(f"-{name}"), settings
    return layout, {}


FSDP_OPS = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")
MB = 1e6


@dataclass(frozen=True)
class Config:
    hidden: int = 640
    intermediate: int = 1792
    layers: int = 10
    heads: int = 10
    seq_len: int = 64
    batch: int = 2
    steps: int = 4
    world: int = 4
    shard: int = 2
    lr: float = 1e-3
    seed: int = 0
    corpus_bytes: int = 2_000_000
    init: str = "whole"  # the sharded layouts' model: "whole" (built, then sharded) or "meta" (never whole on a rank)


TINY = dict(hidden=32, intermediate=64, layers=2, heads=2, seq_len=16, steps=3, corpus_bytes=200_000)


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def local_bytes(t) -> int:
    from hf_demo.topology.dtensor import local

    t = local(t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def state_bytes(opt) -> int:
    return sum(local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


class Links:
    """Bytes handed to collectives by link: 'replicate' (between nodes) and 'shard' (inside the shard group)."""

    def __init__(self, replicate_ranks: tuple[int, ...], shard_ranks: tuple[int, ...]):
        self.ranks = {"replicate": replicate_ranks, "shard": shard_ranks}
        self.bytes = {"replicate": 0, "shard": 0, "other": 0}
        self.in_step = False

    def link_of(self, group) -> str:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
        return next((k for k, v in self.ranks.items() if v == ranks), "other")

    def demo_hook(self, name: str, nbytes: int) -> None:
        """DeMo's collectives: ``node_*`` agree a step inside the shard group; the rest cross the replicate dim."""
        self.bytes["shard" if name.startswith("node_") else "replicate"] += nbytes

    def patch_fsdp(self):
        """Count torch.distributed's collectives made outside ``optimizer.step()`` (FSDP2's) by the group's link."""
        real = {op: getattr(dist, op) for op in FSDP_OPS if hasattr(dist, op)}

        def counting(fn, pick):
            def call(*args, group=None, **kwargs):
                if not self.in_step:
                    t = pick(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                    self.bytes[self.link_of(group)] += t.numel() * t.element_size()
                return fn(*args, group=group, **kwargs)

            return call

        for op, fn in real.items():  # the bytes this rank hands in: an all-gather's input is its smaller tensor
            pick = min if op == "all_gather_single" else max
            setattr(dist, op, counting(fn, lambda ts, pick=pick: pick(ts, key=torch.numel)))
        return lambda: [setattr(dist, op, fn) for op, fn in real.items()]


def groups(rank: int, world: int, shard: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the replicate group's ranks, the shard group's ranks) of ``rank`` on a (world/shard, shard) mesh."""
    return tuple(range(rank % shard, world, shard)), tuple(range(rank - rank % shard, rank - rank % shard + shard))


def shard(layout: str, cfg: Config, model):
    """``model`` sharded for ``layout`` (in place), and the mesh DeMo is given (None for DDP-DeMo and AdamW)."""
    from hf_demo import fsdp

    layout, _ = split_layout(layout)
    if layout == "ddp-demo":
        return None
    if layout == "hsdp-demo":
        mesh = fsdp.hsdp_mesh(shard=cfg.shard)
        fsdp.shard_model(model, mesh)
        return mesh
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp-adamw":
        mesh = init_device_mesh("cpu", (cfg.world,))
    elif layout == "hsdp-adamw":  # FSDP2's own HSDP: placements (Replicate(), Shard(0))
        mesh = init_device_mesh("cpu", (cfg.world // cfg.shard, cfg.shard), mesh_dim_names=fsdp.MESH_DIMS)
    else:
        raise ValueError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    for layer in fsdp.layer_modules(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return None


def build(layout: str, cfg: Config):
    """(the model built and sharded for ``layout``, its optimizer, its parameter count). ``--init meta`` builds a
    sharded layout's model on the meta device, shards it, then gives each rank its shards only (``to_empty``) and
    initialises them (``init_weights``, the same seed on every rank): the whole model never exists on a rank. On a
    CPU mesh DTensor's random ops draw the same values on every shard (PyTorch warns so): a model for measuring
    memory, not a good initialisation; the default builds the model whole (the same weights as DDP-DeMo's)."""
    import hf_demo
    from benchlib.toy import byte_llama

    size = dict(hidden=cfg.hidden, intermediate=cfg.intermediate, layers=cfg.layers, heads=cfg.heads)
    meta = cfg.init == "meta" and layout != "ddp-demo"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = byte_llama(**size, seq_len=cfg.seq_len, seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = shard(layout, cfg, model)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(cfg.seed)
        model.init_weights()
    if layout.endswith("adamw"):
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), n_params
    _, recipe = split_layout(layout)
    return model, hf_demo.create_optimizer(model, lr=cfg.lr, device_mesh=mesh, **recipe), n_params


def _worker(rank: int, world: int, layout: str, cfg: Config) -> dict:
    import hf_demo  # noqa: F401 - imported before the baseline RSS is read
    from benchlib.toy import Data
    from hf_demo.exchange import transport
    from hf_demo.stdlib_corpus import stdlib_bytes

    base, _ = split_layout(layout)
    shard = 1 if base == "ddp-demo" else world if base == "fsdp-adamw" else cfg.shard
    links = Links(*groups(rank, world, shard))
    rss0 = rss_now()
    model, opt, n_params = build(layout, cfg)
    rss_built = rss_now()
    data = Data(stdlib_bytes(cfg.corpus_bytes), rank, world, cfg.seq_len, cfg.batch, cfg.seed, 0.05, 1)
    restore, hook = links.patch_fsdp(), transport.register_collective_hook(links.demo_hook)
    losses, counted, step_s = [], {}, 0.0
    try:
        for step in range(cfg.steps):
            if step == 1:  # the first step plans and checks: count the steady steps
                links.bytes = dict.fromkeys(links.bytes, 0)
            batch = data.next_batch()
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            losses.append(float(loss.detach()))
            grads = sum(local_bytes(p.grad) for p in model.parameters())
            links.in_step, started = True, time.perf_counter()
            opt.step()
            links.in_step = False
            step_s += time.perf_counter() - started if step else 0.0
        counted = {k: v / max(cfg.steps - 1, 1) for k, v in links.bytes.items()}
    finally:
        hook.remove()
        restore()
    params = sum(local_bytes(p) for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(
        layout=layout, rank=rank, n_params=n_params, params=params, grads=grads, state=state_bytes(opt),
        peak_rss=peak, rss_growth=peak - rss0, rss_built=rss_built - rss0, rss_end=rss_now() - rss0,
        per_step=counted, losses=losses, step_s=step_s / max(cfg.steps - 1, 1),
    )  # fmt: skip


def run(cfg: Config, layouts, start_method: str = "spawn") -> list[dict]:
    """Every layout on its own ``cfg.world`` new ranks. "spawn" gives each rank a fresh interpreter (its RSS is its
    own); "fork" starts faster, from a parent that has imported what the workers use (RSS then counts those pages)."""
    if start_method == "fork":
        import transformers.models.llama  # noqa: F401

        import hf_demo.fsdp  # noqa: F401
    rows = []
    for layout in layouts:
        print(f"{layout}: {cfg.world} ranks ({start_method}) ...", flush=True)
        rows += expect_ok(run_ranks(_worker, cfg.world, layout, cfg, start_method=start_method, timeout=1800))
    return rows


def held(r: dict) -> int:
    return r["params"] + r["grads"] + r["state"]


def growths(r: dict) -> str:
    """The RSS above the one after the imports: once the model is built (and sharded), at its peak, at the end."""
    return " / ".join(f"{r[k] / MB:.0f}" for k in ("rss_built", "rss_growth", "rss_end"))


def table(rows: list[dict]) -> list[str]:
    out = [
        "| layout | rank | params MB | grads MB | optimizer state MB | **held MB** | peak RSS MB "
        "| RSS growth MB: built / peak / end | across replicate B/step | inside shard group B/step "
        "| loss first → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["per_step"]
        out.append(
            f"| {r['layout']} | {r['rank']} | {r['params'] / MB:.1f} | {r['grads'] / MB:.1f} | {r['state'] / MB:.1f} "
            f"| **{held(r) / MB:.1f}** | {r['peak_rss'] / MB:.0f} | {growths(r)} "
            f"| {s['replicate']:,.0f} | {s['shard']:,.0f} | {r['losses'][0]:.3f} → {r['losses'][-1]:.3f} |"
        )
    return out


def summary(rows: list[dict]) -> list[str]:
    """One row per layout: the largest rank's held bytes and RSS, the mean bytes per step."""
    by = {}
    for r in rows:
        by.setdefault(r["layout"], []).append(r)
    ddp = max(held(r) for r in by["ddp-demo"]) if "ddp-demo" in by else None
    out = [
        "| layout | held per rank MB | × ddp-demo | peak RSS MB | RSS growth MB: built / peak / end "
        "| across replicate B/step/rank "
        "| inside shard group B/step/rank | optimizer step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lay, rs in by.items():
        h = max(held(r) for r in rs)
        x = f"{h / ddp:.3f}" if ddp else "-"

        def mean(key, rs=rs):
            return sum(r["per_step"][key] for r in rs) / len(rs)

        out.append(
            f"| {lay} | {h / MB:.1f} | {x} | {max(r['peak_rss'] for r in rs) / MB:.0f} "
            f"| {growths(max(rs, key=lambda r: r['rss_growth']))} | {mean('replicate'):,.0f} | {mean('shard'):,.0f} "
            f"| {max(r.get('step_s', float('nan')) for r in rs):.3f} |"
        )
    return out


def ratios(rows: list[dict], cfg: Config) -> list[str]:
    """The issue's two figures against their targets, and what the others compare to."""
    by = {}
    for r in rows:
        by.setdefault(r["layout"], []).append(r)

    def worst(layout, f):
        return max(f(r) for r in by[layout])

    def mean(layout, f):
        return sum(f(r) for r in by[layout]) / len(by[layout])

    lines = []
    if "ddp-demo" in by:
        ddp_held = worst("ddp-demo", held)
        for lay in (x for x in LAYOUTS if x in by and x != "ddp-demo"):
            target = " (target <= 0.55)" if lay == "hsdp-demo" else ""
            lines.append(f"- held per rank, {lay} / ddp-demo (largest rank): {worst(lay, held) / ddp_held:.3f}{target}")
        for lay in (x for x in LAYOUTS if x in by and x != "ddp-demo"):
            rss = mean(lay, lambda r: r["rss_growth"]) / mean("ddp-demo", lambda r: r["rss_growth"])
            lines.append(f"- RSS growth per rank, {lay} / ddp-demo (mean of ranks): {rss:.3f}")
    rep = {lay: mean(lay, lambda r: r["per_step"]["replicate"]) for lay in by}
    if "ddp-demo" in by and "hsdp-demo" in by and rep["ddp-demo"]:
        r = rep["hsdp-demo"] / rep["ddp-demo"]
        lines += [
            f"- DeMo across the replicate dimension per rank per step, hsdp-demo / ddp-demo: {r:.4f} "
            f"(1/shard = {1 / cfg.shard:.4f}: each rank sends its shard's payload)",
            f"- the same per node (the shard group's {cfg.shard} ranks together) against one ddp-demo rank: "
            f"{r * cfg.shard:.4f} (target: 1, DDP's bytes for the same parameters)",
        ]
    n = rows[0]["n_params"]
    for lay, b in rep.items():
        lines.append(f"- across the replicate dimension, {lay}: {b / n:.4f} bytes/param/step per rank")
    if "hsdp-adamw" in rep and rep.get("hsdp-demo"):
        x = rep["hsdp-adamw"] / rep["hsdp-demo"]
        lines.append(f"- hsdp-adamw / hsdp-demo across the replicate dimension: {x:.0f}x")
    return lines


def report(rows: list[dict], cfg: Config, argv: list[str]) -> str:
    n = rows[0]["n_params"]
    head = [
        "# FSDP2 / HSDP memory per rank and bytes per link",
        "",
        f"`python benchmarks/fsdp_memory.py {' '.join(argv)}`".replace(" `", "`"),
        "",
        f"Byte-level Llama, {n / 1e6:.2f}M parameters (hidden {cfg.hidden}, {cfg.layers} layers, intermediate "
        f"{cfg.intermediate}), fp32, {cfg.world} gloo ranks on CPU, shard groups of {cfg.shard} for the HSDP rows, "
        f"batch {cfg.batch} x {cfg.seq_len} per rank, {cfg.steps} steps; bytes per step: the mean of steps "
        f"2-{cfg.steps}. "
        "held = parameters + gradients + optimizer state (local shards); DeMo at its defaults, AdamW torch's. "
        + (
            "The sharded layouts' model is built on the meta device, sharded, then initialised shard by shard."
            if cfg.init == "meta"
            else "Every layout's model is built whole on each rank, then sharded."
        ),
        "",
    ]
    per_rank = ["", "Per rank:", "", *table(rows)]
    return "\n".join([*head, *summary(rows), "", *ratios(rows, cfg), *per_rank, ""])


# ---------------------------------------------------------------- the distributed Newton-Schulz against the unsharded
SCHEMES = ("owner", "everywhere")  # hf_demo.topology.sharded.ShardedMatrices
NS_SIZES = "256x704x2,512x1408x2,640x1792x2,1024x2816x1"  # hidden x intermediate x layers


def _timed(fn, reps: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``, each the median of ``reps`` runs, every rank
    starting each run together. The CPU seconds are the work of this rank alone (gloo's threads included), what a
    machine shared with other work does not inflate as it does the wall time."""
    wall, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def _ns_worker(rank: int, world: int, cfg: Config, reps: int) -> dict:
    """update_rule="orthogonal"'s directions of the hidden matrices (Muon-style groups) of the HSDP-sharded model:
    per scheme, the seconds (median of ``reps``) and the bytes this rank sends and receives inside its shard group;
    against the seconds of the same directions on the whole matrices, as a DDP-DeMo rank computes them."""
    import hf_demo
    from benchlib.toy import byte_llama
    from hf_demo import fsdp
    from hf_demo.exchange.transport import Traffic, Transport
    from hf_demo.optim import update_rules
    from hf_demo.topology.dtensor import local
    from hf_demo.topology.sharded import ShardedMatrices

    size = dict(hidden=cfg.hidden, intermediate=cfg.intermediate, layers=cfg.layers, heads=cfg.heads)
    model = byte_llama(**size, seq_len=cfg.seq_len, seed=cfg.seed)
    fsdp.shard_model(model, fsdp.hsdp_mesh(shard=cfg.shard))
    hidden = hf_demo.muon_style_groups(model)[0]["params"]
    rule, shards = update_rules.get("orthogonal"), Transport(hidden[0].device_mesh.get_group(), 0)
    params = [p for p in hidden if local(p).numel()]
    members, views = list(range(len(params))), [local(p).detach() for p in params]
    out = dict(rank=rank, matrices=len(hidden), hidden_params=sum(p.numel() for p in hidden))
    directions = {}
    for scheme in SCHEMES:
        traffic = Traffic()

        def step(scheme=scheme, traffic=traffic):
            matrices = ShardedMatrices(params, hidden, shards.at(0, traffic), scheme)
            found, _ = matrices.directions(rule, members, views, [v.float().clone() for v in views], [{}] * len(views))
            directions[scheme] = found

        out[f"{scheme}_s"], out[f"{scheme}_cpu_s"] = _timed(step, reps)
        out[f"{scheme}_sent"], out[f"{scheme}_received"] = traffic.sent / reps, traffic.received / reps
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(*directions.values()))
    wholes = [p.full_tensor().detach() for p in hidden]
    unsharded = lambda: rule.directions(wholes, [w.clone() for w in wholes], [{}] * len(wholes))  # noqa: E731
    out["unsharded_s"], out["unsharded_cpu_s"] = _timed(unsharded, reps)
    return out


def newton_schulz_rows(sizes: list[tuple[int, int, int]], cfg: Config, reps: int, start_method: str) -> list[dict]:
    rows = []
    for hidden, intermediate, layers in sizes:
        heads = max(1, hidden // 64)
        at = replace(cfg, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads)
        print(f"newton-schulz {hidden}x{intermediate}x{layers}: {cfg.world} ranks ...", flush=True)
        ranks = expect_ok(run_ranks(_ns_worker, cfg.world, at, reps, start_method=start_method, timeout=3600))
        rows.append(dict(hidden=hidden, intermediate=intermediate, layers=layers, ranks=ranks))
    return rows


def newton_schulz_table(rows: list[dict], cfg: Config, reps: int) -> list[str]:
    """One row per model: the slowest rank's seconds, the mean rank's bytes inside the shard group."""
    out = [
        f'The hidden matrices\' `update_rule="orthogonal"` directions (5 fp32 Newton-Schulz iterations each) on '
        f"{cfg.world} gloo ranks, shard groups of {cfg.shard}, every rank at once; seconds: the slowest rank's "
        f"median of {reps}, wall / CPU (the rank's own work, which other load on the machine does not inflate); "
        "bytes: per rank and step inside the shard group, sent / received (mean of the ranks).",
        "",
        "| model (hidden x intermediate x layers) | matrices | unsharded s, wall / CPU (a DDP rank) "
        "| everywhere s, wall / CPU | owner s, wall / CPU | owner / unsharded, wall / CPU "
        "| everywhere B sent / received | owner B sent / received | bitwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rs = row["ranks"]

        def worst(key, rs=rs):
            return max(r[key] for r in rs)

        def mean(key, rs=rs):
            return sum(r[key] for r in rs) / len(rs)

        out.append(
            f"| {row['hidden']} x {row['intermediate']} x {row['layers']} | {rs[0]['matrices']} "
            f"| {worst('unsharded_s'):.3f} / {worst('unsharded_cpu_s'):.3f} "
            f"| {worst('everywhere_s'):.3f} / {worst('everywhere_cpu_s'):.3f} "
            f"| {worst('owner_s'):.3f} / {worst('owner_cpu_s'):.3f} "
            f"| {worst('owner_s') / worst('unsharded_s'):.2f} / {worst('owner_cpu_s') / worst('unsharded_cpu_s'):.2f} "
            f"| {mean('everywhere_sent'):,.0f} / {mean('everywhere_received'):,.0f} "
            f"| {mean('owner_sent'):,.0f} / {mean('owner_received'):,.0f} | {all(r['bitwise'] for r in rs)} |"
        )
    return out


def newton_schulz_main(args, cfg: Config, argv: list[str]) -> None:
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.ns_sizes.split(",") if size]
    saved = args.results_dir / "fsdp_newton_schulz.json"
    if args.report_only:
        run_ = json.loads(saved.read_text())
        cfg, rows, argv, reps = Config(**run_["config"]), run_["rows"], run_["argv"], run_["reps"]
    else:
        reps = args.ns_reps
        rows = newton_schulz_rows(sizes, cfg, reps, args.start_method)
        args.results_dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(dict(config=asdict(cfg), argv=argv, reps=reps, rows=rows), indent=1))
    command = f"`python benchmarks/fsdp_memory.py {' '.join(argv)}`".replace(" `", "`")
    text = "\n".join(["# The distributed Newton-Schulz against the unsharded one", "", command, "",
                      *newton_schulz_table(rows, cfg, reps), ""])  # fmt: skip
    print(text)
    (args.results_dir / "fsdp_newton_schulz.md").write_text(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()  # the flags default to None: --tiny's sizes, then Config's, fill what is not given
    p.add_argument("--hidden", type=int, help=f"hidden size ({d.hidden})")
    p.add_argument("--intermediate", type=int, help=f"MLP size ({d.intermediate})")
    p.add_argument("--layers", type=int, help=f"decoder layers ({d.layers})")
    p.add_argument("--heads", type=int, help=f"attention heads ({d.heads})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence ({d.seq_len})")
    p.add_argument("--batch", type=int, help=f"sequences per rank and step ({d.batch})")
    p.add_argument("--steps", type=int, help=f"training steps; bytes per step from the 2nd on ({d.steps})")
    p.add_argument("--world", type=int, help=f"ranks ({d.world})")
    p.add_argument("--shard", type=int, help=f"ranks per shard group of the HSDP layouts ({d.shard})")
    p.add_argument("--lr", type=float, help=f"learning rate ({d.lr})")
    p.add_argument("--seed", type=int, help=f"the model's seed ({d.seed})")
    p.add_argument("--corpus-bytes", type=int, help=f"bytes of the stdlib corpus read ({d.corpus_bytes})")
    p.add_argument(
        "--init",
        choices=("whole", "meta"),
        help=f"the sharded layouts' model: built whole then sharded, or on the meta device ({d.init}); on a CPU "
        "mesh, DTensor's random init gives every shard the same values: meta is for the RSS figures only there",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model and 3 steps: seconds (the smoke test)")
    p.add_argument(
        "--layouts",
        default=",".join(DEFAULT_LAYOUTS),
        help=f"comma-separated, from {', '.join(LAYOUTS)} (-orthogonal: update_rule='orthogonal' in Muon-style "
        "groups; -preset: the from_scratch preset)",
    )
    p.add_argument(
        "--newton-schulz",
        action="store_true",
        help="time the sharded orthogonal rule's whole-matrix schemes (owner, everywhere) against the unsharded "
        "Newton-Schulz on --ns-sizes, instead of the memory table",
    )
    p.add_argument("--ns-sizes", default=NS_SIZES, help=f"models, hidden x intermediate x layers ({NS_SIZES})")
    p.add_argument("--ns-reps", type=int, default=3, help="timed runs per scheme and model; the median (3)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--report-only", action="store_true", help="the tables again from --results-dir's fsdp_memory.json")
    p.add_argument("--start-method", choices=("spawn", "fork"), default="spawn", help="fork: faster, RSS less clean")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    given = {f: getattr(args, f) for f in asdict(Config()) if getattr(args, f) is not None}
    cfg = Config(**{**(TINY if args.tiny else {}), **given})
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown layouts {bad}: choose from {', '.join(LAYOUTS)}")
    if cfg.world % cfg.shard:
        raise SystemExit(f"--shard {cfg.shard} does not divide --world {cfg.world}")
    if args.newton_schulz:
        return newton_schulz_main(args, cfg, argv)
    saved = args.results_dir / "fsdp_memory.json"
    if args.report_only:
        run_ = json.loads(saved.read_text())
        cfg, rows, argv = Config(**run_["config"]), run_["rows"], run_["argv"]
    else:
        rows = run(cfg, layouts, args.start_method)
        args.results_dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(dict(config=asdict(cfg), argv=argv, rows=rows), indent=1))
    text = report(rows, cfg, argv)
    print(text)
    (args.results_dir / "fsdp_memory.md").write_text(text)


if __name__ == "__main__":
    main()
