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
- ``all_reduce``: one rank per step (rotating: ``step % W``) picks the positions and broadcasts them; every
  rank sends its values at those positions and an all-reduce sums them; each coefficient is the mean over
  all ranks. Only values travel in the reduction, so the bytes per rank stay flat in ``W`` (a ring
  all-reduce moves ``2 (W-1)/W`` of the buffer), plus one broadcast of the positions.
"""

from __future__ import annotations

import torch

from . import codec
from . import functional as F
from .blocks import BlockLayout
from .errors import DeMoSyncError, lookup


class AllGatherExchange:
    name = "all_gather"

    def __init__(
        self,
        layouts: list[BlockLayout],
        value_format: str,
        secret: bytes | None,
        index_coding: str,
        average: str = "pickers",
    ):
        self.layouts = layouts
        self.weights = F.WEIGHTS[average]
        self.codec = codec.PayloadCodec(layouts, value_format, index_coding)
        self.payload_nbytes = self.codec.nbytes
        self.secret = secret

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

    def __init__(
        self,
        layouts: list[BlockLayout],
        value_format: str,
        secret: bytes | None,
        index_coding: str,
        average: str = "world",
    ):
        if average != "world":  # every rank sends values at the same positions: the mean is over all of them
            raise ValueError(f"exchange='all_reduce' averages over every rank, not {average!r}")
        if value_format not in self.VALUE_DTYPES:
            raise ValueError(
                f"exchange='all_reduce' sums values, so value_format must be one of "
                f"{', '.join(self.VALUE_DTYPES)} (got {value_format!r}); use exchange='all_gather' for sign"
            )
        self.layouts = layouts
        self.dtype = self.VALUE_DTYPES[value_format]
        self.secret = secret  # positions and sums are the same bytes on every rank: the drift check covers them
        self.indices = codec.index_coding(index_coding)
        self.index_offsets, off = [], 0
        for layout in layouts:
            self.index_offsets.append(off)
            off += self.indices.nbytes(layout)
        self.index_nbytes = off
        self.payload_nbytes = 0  # nothing is announced before the headers: positions follow them

    def prepare(self, working: list[torch.Tensor]) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=working[0].device if working else "cpu")

    def communicate(self, transport, headers, payload, working) -> list[torch.Tensor]:
        device = working[0].device if working else torch.device("cpu")
        leader = transport.step % transport.world
        positions = torch.zeros(self.index_nbytes, dtype=torch.uint8, device=device)
        if transport.rank == leader:
            wires = self.indices.pack_many(
                [F.select(m, layout.k)[0] for m, layout in zip(working, self.layouts)], self.layouts
            )
            for wire, off in zip(wires, self.index_offsets):
                positions[off : off + wire.numel()] = wire
        transport.broadcast(positions, leader, "positions")
        wires = [
            positions[None, off : off + self.indices.nbytes(layout)]
            for layout, off in zip(self.layouts, self.index_offsets)
        ]
        chosen = []
        for layout, idx in zip(self.layouts, self.indices.unpack_many(wires, self.layouts)):
            idx = idx[0]
            if bool((idx >= layout.bsize).any()):
                raise DeMoSyncError(
                    f"rank {transport.rank}: positions broadcast by rank {leader} at optimizer step "
                    f"{transport.step} are out of range for a block of {layout.bsize}: corrupted on the way"
                )
            chosen.append(idx)
        # every rank contributes its own values at the agreed positions, exactly as they travel
        contributions = [m.gather(1, idx).to(self.dtype) for m, idx in zip(working, chosen)]
        sums = transport.all_reduce(torch.cat([c.reshape(-1) for c in contributions]), "values")
        if not bool(sums.isfinite().all()):
            raise DeMoSyncError(
                f"rank {transport.rank}: the summed values of optimizer step {transport.step} hold NaN/Inf"
            )
        out, start = [], 0
        for m, idx, mine, layout in zip(working, chosen, contributions, self.layouts):
            F.feedback(m, idx, mine.float())
            n = mine.numel()
            mean = sums[start : start + n].float().view_as(idx) / transport.world
            out.append(F.densify(idx, mean, layout))
            start += n
        return out


EXCHANGES_BY_NAME = {cls.name: cls for cls in (AllGatherExchange, AllReduceExchange)}
EXCHANGES = tuple(EXCHANGES_BY_NAME)


def get(name: str):
    return lookup(EXCHANGES_BY_NAME, "exchange", name)
