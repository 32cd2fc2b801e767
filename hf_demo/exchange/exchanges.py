"""How selected coefficients move between ranks and become one averaged update (identical on every rank).

An exchange works on the step's *working* momenta (copies: the optimizer commits them only when the whole
step succeeded) in two phases:

- ``prepare(working)``: local work before the headers travel; subtracts what will be sent from the working
  momenta (error feedback) where the choice is local, and returns the payload whose CRC32/HMAC the header
  carries (empty when nothing is known yet);
- ``start(transport, headers, payload, working, arrived=None)``: the collectives (the last one may still be
  running when it returns: overlap), as an :class:`InFlight`; ``arrived``: every rank's payload, where it rode
  in the headers' all-gather (an exchange whose first collective is that all-gather says so: ``rides``), so
  that collective is not run again; ``finish(in_flight, traffic)``: waits for it, validates
  everything received (raising :class:`~hf_demo.errors.DeMoPayloadError` on this rank) and returns the averaged
  coefficients per parameter, dense ``(nblocks, bsize)``. ``communicate`` is both at once.

An :class:`InFlight` is what a checkpoint keeps of an exchange still running: :meth:`InFlight.to_state`.

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
import functools

import torch

from hf_demo import compression
from hf_demo import compression as F
from hf_demo.compression import BlockLayout
from hf_demo.errors import DeMoPayloadError, DeMoStateError, lookup
from hf_demo.exchange.collectives import REPLICAS, CollectiveSpec
from hf_demo.exchange.transport import Pending, Traffic
from hf_demo.refusals import refuse
from hf_demo.wire import codec
from hf_demo.wire.sealing import Envelope

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
    sealer: object = None  # HF_DEMO_ENCRYPT=1: the payloads travel sealed (hf_demo.wire.sealing), not HMAC-tagged


@dataclasses.dataclass
class InFlight:
    """An exchange whose collectives have started: ``data`` is the last collective (a running :class:`Pending`
    or its result); ``positions`` the agreed positions' rows (all_reduce). Validated by ``finish``."""

    step: int
    rank: int
    world: int
    headers: list
    data: Pending | torch.Tensor
    positions: torch.Tensor | None = None
    refused: DeMoPayloadError | None = None  # what this rank found wrong while starting it (raised by finish)
    agreed: list | None = dataclasses.field(default=None, repr=False)  # the decoded positions (not saved)

    collective: Pending | None = dataclasses.field(default=None, repr=False)  # what data was, once waited for
    envelopes: list | None = None  # sealed rows (HF_DEMO_ENCRYPT=1): each sender's, from this step's headers

    def wait(self, traffic: Traffic) -> torch.Tensor:
        if isinstance(self.data, Pending):
            self.collective = self.data
            self.data = self.data.wait(traffic)  # done: a failure after this does not wait twice
        return self.data

    @property
    def arrived(self) -> Pending | None:
        """The background collective, once it has been waited for (its traffic then happened)."""
        return self.collective

    def to_state(self, traffic: Traffic) -> dict:
        rows = self.wait(traffic)
        state = {"rows": rows.clone(), "headers": torch.stack([h.to_bytes() for h in self.headers])}
        if self.positions is not None:
            state["positions"] = self.positions.clone()
        if self.envelopes is not None:  # what opens the rows after a restart: no secret, no plaintext
            state["envelopes"] = [  # None: a header this rank refused (the exchange is refused when finished)
                None if e is None else [e.sender, e.session.hex(), e.tries, e.aad.hex()] for e in self.envelopes
            ]
        return state

    @classmethod
    def from_state(cls, state: dict, step: int, rank: int, world: int, device) -> InFlight:
        positions = state.get("positions")
        envelopes = state.get("envelopes")
        if envelopes is not None:
            envelopes = [
                None if e is None else Envelope(int(e[0]), bytes.fromhex(e[1]), int(e[2]), bytes.fromhex(e[3]))
                for e in envelopes
            ]
        return cls(
            step,
            rank,
            world,
            [codec.Header.from_bytes(row) for row in state["headers"]],
            state["rows"].to(device, copy=True),
            None if positions is None else positions.to(device, copy=True),
            envelopes=envelopes,
        )


class AllGatherExchange:
    name = "all_gather"
    rides = True  # its one collective is an all-gather of the payload: it can ride with the headers
    riding_name = "payload"
    collectives = (CollectiveSpec("payload", "all_gather", REPLICAS, "payload", overlaps=True),)  # what start runs

    def __init__(self, spec: ExchangeSpec):
        self.layouts = spec.layouts
        self.weights = F.WEIGHTS[spec.average or "pickers"]
        self.codec = codec.PayloadCodec(spec.layouts, spec.value_format, spec.index_coding)
        self.payload_nbytes = self.codec.nbytes
        self.secret = spec.secret
        self.sealer = spec.sealer

    def prepare(self, working: list[torch.Tensor]) -> torch.Tensor:
        """Top-k, the payload and error feedback, once per bucket (``working``: the per-parameter momenta, best
        :class:`~hf_demo.compression.Bucketed` over this exchange's buckets: the feedback then lands in
        their rows directly)."""
        bucketing = self.codec.bucketing
        rows = compression.bucket_rows(working, bucketing)
        selections = [F.select(m, bucket.k) for m, bucket in zip(rows, bucketing.buckets)]
        device = working[0].device if working else torch.device("cpu")
        payload, sent = self.codec.encode_buckets(selections, device)
        for m, (idx, _), values in zip(rows, selections, sent):
            F.feedback(m, idx, values)
        compression.write_back(working, rows, bucketing)
        return payload

    def start(
        self, transport, headers, payload, working, background: bool = False, arrived=None, skipped: bool = False
    ) -> InFlight:
        """Every rank's payload row (``skipped``: a step every rank skips, whose payload is zeros already)."""
        # the senders' envelopes of this step: overlap opens the rows after the next step's headers
        envelopes = None if self.sealer is None else list(self.sealer.envelopes)
        if arrived is not None:  # every rank's payload rode with the headers (sealed there, where sealing)
            return InFlight(transport.step, transport.rank, transport.world, headers, arrived, envelopes=envelopes)
        if self.sealer is not None:
            payload = self.sealer.seal(payload, transport.step, "payload")
        if background:
            rows = transport.start_all_gather(payload, "payload")
        else:
            rows = transport.all_gather(payload, "payload")
        return InFlight(transport.step, transport.rank, transport.world, headers, rows, envelopes=envelopes)

    def finish(self, in_flight: InFlight, traffic: Traffic) -> list[torch.Tensor]:
        """Every rank's payload row -> the averaged coefficients (validated first)."""
        received = in_flight.wait(traffic)
        if in_flight.refused is not None:  # a header refused when it started (overlap)
            raise in_flight.refused
        if in_flight.envelopes is not None:
            if self.sealer is None:
                raise DeMoStateError(
                    f"the exchange in flight (optimizer step {in_flight.step}) was sent encrypted, and this optimizer "
                    f"has no key to open it: resume with HF_DEMO_ENCRYPT=1 and the same HF_DEMO_SECRET"
                )
            received = self.sealer.open_rows(
                received, in_flight.step, "payload", in_flight.rank, envelopes=in_flight.envelopes
            )
        codec.verify_rows(in_flight.headers, received, self.secret, in_flight.rank, in_flight.step)
        bucketing = self.codec.bucketing
        dense = [
            F.densify(*self.weights(idx, values, bucket), bucket)
            for (idx, values), bucket in zip(self.codec.decode_buckets(received), bucketing.buckets)
        ]
        return compression.Bucketed.of(dense, bucketing)


class AllReduceExchange:
    name = "all_reduce"
    VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def __init__(self, spec: ExchangeSpec):
        if spec.average not in (None, "world"):  # every rank sends values at the same positions: mean over all
            raise ValueError(f"exchange='all_reduce' averages over every rank, not {spec.average!r}")
        if spec.value_format not in self.VALUE_DTYPES:
            refuse("all_reduce_scaled_values", allowed=", ".join(self.VALUE_DTYPES), value_format=spec.value_format)
        self.layouts = spec.layouts
        self.dtype = self.VALUE_DTYPES[spec.value_format]
        self.secret = spec.secret
        self.union = spec.positions == "union"
        self.bucketing = compression.plan_buckets(tuple(spec.layouts))
        # union: each rank nominates k // W positions per block; leader: one rank picks all k
        world = spec.world
        self.picked = self.bucketing.with_k(lambda k: max(1, k // world)) if self.union else self.bucketing
        self.nominated = list(self.picked.layouts)
        self.indices = codec.index_coding(spec.index_coding)
        self.map = codec.wire_map(self.picked, None, spec.index_coding)
        self.index_offsets, self.index_nbytes = self.map.offsets, self.map.nbytes
        # union: the nominations are the payload the headers vouch for; leader: positions follow the headers
        self.payload_nbytes = self.index_nbytes if self.union else 0
        self.rides = self.union  # the nominations' all-gather can ride with the headers; the leader's broadcast not
        self.riding_name = "positions"

    def _positions(self, working: list[torch.Tensor], device) -> torch.Tensor:
        """This rank's nominated positions, index-coded: one buffer for every parameter."""
        streams = [
            self.indices.pack_rows(F.select(m, b.k)[0], b.bsize, b.k).reshape(-1)
            for m, b in zip(compression.bucket_rows(working, self.bucketing), self.picked.buckets)
        ]
        return self.map.assemble(streams, device)

    @property
    def collectives(self) -> tuple[CollectiveSpec, ...]:
        """What :meth:`start` runs: the positions (every rank's nominations all-gathered, or the leader's
        broadcast), then the sum of the values at them."""
        positions = CollectiveSpec("positions", "all_gather" if self.union else "broadcast", REPLICAS, "positions")
        return positions, CollectiveSpec("values", "all_reduce", REPLICAS, "values", overlaps=True)

    def prepare(self, working: list[torch.Tensor]) -> torch.Tensor:
        device = working[0].device if working else torch.device("cpu")
        if self.union:
            return self._positions(working, device)
        return torch.empty(0, dtype=torch.uint8, device=device)

    def _agreed_rows(self, transport, headers, payload, working, arrived=None, skipped=False) -> torch.Tensor:
        """Every rank's nominations (union, under the headers' CRC32/HMAC; ``arrived`` where they rode with the
        headers) or the leader's positions (zeros on a skipped step, whose momenta were not made)."""
        device = payload.device
        if arrived is not None:
            return arrived
        if self.union:
            return transport.all_gather(payload, "positions")  # checked by start against the headers
        leader = transport.step % transport.world
        if transport.rank == leader and not skipped:
            buf = self._positions(working, device)
        else:
            buf = torch.zeros(self.index_nbytes, dtype=torch.uint8, device=device)
        return transport.broadcast(buf, leader, "positions")[None]  # after the headers: not under their CRC

    def _chosen(self, rows: torch.Tensor, rank: int, step: int, world: int) -> list[tuple]:
        """Per bucket (positions (rows, W*k_nominated), first-occurrence mask or None), validated: every bucket's
        range check is made on the device and read back at once; the culprit is named only then."""
        idxs = self._unpack(rows)
        if idxs:  # (2, senders, rows): out-of-range positions, a position named twice by one sender
            flags = [
                torch.stack([(i >= b.bsize).any(-1), self.indices.repeated(i)])
                for b, i in zip(self.picked.buckets, idxs)
            ]
            bad = torch.cat(flags, dim=2)
            if bool(bad.any()):
                raise self._refusal(self._by_parameter(bad), rank, step, world)
        chosen = []
        for bucket, idx in zip(self.picked.buckets, idxs):
            # every rank's nominations one after the other: (rows, W * k_nominated)
            positions = idx.permute(1, 0, 2).reshape(bucket.rows, -1)
            chosen.append((positions, F.first_occurrences(idx, bucket) if self.union else None))
        return chosen

    def _by_parameter(self, bad: torch.Tensor) -> list:
        """Row flags (2, senders, rows of every bucket) -> per parameter [[out-of-range per sender], [repeated
        per sender]] (on the host)."""
        bad, firsts, base = bad.cpu(), [], 0
        for bucket in self.picked.buckets:
            firsts.append(base)
            base += bucket.rows
        return [
            bad[:, :, firsts[b] + row : firsts[b] + row + layout.nblocks].any(-1).tolist()
            for (b, row), layout in zip(self.picked.where, self.layouts)
        ]

    def _refusal(self, bad: list, rank: int, step: int, world: int) -> DeMoPayloadError:
        """The error naming the first parameter with out-of-range or repeated positions (``bad``: per parameter
        [[out-of-range per sender], [repeated per sender]])."""
        i, kind = next((i, kind) for i, flags in enumerate(bad) for kind in (0, 1) if any(flags[kind]))
        layout = self.layouts[i]
        senders = [r for r, flag in enumerate(bad[i][kind]) if flag]
        source = f"nominated by rank(s) {senders}" if self.union else f"broadcast by rank {step % world}"
        what = "out-of-range positions" if kind == 0 else "repeated positions (a block naming one position twice)"
        return DeMoPayloadError(
            f"rank {rank}: {what} for parameter {i} (shape {layout.shape}, "
            f"block of {layout.bsize}) {source} at optimizer step {step}: corrupted payload"
        )

    def _sum_order(self, senders: int, device) -> torch.Tensor:
        """Where each value of the summed buffer (parameter after parameter, as it travels) is in the buckets'
        contributions (bucket after bucket); ``senders`` runs of positions per block (W union, 1 leader)."""
        return _sum_order(self.picked, senders, torch.device(device))

    def start(
        self, transport, headers, payload, working, background: bool = False, arrived=None, skipped: bool = False
    ) -> InFlight:
        """The agreed positions, then the sum of every rank's values at them. ``skipped``: a step every rank
        skips (the headers say non-finite): the same collectives of the same sizes, with zeros, and the
        momenta left alone, so a rank that could not read that (a refused header) still meets every other."""
        rows = self._agreed_rows(transport, headers, payload, working, arrived, skipped)
        if skipped:
            return self._sum_zeros(transport, headers, rows, background, payload.device)
        try:
            if self.union:
                codec.verify_rows(headers, rows, self.secret, transport.rank, transport.step)
            chosen = self._chosen(rows, transport.rank, transport.step, transport.world)
        except DeMoPayloadError as exc:  # still take part in the sum (zeros), so no rank waits: finish raises
            in_flight = self._sum_zeros(transport, headers, rows, background, payload.device)
            in_flight.refused = exc
            return in_flight
        # every rank contributes its own values at the agreed positions (once each), exactly as they travel
        device = working[0].device if working else torch.device("cpu")
        momenta = compression.bucket_rows(working, self.bucketing)
        contributions = []
        for m, (idx, first) in zip(momenta, chosen):
            mine = m.gather(1, idx)
            mine = (mine if first is None else mine * first).to(self.dtype)
            F.feedback(m, idx, mine.float())
            contributions.append(mine.reshape(-1))
        compression.write_back(working, momenta, self.bucketing)
        # nothing to send (every parameter frozen, or a hierarchy shard without one): the same on every rank of
        # the group, whose layouts the headers proved equal
        if not contributions:
            sums = torch.empty(0, dtype=self.dtype, device=device)
        else:
            flat = torch.cat(contributions).index_select(0, self._sum_order(rows.shape[0], device))
            sums = transport.start_all_reduce(flat, "values") if background else transport.all_reduce(flat, "values")
        return InFlight(transport.step, transport.rank, transport.world, headers, sums, rows, None, chosen)

    def _sum_zeros(self, transport, headers, rows, background: bool, device) -> InFlight:
        """The values' all-reduce with zeros of the size every rank sends (set by the layouts and the senders of
        positions alone): a rank that cannot or must not send its values still takes part."""
        size = sum(bucket.rows * bucket.k for bucket in self.picked.buckets) * rows.shape[0]
        flat = torch.zeros(size, dtype=self.dtype, device=device)
        if size:
            sums = transport.start_all_reduce(flat, "values") if background else transport.all_reduce(flat, "values")
        else:
            sums = flat
        return InFlight(transport.step, transport.rank, transport.world, headers, sums, rows)

    def finish(self, in_flight: InFlight, traffic: Traffic) -> list[torch.Tensor]:
        sums = in_flight.wait(traffic)
        if in_flight.refused is not None:
            raise in_flight.refused
        limit = in_flight.world * min((codec.coefficient_bound(b.bsize) for b in self.bucketing.buckets), default=0)
        if not bool((sums.abs() <= limit).all()):  # NaN, Inf, or finite sums too large to average and transform
            if not bool(sums.isfinite().all()):
                raise DeMoPayloadError(
                    f"rank {in_flight.rank}: the summed values of optimizer step {in_flight.step} hold NaN/Inf"
                )
            raise DeMoPayloadError(
                f"rank {in_flight.rank}: the summed values of optimizer step {in_flight.step} hold coefficients too "
                f"large: finite, but their mean is beyond {limit / in_flight.world:.3g}, past which the inverse "
                "transform could overflow fp32 (a corrupted or forged payload, or a rank whose momentum diverged)"
            )
        chosen = in_flight.agreed or self._chosen(in_flight.positions, in_flight.rank, in_flight.step, in_flight.world)
        out = []
        if chosen:
            order = self._sum_order(in_flight.positions.shape[0], sums.device)
            by_bucket = torch.empty_like(sums).index_copy_(0, order, sums)
            parts = by_bucket.split([idx.numel() for idx, _ in chosen])
            for (idx, _), bucket, part in zip(chosen, self.picked.buckets, parts):
                mean = part.float().view_as(idx) / in_flight.world
                out.append(F.densify(idx, mean, bucket))  # runs of one rank's nominations: no repeats within
        return compression.Bucketed.of(out, self.bucketing)

    def _unpack(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """(senders, index_nbytes) -> per bucket (senders, rows, k_nominated) positions."""
        codec.check_rows(rows, self.index_nbytes, "position")
        streams = self.map.extract(rows) if self.picked.buckets else []
        return [self.indices.unpack_rows(w, b.rows, b.bsize, b.k) for w, b in zip(streams, self.picked.buckets)]


@functools.lru_cache(maxsize=64)
def _sum_order_cpu(picked: compression.Bucketing, world: int) -> torch.Tensor:
    firsts, base = [], 0
    for bucket in picked.buckets:
        firsts.append(base)
        base += bucket.rows * bucket.k * world
    parts = []
    for (b, row), layout in zip(picked.where, picked.layouts):
        start = firsts[b] + row * layout.k * world
        parts.append(torch.arange(start, start + layout.nblocks * layout.k * world))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


_SUM_ORDERS: dict = {}


def _sum_order(picked: compression.Bucketing, world: int, device: torch.device) -> torch.Tensor:
    key = (picked, world, device)
    if key not in _SUM_ORDERS:
        _SUM_ORDERS[key] = _sum_order_cpu(picked, world).to(device)
    return _SUM_ORDERS[key]


EXCHANGES_BY_NAME = {cls.name: cls for cls in (AllGatherExchange, AllReduceExchange)}
EXCHANGES = tuple(EXCHANGES_BY_NAME)


def get(name: str):
    return lookup(EXCHANGES_BY_NAME, "exchange", name)


def build(name: str, spec: ExchangeSpec):
    """The exchange ``name`` for one step (raises ValueError, naming the fix, on settings it refuses)."""
    return get(name)(spec)
