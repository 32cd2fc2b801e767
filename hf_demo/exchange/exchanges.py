"""How selected coefficients move between ranks and become one averaged update (identical on every rank).

An exchange works on the step's *working* momenta (copies: the optimizer commits them only when the whole
step succeeded) in two phases:

- ``prepare(working)``: local work before the headers travel; subtracts what will be sent from the working
  momenta (error feedback) where the choice is local, and returns the payload whose CRC32/HMAC the header
  carries (empty when nothing is known yet);
- ``communicate(transport, headers, payload, working)``: the collectives, validation of everything
  received, and the averaged DCT-domain coefficients per parameter, dense ``(nblocks, bsize)``.

Exchanges (:data:`EXCHANGES`):

- ``all_gather`` (default): each rank sends its own top-k positions and values; each coefficient is the
  mean over the ranks that picked it (``average="pickers"``, every-step DeMo's rule), or at a
  synchronisation of ``sync_every > 1`` the mean over all ranks (``average="world"``: a rank that did not
  pick it counts zero, the average of the ranks' pseudo-gradients). Each rank receives ``W - 1`` payloads.
- ``all_reduce``: every rank sends its values at the same agreed positions and an all-reduce sums them, so
  each coefficient is the mean over all ranks. Only values travel in the reduction: the bytes per rank stay
  flat in ``W`` (a ring all-reduce moves ``2 (W-1)/W`` of the buffer, the least any all-reduce can). How the
  positions are agreed (``reduce_positions``, :data:`REDUCE_POSITIONS`):

  - ``union`` (default): each rank nominates the top ``k // W`` (at least 1) positions of its own momentum
    per block and the nominations are all-gathered (under the header's CRC32/HMAC, like any payload); the
    union (``W * (k // W)`` slots, a position nominated twice counted once) is where every rank's values are
    summed. Every rank's energetic coefficients get in, and positions cost ``(W-1)/W`` of one top-k index
    set per rank.
  - ``leader``: one rank per step (rotating: ``step % W``) picks all ``k`` positions and broadcasts them;
    the other ranks' energetic coefficients wait in their residuals until their turn.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_demo.compression import functional as F
from hf_demo.compression.blocks import BlockLayout
from hf_demo.errors import DeMoSyncError, lookup
from hf_demo.wire import codec

REDUCE_POSITIONS = ("union", "leader")  # how exchange="all_reduce" agrees on positions (see above)


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """What one step's exchange needs to know, whichever exchange it is (the optimizer builds one per step)."""

    layouts: list[BlockLayout]
    value_format: str
    index_coding: str
    secret: bytes | None = None
    average: str | None = None  # "pickers" or "world" (functional.WEIGHTS); None: the exchange's own rule
    world: int = 1
    positions: str = REDUCE_POSITIONS[0]  # exchange="all_reduce"; the optimizer passes the setting


class AllGatherExchange:
    name = "all_gather"

    def __init__(self, spec: ExchangeSpec):
        self.layouts = spec.layouts
        self.weights = F.WEIGHTS[spec.average or "pickers"]
        self.codec = codec.PayloadCodec(spec.layouts, spec.value_format, spec.index_coding)
        self.payload_nbytes = self.codec.nbytes
        self.secret = spec.secret

    def prepare(self, working: list[torch.Tensor]) -> torch.Tensor:
        selections = [F.select(m, layout.k) for m, layout in zip(working, self.layouts)]
        device = working[0].device if working else torch.device("cpu")
        payload, sent = self.codec.encode(selections, device)
        for m, (idx, _), values in zip(working, selections, sent):
            F.feedback(m, idx, values)
        return payload

    def communicate(self, transport, headers, payload, working) -> list[torch.Tensor]:
        return self.finish(transport.all_gather(payload, "payload"), headers, transport.rank, transport.step)

    def finish(self, received: torch.Tensor, headers, rank: int, step: int) -> list[torch.Tensor]:
        """Every rank's payload row -> the averaged coefficients (validated first)."""
        codec.verify_rows(headers, received, self.secret, rank, step)
        return [
            F.densify(*self.weights(idx, values, layout), layout)
            for (idx, values), layout in zip(self.codec.decode(received), self.layouts)
        ]


class AllReduceExchange:
    name = "all_reduce"
    VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def __init__(self, spec: ExchangeSpec):
        if spec.average not in (None, "world"):  # every rank sends values at the same positions: mean over all
            raise ValueError(f"exchange='all_reduce' averages over every rank, not {spec.average!r}")
        if spec.value_format not in self.VALUE_DTYPES:
            raise ValueError(
                f"exchange='all_reduce' sums values, so value_format must be one of "
                f"{', '.join(self.VALUE_DTYPES)} (got {spec.value_format!r}); use exchange='all_gather' for sign"
            )
        self.layouts = spec.layouts
        self.dtype = self.VALUE_DTYPES[spec.value_format]
        self.secret = spec.secret
        self.union = spec.positions == "union"
        # union: each rank nominates k // W positions per block; leader: one rank picks all k
        self.nominated = [
            dataclasses.replace(layout, k=max(1, layout.k // spec.world)) if self.union else layout
            for layout in spec.layouts
        ]
        self.indices = codec.index_coding(spec.index_coding)
        self.index_offsets, off = [], 0
        for layout in self.nominated:
            self.index_offsets.append(off)
            off += self.indices.nbytes(layout)
        self.index_nbytes = off
        # union: the nominations are the payload the headers vouch for; leader: positions follow the headers
        self.payload_nbytes = off if self.union else 0

    def _positions(self, working: list[torch.Tensor], device) -> torch.Tensor:
        """This rank's nominated positions, index-coded: one buffer for every parameter."""
        wires = self.indices.pack_many(
            [F.select(m, layout.k)[0] for m, layout in zip(working, self.nominated)], self.nominated
        )
        buf = torch.zeros(self.index_nbytes, dtype=torch.uint8, device=device)
        for wire, off in zip(wires, self.index_offsets):
            buf[off : off + wire.numel()] = wire
        return buf

    def prepare(self, working: list[torch.Tensor]) -> torch.Tensor:
        device = working[0].device if working else torch.device("cpu")
        if self.union:
            return self._positions(working, device)
        return torch.empty(0, dtype=torch.uint8, device=device)

    def communicate(self, transport, headers, payload, working) -> list[torch.Tensor]:
        device = working[0].device if working else torch.device("cpu")
        if self.union:
            rows = transport.all_gather(payload, "positions")
            codec.verify_rows(headers, rows, self.secret, transport.rank, transport.step)
        else:
            leader = transport.step % transport.world
            if transport.rank == leader:
                buf = self._positions(working, device)
            else:
                buf = torch.zeros(self.index_nbytes, dtype=torch.uint8, device=device)
            rows = transport.broadcast(buf, leader, "positions")[None]  # after the headers: not under their CRC
        chosen, keep = [], []
        for i, (layout, idx) in enumerate(zip(self.layouts, self._unpack(rows))):
            bad = (idx >= layout.bsize).flatten(1).any(1)
            if bool(bad.any()):
                source = (
                    f"nominated by rank(s) {bad.nonzero().flatten().tolist()}"
                    if self.union
                    else f"broadcast by rank {transport.step % transport.world}"
                )
                raise DeMoSyncError(
                    f"rank {transport.rank}: out-of-range positions for parameter {i} (shape {layout.shape}, "
                    f"block of {layout.bsize}) {source} at optimizer step {transport.step}: corrupted payload"
                )
            # every rank's nominations one after the other: (nblocks, W * k_nominated)
            chosen.append(idx.permute(1, 0, 2).reshape(layout.nblocks, -1))
            keep.append(F.first_occurrences(idx, layout) if self.union else None)
        # every rank contributes its own values at the agreed positions (once each), exactly as they travel
        contributions = []
        for m, idx, first in zip(working, chosen, keep):
            mine = m.gather(1, idx)
            contributions.append((mine if first is None else mine * first).to(self.dtype))
        if not contributions:  # nothing to send (every parameter frozen, or a hierarchy shard without one):
            return []  # the same on every rank of the group, whose layouts the headers proved equal
        sums = transport.all_reduce(torch.cat([c.reshape(-1) for c in contributions]), "values")
        if not bool(sums.isfinite().all()):
            raise DeMoSyncError(
                f"rank {transport.rank}: the summed values of optimizer step {transport.step} hold NaN/Inf"
            )
        out, start = [], 0
        for m, idx, mine, nominated in zip(working, chosen, contributions, self.nominated):
            F.feedback(m, idx, mine.float())
            n = mine.numel()
            mean = sums[start : start + n].float().view_as(idx) / transport.world
            out.append(F.densify(idx, mean, nominated))  # runs of one rank's nominations: no repeats within
            start += n
        return out

    def _unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """(senders, index_nbytes) -> per parameter (senders, nblocks, k_nominated) positions."""
        wires = [
            rows[:, off : off + self.indices.nbytes(layout)] for layout, off in zip(self.nominated, self.index_offsets)
        ]
        return self.indices.unpack_many(wires, self.nominated)


EXCHANGES_BY_NAME = {cls.name: cls for cls in (AllGatherExchange, AllReduceExchange)}
EXCHANGES = tuple(EXCHANGES_BY_NAME)


def get(name: str):
    return lookup(EXCHANGES_BY_NAME, "exchange", name)


def build(name: str, spec: ExchangeSpec):
    """The exchange ``name`` for one step (raises ValueError, naming the fix, on settings it refuses)."""
    return get(name)(spec)
