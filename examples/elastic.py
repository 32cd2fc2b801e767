"""Elastic DeMo on torchft: one replica group per process (or per HSDP node), a Lighthouse, replicas lost and back.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 &
    # one per replica group (each restarted by its launcher when it dies: --max-restarts)
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://$(hostname):29510 \\
        torchrun --nproc_per_node 1 --master_port 29600 --max-restarts 10 examples/elastic.py --steps 200
    REPLICA_GROUP_ID=1 TORCHFT_LIGHTHOUSE=http://$(hostname):29510 \\
        torchrun --nproc_per_node 1 --master_port 29601 --max-restarts 10 examples/elastic.py --steps 200

HSDP: a node as one replica group, ``--nproc_per_node`` shard ranks (FSDP2 over the node's processes; DeMo's
exchange between replica groups, shard rank i with shard rank i)::

    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://$(hostname):29510 \\
        torchrun --nproc_per_node 2 --master_addr $(hostname) --master_port 29600 --max-restarts 10 \\
        examples/elastic.py --steps 200

Each step: torchft's quorum (``Elastic.start_step``: a restarted replica receives the agreed state from a live
peer here), forward and backward on this replica's batch (its rank in the quorum), ``elastic.step()`` (the wrapper
around DeMo), which commits only where torchft's ``should_commit`` says so. A killed replica costs the survivors the
step in flight; they go on with the replicas present. Prints one JSON line per step (``--quiet``: none) and, with
``--out``, writes ``replica<id>.json`` (HSDP: ``replica<id>-<shard rank>.json``) at the end: the parameters' SHA-256
(HSDP: of this rank's shards), the steps, the final loss, the quorum's figures.

A warm standby (``--standby FILE``): the process imports torch, transformers and torchft, builds its model,
optimizer and data, prints ``{"standby": "warm"}`` and waits until FILE holds a replica id; then it joins the
quorum as that replica group and receives the agreed state from a live peer, like a restarted one. A launcher that
keeps one standby warm replaces a dead replica group within the quorum and recovery time instead of a process's
start-up (tens of seconds for the imports alone on a busy machine):

    python examples/elastic.py --standby /run/spare0 --steps 200 &     # warm, waiting
    echo 1 > /run/spare0.tmp && mv /run/spare0.tmp /run/spare0          # replica group 1 died: take its place
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

import hf_demo
from hf_demo.elastic import Elastic
from hf_demo.exchange.transport import register_collective_hook

BATCH = {"mlp": 32, "llama": 8}  # samples in one replica's batch
HELD_OUT = 1 << 40  # batch indices from here on are never trained on


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny MLP (``mlp``: tests) or a byte-level Llama (``llama``: needs the hf extra)."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def loss_of(model, kind: str, batch: int, corpus=None) -> torch.Tensor:
    """The loss of batch ``batch`` of the run's stream (``Elastic.batch_index``: a committed step consumes one
    batch per replica present, a refused step none, so a dead replica's batch is read at the next step)."""
    g = torch.Generator().manual_seed(100_003 + batch)
    if kind == "mlp":
        x = torch.randn(32, 16, generator=g)
        y = torch.randint(0, 8, (32,), generator=g)
        return torch.nn.functional.cross_entropy(model(x), y)
    starts = torch.randint(0, corpus.numel() - 65, (BATCH[kind],), generator=g)
    ids = torch.stack([corpus[s : s + 64] for s in starts.tolist()]).long()
    return model(input_ids=ids, labels=ids).loss


def digest(model) -> str:
    """The SHA-256 of the parameters this process holds (HSDP: its shards)."""
    h = hashlib.sha256()
    for p in model.parameters():
        mine = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 parameter (DTensor): this rank's shard
        h.update(mine.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_group(model: torch.nn.Module, kind: str) -> tuple[int, int]:
    """HSDP (``torchrun --nproc_per_node N``, N > 1): the replica group's processes shard ``model`` with FSDP2 over
    their own process group (gloo on CPU); torchft's quorum is the replicate dimension. Returns (shard rank,
    shards): (0, 1) for a replica group of one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_demo.fsdp import shard_model

    dist.init_process_group("gloo")
    shard_model(model, init_device_mesh("cpu", (dist.get_world_size(),)), layers=[] if kind == "mlp" else None)
    return dist.get_rank(), dist.get_world_size()


def die_at(spec: str | None, elastic, group: bool = False) -> None:
    """``--die-at STEP:POINT``: SIGKILL this process at torchft step STEP, at POINT of the step: ``before`` its
    exchange (after the quorum, in the forward pass), ``inside`` it (at DeMo's second collective), ``after`` it
    (the exchange done, before the commit decision) or ``between`` steps (committed, before the next quorum);
    ``local``: before the exchange of the first step from STEP on that is inside a local phase (the replicas'
    parameters apart: ``sync_every > 1`` or a budget policy's local-step tier). ``group``: every process of this
    process's Unix process group dies with it (an HSDP replica group started as one, as a node fails)."""
    if not spec:
        return
    step, point = int(spec.split(":")[0]), spec.split(":")[1]
    points = ("before", "inside", "after", "between", "local")
    if point not in points:
        raise SystemExit(f"--die-at {spec}: the point is one of {points}")

    def die(at: str) -> None:
        now = elastic.manager.current_step()
        local = point == "local" and at == "before" and now >= step and bool(elastic.opt.unsynced)
        if local or (at == point and now == step):
            os.killpg(os.getpgrp(), signal.SIGKILL) if group else os.kill(os.getpid(), signal.SIGKILL)

    seen = []

    def collective(name: str, nbytes: int) -> None:
        seen.append(elastic.manager.current_step())
        if seen.count(step) == 2:
            die("inside")

    register_collective_hook(collective) if point == "inside" else None
    decide = elastic.decide
    elastic.decide = lambda error: (die("after"), decide(error))[1]
    elastic.die = die


def flip_at(spec: str | None, elastic) -> None:
    """``--flip-at STEP:WHAT[:BYTE]``: at torchft step STEP (its first try), the lowest bit of one byte of another
    replica's row flipped in what this replica receives: its header's byte BYTE (default 40, the flags word) for
    ``header``, the middle of its payload for ``payload``. DeMo's guards (CRC32; HMAC-SHA256 with
    ``HF_DEMO_SECRET``) refuse it on every replica."""
    if not spec:
        return
    from hf_demo.elastic import ManagedGroup
    from hf_demo.wire import codec, sealing

    parts = spec.split(":")
    step, what, byte = int(parts[0]), parts[1], int(parts[2]) if len(parts) > 2 else 5 * 8
    if what not in ("header", "payload"):
        raise SystemExit(f"--flip-at {spec}: header or payload")
    real, spent = ManagedGroup.gather, []  # the backend's call, which every all-gather of the transport makes

    def gather(transport, out, wire, async_op=False):
        work = real(transport, out, wire, async_op)
        if async_op or spent or elastic.manager.current_step() != step:
            return work  # once: the step, refused, is tried again intact
        n, other = wire.numel(), 1 if transport.rank == 0 else 0
        row = out.view(-1)[other * n : (other + 1) * n]
        header = n >= codec.HEADER_BYTES and (
            int.from_bytes(row[:8].numpy().tobytes(), "little") == codec.MAGIC
            or sealing.is_sealed(row[: codec.HEADER_BYTES])
        )
        if what == "header" and header:
            row[byte] ^= 0x01
        elif what == "payload" and not header:
            row[n // 2] ^= 0x01
        elif what == "payload" and n > codec.HEADER_BYTES:  # the payload rides after the header
            row[codec.HEADER_BYTES + (n - codec.HEADER_BYTES) // 2] ^= 0x01
        else:
            return work
        spent.append(step)
        return work

    ManagedGroup.gather = gather


def slow_link(spec: str | None, elastic) -> None:
    """``--slow-link FROM:TO:SECONDS``: sleep SECONDS before each of DeMo's collectives at torchft steps FROM to
    TO-1 (a slow link: the other replicas wait for this one inside the collective, and their headers carry that
    time to the budget policy)."""
    if not spec:
        return
    first, last, seconds = spec.split(":")

    def wait(name: str, nbytes: int) -> None:
        if int(first) <= elastic.manager.current_step() < int(last):
            time.sleep(float(seconds))

    register_collective_hook(wait)


@torch.no_grad()
def held_out(model, kind: str, batches: int, corpus=None) -> float | None:
    """The mean loss of ``batches`` batches that training never reads (the same on every replica)."""
    if not batches:
        return None
    return sum(float(loss_of(model, kind, HELD_OUT + i, corpus)) for i in range(batches)) / batches


def momentum(opt) -> float:
    """The sum of this replica's momentum norms (0 right after a restarted replica received the agreed state)."""
    return sum(float(s["momentum"].norm()) for s in opt.state.values() if "momentum" in s)


def target(args) -> int:
    """The committed steps to train: ``--steps``, or the number in ``--steps-file`` once it exists (a harness
    ends every replica at the same step that way)."""
    if args.steps_file and os.path.exists(args.steps_file):
        text = Path(args.steps_file).read_text().strip()
        if text:
            return int(text)
    return args.steps


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200, help="committed steps to train")
    ap.add_argument("--steps-file", default=None, help="a file whose number, once it exists, replaces --steps")
    ap.add_argument("--model", default="mlp", choices=["mlp", "llama"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--topk", type=int, default=4, help="compression_topk (of chunks of 8; not with --preset)")
    ap.add_argument("--sync-every", type=int, default=1, help="DeMo's sync_every (local steps between exchanges)")
    ap.add_argument("--preset", default=None, help="a DeMo preset (e.g. from_scratch)")
    ap.add_argument("--overlap", action="store_true", help="DeMo's overlap=True (the exchange lands a step late)")
    ap.add_argument("--comm-budget", type=float, default=0.0, help="DeMo's comm_budget (0: no budget policy)")
    ap.add_argument("--policy-sync-every", type=int, default=None, help="DeMo's policy_sync_every")
    ap.add_argument("--policy-patience", type=int, default=None, help="DeMo's policy_patience")
    ap.add_argument("--slow-link", default=None, help="FROM:TO:SECONDS: sleep before each collective of those steps")
    ap.add_argument("--lighthouse", default=None, help="default TORCHFT_LIGHTHOUSE")
    ap.add_argument("--replica-id", default=None, help="default REPLICA_GROUP_ID")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds: collectives, should_commit, recovery")
    ap.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds to wait for torchft's quorum")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (emulates a longer step)")
    ap.add_argument("--seed", type=int, default=None, help="model init seed (default: the replica id)")
    ap.add_argument("--out", default=None, help="directory for replica<id>.json at the end")
    ap.add_argument("--die-at", default=None, help="STEP:POINT (before, inside, after, between, local): SIGKILL itself")
    ap.add_argument("--die-group", action="store_true", help="--die-at kills this process's whole process group")
    ap.add_argument("--drift-at", type=int, default=None, help="nudge a parameter after this step (the drift check)")
    ap.add_argument("--check-every", type=int, default=None, help="DeMo's check_every (the drift check's period)")
    ap.add_argument("--nan-at", type=int, default=None, help="a NaN gradient at this step (the non-finite guard)")
    ap.add_argument("--max-attempts", type=int, default=None, help="stop after this many steps tried")
    ap.add_argument("--digests", action="store_true", help="each step's line carries the parameters' SHA-256")
    ap.add_argument("--start-file", default=None, help="wait for this file before the first quorum (a harness)")
    ap.add_argument("--eval-batches", type=int, default=0, help="held-out batches for the final record's eval_loss")
    ap.add_argument(
        "--standby", default=None, help="a warm standby: ready, then wait for this file to name its replica id"
    )
    ap.add_argument(
        "--flip-at", action="append", default=[], help="STEP:header|payload[:BYTE]: a bit flipped on receipt"
    )
    ap.add_argument("--momentum-dir", default=None, help="keep this replica's momentum here (resumed on a restart)")
    ap.add_argument("--momentum-every", type=int, default=1, help="committed steps between momentum snapshots")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args()


def prepare(args, seed: int):
    """What a replica builds before its first quorum: the model, the corpus (``llama``) and DeMo over the model."""
    torch.set_num_threads(1)
    model = build(args.model, seed)
    shard, shards = shard_group(model, args.model)
    corpus = None
    if args.model == "llama":
        from hf_demo.stdlib_corpus import stdlib_bytes

        corpus = stdlib_bytes(1 << 20)
    shape = {} if args.preset else {"compression_topk": args.topk, "compression_chunk": 8}
    if args.sync_every > 1:
        shape["sync_every"] = args.sync_every
    if args.overlap:
        shape["overlap"] = True
    if args.check_every is not None:
        shape["check_every"] = args.check_every
    if args.comm_budget:
        shape["comm_budget"] = args.comm_budget
    for name in ("policy_sync_every", "policy_patience"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    opt = hf_demo.DeMo(model.parameters(), lr=args.lr, preset=args.preset, **shape)
    return model, corpus, opt, shard, shards


def wait_for_id(path: str) -> str:
    """A warm standby's wait: torchft's Manager imported, ``{"standby": "warm"}`` printed, then the replica id once
    ``path`` holds one (the launcher writes it whole: a rename)."""
    import torchft.manager  # noqa: F401 - imported now, not after the call
    import torchft.process_group  # noqa: F401

    print(json.dumps({"standby": "warm", "pid": os.getpid()}), flush=True)
    while not (os.path.exists(path) and Path(path).read_text().strip()):
        time.sleep(0.05)
    return Path(path).read_text().strip()


def train(args, replica: str, elastic, model, opt, corpus, shard: int = 0, shards: int = 1) -> float:
    """Steps until torchft's step reaches the target (``--steps``/``--steps-file``) or ``--max-attempts``; the
    last step's loss."""
    loss, started, attempts = float("nan"), time.monotonic(), 0
    while elastic.manager.current_step() < target(args) and attempts != args.max_attempts:
        attempts += 1
        elastic.start_step()
        step, batch = elastic.manager.current_step(), elastic.batch_index
        model.zero_grad(set_to_none=True)
        value = loss_of(model, args.model, batch * shards + shard, corpus)  # HSDP: each shard rank its part
        value.backward()
        if step == args.nan_at:
            next(model.parameters()).grad.fill_(float("nan"))
        time.sleep(args.step_seconds)
        getattr(elastic, "die", lambda at: None)("before")
        elastic.step()  # the wrapper steps DeMo (a plain opt.step() is refused while it wraps it)
        getattr(elastic, "die", lambda at: None)("between")
        if step == args.drift_at and elastic.last_committed:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3  # this replica alone: a bit flip, a kernel's noise
        loss = value.item()
        if not args.quiet:
            line = {"replica": replica, "shard": shard, "step": step, "batch": batch,
                    "committed": elastic.last_committed, "quorum": elastic.world, "loss": round(loss, 5),
                    "tier": opt.tier, "local": opt.tiers[opt.tier].sync_every > 1, "unsynced": bool(opt.unsynced),
                    "time": round(time.monotonic() - started, 3), "momentum": momentum(opt)}  # fmt: skip
            if args.digests:
                line["digest"] = digest(model)
            if not elastic.last_committed:
                line["error"] = elastic.stats.last_error
            print(json.dumps(line), flush=True)
    return loss


def main() -> None:
    args = parse()
    own = args.replica_id if args.replica_id is not None else os.environ.get("REPLICA_GROUP_ID", "0")
    # each replica may start from its own weights: the first quorum gives every replica the same (torchft's
    # init_sync); a standby's are replaced by the agreed state when it joins
    seed = args.seed if args.seed is not None else (0 if args.standby else int(own))
    model, corpus, opt, shard, shards = prepare(args, seed)
    replica = wait_for_id(args.standby) if args.standby else own
    elastic = Elastic(opt, model, lighthouse=args.lighthouse, replica_id=replica, min_replicas=args.min_replicas,
                      timeout=args.timeout, quorum_timeout=args.quorum_timeout, batch_size=BATCH[args.model],
                      momentum_dir=args.momentum_dir,
                      momentum_every=args.momentum_every)  # fmt: skip
    elastic.add_listener(lambda e: print(json.dumps({"event": dataclasses.asdict(e), "momentum": momentum(opt)}),
                                         flush=True))  # fmt: skip
    die_at(args.die_at, elastic, args.die_group)
    slow_link(args.slow_link, elastic)
    for spec in args.flip_at:
        flip_at(spec, elastic)
    print(json.dumps({"ready": replica}), flush=True)
    while args.start_file and not os.path.exists(args.start_file):
        time.sleep(0.05)
    started = time.monotonic()
    try:
        loss = train(args, replica, elastic, model, opt, corpus, shard, shards)
    except Exception as exc:  # noqa: BLE001 - named on stdout and stderr, then out: torchft's threads would keep it
        print(
            json.dumps({"error": f"{type(exc).__name__}: {exc}", "at_step": elastic.manager.current_step()}), flush=True
        )
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if args.overlap:
        opt.flush()  # the last exchange in flight lands, on every replica (they all end at the same step)
    eval_loss = held_out(model, args.model, args.eval_batches, corpus)
    record = {"replica": replica, "shard": shard, "eval_loss": eval_loss, "digest": digest(model),
              "steps": elastic.manager.current_step(),
              "demo_steps": opt.steps, "skipped_steps": opt.skipped_steps, "resyncs": opt.resyncs, "loss": loss,
              "policy": opt.policy.state_dict(),
              "seconds": time.monotonic() - started, "batches_committed": elastic.manager.batches_committed(),
              "events": [dataclasses.asdict(e) for e in elastic.events], **elastic.stats.as_dict()}  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"replica{replica}" if shards == 1 else f"replica{replica}-{shard}"
        Path(args.out, f"{name}.json").write_text(json.dumps(record))
    print(json.dumps({"done": record}), flush=True)
    elastic.shutdown()
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads would keep the process waiting


if __name__ == "__main__":
    main()
