"""Why DeMo's held-out loss falls behind DDP-Muon's more as the number of ranks W grows (issue 53, item 1).

For each configuration (``--configs``) and each W (``--worlds``), W real gloo ranks (forked, one torch thread
each, ``benchlib.ranks.run_ranks``) train the job of ``convergence.py`` (``benchlib.toy``'s byte Llama on the
stdlib, the same shards, batches, schedule and optimizer as ``convergence.py --methods demo --demo-configs ...``:
bit for bit the same run) and measure, beside the real ``hf_demo.DeMo`` steps and without changing them:

- **the DDP-Muon reference**: a shadow ``torch.optim.Muon`` + AdamW (``benchlib.baselines.ddp_muon``, its lr
  ``--muon-lr`` on the same schedule) fed every step with the ranks' mean gradient (each rank's gradient at its
  own parameters, all-reduced): what DDP-Muon would apply from the same batches along DeMo's trajectory (its
  update does not depend on the parameters: no weight decay). Summed over each synchronisation interval of H
  steps it is compared with DeMo's applied change over the interval (``anchor_before - anchor_after``): cosine,
  norm ratio;
- **the decomposition of that change**: each rank's own change since the last synchronisation (the
  pseudo-gradient DeMo compresses, recorded where ``local_steps.pseudo_gradient`` makes it), their dense mean (what
  an uncompressed average of the local phases would apply), and DeMo's compressed mean: the cosines and norm
  ratios of each against the reference and against each other, the ranks' mean pairwise cosine;
- **top-k's share of the energy**: at each synchronisation, the share of each rank's error-feedback buffer
  (pseudo-gradient plus residue, DCT domain) that its top-k keeps, the share of the ranks' *mean* buffer's
  energy at the positions some rank sent, and how many distinct positions the ranks sent (1 = no two ranks
  chose the same coefficient, 1/W = all chose the same);
- **drift inside a local phase**: after every step, the spread of the ranks' changes since the anchor,
  ``sqrt(mean_r |d_r - mean d|^2) / sqrt(mean_r |d_r|^2)`` (0: every rank moved alike; sqrt(1 - 1/W): unrelated);
- **the effective learning rate**: per-step RMS of the applied change of the hidden matrices over the interval,
  divided by 0.2 (Muon's ``match_rms_adamw`` RMS per unit lr), against the same of the reference.

Benchmark-only levers (a configuration's ``name:key=value,...``; other keys go to DeMo as in ``convergence.py``):
``lr_scale=E``: DeMo's lr times (W/2)^E; ``outer=ortho``: at each synchronisation the mean change of every hidden
matrix is orthogonalised (Newton-Schulz, as Muon's step) and scaled back to its own Frobenius norm before the
ranks apply it (:func:`orthogonal_outer`, this forked rank's process only).

    python benchmarks/diagnose_scaling.py --worlds 2,4,8 --seeds 0 --tag w248
    python benchmarks/diagnose_scaling.py --tag w248 --report-only

Writes ``<results-dir>/diagnose_<tag>.{json,md,png}``; ``convergence.py``'s DDP-Muon runs
(``convergence_ranks300_w{W}_{shards}.json``, same seed) give the loss ratios where they exist.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import convergence as conv  # noqa: E402
from benchlib import patches, toy  # noqa: E402
from benchlib.baselines import ddp_muon  # noqa: E402
from benchlib.ranks import expect_ok, run_ranks  # noqa: E402

P = "decay=0.999,format=sign,inner_rule=orthogonal"
CONFIGS = {  # the presets as convergence.py's ranks300 runs wrote them (the same groups and bits), the mean change
    # applied as it is (outer lr 1): add outer_lr_scaling=sqrt_world for the presets' own (x sqrt(W/2))
    "from_scratch": f"sync_every=2,topk=24,chunk=32,{P}",
    "from_scratch_few_bytes": f"sync_every=4,topk=16,chunk=64,{P}",
}
MUON_RMS = 0.2  # torch Muon's match_rms_adamw: update RMS per unit lr
METRICS = (  # (key, what it is) per synchronisation
    ("cos_demo_ref", "cos(DeMo's applied change, DDP-Muon's)"),
    ("norm_demo_ref", "|DeMo's change| / |DDP-Muon's|"),
    ("cos_mean_ref", "cos(dense mean of the ranks' changes, DDP-Muon's)"),
    ("norm_mean_ref", "|dense mean of the ranks' changes| / |DDP-Muon's|"),
    ("cos_rank_ref", "cos(one rank's change, DDP-Muon's), mean over ranks"),
    ("norm_rank_ref", "|one rank's change| / |DDP-Muon's|, RMS over ranks"),
    ("cos_demo_mean", "cos(DeMo's change, the dense mean)"),
    ("norm_demo_mean", "|DeMo's change| / |the dense mean|"),
    ("pair_cos", "mean pairwise cosine of the ranks' changes"),
    ("drift", "spread of the ranks' changes at the synchronisation"),
    ("kept_rank", "energy share of a rank's buffer its top-k keeps (mean over ranks)"),
    ("kept_mean", "energy share of the ranks' mean buffer at the positions sent"),
    ("distinct", "distinct positions sent / (W x positions per rank)"),
    ("eff_lr_demo", "DeMo's per-step update RMS / 0.2 (hidden matrices)"),
    ("cos_prev_demo", "cos(DeMo's applied change, its change at the previous synchronisation), hidden matrices"),
    ("cos_prev_ref", "cos(DDP-Muon's change over the interval, over the previous interval), hidden matrices"),
    ("eff_lr_ref", "DDP-Muon's per-step update RMS / 0.2 (hidden matrices)"),
)


def parse_config(spec: str) -> tuple[str, str, dict]:
    """``name[:key=value,...]`` -> (label, DeMo overrides for ``convergence.parse_method``, benchmark-only keys)."""
    name, _, extra = spec.partition(":")
    if name not in CONFIGS:
        raise SystemExit(f"diagnose_scaling.py: unknown configuration {name!r}; expected one of {sorted(CONFIGS)}")
    own = {}
    rest = []
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        if key == "lr_scale":
            own[key] = float(value)
        elif key == "outer":
            if value != "ortho":
                raise SystemExit(f"diagnose_scaling.py: outer={value!r}: the one outer lever is outer=ortho")
            own[key] = value
        else:
            rest.append(item)
    overrides = ",".join([CONFIGS[name], *rest])
    return spec, overrides, own


# ------------------------------------------------------------------ recording inside DeMo's step
class Recorder:
    """Wraps ``functional.select`` and ``local_steps.pseudo_gradient`` (this forked rank's process only) to keep
    what a synchronisation compresses: each bucket's buffer and chosen positions, each parameter's change."""

    def __init__(self):
        from hf_demo import compression as functional
        from hf_demo.optim import local_steps

        self.selects, self.changes = [], {}
        real_select, real_pseudo = functional.select, local_steps.pseudo_gradient

        def select(momentum, k, scratch=None):
            idx, values = real_select(momentum, k, scratch)
            self.selects.append((momentum.detach().clone(), idx))
            return idx, values

        def pseudo(anchor, after):
            out = real_pseudo(anchor, after)
            self.changes[id(anchor)] = out.detach().clone()
            return out

        functional.select, local_steps.pseudo_gradient = select, pseudo

    def clear(self):
        self.selects, self.changes = [], {}


def orthogonal_outer(hidden_ids: set[int]) -> None:
    """Patch ``local_steps.commit_sync``: the mean change of a hidden matrix, orthogonalised and given its own
    Frobenius norm back, is what every rank applies (the same bits on every rank: the same input)."""
    from hf_demo.optim.update_rules import matrix_view, newton_schulz

    def orthogonalise(param, state, update, outer_lr, m_in, rule_state):
        if id(param) in hidden_ids and update.dim() >= 2:
            ortho = newton_schulz(matrix_view(update), 5)
            scale = update.norm() / ortho.norm().clamp(min=1e-12)
            update = (ortho * scale).reshape(update.shape)
        return param, state, update, outer_lr, m_in, rule_state

    patches.wrap_commit_sync(orthogonalise)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def all_mean(x, world: int):
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x)
    return x / world


def cos(a, b) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na and nb else float("nan")


def ratio(a, b) -> float:
    nb = float(b.norm())
    return float(a.norm()) / nb if nb else float("nan")


def change_metrics(d_demo, d_rank, d_ref, world: int, mask) -> dict:
    """The interval's metrics on the entries ``mask`` selects (collectives: every rank calls it alike)."""
    d_demo, d_rank, d_ref = d_demo[mask], d_rank[mask], d_ref[mask]
    d_mean = all_mean(d_rank, world)
    sq = all_mean(torch.stack([d_rank.square().sum(), torch.tensor(cos(d_rank, d_ref))]), world)
    mean_sq, mean_cos = float(sq[0]), float(sq[1])  # mean over ranks of |d_r|^2, of cos(d_r, ref)
    mean_norm2 = float(d_mean.square().sum())
    pair = (world * world * mean_norm2 - world * mean_sq) / ((world - 1) * world * mean_sq) if world > 1 else 1.0
    ref = float(d_ref.norm())
    return dict(
        cos_demo_ref=cos(d_demo, d_ref),
        norm_demo_ref=ratio(d_demo, d_ref),
        cos_mean_ref=cos(d_mean, d_ref),
        norm_mean_ref=ratio(d_mean, d_ref),
        cos_rank_ref=mean_cos,
        norm_rank_ref=math.sqrt(mean_sq) / ref if ref else float("nan"),
        cos_demo_mean=cos(d_demo, d_mean),
        norm_demo_mean=ratio(d_demo, d_mean),
        pair_cos=pair,
        drift=math.sqrt(max(0.0, mean_sq - mean_norm2) / mean_sq) if mean_sq else float("nan"),
    )


def energy_metrics(selects, world: int) -> dict:
    """Top-k's share of each rank's buffer and of the ranks' mean buffer, over every bucket (collectives)."""
    kept = total = kept_mean = total_mean = distinct = sent = 0.0
    for m, idx in selects:
        kept += float(m.gather(1, idx).square().sum())
        total += float(m.square().sum())
        mean = all_mean(m, world)
        picked = torch.zeros_like(m).scatter_(1, idx, 1.0)
        union = all_mean(picked, world) > 0
        kept_mean += float(mean[union].square().sum())
        total_mean += float(mean.square().sum())
        distinct += float(union.sum())
        sent += world * idx.numel()
    shares = all_mean(torch.tensor([kept / total if total else float("nan")]), world)
    return dict(
        kept_rank=float(shares[0]),
        kept_mean=kept_mean / total_mean if total_mean else float("nan"),
        distinct=distinct / sent if sent else float("nan"),
    )


def spread(d_rank, world: int) -> float:
    """The spread of the ranks' changes since the anchor (collectives)."""
    d_mean = all_mean(d_rank, world)
    mean_sq = float(all_mean(torch.tensor([float(d_rank.square().sum())]), world)[0])
    return math.sqrt(max(0.0, mean_sq - float(d_mean.square().sum())) / mean_sq) if mean_sq else 0.0


class Reference:
    """DDP-Muon's update from the ranks' mean gradient: a shadow model stepped by ``ddp_muon``."""

    def __init__(self, model, lr: float, cfg):
        self.model = copy.deepcopy(model)
        self.params = list(self.model.parameters())
        self.opt = ddp_muon(self.model, lr)
        self.cfg = cfg

    def step(self, grads, world: int, step: int):
        """DDP-Muon's change (before - after, flat) for the ranks' mean of ``grads`` at ``step``."""
        lr = conv.lr_at(self.cfg, step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        mean = all_mean(flat(grads), world)
        start = 0
        for p in self.params:
            p.grad = mean[start : start + p.numel()].view_as(p).clone()
            start += p.numel()
        before = flat(self.params)
        self.opt.step()
        return before - flat(self.params)


def build(rank: int, world: int, job: dict):
    """(data, model, DeMo optimizer, its RunConfig, the reference) of one rank, as ``convergence.py`` builds them."""

    label, overrides, own = parse_config(job["config"])
    lr = job["lr"] * (world / 2) ** own.get("lr_scale", 0.0)
    cfg = conv.RunConfig(
        method=conv.parse_method("demo:" + overrides),
        lr=lr,
        seed=job["seed"],
        steps=job["steps"],
        world=world,
        shards=job["shards"],
        **job["model"],
    )
    data, model = conv.rank_setup(cfg, rank)
    _, opt, _ = conv._build_optimizer(cfg, model, sum(p.numel() for p in model.parameters()))
    if own.get("outer") == "ortho":
        orthogonal_outer({id(p) for g in opt.param_groups if g.get("inner_rule") == "orthogonal" for p in g["params"]})
    ref_cfg = dataclasses.replace(cfg, lr=job["muon_lr"])
    return data, model, opt, cfg, Reference(model, job["muon_lr"], ref_cfg)


def hidden_mask(model, opt):
    hidden = {id(p) for g in opt.param_groups if g.get("inner_rule") == "orthogonal" for p in g["params"]}
    return torch.cat([torch.full((p.numel(),), id(p) in hidden) for p in model.parameters()])


def _rank(rank: int, world: int, job: dict) -> dict:
    """One rank's run; rank 0 returns every synchronisation's metrics, the drift by step and the held-out losses."""
    from hf_demo.optim.local_steps import is_sync_step

    data, model, opt, cfg, ref = build(rank, world, job)
    params, rec = list(model.parameters()), Recorder()
    masks = {"all": torch.ones(sum(p.numel() for p in params), dtype=torch.bool), "hidden": hidden_mask(model, opt)}
    H = int(cfg.method.overrides["sync_every"])
    anchor, d_ref, lrs, syncs, drift, evals = flat(params), 0.0, [], [], [], []
    prev = None  # (DeMo's change, DDP-Muon's) over the last interval, hidden matrices: what an outer momentum adds up
    for step in range(cfg.steps):
        lr = conv.lr_at(cfg, step)
        conv.set_lr(opt, lr)
        batch = data.next_batch()
        model(input_ids=batch, labels=batch).loss.backward()
        d_ref = d_ref + ref.step([p.grad for p in params], world, step)
        lrs.append((lr, conv.lr_at(ref.cfg, step)))
        rec.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = flat(params)
        if not is_sync_step(H, step):
            drift.append((step + 1, (step % H) + 1, spread(anchor - now, world)))
            continue
        d_rank = flat(rec.changes[id(opt.state[p]["anchor"])] for p in params)
        row = dict(step=step + 1, lr=sum(a for a, _ in lrs) / len(lrs), muon_lr=sum(b for _, b in lrs) / len(lrs))
        for name, mask in masks.items():
            got = change_metrics(anchor - now, d_rank, d_ref, world, mask)
            row.update({f"{k}_{name}" if name != "all" else k: v for k, v in got.items()})
        row.update(energy_metrics(rec.selects, world))
        n_h = int(masks["hidden"].sum())
        row["eff_lr_demo"] = float((anchor - now)[masks["hidden"]].norm()) / math.sqrt(n_h) / H / MUON_RMS
        row["eff_lr_ref"] = float(d_ref[masks["hidden"]].norm()) / math.sqrt(n_h) / H / MUON_RMS
        now_pair = ((anchor - now)[masks["hidden"]], d_ref[masks["hidden"]])
        row["cos_prev_demo"] = cos(now_pair[0], prev[0]) if prev else float("nan")
        row["cos_prev_ref"] = cos(now_pair[1], prev[1]) if prev else float("nan")
        prev = now_pair
        drift.append((step + 1, H, row["drift"]))
        syncs.append(row)
        anchor, d_ref, lrs = now, 0.0, []
        if (step + 1) % job["eval_every"] == 0 or step + 1 == cfg.steps:
            evals.append((step + 1, toy.evaluate(model, data.eval) if rank == 0 else None))
    return dict(syncs=syncs, drift=drift, evals=evals, lr=cfg.lr, sync_every=H) if rank == 0 else {}


# ------------------------------------------------------------------ runs, report
def run_one(job: dict, world: int) -> dict:
    out = expect_ok(run_ranks(_rank, world, job, timeout=job["timeout"], collective_timeout=600))[0]
    return dict(job, world=world, key=key(job, world), **out)


def key(job: dict, world: int) -> str:
    return json.dumps([job["config"], world, job["seed"], job["steps"], job["lr"], job["muon_lr"], job["shards"]])


def summary(run: dict, after: int) -> dict:
    """Each metric's mean over the synchronisations after step ``after`` (the warm-up), and the final loss."""
    rows = [r for r in run["syncs"] if r["step"] > after]
    out = {k: statistics.mean(r[k] for r in rows) for k in rows[0] if k not in ("step",)}
    inner = [d for s, pos, d in run["drift"] if s > after and pos < run["sync_every"]]
    out["drift_inner"] = statistics.mean(inner) if inner else float("nan")
    out["final_loss"] = run["evals"][-1][1]
    return out


def muon_loss(results: Path, world: int, shards: str, seed: int, steps: int):
    """DDP-Muon's final held-out loss from ``convergence.py``'s runs of the same job (None: not run)."""
    path = results / f"convergence_ranks{steps}_w{world}_{shards}.json"
    if not path.exists():
        return None
    for r in json.loads(path.read_text()):
        if r.get("ok") and r["kind"] == "muon" and r["seed"] == seed:
            return r["final_loss"]
    return None


def seed_stats(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "–"
    f = ".3g" if abs(xs[0]) < 0.01 else ".3f"
    if len(xs) == 1:
        return f"{xs[0]:{f}}"
    return f"{statistics.mean(xs):{f}} ± {statistics.stdev(xs):{f}}"


TABLE = (
    ("cos_demo_ref_hidden", "cos(DeMo, Muon)"),
    ("norm_demo_ref_hidden", "norm DeMo/Muon"),
    ("cos_mean_ref_hidden", "cos(dense mean, Muon)"),
    ("norm_mean_ref_hidden", "norm dense mean/Muon"),
    ("norm_rank_ref_hidden", "norm one rank/Muon"),
    ("pair_cos_hidden", "ranks' pairwise cos"),
    ("cos_demo_mean_hidden", "cos(DeMo, dense mean)"),
    ("norm_demo_mean_hidden", "norm DeMo/dense mean"),
    ("kept_rank", "energy kept, a rank"),
    ("kept_mean", "energy kept, mean buffer"),
    ("distinct", "distinct positions"),
    ("drift_inner", "drift inside phase"),
    ("drift", "drift at sync"),
    ("eff_lr_demo", "eff. lr DeMo"),
    ("eff_lr_ref", "eff. lr Muon"),
    ("cos_prev_demo", "cos(DeMo, its last)"),
    ("cos_prev_ref", "cos(Muon, its last)"),
    ("final_loss", "held-out loss"),
    ("muon_ratio", "/ DDP-Muon"),
)


def table(runs: list[dict], results: Path, after: int) -> list[str]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        s = summary(r, after)
        m = muon_loss(results, r["world"], r["shards"], r["seed"], r["steps"])
        s["muon_ratio"] = s["final_loss"] / m if m else None
        groups.setdefault((r["config"], r["world"]), []).append(s)
    head = "| configuration | W | seeds | " + " | ".join(label for _, label in TABLE) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(TABLE)]
    for (config, world), ss in sorted(groups.items()):
        cells = [seed_stats([s.get(k) for s in ss]) for k, _ in TABLE]  # older runs lack the newer metrics
        lines.append(f"| {config} | {world} | {len(ss)} | " + " | ".join(cells) + " |")
    return lines


PANELS = (
    (
        "cosine with DDP-Muon's change (hidden matrices)",
        ("cos_demo_ref_hidden", "cos_mean_ref_hidden", "cos_rank_ref_hidden"),
    ),
    (
        "norm / DDP-Muon's change (hidden matrices)",
        ("norm_demo_ref_hidden", "norm_mean_ref_hidden", "norm_rank_ref_hidden"),
    ),
    ("ranks' agreement", ("pair_cos_hidden", "drift", "distinct")),
    ("top-k's energy share", ("kept_rank", "kept_mean", "norm_demo_mean_hidden")),
)
NAMES = {
    "cos_demo_ref_hidden": "DeMo's applied change",
    "cos_mean_ref_hidden": "dense mean of ranks' changes",
    "cos_rank_ref_hidden": "one rank's change",
    "norm_demo_ref_hidden": "DeMo's applied change",
    "norm_mean_ref_hidden": "dense mean of ranks' changes",
    "norm_rank_ref_hidden": "one rank's change",
    "pair_cos_hidden": "pairwise cos of ranks' changes",
    "drift": "drift at the sync",
    "distinct": "distinct positions / sent",
    "kept_rank": "kept of a rank's buffer",
    "kept_mean": "kept of the mean buffer",
    "norm_demo_mean_hidden": "|DeMo| / |dense mean|",
}


def plot(runs: list[dict], results: Path, after: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in runs))
    fig, axes = plt.subplots(len(configs), len(PANELS) + 1, figsize=(4.2 * (len(PANELS) + 1), 3.6 * len(configs)))
    axes = [axes] if len(configs) == 1 else axes
    for row, config in zip(axes, configs):
        mine = [r for r in runs if r["config"] == config]
        worlds = sorted({r["world"] for r in mine})
        sums = {w: [summary(r, after) for r in mine if r["world"] == w] for w in worlds}
        for ax, (title, keys) in zip(row, PANELS):
            for k in keys:
                ax.plot(worlds, [statistics.mean(s[k] for s in sums[w]) for w in worlds], "o-", label=NAMES[k])
            ax.set(title=f"{config}: {title}", xlabel="ranks W", xscale="log")
            ax.set_title(ax.get_title(), fontsize=8)
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        ax = row[-1]
        for w in worlds:
            r = next(r for r in mine if r["world"] == w)
            ax.plot(
                [s["step"] for s in r["syncs"]], [s["norm_demo_ref_hidden"] for s in r["syncs"]], lw=0.8, label=f"W={w}"
            )
        ax.set(title=f"{config}: |DeMo| / |Muon| by step (seed {mine[0]['seed']})", xlabel="step")
        ax.set_title(ax.get_title(), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_norms(runs: list[dict], after: int, path: Path) -> None:
    """The decisive figure: per configuration, the norm and the cosine of DeMo's change against DDP-Muon's, and its
    useful part (norm x cosine), against W, with ``c / sqrt(W)`` through the W = 2 point (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        worlds = sorted({r["world"] for r in mine})
        s = {w: [summary(r, after) for r in mine if r["world"] == w] for w in worlds}
        norm = [statistics.mean(x["norm_demo_ref_hidden"] for x in s[w]) for w in worlds]
        cosine = [statistics.mean(x["cos_demo_ref_hidden"] for x in s[w]) for w in worlds]
        (line,) = a1.plot(worlds, norm, "o-", label=f"{config}: |DeMo| / |Muon|")
        a1.plot(worlds, [norm[0] * math.sqrt(worlds[0] / w) for w in worlds], ":", color=line.get_color(), lw=0.8)
        a2.plot(worlds, cosine, "o-", color=line.get_color(), label=f"{config}: cos")
        a2.plot(
            worlds, [n * c for n, c in zip(norm, cosine)], "s--", color=line.get_color(), label=f"{config}: norm x cos"
        )
    a1.set(
        xlabel="ranks W", xscale="log", ylabel="ratio", title="DeMo's applied change / DDP-Muon's (dotted: 1/sqrt(W))"
    )
    a2.set(xlabel="ranks W", xscale="log", title="direction, and the part along DDP-Muon's change")
    for ax in (a1, a2):
        ax.set_xticks(sorted({r["world"] for r in runs}), [str(w) for w in sorted({r["world"] for r in runs})])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="from_scratch;from_scratch_few_bytes", help="name[:key=value...];...")
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-2, help="DeMo's lr (the presets' best on 2 ranks)")
    p.add_argument("--muon-lr", type=float, default=8e-3, help="the reference's lr (DDP-Muon's best)")
    p.add_argument("--shards", choices=toy.SHARDS, default="interleaved")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=344)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--warmup-skip", type=int, default=20, help="the table averages the syncs after this step")
    p.add_argument("--tag", default="w248")
    p.add_argument("--results-dir", default=str(conv.RESULTS))
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--report-only", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    results = Path(a.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"diagnose_{a.tag}.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    model = dict(
        hidden=a.hidden,
        intermediate=a.intermediate,
        layers=a.layers,
        heads=a.heads,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        eval_batches=a.eval_batches,
    )
    if not a.report_only:
        done = {r["key"] for r in runs}
        for config in filter(None, a.configs.split(";")):
            parse_config(config)  # an unknown name fails here, before any rank starts
        for config in filter(None, a.configs.split(";")):
            for world in (int(w) for w in a.worlds.split(",")):
                for seed in a.seeds:
                    job = dict(
                        config=config,
                        seed=seed,
                        steps=a.steps,
                        lr=a.lr,
                        muon_lr=a.muon_lr,
                        shards=a.shards,
                        eval_every=a.eval_every,
                        model=model,
                        timeout=a.timeout,
                    )
                    if key(job, world) in done:
                        continue
                    runs.append(run_one(job, world))
                    path.write_text(json.dumps(runs))
                    s = summary(runs[-1], a.warmup_skip)
                    print(
                        f"[diagnose] {config} W={world} seed {seed}: loss {s['final_loss']:.4f}, cos "
                        f"{s['cos_demo_ref_hidden']:.3f}, norm {s['norm_demo_ref_hidden']:.3f}",
                        flush=True,
                    )
    lines = [
        f"# Scaling diagnosis `{a.tag}` (benchmarks/diagnose_scaling.py)",
        "",
        f"Means over the synchronisations after step {a.warmup_skip}; ± sd over seeds.",
        "",
    ]
    lines += table(runs, results, a.warmup_skip)
    lines += ["", *(f"- `{k}`: {v}" for k, v in METRICS)]
    (results / f"diagnose_{a.tag}.md").write_text("\n".join(lines) + "\n")
    plot(runs, results, a.warmup_skip, results / f"diagnose_{a.tag}.png")
    plot_norms(runs, a.warmup_skip, results / f"diagnose_{a.tag}_norms.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
