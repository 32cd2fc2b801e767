"""``hf_demo.DeMo``: Decoupled Momentum Optimization as a ``torch.optim.Optimizer``.

One step, top to bottom (each stage is a function in :mod:`hf_demo.functional`, :mod:`hf_demo.codec` or
:mod:`hf_demo.comm`):

1. check local gradients for NaN/Inf and exchange the 64-byte headers (collective 1);
2. per parameter: momentum += DCT(grad) in the DCT domain, select top-k per block, quantize, error
   feedback, pack into the one payload;
3. all-gather the payload (collective 2);
4. unpack and validate every rank's coefficients, then per parameter: mean over the ranks that selected
   each coefficient, inverse DCT, update.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from . import codec, functional as F
from .blocks import MAX_BLOCK_SIZE, BlockLayout, decode, plan
from .comm import CommStats, all_gather_bytes, check_headers, nonfinite_ranks
from .errors import DeMoNonFiniteError, DeMoStateError, DeMoSyncError

NONFINITE_POLICIES = ("skip", "raise")


class DeMo(torch.optim.Optimizer):
    """Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024).

    Args:
        params: parameters or parameter groups. Groups may override ``lr``, ``weight_decay``,
            ``compression_decay``, ``compression_topk``, ``compression_chunk`` and ``sign_update``.
        lr: learning rate; also scales the gradient into the momentum, as in the reference.
        compression_decay: momentum decay (0 <= decay < 1 recommended; must be in [0, 1]).
        compression_topk: coefficients kept per block.
        compression_chunk: block side (1..256; blocks of chunk x chunk for matrices, chunk for vectors).
        weight_decay: decoupled weight decay, ``p *= 1 - lr*weight_decay``.
        process_group: the group to communicate in; default the world group when
            ``torch.distributed`` is initialised, otherwise a world of one.
        value_format: ``"bf16"`` (default), ``"fp32"`` or ``"sign"`` (1 bit and a per-block scale).
        sign_update: step with ``sign(update)`` (default, as the reference) or the raw update.
        nonfinite: ``"skip"`` (every rank skips a step in which any rank saw NaN/Inf gradients; momentum
            untouched) or ``"raise"``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 process_group=None, *, value_format: str = "bf16", sign_update: bool = True,
                 nonfinite: str = "skip"):
        if value_format not in codec.VALUE_FORMATS:
            raise ValueError(f"value_format must be one of {codec.VALUE_FORMATS}, got {value_format!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        defaults = dict(lr=lr, compression_decay=compression_decay, compression_topk=compression_topk,
                        compression_chunk=compression_chunk, weight_decay=weight_decay,
                        sign_update=sign_update)
        self.process_group = process_group
        self.value_format = value_format
        self.nonfinite = nonfinite
        self.comm_stats = CommStats()
        self.steps = 0           # optimizer steps taken in lockstep, skipped ones included
        self.skipped_steps = 0
        self._saved_world: tuple[int, int] | None = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ configuration
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1])

    def _world(self):
        if dist.is_available() and dist.is_initialized():
            group = self.process_group or dist.group.WORLD
            return group, dist.get_rank(group), dist.get_world_size(group)
        return None, 0, 1

    def _plan(self):
        """[(param, group, layout, offset)], payload length, layout checksum, settings checksum."""
        items, offset, layout_key, settings_key = [], 0, [], [self.value_format]
        for group in self.param_groups:
            _validate_group(group)
            settings_key.append((float(group["lr"]), float(group["weight_decay"]),
                                 float(group["compression_decay"]), bool(group["sign_update"])))
            for p in group["params"]:
                layout = plan(tuple(p.shape), group["compression_chunk"], group["compression_topk"])
                items.append((p, group, layout, offset))
                layout_key.append((layout, str(p.dtype)))
                offset += codec.segment_bytes(layout, self.value_format)
        return items, offset, codec.checksum(tuple(layout_key)), codec.checksum(tuple(settings_key))

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group, rank, world = self._world()
        self._check_saved_world(rank, world)
        items, payload_len, layout_ck, settings_ck = self._plan()
        self.comm_stats.start_step(4 * sum(layout.numel for _, _, layout, _ in items))

        # 1. headers: every rank learns every rank's step, layout, settings and non-finite flag
        header = codec.Header(step=self.steps, layout_checksum=layout_ck, settings_checksum=settings_ck,
                              flags=codec.FLAG_NONFINITE if self._local_nonfinite(items) else 0,
                              world_size=world, payload_bytes=payload_len)
        device = items[0][0].device if items else torch.device("cpu")
        gathered = all_gather_bytes(header.to_bytes().to(device), group, world, self.comm_stats)
        headers = [codec.Header.from_bytes(row.cpu()) for row in gathered]
        check_headers(headers, rank)
        bad = nonfinite_ranks(headers)
        if bad:
            if self.nonfinite == "raise":
                raise DeMoNonFiniteError(f"non-finite gradients on rank(s) {bad} at optimizer step "
                                         f"{self.steps}; no state was changed (nonfinite='raise')")
            self.steps += 1
            self.skipped_steps += 1
            return loss

        # 2. momentum -> select -> quantize -> error feedback -> pack
        payload = torch.empty(payload_len, dtype=torch.uint8, device=device)
        for p, g, layout, off in items:
            momentum = self._momentum(p, layout)
            F.accumulate(momentum, p.grad, layout, g["compression_decay"], g["lr"])
            idx, values = F.select(momentum, layout.k)
            sent, wire = codec.quantize(values, self.value_format)
            F.feedback(momentum, idx, sent)
            ib = codec.index_bytes(layout)
            payload[off: off + ib] = codec.pack_indices(idx)
            payload[off + ib: off + ib + wire.numel()] = wire

        # 3. gather
        received = all_gather_bytes(payload, group, world, self.comm_stats)

        # 4. unpack and validate everything before touching any parameter, then average -> decode -> update
        coefficients = [self._unpack(received, i, layout, off) for i, (_, _, layout, off) in enumerate(items)]
        for (p, g, layout, _), (idx, values) in zip(items, coefficients):
            update = decode(F.densify(*F.mean_weights(idx, values, layout), layout), layout)
            F.apply_update(p, update, g["lr"], g["weight_decay"], g["sign_update"])
        self.steps += 1
        return loss

    def _momentum(self, p: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros(layout.nblocks, layout.bsize, dtype=torch.float32, device=p.device)
        return state["momentum"]

    def _local_nonfinite(self, items) -> bool:
        grads = [p.grad for p, _, _, _ in items if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise ValueError("DeMo does not support sparse gradients")
        if not grads:
            return False
        norms = torch._foreach_norm(grads)
        return not bool(torch.stack([n.float() for n in norms]).isfinite().all())

    def _unpack(self, received: torch.Tensor, i: int, layout: BlockLayout, off: int):
        ib = codec.index_bytes(layout)
        end = off + codec.segment_bytes(layout, self.value_format)
        idx = codec.unpack_indices(received[:, off: off + ib], layout.nblocks, layout.k)
        values = codec.dequantize(received[:, off + ib: end], self.value_format, layout.nblocks, layout.k)
        if bool((idx >= layout.bsize).any()):
            ranks = sorted(set((idx >= layout.bsize).flatten(1).any(1).nonzero().flatten().tolist()))
            raise DeMoSyncError(f"received out-of-range indices for parameter {i} (shape {layout.shape}, "
                                f"block of {layout.bsize}) from rank(s) {ranks}: corrupted payload")
        if not bool(values.isfinite().all()):
            ranks = sorted(set((~values.isfinite()).flatten(1).any(1).nonzero().flatten().tolist()))
            raise DeMoSyncError(f"received NaN/Inf coefficients for parameter {i} (shape {layout.shape}) "
                                f"from rank(s) {ranks}")
        return idx, values

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        _, rank, world = self._world()
        sd = super().state_dict()
        sd["demo"] = {"format_version": codec.FORMAT_VERSION, "steps": self.steps,
                      "skipped_steps": self.skipped_steps, "rank": rank, "world_size": world,
                      "value_format": self.value_format,
                      "comm": {k: v for k, v in self.comm_stats.as_dict().items() if k.startswith("total_")
                               or k == "steps"}}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("demo", None)
        if extra is None:
            raise DeMoStateError("this optimizer state was not saved by hf_demo.DeMo (no 'demo' entry)")
        if extra.get("format_version") != codec.FORMAT_VERSION:
            raise DeMoStateError(f"optimizer state has format version {extra.get('format_version')}, "
                                 f"this hf_demo reads {codec.FORMAT_VERSION}")
        saved_momenta = {pid: s["momentum"] for pid, s in state_dict.get("state", {}).items() if "momentum" in s}
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter dtype; momentum stays fp32 whatever the parameter
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        for pid, (p, group) in zip(ids, ((p, g) for g in self.param_groups for p in g["params"])):
            if pid not in saved_momenta:
                continue
            layout = plan(tuple(p.shape), group["compression_chunk"], group["compression_topk"])
            m = saved_momenta[pid]
            if tuple(m.shape) != (layout.nblocks, layout.bsize):
                raise DeMoStateError(f"saved momentum of parameter {pid} has shape {tuple(m.shape)}, this "
                                     f"model needs {(layout.nblocks, layout.bsize)} (shape {tuple(p.shape)}, "
                                     f"chunk {group['compression_chunk']}, top-k {group['compression_topk']})")
            self.state[p]["momentum"] = m.to(device=p.device, dtype=torch.float32, copy=True)
        self.steps = int(extra["steps"])
        self.skipped_steps = int(extra["skipped_steps"])
        self.comm_stats.load(extra.get("comm", {}))
        self._saved_world = (int(extra["rank"]), int(extra["world_size"]))
        _, rank, world = self._world()
        if dist.is_available() and dist.is_initialized():
            self._check_saved_world(rank, world)

    def _check_saved_world(self, rank: int, world: int) -> None:
        if self._saved_world is None:
            return
        saved_rank, saved_world = self._saved_world
        if saved_world != world:
            raise DeMoStateError(f"optimizer state was saved with {saved_world} process(es) but this run has "
                                 f"{world}: each rank's momentum is its own, resume with {saved_world} processes "
                                 "(or start the optimizer afresh)")
        if saved_rank != rank:
            raise DeMoStateError(f"rank {rank} loaded the optimizer state saved by rank {saved_rank}; "
                                 "each rank must load its own state")
        self._saved_world = None


def _validate_group(group: dict) -> None:
    def bad(name, why):
        raise ValueError(f"DeMo: invalid {name}={group[name]!r}: {why}")

    lr, wd, decay = group["lr"], group["weight_decay"], group["compression_decay"]
    chunk, topk = group["compression_chunk"], group["compression_topk"]
    if isinstance(lr, torch.Tensor):
        bad("lr", "a tensor learning rate is not supported; pass a float")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        bad("lr", "must be a finite number >= 0")
    if not (isinstance(wd, (int, float)) and math.isfinite(wd) and wd >= 0):
        bad("weight_decay", "must be a finite number >= 0")
    if not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
        bad("compression_decay", "must be in [0, 1]")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk * chunk <= MAX_BLOCK_SIZE:
        bad("compression_chunk", "must be an integer in [1, 256] (indices travel as 16-bit)")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        bad("compression_topk", "must be an integer >= 1")
    if topk > chunk * chunk:
        bad("compression_topk", f"cannot exceed the block size chunk*chunk = {chunk * chunk}")
    if not isinstance(group["sign_update"], bool):
        bad("sign_update", "must be True or False")
