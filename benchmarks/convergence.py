"""Convergence per step: DeMo configurations against DDP-AdamW and DDP-AdamW + PowerSGD (issue 10, items 1-2).

    # compare methods, each with its own learning-rate sweep, several seeds
    python benchmarks/convergence.py --steps 300 --seeds 0 1 2 \\
        --methods adamw powersgd peer demo \\
        --lrs adamw=1e-3,2e-3 powersgd=1e-3,2e-3 peer=1e-3 demo=3e-4,1e-3 \\
        --demo-configs "value_format=bf16;value_format=sign;update_rule=adam"
    # compression sweep (item 2): top-k x chunk x value format, Pareto plot of final loss vs bytes/param/step
    python benchmarks/convergence.py --sweep --steps 200 --seeds 0 --lrs demo=1e-3 \\
        --sweep-topk 4 8 16 32 64 --sweep-chunk 32 64 128 --sweep-format bf16 sign
    # redraw tables and plots from the JSON without training
    python benchmarks/convergence.py --tag short --report-only

The job is ``benchlib.toy``'s (the WAN benchmark's too): a byte-level ``LlamaForCausalLM`` (vocab 256, hidden 256,
4 layers, intermediate 688: 3.3M parameters, random init from the seed) on the Python standard library's
sources; the last 2% of the bytes are held out; rank r draws its windows from its own shard with a generator
seeded by (seed, rank), so every method sees the same batches. ``--shards`` says how the rest is split between
the ranks (``benchlib.toy``): ``contiguous`` (default: equal byte ranges of the sorted files), ``interleaved``
(IID: whole files dealt in turn to the least-loaded rank) or ``by_directory`` (non-IID: whole packages per
rank); the held-out set is the same in every mode. ``--world`` gloo ranks (default 2) are forked
per run (``torch.multiprocessing``), one torch thread each, on 127.0.0.1.

Methods (``--methods``; each may be given several times through ``--demo-configs``):

- ``adamw``     ``torch.optim.AdamW`` (betas 0.9/0.95, no weight decay) on ``DistributedDataParallel``: a dense
                fp32 gradient all-reduce, counted as 4 bytes/param/step (what the rank hands in).
- ``powersgd``  the same with DDP's ``powerSGD_hook`` (rank ``--powersgd-rank``, plain all-reduce for the
                first 2 steps, one DDP bucket: ``benchlib.baselines.ddp_baseline``); bytes from the shapes with
                torch's rule (``benchlib.baselines.powersgd_bytes``).
- ``muon``      ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``, momentum 0.95, Nesterov) for the hidden
                matrices and AdamW for the embeddings, head and norms (``hf_demo.muon_style_groups``), on
                ``DistributedDataParallel``: 4 bytes/param/step. Its Newton-Schulz iteration runs in fp32
                (hf_demo's, replaced in the run's process: torch's bf16 one is ~20x slower on a CPU).
- ``peer``      ``pytorch_optimizer.DeMo`` (``--topk``, ``--chunk``); bytes = its ``data_transmit``.
- ``demo``      ``hf_demo.DeMo``, once per configuration in ``--demo-configs``: ``;`` separates
                configurations, ``,`` separates ``key=value`` overrides of DeMo's keyword arguments. Short keys:
                ``topk``, ``chunk``, ``decay``, ``format`` (= compression_topk, compression_chunk,
                compression_decay, value_format). Any other key goes to ``DeMo(...)`` as is (e.g.
                ``update_rule=adam``, ``sign_update=false``); a keyword this hf_demo does not know fails that
                configuration with the error, the rest still run. Values: int, float, true/false or text.
                ``mlp_topk=K`` (also benchmark-only) puts the MLP matrices in a parameter group with top-k K;
                ``params=bf16`` (benchmark-only) trains bf16 parameters with no fp32 copy (forward, backward
                and held-out loss in bf16), e.g. with ``param_rounding=stochastic``.
                ``update_rule=orthogonal`` (and its variants ``orthogonal_momentum``, ``orthogonal_signal``,
                ``muon_signal``) trains ``hf_demo.muon_style_groups(model)`` (hidden matrices orthogonalised, the rest
                ``sign``); benchmark-only with it: ``others=RULE`` (the rest's rule), ``others_lr=X`` (the rest's lr is
                X times the hidden matrices'), ``ortho_rms=X`` (the rule's RMS), ``ortho_scale=shape|measured`` (its
                scale from the shape, or from the step's own RMS), ``ortho_beta=X`` (orthogonal_momentum's beta),
                ``signal_beta=X`` (muon_signal's), ``ns_steps=N`` (the rules' Newton-Schulz steps).
                ``inner_rule=orthogonal`` (``sync_every > 1``) trains Muon-style groups too: local Muon steps for the
                hidden matrices, local Adam steps for the rest; benchmark-only with ``sync_every > 1``:
                ``inner_beta=X`` (the local steps' momentum), ``outer_momentum=B`` (an outer Nesterov momentum on
                the mean change, DiLoCo's; the ``outer_lr`` setting multiplies what it applies), ``inner_mix=G`` (at a
                synchronisation each rank's inner momentum of a matrix stepped by local Muon steps takes the agreed
                mean change, scaled to G times the momentum's own norm, and keeps its norm: the next local steps
                start from the ranks' consensus). DeMo's own
                ``outer_lr=X`` and ``outer_lr_scaling=sqrt_world`` (the mean change x X, x sqrt(W/2)) go to DeMo
                as any setting does; the presets' is ``outer_lr_scaling=sqrt_world``. ``shared_positions=true`` (any
                configuration; a prototype): every rank sends the same randomly drawn positions instead of its own
                top-k. Bytes = ``comm_stats.bytes_sent`` (headers included).

Schedule: linear warmup over ``--warmup`` steps, then cosine decay to ``--min-lr-ratio`` x lr at the last step
(``--schedule cosine``, default) or constant (``--schedule constant``).

Measured per run: training loss every step (rank 0's own batch), held-out loss every ``--eval-every`` steps
(rank 0; the replicas are identical for every method), bytes/param/step, wall time. Reported per
(method, lr): mean +- sd over seeds of the final held-out loss, steps to the target loss (first evaluation at
or below it, linearly interpolated between evaluations; ``--target``, default 1.03 x the best AdamW mean),
bytes/param/step; per method its best lr; ratio to AdamW. Written under ``benchmarks/results/``:
``convergence_<tag>.json`` (every run, appended after each run so an interrupted sweep keeps what finished;
``--resume`` skips runs already there), ``convergence_<tag>.md`` and ``convergence_<tag>.png`` (held-out loss
vs step and vs bytes/param sent; best lr per method, mean over seeds, sd band), with ``--sweep`` also
``convergence_<tag>_pareto.png``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
RESULTS = HERE / "results"

from benchlib import patches, toy  # noqa: E402
from benchlib.baselines import POWERSGD_START_ITER, ddp_baseline, ddp_muon, powersgd_bytes  # noqa: E402
from benchlib.overrides import ALIASES, parse_overrides  # noqa: E402
from benchlib.ranks import free_port  # noqa: E402

BASE_METHODS = ("adamw", "powersgd", "muon", "peer", "demo")


# ------------------------------------------------------------------ methods
@dataclass
class Method:
    kind: str  # adamw | powersgd | muon | peer | demo
    label: str
    overrides: dict = field(default_factory=dict)  # DeMo keywords (kind demo)


def demo_label(overrides: dict) -> str:
    short = {v: k for k, v in ALIASES.items()}
    if not overrides:
        return "DeMo"
    return "DeMo " + ",".join(f"{short.get(k, k)}={v}" for k, v in overrides.items())


def parse_method(spec: str, label: str | None = None) -> Method:
    """``adamw`` | ``powersgd`` | ``muon`` | ``peer`` | ``demo`` | ``demo:key=value,...``."""
    kind, _, rest = spec.partition(":")
    if kind not in BASE_METHODS:
        raise SystemExit(f"unknown method {kind!r}; expected one of {BASE_METHODS}")
    overrides = parse_overrides(rest) if kind == "demo" else {}
    default = {
        "adamw": "DDP-AdamW",
        "powersgd": "DDP-AdamW+PowerSGD",
        "muon": "DDP-Muon",
        "peer": "pytorch-optimizer DeMo",
    }
    return Method(kind, label or default.get(kind) or demo_label(overrides), overrides)


# ------------------------------------------------------------------ one run
@dataclass
class RunConfig:
    method: Method
    lr: float
    seed: int
    steps: int
    warmup: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    world: int = 2
    eval_every: int = 25
    hidden: int = 256
    intermediate: int = 688
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    batch_size: int = 8
    eval_batches: int = 4
    topk: int = 32
    chunk: int = 64
    powersgd_rank: int = 4
    threads: int = 1
    timeout_s: float = 3600.0
    shards: str = "contiguous"
    corpus: str = "stdlib"
    corpus_tokens: int | None = None
    corpus_packages: tuple[str, ...] | None = None  # site-packages: only these top-level packages' sources
    device: str = "cpu"
    tie_embeddings: bool = False
    checkpoint_every: int = 0  # 0: none; else every rank saves its state every this many steps (resumable)
    checkpoint_dir: str = ""  # "": benchlib.run_checkpoint.default_root()
    stop_at: float | None = None  # time.time() after which a run stops at its next checkpoint

    def key(self) -> str:
        m = self.method
        extra = [] if self.shards == "contiguous" else [f"shards={self.shards}"]  # earlier runs' keys unchanged
        if self.corpus != "stdlib":
            extra += [f"corpus={self.corpus}", f"corpus_tokens={self.corpus_tokens}", f"heads={self.heads}"]
        if self.corpus_packages is not None:
            extra.append(f"corpus_packages={hashlib.sha1(repr(self.corpus_packages).encode()).hexdigest()[:12]}")
        if self.device != "cpu":
            extra.append(f"device={self.device}")
        if self.tie_embeddings:
            extra.append("tied")
        return json.dumps(
            [
                m.kind,
                m.label,
                sorted(m.overrides.items()),
                self.lr,
                self.seed,
                self.steps,
                self.warmup,
                self.schedule,
                self.min_lr_ratio,
                self.world,
                self.hidden,
                self.intermediate,
                self.layers,
                self.batch_size,
                self.topk,
                self.chunk,
                *extra,
            ],
            default=str,
        )


def lr_at(cfg: RunConfig, step: int) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine (or constant)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup - 1)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


_CORPUS = None
_SPANS = None
CORPORA = ("stdlib", "site-packages")  # bytes of the standard library; SmolLM2 tokens of site-packages' sources
VOCAB = {"stdlib": 256, "site-packages": 49152}


def _corpus(name: str = "stdlib", max_tokens: int | None = None, packages: tuple[str, ...] | None = None):
    global _CORPUS, _SPANS
    if _CORPUS is None:
        if name == "stdlib":
            _CORPUS, _SPANS = toy.stdlib_bytes(), toy.stdlib_spans()
        else:
            from benchlib.code_corpus import code_tokens

            _CORPUS, _SPANS = code_tokens(max_tokens, packages=packages)
    return _CORPUS


def _build_optimizer(cfg: RunConfig, model, n_params: int):
    """(module to call, optimizer, bytes sent this step -> int)."""
    import torch

    m = cfg.method
    if m.kind == "demo":
        import hf_demo

        kw = dict(compression_topk=cfg.topk, compression_chunk=cfg.chunk)
        kw.update(m.overrides)
        mlp_topk = kw.pop("mlp_topk", None)
        params = _orthogonal_groups(model, kw)
        param_dtype = kw.pop("params", "fp32")
        if param_dtype == "bf16":  # benchmark-only: bf16 parameters, no fp32 master copy (issue 10, item 4)
            model.to(torch.bfloat16)
        elif param_dtype != "fp32":
            raise ValueError(f"params must be fp32 or bf16, got {param_dtype!r}")
        if mlp_topk is not None:  # benchmark-only: another top-k for the MLP matrices (a parameter group)
            params = _with_mlp_topk(model, params, int(mlp_topk))
        opt = hf_demo.DeMo(model.parameters() if params is None else params, lr=cfg.lr, **kw)
        return model, opt, lambda: opt.comm_stats.bytes_sent
    if m.kind == "peer":
        import pytorch_optimizer

        opt = pytorch_optimizer.DeMo(
            model.parameters(), lr=cfg.lr, compression_top_k=cfg.topk, compression_chunk=cfg.chunk, **m.overrides
        )
        return model, opt, lambda: opt.data_transmit
    dense = 4 * n_params
    if m.kind == "muon":
        return ddp_baseline(model, "muon"), ddp_muon(model, cfg.lr), lambda: dense
    net = ddp_baseline(model, m.kind, powersgd_rank=cfg.powersgd_rank)
    if m.kind == "adamw":
        sent = lambda: dense  # noqa: E731
    else:
        compressed = powersgd_bytes([tuple(p.shape) for p in model.parameters()], cfg.powersgd_rank)
        counter = {"n": 0}

        def sent():
            counter["n"] += 1
            return dense if counter["n"] <= POWERSGD_START_ITER else compressed

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return net, opt, sent


def _with_mlp_topk(model, groups: list[dict] | None, topk: int) -> list[dict]:
    """``groups`` (None: every parameter in one) with each group's MLP matrices in a group of their own, the same
    settings and top-k ``topk``."""
    mlp = {id(p) for n, p in model.named_parameters() if "mlp" in n}
    out = []
    for group in groups or [{"params": list(model.parameters())}]:
        settings = {k: v for k, v in group.items() if k != "params"}
        rest = [p for p in group["params"] if id(p) not in mlp]
        mine = [p for p in group["params"] if id(p) in mlp]
        out += [{"params": rest, **settings}] if rest else []
        out += [{"params": mine, **settings, "compression_topk": topk}] if mine else []
    return out


def _orthogonal_groups(model, kw: dict):
    """DeMo's parameter groups for ``update_rule=orthogonal`` (``muon_style_groups``: what ``create_optimizer``
    and DeMoTrainer build), else None. Benchmark-only keys, taken out of ``kw``: ``others=RULE`` (the rule of the
    embeddings, head, norms; default sign), ``others_lr=X`` (their lr is X times the hidden matrices'; applied by
    the schedule through the group's ``lr_scale``), ``ortho_rms=X`` (the orthogonal rule's target RMS, 0.2),
    ``ortho_scale=shape|measured`` (the rule's scale from the matrix's shape, or from the step's own RMS),
    ``ns_steps=N`` (the rules' Newton-Schulz steps, 5), ``shared_positions=true`` (:func:`_shared_positions`).
    With ``inner_rule=orthogonal`` (``sync_every > 1``): ``model_groups``'s (local Muon steps for the hidden
    matrices, local Adam steps for the rest)."""
    from hf_demo.optim import update_rules
    from hf_demo.optim.param_groups import model_groups, muon_style_groups

    others = {"update_rule": kw.pop("others", "sign")}
    if "others_lr" in kw:
        others["lr_scale"] = float(kw.pop("others_lr"))
    if "ortho_rms" in kw:
        update_rules.OrthogonalRule.rms = float(kw.pop("ortho_rms"))  # this forked run's process only
    if "ortho_scale" in kw:
        scale = kw.pop("ortho_scale")
        if scale not in ("shape", "measured"):
            raise ValueError(f"ortho_scale must be shape or measured, got {scale!r}")
        update_rules.OrthogonalRule.measured_rms = scale == "measured"
    if "ns_steps" in kw:
        update_rules.OrthogonalRule.ns_steps = int(kw.pop("ns_steps"))  # this forked run's process only
    if "signal_beta" in kw:
        update_rules.MuonSignalRule.beta = float(kw.pop("signal_beta"))  # this forked run's process only
    if "ortho_beta" in kw:
        update_rules.OrthogonalMomentumRule.beta = float(kw.pop("ortho_beta"))  # this forked run's process only
    if kw.pop("shared_positions", False):
        _shared_positions()
    if "inner_beta" in kw:
        from hf_demo.optim import local_steps

        local_steps.INNER_BETA = float(kw.pop("inner_beta"))  # this forked run's process only
    if "outer_momentum" in kw:
        _outer_momentum(float(kw.pop("outer_momentum")))
    if "inner_mix" in kw:
        _inner_mix(float(kw.pop("inner_mix")))
    if kw.get("update_rule") in update_rules.ORTHOGONAL:
        return muon_style_groups(model, hidden={"update_rule": kw["update_rule"]}, others=others)
    if kw.get("inner_rule") in update_rules.ORTHOGONAL:  # local Muon steps: the groups create_optimizer builds
        return model_groups(model, None, kw.get("update_rule", "sign"), kw["inner_rule"])
    if len(others) > 1 or others["update_rule"] != "sign":
        raise ValueError("others and others_lr are settings of update_rule=orthogonal's groups")
    return None


def _outer_momentum(beta: float) -> None:
    """Benchmark-only prototype (``outer_momentum=B``, this forked run's process only): DiLoCo's outer Nesterov
    momentum on the mean change of each synchronisation, ``v <- B*v + change``, the anchor moving by
    ``outer_lr * (change + B*v)`` instead of ``outer_lr * change`` (``outer_lr``: DeMo's factor, from its
    ``outer_lr`` and ``outer_lr_scaling`` settings; identical on every rank; not in checkpoints)."""
    buffers = {}

    def momentum(param, state, update, outer_lr, m_in, rule_state):
        v = buffers.get(id(param))
        buffers[id(param)] = v = update.clone() if v is None else v.mul_(beta).add_(update)
        return param, state, update + beta * v, outer_lr, m_in, rule_state

    patches.wrap_commit_sync(momentum)


def _inner_mix(gain: float) -> None:
    """Benchmark-only prototype (``inner_mix=G``, this forked run's process only): at a synchronisation the inner
    momentum ``m`` of each matrix with a stateless inner rule (local Muon steps) becomes ``m + G * |m| * u / |u|``,
    given ``m``'s norm back, ``u`` the agreed mean change (the same on every rank, no traffic; the pseudo-gradient
    and ``m`` point the same way). Each rank's ``m`` is its own gradients' average, mostly its own noise; the mean
    change holds every rank's, so the next local steps follow the consensus more than one rank's batches."""

    def mix(param, state, update, outer_lr, m_in, rule_state):
        if update.dim() >= 2 and m_in is not None and not rule_state:
            norm_u, norm_m = update.float().norm(), m_in.norm()
            if norm_u > 0 and norm_m > 0:
                mixed = m_in + (gain * norm_m / norm_u) * update.float()
                m_in = mixed * (norm_m / mixed.norm())
        return param, state, update, outer_lr, m_in, rule_state

    patches.wrap_commit_sync(mix)


def _shared_positions() -> None:
    """Benchmark-only prototype (``shared_positions=true``, this forked run's process only): every rank sends the
    same top-k-many positions of each block, drawn afresh each step from a generator every rank seeds alike, instead
    of its own top-k. The positions still travel (bytes/param/step counts them); a wire format that derives them
    from the seed would send only the values."""
    import torch

    from hf_demo import compression as functional

    calls = [0]

    def select(momentum, k, scratch=None):  # (the workspace's scratch buffer: not needed here)
        gen = torch.Generator().manual_seed(1_000_003 * calls[0] + 17)
        calls[0] += 1
        draw = torch.rand(momentum.shape, generator=gen)
        idx = draw.topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        return idx, momentum.gather(1, idx)

    functional.select = select


def rank_setup(cfg: RunConfig, rank: int):
    """One rank's (data, model) on ``cfg.device``: its shard of the corpus, the model with rank 0's weights
    (broadcast: needs the process group)."""
    import torch
    import torch.distributed as dist

    data = toy.Data(
        _corpus(cfg.corpus, cfg.corpus_tokens, cfg.corpus_packages),
        *(rank, cfg.world, cfg.seq_len, cfg.batch_size, cfg.seed, 0.02, cfg.eval_batches, cfg.shards, _SPANS),
    )
    device = torch.device(cfg.device)
    data.eval = [b.to(device) for b in data.eval]
    model = toy.byte_llama(
        hidden=cfg.hidden,
        intermediate=cfg.intermediate,
        layers=cfg.layers,
        heads=cfg.heads,
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        vocab=VOCAB[cfg.corpus],
        tie=cfg.tie_embeddings,
    ).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    return data, model


def set_lr(opt, lr: float) -> None:
    """Every group's learning rate for this step: ``lr`` times the group's ``lr_scale`` (1 where it has none)."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def _worker(rank: int, cfg: RunConfig, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = None
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=cfg.world, timeout=datetime.timedelta(seconds=cfg.timeout_s)
        )
        out = _train(rank, cfg)
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out = dict(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    if out is not None:
        queue.put((rank, out))
    try:
        from hf_demo.exchange.teardown import shutdown

        shutdown()  # waits for gloo's workers first (a bare destroy can deadlock at exit: see wan_worker.py)
    except Exception:
        pass


def _setup(rank: int, cfg: RunConfig):
    """(data, model, module to call, optimizer, bytes sent -> int, parameter count) of rank ``rank``."""
    data, model = rank_setup(cfg, rank)
    n_params = sum(p.numel() for p in model.parameters())
    net, opt, sent = _build_optimizer(cfg, model, n_params)
    return data, model, net, opt, sent, n_params


def _train(rank: int, cfg: RunConfig) -> dict | None:
    """Train rank ``rank``'s part of ``cfg`` (from its last checkpoint, with ``checkpoint_every``): rank 0's
    measurements, or on every rank a ``stopped`` record when it stopped at a checkpoint (``stop_at``)."""
    import torch.distributed as dist

    data, model, net, opt, sent, n_params = _setup(rank, cfg)
    rec = dict(evals=[], train_loss=[], sent=[], lr=[], segments=[])
    ckpt = _checkpoints(cfg, rank)
    start = _resume(ckpt, model, opt, data, rec)
    t0, load = time.perf_counter(), []

    def do_eval(step):
        if rank == 0:
            rec["evals"].append((step, toy.evaluate(model, data.eval)))
        dist.barrier()

    if start == 0:
        do_eval(0)
    for step in range(start, cfg.steps):
        lr = lr_at(cfg, step)
        set_lr(opt, lr)
        batch = data.next_batch().to(cfg.device)
        loss = net(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["train_loss"].append(float(loss.detach()))
        rec["sent"].append(int(sent()))
        rec["lr"].append(lr)
        if not math.isfinite(rec["train_loss"][-1]):
            raise FloatingPointError(f"training loss is {rec['train_loss'][-1]} at step {step + 1}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            do_eval(step + 1)
        if ckpt is not None and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            load.append(os.getloadavg()[0])
            _segment(rec, start, step + 1, time.perf_counter() - t0, load)
            _save(ckpt, cfg, model, opt, data, rec, n_params)
            if ckpt.should_stop(cfg.stop_at, time.time()):
                return dict(ok=False, stopped=True, step=step + 1)
            rec["segments"].pop()
    load.append(os.getloadavg()[0])
    _segment(rec, start, cfg.steps, time.perf_counter() - t0, load)
    if rank != 0:
        return None
    wall = sum(seg["wall_s"] for seg in rec["segments"])
    return dict(ok=True, n_params=n_params, wall_s=wall, **rec)


def _segment(rec: dict, start: int, end: int, wall: float, load: list) -> None:
    """Append this process's stretch of the run (steps, wall time, mean 1-minute load average of the machine)."""
    rec["segments"].append(dict(steps=[start, end], wall_s=wall, load=statistics.mean(load)))


def _checkpoints(cfg: RunConfig, rank: int):
    if not cfg.checkpoint_every:
        return None
    if cfg.method.kind == "powersgd":
        raise ValueError("--checkpoint-every cannot resume powersgd: its hook's error feedback is not saved")
    from benchlib.run_checkpoint import RunCheckpoint, default_root

    return RunCheckpoint(Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else default_root(), cfg.key(), rank, _CORPUS)


def _resume(ckpt, model, opt, data, rec: dict) -> int:
    """Load this rank's last checkpoint into the run (its step), or 0 without one."""
    import torch

    step = ckpt.latest() if ckpt is not None else None
    if step is None:
        return 0
    state = ckpt.load(step)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    data.gen.set_state(state["data_gen"])
    torch.set_rng_state(state["rng"])
    rec.update(state["record"])
    return step


def _save(ckpt, cfg: RunConfig, model, opt, data, rec: dict, n_params: int) -> None:
    import torch

    step = len(rec["train_loss"])
    state = dict(
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        data_gen=data.gen.get_state(),
        rng=torch.get_rng_state(),
        record=rec,
    )
    progress = dict(
        method=cfg.method.label,
        kind=cfg.method.kind,
        lr=cfg.lr,
        seed=cfg.seed,
        step=step,
        steps=cfg.steps,
        n_params=n_params,
        evals=rec["evals"],
        bytes_per_param_step=statistics.mean(rec["sent"]) / n_params,
        segments=rec["segments"],
        config=_cfg_dict(cfg),
    )
    ckpt.save(step, state, progress)


def run(cfg: RunConfig) -> dict:
    """Train one configuration on ``cfg.world`` forked gloo ranks; rank 0's measurements as a dict."""
    import torch.multiprocessing as mp

    # read once in the parent (never CUDA there), shared by the forked ranks
    _corpus(cfg.corpus, cfg.corpus_tokens, cfg.corpus_packages)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue), daemon=True) for r in range(cfg.world)]
    started = time.perf_counter()
    for p in procs:
        p.start()
    result = None
    errors = []
    deadline = time.monotonic() + cfg.timeout_s + 120
    expected = 1
    got = 0
    while got < expected and time.monotonic() < deadline:
        try:
            rank, out = queue.get(timeout=5)
        except Exception:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if out.get("ok"):
            result = out
            got += 1
        elif out.get("stopped"):
            result = out
            break
        else:
            errors.append(f"rank {rank}: {out['error']}")
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    if result is None:
        return dict(ok=False, error="; ".join(errors) or "no result (a rank died?)", config=_cfg_dict(cfg))
    if result.get("stopped"):
        return dict(result, config=_cfg_dict(cfg), error=f"stopped at its checkpoint of step {result['step']}")
    sent = result["sent"]
    result.update(
        config=_cfg_dict(cfg),
        key=cfg.key(),
        method=cfg.method.label,
        kind=cfg.method.kind,
        lr=cfg.lr,
        seed=cfg.seed,
        final_loss=result["evals"][-1][1],
        bytes_per_param_step=statistics.mean(sent) / result["n_params"],
        total_s=time.perf_counter() - started,
    )
    return result


def _cfg_dict(cfg: RunConfig) -> dict:
    d = asdict(cfg)
    d["method"] = asdict(cfg.method)
    return d


# ------------------------------------------------------------------ reporting
def interp_steps_to(evals, target: float):
    """First step at which the held-out loss reaches ``target`` (linear between evaluations), else None."""
    prev = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def _ms(xs):
    if not xs:
        return float("nan"), float("nan")
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(runs: list[dict], target: float | None, target_ratio: float = 1.03):
    ok = [r for r in runs if r.get("ok")]
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in ok:
        groups.setdefault((r["method"], r["lr"]), []).append(r)
    rows = []
    for (method, lr), rs in groups.items():
        mean, sd = _ms([r["final_loss"] for r in rs])
        rows.append(
            dict(
                method=method,
                kind=rs[0]["kind"],
                lr=lr,
                n=len(rs),
                mean=mean,
                sd=sd,
                bpps=statistics.mean(r["bytes_per_param_step"] for r in rs),
                steps=rs[0]["config"]["steps"],
                runs=rs,
                step_s=statistics.mean(r["wall_s"] / r["config"]["steps"] for r in rs),
            )
        )
    best = {}
    for row in rows:
        if row["method"] not in best or row["mean"] < best[row["method"]]["mean"]:
            best[row["method"]] = row
    adamw = [b for b in best.values() if b["kind"] == "adamw"]
    if target is None and adamw:
        target = target_ratio * adamw[0]["mean"]
    for row in rows:
        reached = [interp_steps_to(r["evals"], target) for r in row["runs"]] if target else []
        row["reached"] = sum(s is not None for s in reached)
        row["steps_to_target"] = _ms([s for s in reached if s is not None])
    return rows, best, target, (adamw[0] if adamw else None)


def write_report(tag: str, runs: list[dict], args) -> str:
    rows, best, target, adamw = summarise(runs, args.target, args.target_ratio)
    failed = [r for r in runs if not r.get("ok")]
    lines = [f"# Convergence: `{tag}`", ""]
    if rows:
        c = rows[0]["runs"][0]["config"]
        lines += [
            f"Byte-level Llama ({rows[0]['runs'][0]['n_params'] / 1e6:.2f}M params: hidden {c['hidden']}, "
            f"intermediate {c['intermediate']}, {c['layers']} layers), {c['world']} gloo ranks "
            f"({c.get('shards', 'contiguous')} shards) x batch "
            f"{c['batch_size']}x{c['seq_len']}, stdlib corpus, {c['steps']} steps, warmup {c['warmup']} + "
            f"{c['schedule']}"
            + (f" to {c['min_lr_ratio']} x lr" if c["schedule"] == "cosine" else "")
            + f"; held-out loss every {c['eval_every']} steps ({c['eval_batches']}x{c['batch_size']} windows). "
            + (
                f"Target loss for 'steps to target': {target:.4f}"
                + (f" ({args.target_ratio:g} x best DDP-AdamW mean)." if args.target is None else " (--target).")
                if target is not None
                else "No target loss (no DDP-AdamW run and no --target)."
            ),
            "",
        ]
    lines += [
        "## Every (method, lr)",
        "",
        "| method | lr | seeds | final held-out (mean ± sd) | steps to target (mean ± sd, reached) | "
        "bytes/param/step | s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["method"], r["lr"])):
        st, sd = row["steps_to_target"]
        sts = f"{st:.0f} ± {sd:.0f} ({row['reached']}/{row['n']})" if row["reached"] else f"– (0/{row['n']})"
        lines.append(
            f"| {row['method']} | {row['lr']:g} | {row['n']} | {row['mean']:.4f} ± {row['sd']:.4f} | {sts} | "
            f"{row['bpps']:.4f} | {row['step_s']:.2f} |"
        )
    lines += [
        "",
        "## Each method at its best lr",
        "",
        "| method | best lr | final held-out | / AdamW | / Muon | steps to target | / AdamW | bytes/param/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    muon = min((b for b in best.values() if b["kind"] == "muon"), key=lambda r: r["mean"], default=None)
    for b in sorted(best.values(), key=lambda r: r["mean"]):
        ratio = f"{b['mean'] / adamw['mean']:.3f}" if adamw else "–"
        ratio += f" | {b['mean'] / muon['mean']:.3f}" if muon else " | –"
        st = b["steps_to_target"][0]
        ast = adamw["steps_to_target"][0] if adamw else float("nan")
        sratio = f"{st / ast:.2f}" if b["reached"] and adamw and adamw["reached"] and ast else "–"
        sts = f"{st:.0f} ({b['reached']}/{b['n']})" if b["reached"] else f"– (0/{b['n']})"
        lines.append(
            f"| {b['method']} | {b['lr']:g} | {b['mean']:.4f} ± {b['sd']:.4f} | {ratio} | {sts} | {sratio} | "
            f"{b['bpps']:.4f} |"
        )
    if failed:
        lines += ["", "## Failed runs", ""]
        for r in failed:
            cfg = r.get("config", {})
            lines.append(
                f"- {cfg.get('method', {}).get('label')} lr {cfg.get('lr')} seed {cfg.get('seed')}: {r['error']}"
            )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"convergence_{tag}.md").write_text(text)
    plot(tag, rows, best)
    if args.sweep or any(r["kind"] == "demo" for r in rows):
        pareto(tag, rows, best)
    return text


def _mean_curve(rs: list[dict]):
    steps = [s for s, _ in rs[0]["evals"]]
    losses = [[loss for _, loss in r["evals"]] for r in rs if len(r["evals"]) == len(steps)]
    mean = [statistics.mean(c) for c in zip(*losses)]
    sd = [statistics.stdev(c) if len(c) > 1 else 0.0 for c in zip(*losses)]
    return steps, mean, sd


def plot(tag, rows, best):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    for b in sorted(best.values(), key=lambda r: r["mean"]):
        steps, mean, sd = _mean_curve(b["runs"])
        label = f"{b['method']} lr {b['lr']:g} ({b['bpps']:.3g} B/param/step)"
        (line,) = a1.plot(steps, mean, label=label)
        a1.fill_between(
            steps,
            [m - s for m, s in zip(mean, sd)],
            [m + s for m, s in zip(mean, sd)],
            color=line.get_color(),
            alpha=0.2,
        )
        # cumulative bytes per parameter sent by one rank up to each evaluation
        cum = [0.0]
        for x in b["runs"][0]["sent"]:
            cum.append(cum[-1] + x / b["runs"][0]["n_params"])
        xb = [cum[s] for s in steps]
        a2.plot(xb[1:], mean[1:], label=label, color=line.get_color())
    a1.set(xlabel="step", ylabel="held-out loss", title="held-out loss vs step (best lr, mean ± sd over seeds)")
    a2.set(
        xlabel="bytes sent per parameter (one rank, cumulative)",
        ylabel="held-out loss",
        xscale="log",
        title="held-out loss vs bytes sent",
    )
    lo = min(min(_mean_curve(b["runs"])[1]) for b in best.values())
    for ax in (a1, a2):
        ax.set_ylim(lo - 0.05, lo + 1.2)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"convergence_{tag}.png", dpi=110)
    plt.close(fig)


def pareto(tag, rows, best):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pts = sorted(best.values(), key=lambda r: r["bpps"])
    front, lowest = [], float("inf")
    for r in pts:
        if r["mean"] < lowest:
            front.append(r)
            lowest = r["mean"]
    fig, ax = plt.subplots(figsize=(9, 6))
    for r in pts:
        marker = {"demo": "o", "peer": "s", "adamw": "*", "powersgd": "^", "muon": "P"}[r["kind"]]
        ax.errorbar(r["bpps"], r["mean"], yerr=r["sd"], fmt=marker, capsize=2)
        ax.annotate(
            r["method"].replace("DeMo ", ""),
            (r["bpps"], r["mean"]),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    ax.plot([r["bpps"] for r in front], [r["mean"] for r in front], "k--", lw=0.8, label="Pareto front")
    ax.set(
        xscale="log",
        xlabel="bytes/param/step (one rank)",
        ylabel="final held-out loss (mean ± sd)",
        title="final loss vs communication",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"convergence_{tag}_pareto.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main
def parse_lrs(items: list[str]) -> dict[str, list[float]]:
    """``adamw=1e-3,2e-3 demo=1e-3`` (a bare list applies to every method)."""
    out = {}
    for item in items:
        if "=" in item:
            k, v = item.split("=", 1)
            out[k] = [float(x) for x in v.split(",")]
        else:
            out["*"] = [float(x) for x in item.split(",")]
    return out


DEFAULT_LRS = {"adamw": [1e-3], "powersgd": [1e-3], "muon": [1e-3], "peer": [1e-3], "demo": [1e-3]}


def build_methods(args) -> list[Method]:
    methods = []
    for name in args.methods:
        if name == "demo":
            configs = [c for c in (args.demo_configs or "").split(";")] or [""]
            for c in configs:
                methods.append(parse_method("demo:" + c.strip()))
        else:
            methods.append(parse_method(name))
    if args.sweep:
        common = parse_overrides(args.demo_common or "")
        for fmt in args.sweep_format:
            for chunk in args.sweep_chunk:
                for topk in args.sweep_topk:
                    if topk > chunk * chunk:
                        continue
                    ov = dict(compression_topk=topk, compression_chunk=chunk, value_format=fmt, **common)
                    methods.append(Method("demo", demo_label(ov), ov))
    elif args.demo_common:
        common = parse_overrides(args.demo_common)
        for m in methods:
            if m.kind == "demo":
                m.overrides = {**common, **m.overrides}
                m.label = demo_label(m.overrides)
    return methods


def build_plan(args, stop_at: float | None = None) -> list[RunConfig]:
    """Every run the arguments ask for: each method at each of its lrs, each seed."""
    lrs, packages = parse_lrs(args.lrs), _packages(args)
    plan = []
    for m in build_methods(args):
        for lr in lrs.get(m.kind, lrs.get("*", DEFAULT_LRS[m.kind])):
            for seed in args.seeds:
                plan.append(
                    RunConfig(
                        method=m,
                        lr=lr,
                        seed=seed,
                        steps=args.steps,
                        warmup=args.warmup,
                        schedule=args.schedule,
                        min_lr_ratio=args.min_lr_ratio,
                        world=args.world,
                        shards=args.shards,
                        eval_every=args.eval_every,
                        hidden=args.hidden,
                        intermediate=args.intermediate,
                        layers=args.layers,
                        heads=args.heads,
                        seq_len=args.seq_len,
                        batch_size=args.batch_size,
                        eval_batches=args.eval_batches,
                        topk=args.topk,
                        chunk=args.chunk,
                        powersgd_rank=args.powersgd_rank,
                        threads=args.threads,
                        corpus=args.corpus,
                        corpus_tokens=int(args.corpus_tokens) if args.corpus_tokens else None,
                        corpus_packages=packages,
                        device=args.device,
                        tie_embeddings=args.tie_embeddings,
                        checkpoint_every=args.checkpoint_every,
                        checkpoint_dir=args.checkpoint_dir,
                        stop_at=stop_at,
                        timeout_s=args.timeout_s,
                    )
                )
    return plan


def _packages(args) -> tuple[str, ...] | None:
    if args.corpus_packages is None:
        return None
    if args.corpus != "site-packages":
        raise SystemExit(f"--corpus-packages picks site-packages' packages; --corpus is {args.corpus}")
    from benchlib.code_corpus import read_packages

    return read_packages(args.corpus_packages)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default="short", help="results go to <results-dir>/convergence_<tag>.*")
    p.add_argument("--results-dir", default=str(RESULTS), help="where results go (default benchmarks/results)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["adamw", "powersgd", "demo"],
        help=f"from {BASE_METHODS} (or demo:key=value,...)",
    )
    p.add_argument(
        "--demo-configs",
        default=None,
        help='DeMo configurations for method demo: "topk=32,format=bf16;update_rule=adam"',
    )
    p.add_argument("--demo-common", default=None, help="overrides added to every DeMo configuration")
    p.add_argument("--lrs", nargs="+", default=[], help="per method: adamw=1e-3,2e-3 demo=1e-3 (bare: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--shards",
        choices=toy.SHARDS,
        default="contiguous",
        help="how the training bytes are split between ranks: contiguous byte ranges (default), interleaved files "
        "(IID), or whole packages per rank (by_directory, non-IID); the held-out set is the same",
    )
    p.add_argument(
        "--corpus",
        choices=CORPORA,
        default="stdlib",
        help="stdlib: the standard library's bytes, a byte-level Llama (default); site-packages: the installed "
        "packages' Python sources in SmolLM2 tokens (benchlib.code_corpus), a Llama with SmolLM2's vocabulary",
    )
    p.add_argument("--corpus-tokens", type=float, default=None, help="site-packages: at most this many tokens")
    p.add_argument(
        "--corpus-packages",
        default=None,
        help="site-packages: a file listing the top-level packages the corpus is made of, one a line (a corpus that "
        "installing another package does not change; benchlib.code_corpus.read_packages)",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on cuda:0 over gloo)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topk", type=int, default=32, help="peer's top-k and DeMo's unless overridden")
    p.add_argument("--chunk", type=int, default=64, help="peer's chunk and DeMo's unless overridden")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--target", type=float, default=None, help="target held-out loss (default 1.03 x AdamW)")
    p.add_argument("--target-ratio", type=float, default=1.03, help="without --target: this x the best DDP-AdamW mean")
    p.add_argument("--sweep", action="store_true", help="item 2: top-k x chunk x format grid of DeMo")
    p.add_argument("--sweep-topk", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--sweep-chunk", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--sweep-format", nargs="+", default=["bf16", "sign"])
    p.add_argument("--resume", action="store_true", help="skip runs already in the tag's JSON")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the JSON")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this long")
    p.add_argument(
        "--stop-after-minutes",
        type=float,
        default=None,
        help="with --checkpoint-every: after this long, the run going on stops at its next checkpoint and no new run "
        "starts (--resume goes on from there)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="every rank saves its state every this many steps (benchlib.run_checkpoint); --resume goes on from "
        "the last checkpoint of an unfinished run (default 0: no checkpoints)",
    )
    p.add_argument("--checkpoint-dir", default="", help="default: $HF_DEMO_BENCH_CACHE/checkpoints")
    p.add_argument("--tie-embeddings", action="store_true", help="the output head shares the embedding matrix")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="a run's limit (and gloo's timeout), seconds")
    return p.parse_args(argv)


def main(argv=None):
    global RESULTS
    args = parse_args(argv)
    RESULTS = Path(args.results_dir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"convergence_{args.tag}.json"
    runs = json.loads(path.read_text()) if path.exists() and (args.resume or args.report_only) else []
    if not args.report_only:
        done = {r.get("key") for r in runs if r.get("ok")}
        stop_at = time.time() + 60 * args.stop_after_minutes if args.stop_after_minutes else None
        plan = build_plan(args, stop_at)
        t_start = time.monotonic()
        for i, cfg in enumerate(plan):
            if cfg.key() in done:
                continue
            if args.max_minutes and time.monotonic() - t_start > 60 * args.max_minutes:
                print(f"[convergence] --max-minutes reached: {len(plan) - i} runs not started", flush=True)
                break
            if stop_at is not None and time.time() > stop_at:
                print(f"[convergence] --stop-after-minutes reached: {len(plan) - i} runs not started", flush=True)
                break
            r = run(cfg)
            if r.get("stopped"):
                print(f"[convergence] {cfg.method.label}: {r['error']}; --resume goes on from there", flush=True)
                break
            runs = [x for x in runs if x.get("key") != cfg.key()] + [r]
            path.write_text(json.dumps(runs))
            if r.get("ok"):
                print(
                    f"[convergence] {i + 1}/{len(plan)} {cfg.method.label} lr {cfg.lr:g} seed {cfg.seed}: "
                    f"final {r['final_loss']:.4f}, {r['bytes_per_param_step']:.4f} B/param/step, "
                    f"{r['wall_s']:.0f} s",
                    flush=True,
                )
            else:
                print(
                    f"[convergence] {i + 1}/{len(plan)} {cfg.method.label} lr {cfg.lr:g} seed {cfg.seed}: "
                    f"FAILED {r['error']}",
                    flush=True,
                )
    if not any(r.get("ok") for r in runs):
        print(f"[convergence] no finished run in {path}: no report", flush=True)
        return
    print(write_report(args.tag, runs, args))


if __name__ == "__main__":
    main()
