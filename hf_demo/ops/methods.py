"""The methods the planner compares, in a registry: DDP-AdamW, DDP-PowerSGD and DeMo's layouts and presets.

Each method turns a :class:`Cluster` and a :class:`Workload` into an :class:`Estimate`: its collectives
(:mod:`hf_demo.ops.traffic`), its computation, the memory per device, and how close it trains to dense
AdamW at equal steps (``quality``, lower is closer: the order of the figures in docs/results.md) and what
that costs in loss as measured there (:data:`LOSS_COST`, each with the section it comes from). Add a method
by writing one function here and listing it in :data:`METHODS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_demo import refusals
from hf_demo.ops.links import COLLECTIVE_OVERHEAD, Link, collective_seconds, edge_bytes, sent_bytes
from hf_demo.ops.shapes import Shape
from hf_demo.ops.traffic import (
    GROUPS,
    Collective,
    ddp_collectives,
    demo_collectives,
    demo_layouts,
    powersgd_collectives,
    shard_shapes,
)
from hf_demo.optim import policy as policies
from hf_demo.optim import update_rules
from hf_demo.settings import PRESETS, DeMoSettings
from hf_demo.topology import owners


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    overhead: float = COLLECTIVE_OVERHEAD  # seconds every collective costs whatever its bytes and hops (links.py)
    # collectives one process group runs at once: 1 for NCCL (one stream, in order), 2 for gloo (ProcessGroupGloo's
    # two worker threads: DDP's bucket all-reduces, issued without waiting, run side by side)
    concurrent: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, scope: str) -> Link:
        return self.inter if scope == "inter" else self.intra

    @property
    def flat_scope(self) -> str:
        """Where a collective over every rank is limited: between nodes as soon as there are two."""
        return "inter" if self.nodes > 1 else "intra"


# DeMo's own computation at a synchronisation (DCT, top-k, coding, the update) against one forward+backward, as
# measured: DeMo defaults on the 3.3M-parameter byte-level Llama, batch 8x128, one CPU thread per rank, in the
# six runs of benchmarks/results/wan_headline/run*/wan_summary.json ((opt_s - comm_s) / fwd_bwd_s: 0.452 to 0.463,
# median 0.457). Where the forward+backward is cheap against the step it is higher (1.44 on an H200 at 2 x 128
# tokens per rank, docs/results.md#on-a-gpu): the planner's --demo-overhead says so and asks for the job's own.
DEMO_OVERHEAD = 0.46
DEMO_OVERHEAD_SOURCE = (
    "DeMo defaults measured on the 3.3M-parameter Llama, batch 8x128, one CPU thread per rank (median of the 6 runs "
    "of benchmarks/results/wan_headline); higher where forward+backward is cheap (1.44 on an H200 at 2x128 tokens, "
    "docs/results.md#on-a-gpu)"
)


@dataclass(frozen=True)
class Workload:
    shapes: list[Shape]
    compute_s: float  # forward + backward of one step on one device (given or measured)
    demo_overhead: float = DEMO_OVERHEAD  # DeMo's own computation at a synchronisation, a fraction of compute_s
    # one Newton-Schulz orthogonalisation of every hidden matrix, as a fraction of compute_s (None: not known, and
    # the rows whose rules orthogonalise say their step leaves it out)
    orthogonal_overhead: float | None = None
    powersgd_overhead: float = 0.15  # PowerSGD's factorisation per step, as a fraction of compute_s
    adamw_s: float = 0.0  # AdamW's own step
    param_bytes: int = 4  # bytes per parameter (fp32 4, bf16 2)
    backward_fraction: float = 2 / 3  # the part of compute_s a DDP all-reduce can hide under
    powersgd_rank: int = 4
    demo_settings: dict = field(default_factory=dict)  # settings every DeMo variant starts from
    # the model has buffers, which DDP broadcasts before every forward (every transformers language model has some:
    # rotary frequencies, position ids); the shapes do not say, so the planner assumes it, as for those models
    ddp_buffers: bool = True

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass
class Estimate:
    method: str
    label: str
    collectives: list[Collective]
    compute_s: float  # this method's computation per step (forward, backward, optimizer)
    hide_window_s: float  # computation that hideable collectives can run under
    memory_bytes: float  # parameters, gradients and optimizer state per device (activations excluded)
    quality: int
    settings: dict | None = None  # DeMo's settings (None: not DeMo)
    note: str = ""
    loss_cost: str = ""  # what it costs in loss, measured (docs/results.md), with the section

    def exchange_s(self, cluster: Cluster) -> float:
        """Seconds per step (amortised over ``every``) that the step waits on the network: the collectives one
        after the other, those that may hide less the computation they hide under, and on a backend that runs
        collectives at once (``cluster.concurrent``) the ``overlaps`` ones side by side (:meth:`_side_by_side_s`)."""
        at_once = cluster.concurrent > 1
        side = [c for c in self.collectives if at_once and c.overlaps]
        fixed, hidden = self._collective_seconds(cluster, [c for c in self.collectives if not (at_once and c.overlaps)])
        return fixed + max(0.0, hidden - self.hide_window_s) + self._side_by_side_s(cluster, side)

    def comm_s(self, cluster: Cluster) -> float:
        """Seconds per step (amortised) its collectives take, hidden under computation or not: what a rank's
        clock around each collective adds up to (``benchmarks/plan_check.py --measure`` measures it)."""
        return sum(self._collective_seconds(cluster, self.collectives))

    def _collective_seconds(self, cluster: Cluster, collectives: list[Collective]) -> tuple[float, float]:
        """(seconds of the collectives the step waits for, seconds of those that may hide), per step."""
        fixed = hidden = 0.0
        for c, seconds in zip(collectives, _each_seconds(collectives, cluster)):
            if c.hideable:
                hidden += seconds
            else:
                fixed += seconds
        return fixed, hidden

    def _side_by_side_s(self, cluster: Cluster, side: list[Collective]) -> float:
        """The wait on collectives that run ``cluster.concurrent`` at once (gloo's DDP buckets, issued as each
        fills): the longest of those issued last (the step waits for each whole), those issued during the backward
        pass less the computation left after them (each whole, or their times shared over the threads, the
        longer), and all their bytes together on the one link, less the same computation."""
        if not side:
            return 0.0
        window = self.hide_window_s
        seconds = _each_seconds(side, cluster)
        early = [t for c, t in zip(side, seconds) if c.hideable]
        last = max((t for c, t in zip(side, seconds) if not c.hideable), default=0.0)
        shared = max(max(early, default=0.0), sum(early) / cluster.concurrent) - window
        together = _seconds(side[0], cluster, sum(c.nbytes for c in side)) - window  # one period: DDP's, every step
        return max(0.0, last, shared, together)

    def step_s(self, cluster: Cluster) -> float:
        return self.compute_s + self.exchange_s(cluster)

    def link_bytes(self, scope: str, cluster: Cluster) -> float:
        """Bytes per step (amortised) one ring edge carries on the ``scope`` link, each direction (a ring over
        several ranks of each node runs on the links inside the nodes too; one over one rank per node does not)."""

        def on_link(c: Collective) -> bool:
            return c.scope == scope or (scope == "intra" and c.scope == "inter" and c.world > cluster.nodes)

        return sum(edge_bytes(c.kind, c.nbytes, c.world) * c.parallel / c.every for c in self.collectives if on_link(c))

    def rank_bytes(self, group: str = "replicas") -> float:
        """Bytes per step (amortised, mean over ranks) each rank hands to the collectives of ``group``
        (:attr:`~hf_demo.ops.traffic.Collective.group`), counted as :class:`~hf_demo.exchange.transport.CommStats`
        counts them: ``"replicas"`` its ``bytes_sent`` (DeMo across the replicas; a data-parallel method's own),
        ``"shard"`` its ``intra_bytes_sent`` (HSDP: the shard group's, inside the node), ``"fsdp"`` FSDP2's."""
        if group not in GROUPS:
            raise ValueError(f"rank_bytes: group={group!r}; give one of {', '.join(GROUPS)}")
        return sum(sent_bytes(c.kind, c.nbytes, c.world) / c.every for c in self.collectives if c.group == group)


def _seconds(c: Collective, cluster: Cluster, nbytes: float | None = None) -> float:
    """Seconds per step (amortised over ``c.every``) of collective ``c`` on ``cluster`` (``nbytes``: in place of
    its own). Ranks running it side by side on one link (``parallel``) hand the link their sum, one fixed cost."""
    spans = c.scope == "inter" and c.world > cluster.nodes  # several ranks of each node in the ring
    inner, per_node = (cluster.intra, c.world // cluster.nodes) if spans else (None, 1)
    total = (c.nbytes if nbytes is None else nbytes) * c.parallel
    link = cluster.link(c.scope)
    return collective_seconds(c.kind, total, c.world, link, inner, per_node, cluster.overhead) / c.every


def _each_seconds(collectives: list[Collective], cluster: Cluster) -> list[float]:
    """:func:`_seconds` of each collective, computed once per distinct collective (DDP's equal buckets: a
    ten-trillion-parameter model has 1.6 million of them)."""
    found: dict[tuple, float] = {}
    out = []
    for c in collectives:
        key = (c.kind, c.nbytes, c.world, c.scope, c.every, c.parallel)
        if key not in found:
            found[key] = _seconds(c, cluster)
        out.append(found[key])
    return out


# ---------------------------------------------------------------- the methods
def ddp_adamw(cluster: Cluster, work: Workload) -> Estimate:
    n, pb = work.n_params, work.param_bytes
    return Estimate(
        "ddp-adamw",
        "DDP AdamW",
        ddp_collectives(work.shapes, cluster.world, cluster.flat_scope, buffers=work.ddp_buffers),
        work.compute_s + work.adamw_s,
        work.backward_fraction * work.compute_s,
        memory_bytes=2 * pb * n + 4 * n + 8 * n,  # parameters, gradients, DDP's buckets, AdamW's two moments
        quality=0,
        loss_cost=loss_cost("ddp-adamw"),
    )


def ddp_muon(cluster: Cluster, work: Workload) -> Estimate:
    """DDP's dense all-reduce with Muon's step (``torch.optim.Muon`` on the hidden matrices, AdamW on the rest):
    one Newton-Schulz run over the hidden matrices per step (``orthogonal_overhead``, refused without it)."""
    label = "DDP Muon"
    if work.orthogonal_overhead is None:
        return _refused("ddp-muon", label, 0, "its step is mostly Newton-Schulz: give --orthogonal-overhead")
    n, pb = work.n_params, work.param_bytes
    return Estimate(
        "ddp-muon",
        label,
        ddp_collectives(work.shapes, cluster.world, cluster.flat_scope, buffers=work.ddp_buffers),
        work.compute_s * (1 + work.orthogonal_overhead) + work.adamw_s,
        work.backward_fraction * work.compute_s,
        # parameters, gradients, DDP's buckets, at most AdamW's state: a momentum for every parameter, a second
        # moment for those AdamW steps (embeddings, head, norms: the shapes do not say which)
        memory_bytes=2 * pb * n + 4 * n + 8 * n,
        quality=0,
        loss_cost=loss_cost("ddp-muon"),
    )


def ddp_powersgd(cluster: Cluster, work: Workload) -> Estimate:
    n, pb, r = work.n_params, work.param_bytes, work.powersgd_rank
    factors = sum(4 * r * (s[0] + math.prod(s[1:])) for s in work.shapes if len(s) >= 2)
    return Estimate(
        "ddp-powersgd",
        f"DDP PowerSGD r{r}",
        powersgd_collectives(work.shapes, cluster.world, cluster.flat_scope, r, buffers=work.ddp_buffers),
        work.compute_s * (1 + work.powersgd_overhead) + work.adamw_s,
        0.0,  # the hook's P and Q all-reduces run one after the other at the end of the backward pass
        memory_bytes=2 * pb * n + 4 * n + 8 * n + 4 * n + factors,  # + error feedback and the factors
        quality=1,
        loss_cost=loss_cost("ddp-powersgd"),
    )


def _demo_memory(shapes, settings: DeMoSettings, param_bytes: int) -> float:
    """Parameters, gradients, the blocked fp32 momentum (twice at the step's peak: the working copy) and the
    rules' state, for a rank holding tensors of ``shapes``."""
    n, pb = sum(math.prod(s) for s in shapes), param_bytes
    momentum = sum(layout.nblocks * layout.bsize * 4 for layout in demo_layouts(shapes, settings))
    rule = update_rules.FACTS[settings.update_rule].state_bytes(shapes)
    local = 0
    if settings.sync_every > 1 or settings.comm_budget > 0:  # anchor, inner momentum, inner rule state
        local = pb * n + 4 * n + update_rules.FACTS[settings.inner_rule].state_bytes(shapes)
    return 2 * pb * n + 2 * momentum + rule + local


def _hsdp_memory(shapes, settings: DeMoSettings, param_bytes: int, devices_per_node: int) -> float:
    """HSDP: what :func:`_demo_memory` counts for the node's first (largest) shard of every tensor, plus the
    largest tensor unsharded, its parameters and gradient (FSDP2 gathers a layer whole while it computes; the
    planner knows tensors, not layers)."""
    largest = max(math.prod(s) for s in shapes)
    return _demo_memory(shard_shapes(shapes, devices_per_node, 0), settings, param_bytes) + 2 * param_bytes * largest


# docs/results.md's order
PRESET_QUALITY = {"balanced": 3, "many_nodes": 3, "lean": 5, "from_scratch_few_bytes": 5, "extreme": 7}

RESULTS = "docs/results.md"
SCRATCH = "0.46M Llama from scratch, 1000 steps"
LOSS_COST = {  # method -> (its loss against DDP-AdamW or every-step DeMo as measured, the section of RESULTS)
    "ddp-adamw": ("the reference the others are measured against", "summary"),
    "ddp-powersgd": (f"1.107x DDP-AdamW's held-out loss ({SCRATCH})", "training-from-scratch"),
    "ddp-muon": (f"0.862x DDP-AdamW's held-out loss ({SCRATCH})", "training-from-scratch-against-ddp-muon"),
    "demo": (
        "2.2957 against DDP-AdamW's 2.2927 held-out loss (1.001x; SmolLM2-135M fine-tune, 20 steps, 3 seeds)",
        "against-ddp-adamw-and-powersgd-on-a-fine-tune",
    ),
    "demo-hsdp": ("not measured yet: the defaults' exchange, each rank's shard between nodes", "many-workers"),
    "demo-hsdp-from_scratch": (
        "the from_scratch preset's (its loss is measured flat; on HSDP each matrix is orthogonalised whole, the same "
        "steps)",
        "training-from-scratch-against-ddp-muon",
    ),
    "demo-all_reduce": (
        "not measured at top-32; the union all-reduce at top-128 (many_nodes): -9.0% (2 workers) to +0.72% "
        "(16 workers) final held-out loss against the all-gather",
        "many-workers",
    ),
    "demo-overlap": (
        "+14.9% held-out loss at lr 1e-3, +2.6% at 5e-4, +1.8% at 2.5e-4 against every-step DeMo (0.46M Llama, "
        "300 steps)",
        "overlap",
    ),
    "demo-sync8": (
        "not measured with the defaults; sync_every=8 with sign values and top-96: within 1.2% of every-step DeMo "
        "at 300 steps, +20% at 1000 steps",
        "fewer-messages-and-bf16-weights",
    ),
    "demo-balanced": ("not measured (sign values at top-64; lean, top-32: 1.036x DDP-AdamW)", "training-from-scratch"),
    "demo-lean": (f"1.036x DDP-AdamW's held-out loss ({SCRATCH})", "training-from-scratch"),
    "demo-extreme": (
        "not measured (sign values at top-4: far fewer coefficients than lean's 1.036x DDP-AdamW)",
        "training-from-scratch",
    ),
    "demo-many_nodes": (
        "-9.0% (2 workers) to +0.72% (16 workers) final held-out loss against the all-gather (0.46M Llama, 300 steps)",
        "many-workers",
    ),
    "demo-from_scratch": (
        "1.016x DDP-Muon's and 0.875x DDP-AdamW's held-out loss from scratch; 1.013x DDP-AdamW's on the SmolLM2 "
        "fine-tune",
        "training-from-scratch-against-ddp-muon",
    ),
    "demo-from_scratch_few_bytes": (
        "1.057x the from_scratch preset's held-out loss after 1000 steps (0.46M Llama from scratch, 2 ranks, 3 seeds) "
        "for 6.9x fewer bytes; with the mean change x 1, 1.008x after 3000 steps and 1.032x on the 3.3M Llama",
        "fewer-bytes-with-local-muon-steps",
    ),
}
BUDGET_LOSS = (
    "not measured in this tier ({tier}); the nearest measured: sync_every=8 with sign values and top-96, within "
    "1.2% of every-step DeMo at 300 steps and +20% at 1000 steps",
    "fewer-messages-and-bf16-weights",
)


def loss_cost(method: str, tier: str | None = None) -> str:
    """The measured loss cost of ``method`` with its source, or a plain "no figure"."""
    text, section = LOSS_COST.get(method, ("no figure in docs/results.md", "summary"))
    if tier is not None:
        text, section = BUDGET_LOSS[0].format(tier=tier), BUDGET_LOSS[1]
    return f"{text} ({RESULTS}#{section})"


DEMO_VARIANTS = {  # name -> (label, settings on top of the workload's, quality)
    "demo": ("DeMo (defaults: all_gather)", {}, 2),
    "demo-hsdp": ("HSDP-DeMo (hf_demo.fsdp: FSDP2 in a node, DeMo between)", {"layout": "hsdp"}, 2),
    "demo-hsdp-from_scratch": (
        "HSDP-DeMo, preset from_scratch (local Muon steps)",
        {"layout": "hsdp", "preset": "from_scratch"},
        PRESET_QUALITY.get("from_scratch", 4),
    ),
    "demo-all_reduce": ("DeMo exchange=all_reduce", {"exchange": "all_reduce"}, 4),
    "demo-overlap": ("DeMo overlap", {"overlap": True}, 5),
    "demo-sync8": ("DeMo sync_every=8", {"sync_every": 8}, 6),
    "demo-budget": ("DeMo budget policy (comm_budget=0.15)", {"comm_budget": 0.15}, 6),
    **{
        f"demo-{name}": (f"DeMo preset {name}", {"preset": name}, PRESET_QUALITY.get(name, 4))
        for name in PRESETS  # every preset of hf_demo.settings
    },
}


LAYOUTS = ("flat", "hsdp")  # a variant's "layout": DeMo between every rank, or HSDP (hf_demo.fsdp)


def demo_settings(variant: str, work: Workload) -> DeMoSettings:
    chosen = {**work.demo_settings, **DEMO_VARIANTS[variant][1]}
    chosen.pop("layout", None)
    return DeMoSettings.resolve(chosen.pop("preset", None), **chosen)


def demo_layout(variant: str) -> str:
    return DEMO_VARIANTS[variant][1].get("layout", "flat")


def demo_method(variant: str):
    label, _, quality = DEMO_VARIANTS[variant]

    def estimate(cluster: Cluster, work: Workload) -> Estimate | None:
        try:
            settings = demo_settings(variant, work)
        except ValueError as exc:  # a combination DeMo refuses (e.g. overlap with the workload's settings)
            return _refused(variant, label, quality, str(exc))
        layout = demo_layout(variant)
        if layout == "hsdp" and cluster.devices_per_node < 2:
            return None  # one device per node: nothing to shard, the same as the flat layout
        refusal = _sharded_refusal(settings) if layout == "hsdp" else None
        if refusal:
            return _refused(variant, label, quality, refusal)
        try:
            return demo_estimate(variant, label, quality, settings, cluster, work, layout)
        except ValueError as exc:  # the exchange refuses this variant's settings (e.g. all_reduce with sign)
            return _refused(variant, label, quality, str(exc))

    return estimate


def _sharded_refusal(settings: DeMoSettings) -> str | None:
    """Why DeMo refuses these settings on FSDP2-sharded parameters (the ``unshardable_rule`` refusal that
    :func:`hf_demo.topology.sharded.refuse_unshardable` raises), or None."""
    refused = {settings.update_rule, settings.inner_rule} & set(update_rules.WHOLE_STATE)
    return refusals.text("unshardable_rule", rule=min(refused)) if refused else None


def demo_estimate(
    variant: str,
    label: str,
    quality: int,
    settings: DeMoSettings,
    cluster: Cluster,
    work: Workload,
    layout: str = "flat",
) -> Estimate:
    """DeMo with ``settings`` on this cluster in ``layout`` (the budget policy: in the tier it settles in)."""
    d = cluster.devices_per_node
    hsdp = layout == "hsdp"
    compute = demo_compute_s(settings, work, settings.sync_every, d if hsdp else 1)
    est = Estimate(
        variant,
        label,
        demo_collectives(work.shapes, settings, cluster.nodes, d, layout=layout, param_bytes=work.param_bytes),
        compute,
        # overlap: the payload of step t moves during step t+1's computation; HSDP: FSDP2's collectives run
        # under the forward and backward passes
        compute if settings.overlap or hsdp else 0.0,
        _hsdp_memory(work.shapes, settings, work.param_bytes, d)
        if hsdp
        else _demo_memory(work.shapes, settings, work.param_bytes),
        quality,
        settings.as_dict(),
        "hf_demo.fsdp.shard_model(model, hsdp_mesh()); hf_demo.create_optimizer(model, ..., device_mesh=mesh)"
        if hsdp
        else "",
    )
    est.loss_cost = loss_cost(variant)
    if settings.comm_budget > 0:
        return _settle_budget(est, settings, cluster, work, layout)
    est.note = "; ".join(filter(None, (est.note, orthogonal_note(settings, work, settings.sync_every))))
    return est


def orthogonalisations(settings: DeMoSettings, sync_every: int) -> int:
    """Newton-Schulz runs of each hidden matrix per step: one for local Muon steps (``inner_rule="orthogonal"``
    with ``sync_every > 1``: every step, synchronising or not, takes one) or an orthogonal update rule, two where
    each rank's gradient is orthogonalised as well before it enters the momentum (``orthogonal_signal``,
    ``muon_signal``)."""
    if sync_every > 1:
        return update_rules.FACTS[settings.inner_rule].ns_update
    return update_rules.FACTS[settings.update_rule].ns_runs


def demo_compute_s(settings: DeMoSettings, work: Workload, sync_every: int, shards: int = 1) -> float:
    """Forward+backward, DeMo's own computation (at synchronisations only: every ``sync_every`` steps) and the
    rules' Newton-Schulz runs (where known), per step on one device. ``shards`` > 1 (HSDP): each matrix is
    orthogonalised whole by one rank of the node, the work balanced as :func:`hf_demo.topology.owners.owners`
    hands it out; a device does its most loaded rank's share. The shares are of every matrix of the workload, the
    embeddings and the head among them, which no rank orthogonalises (the planner's shapes do not say which they
    are): an upper bound on a device's share."""
    orthogonal = orthogonalisations(settings, sync_every) * (work.orthogonal_overhead or 0.0)
    if orthogonal and shards > 1:
        load = owners.loads([s for s in work.shapes if len(s) >= 2], shards)
        orthogonal *= max(load) / max(1, sum(load))
    return work.compute_s * (1 + work.demo_overhead / sync_every + orthogonal)


def orthogonal_note(settings: DeMoSettings, work: Workload, sync_every: int) -> str:
    """What the step's computation leaves out: the Newton-Schulz runs when their cost was not given."""
    runs = orthogonalisations(settings, sync_every)
    if runs == 0 or work.orthogonal_overhead is not None:
        return ""
    return (
        f"step without its {runs} Newton-Schulz run(s) per hidden matrix: give --orthogonal-overhead "
        "(their seconds / forward+backward's)"
    )


def _refused(variant, label, quality, why) -> Estimate:
    return Estimate(variant, label, [], math.inf, 0.0, math.inf, quality, None, f"refused: {why}")


def _settle_budget(est: Estimate, settings: DeMoSettings, cluster: Cluster, work: Workload, layout: str) -> Estimate:
    """The tier the budget policy settles in on this link: the first (most bytes) whose predicted time on the
    exchange is within the budget, the last tier when none is (the policy's own tiers, hf_demo.optim.policy)."""
    tiers = policies.tiers(settings.value_format, settings.exchange, settings.sync_every, settings.policy_sync_every)
    index, tier = 0, tiers[0]
    for index, tier in enumerate(tiers):  # noqa: B007 - the tier it stops at is the answer
        tier_settings = (tier.value_format, tier.topk_divisor, tier.sync_every)
        est.collectives = demo_collectives(
            work.shapes, settings, cluster.nodes, cluster.devices_per_node, *tier_settings, layout, work.param_bytes
        )
        est.compute_s = demo_compute_s(
            settings, work, tier.sync_every, cluster.devices_per_node if layout == "hsdp" else 1
        )
        if est.exchange_s(cluster) <= settings.comm_budget * est.step_s(cluster):
            break
    est.note = (
        f"settles in tier {index} of {len(tiers) - 1} ({tier.value_format} values, top-k/{tier.topk_divisor}, "
        f"sync every {tier.sync_every})"
    )
    left_out = orthogonal_note(settings, work, tier.sync_every)
    if index > 0:  # tier 0 is the configured settings
        est.loss_cost = loss_cost(est.method, est.note.removeprefix("settles in "))
    est.note += f"; {left_out}" if left_out else ""
    return est


METHODS = {
    "ddp-adamw": ddp_adamw,
    "ddp-muon": ddp_muon,
    "ddp-powersgd": ddp_powersgd,
    **{v: demo_method(v) for v in DEMO_VARIANTS},
}
