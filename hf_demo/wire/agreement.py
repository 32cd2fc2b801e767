"""What the ranks agree on in a step, beyond the payload: the headers, rank 0's replicas (a resync), the vote.

The vote makes a step all-or-nothing across ranks: a payload corrupted on its way to one rank fails that
rank's checks only (CRC32, HMAC, positions in range, finite values), so before anything is committed every
rank says whether what it received was whole. Any refusal raises :class:`~hf_demo.errors.DeMoPayloadError` on
every rank, naming the refusing ranks, and no rank applies the step: the replicas stay identical and the step
can be retried. It costs one all-gather of 16 bytes per rank per step, the verdict and its tag (``commit_vote=
"off"`` leaves it out: a refused payload then raises on the refusing rank only, and the drift check finds the
replicas apart later).

Every verdict is authenticated: the vote's word carries a tag (HMAC-SHA256 over the step, the sender, the word and
the sender's header of this try with ``HF_DEMO_SECRET``, a CRC32 without; AES-GCM with ``HF_DEMO_ENCRYPT=1``), and a
settling row is a header, signed or sealed like one (with a secret, a row that claims not to be signed is refused).
A verdict this rank cannot trust is one fault on top of a step every rank received whole or of a refusal the
others read: the vote is the round after the exchange, so a vote row that fails its tag is left out (every rank
that read the others' verdicts decides alike when at most one message of the step was corrupted); a settling row
is read by the rules of :mod:`hf_demo.optim.settle`, which agree on such a finding before any rank keeps the step.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from hf_demo.errors import DeMoPayloadError, DeMoSettingsError, DeMoSyncError
from hf_demo.exchange.collectives import COMMIT_VOTE, FULL_SYNC, REPLICAS, CollectiveSpec
from hf_demo.wire import codec, sealing, uniform

REFUSED = 1  # a payload failed this rank's checks
HEADER_REFUSED = 2  # a header failed this rank's checks (its sender in the bits above the eighth)
VOTE_BYTES = 8  # a verdict word (the vote's, a shard group's)
VOTE_TAG_BYTES = 8  # the vote word's tag: HMAC-SHA256 (truncated) with HF_DEMO_SECRET, a CRC32 without
VOTE_ROW_BYTES = VOTE_BYTES + VOTE_TAG_BYTES  # what each rank sends in the vote (sealed: the word and AES-GCM's tag)
RIDE = True  # the payload rides in the headers' all-gather where it can (False: benchmarks/commit_vote.py's baseline)
COLLECTIVES = (  # what this module runs over the exchange group (hf_demo.exchange.collectives)
    CollectiveSpec("header", "all_gather", REPLICAS, codec.HEADER_BYTES),  # in steady state inside the payload's
    CollectiveSpec("vote", "all_gather", REPLICAS, VOTE_ROW_BYTES, COMMIT_VOTE),
    CollectiveSpec("resync", "broadcast", REPLICAS, "parameters", FULL_SYNC),
)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU from pinned memory without making the host wait for the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Riding:
    """A payload that asks to ride in the headers' all-gather: ``payload`` (clear; sealed on the way where the
    headers are), ``agreed`` the bytes it took on the wire at the last committed exchange in this world (0:
    none yet), ``name`` the collective it stands for (the exchange's first, for the traffic accounts).

    Each rank's row is then its header followed by ``agreed`` bytes, the size every rank derives from the last
    committed exchange alone (so every row has the same size whatever this step holds): the payload as it travels
    when it has that size, zeros otherwise. The payloads rode when every header names this rank's payload size and
    it is the agreed one (the headers checked equal, so every rank finds the same); else the exchange sends them
    in its own collective, and this step's size becomes the agreed one (:func:`gather_headers`)."""

    payload: torch.Tensor
    agreed: int
    name: str


@dataclass(frozen=True)
class Gathered:
    """What the headers' all-gather brought: every rank's header, this rank's refusal of one (or None), every
    rank's payload row where the payloads rode along (else None), and this step's payload bytes on the wire
    (None where the payload cannot ride: overlap, or an exchange whose first collective is not an all-gather)."""

    headers: list
    refusal: object
    rows: torch.Tensor | None
    wire_bytes: int | None
    settling: dict | None = None  # {rank: verdict} of rows that settle the last step instead (codec.FLAG_SETTLES)


def gather_headers(
    transport,
    header: codec.Header,
    payload: torch.Tensor,
    secret,
    device,
    settings: Callable[[], list],
    sealer=None,
    riding: Riding | None = None,
    first: bool = False,
) -> Gathered:
    """Sign this rank's header for its payload, all-gather every rank's, check them.

    A disagreement between intact headers raises here, on every rank alike (they all hold the same headers);
    where the settings differ the error names each differing setting with every rank's value (``settings``: this
    rank's ``[label, settings by name]`` rows, its shard group's under HSDP: the topology's ``node_settings``,
    gathered only then).
    A header this rank cannot trust (its CRC32 or HMAC fails, or it claims another signing than this rank's:
    :func:`codec.receive_headers`) is the refusal returned, a :class:`DeMoPayloadError`: this rank goes on into
    the step's collectives like the others and the commit vote makes every rank raise it. With a
    :class:`~hf_demo.wire.sealing.Sealer` (``HF_DEMO_ENCRYPT=1``) the header travels encrypted instead, and one
    that does not open (or is a replay) is refused the same way, as is, after a process's first exchange, a header
    of the other sealing (clear in a sealed run, or bearing the seal's marker in a clear one). At a process's
    first exchange (``first``) the ranks agree first, in a round of a few bytes, that every rank's headers are
    sealed or none (:func:`hf_demo.wire.uniform.agree`: the same error on every rank otherwise); there, a header refused
    for its HMAC, its signing or its seal (corruption or another secret alike) makes every rank raise the same
    :class:`DeMoSyncError` naming both causes (:func:`hf_demo.optim.settle.vote`). ``riding``: the payload, where
    it asks to ride in the same all-gather (:class:`Riding`)."""
    signed = codec.sign(header, payload, None if sealer is not None else secret)
    if sealer is not None:
        own_row = sealer.seal_header(signed, transport.step, transport.global_rank(transport.rank))
    else:
        own_row = signed.to_bytes()
    wire_bytes = None if riding is None else riding.payload.numel() + (sealing.TAG_BYTES if sealer else 0)
    fits = riding is not None and riding.agreed > 0 and wire_bytes == riding.agreed
    row = to_device(own_row, device)
    if fits:
        wire = sealer.seal(riding.payload, transport.step, "payload") if sealer is not None else riding.payload
        row = torch.cat([row, wire.to(device)])
    elif riding is not None and riding.agreed:
        row = torch.cat([row, torch.zeros(riding.agreed, dtype=torch.uint8, device=device)])
    rows = transport.all_gather(row, riding.name if fits else "header")
    header_rows = rows[:, : own_row.numel()].cpu()  # one copy back for all ranks
    if sealer is not None:
        senders = [transport.global_rank(r) for r in range(rows.shape[0])]
        headers, refusal = sealer.open_headers(header_rows, transport.step, senders, transport.rank, signed)
    else:
        headers, refusal = codec.receive_headers(header_rows, signed, secret, transport.rank, transport.step)
    if first:  # every rank's headers sealed or none, agreed before any payload-sized collective
        refusal = uniform.agree(transport, header_rows, secret, sealer, device, refusal)
    settling = {r: codec.settles(headers[r]) for r in codec.flagged(headers, codec.FLAG_SETTLES)}
    if settling:  # the last step's verdicts, not this step's headers: hf_demo.optim.settle reads them
        return Gathered(headers, refusal, None, wire_bytes, settling)
    try:
        codec.check_headers(headers, transport.rank)
    except DeMoSyncError as exc:
        _raise_disagreement(transport, headers, settings, sealer, exc)
    if codec.flagged(headers, codec.FLAG_SETTINGS_APART):  # a replica's shard group holds different settings
        _raise_disagreement(transport, headers, settings, sealer)
    arrived = rows[:, own_row.numel() :] if fits else None
    return Gathered(headers, refusal, arrived, wire_bytes)


def _raise_disagreement(transport, headers: list, settings: Callable[[], list], sealer=None, exc=None) -> NoReturn:
    """Raise for headers that disagree (``exc``: :func:`codec.check_headers`'s error) or that say a replica's shard
    group holds different settings (``codec.FLAG_SETTINGS_APART``, so every rank of every replica hears of it):
    where the settings differ, a :class:`DeMoSettingsError` names each differing setting with every rank's value
    (``settings``: this rank's shard group's labelled settings; gathered sealed with a sealer); else ``exc``."""
    if exc is not None and not codec.settings_differ(headers):
        raise exc
    also = "" if exc is None or codec.settings_only(headers) else f"{exc}\n"
    raise DeMoSettingsError(
        f"DeMo ranks disagree (seen by {rank_label(transport)}): they have different optimizer settings; give "
        f"every rank the same settings.\n{also}{name_settings(transport, settings(), sealer)}"
    ) from None


def rank_label(transport) -> str:
    """How a settings error names this rank: its global rank; in an elastic run its replica group too."""
    me = f"rank {transport.global_rank(transport.rank)}"
    group = getattr(getattr(transport, "transport", transport), "replica_name", None)
    return me if group is None else f"replica group {group} ({me} of the quorum)"


def name_settings(transport, node: list, sealer=None) -> str:
    """Every rank's settings gathered (on every rank alike, after headers that all ranks saw disagree; sealed with
    a sealer: nothing of them travels in the clear), the differing ones named with each rank's value. ``node``:
    this rank's ``[label, settings]`` rows (HSDP: its shard group's), so the names cover every rank of every
    replica."""
    parts = gather_objects(transport, node, "settings_names", sealer) if transport.world > 1 else [node]
    rows = [row for part in parts for row in part]
    unique = {label: view for label, view in rows}
    lines = differing_settings(list(unique.values()), list(unique))
    if not lines:
        return "the settings by name agree: the difference is in a value not shown by name"
    return "settings that differ:\n    " + "\n    ".join(lines)


def gather_objects(transport, obj, name: str, sealer=None) -> list:
    """Every rank's ``obj`` (JSON-able), through the transport's own all-gathers (lengths, then the padded bytes),
    so it runs on any group DeMo exchanges over (torchft's managed one included), not only torch.distributed's.
    With a :class:`~hf_demo.wire.sealing.Sealer` (after headers it opened) both travel sealed (AES-GCM): a row
    that does not open raises :class:`DeMoSyncError`."""
    import json

    mine = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64).view(torch.uint8)
    sizes = _gather_sealed(transport, size, name + "_sizes", sealer, "settings_sizes")
    sizes = sizes.contiguous().view(torch.int64).view(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    rows = _gather_sealed(transport, padded, name, sealer, "settings")
    return [json.loads(bytes(rows[r, :n].tolist()).decode()) for r, n in enumerate(sizes)]


def _gather_sealed(transport, buf: torch.Tensor, name: str, sealer, kind: str) -> torch.Tensor:
    """Every rank's ``buf`` (uint8, host), all-gathered; sealed and opened with a sealer."""
    if sealer is None:
        return transport.all_gather(buf, name, count=False)
    rows = transport.all_gather(sealer.seal(buf, transport.step, kind), name, count=False)
    try:
        return sealer.open_rows(rows, transport.step, kind, transport.rank)
    except DeMoPayloadError as exc:
        raise DeMoSyncError(str(exc)) from None


def differing_settings(views: list[dict[str, str]], labels: list[str] | None = None) -> list[str]:
    """``name: rank 0 value, rank 1 value, ...`` for each setting on which ``views`` differ (``labels``: who holds
    each view; default ``rank 0``, ``rank 1``...)."""
    labels = labels or [f"rank {r}" for r in range(len(views))]
    names = sorted({k for v in views for k in v}, key=lambda k: (k.startswith("param_groups"), k))
    return [
        f"{k}: " + ", ".join(f"{who} {v.get(k, '(none)')}" for who, v in zip(labels, views))
        for k in names
        if len({v.get(k) for v in views}) > 1
    ]


def fetch_rank0(params: list[torch.Tensor], transport, sealer=None) -> list[torch.Tensor]:
    """Rank 0's values of ``params``, into copies (committed only with the step); sealed with a sealer."""
    if sealer is not None:
        return _fetch_sealed(params, transport, sealer)
    out = []
    for p in params:
        buf = p.detach().clone().contiguous()
        transport.broadcast(buf, 0, "resync")
        out.append(buf)
    return out


def _fetch_sealed(params: list[torch.Tensor], transport, sealer) -> list[torch.Tensor]:
    """:func:`fetch_rank0` as one sealed broadcast of every parameter's bytes (raises DeMoSyncError where rank 0's
    does not open)."""
    flat = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in params]
    plain = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    if transport.rank == 0:
        buf = sealer.seal(plain, transport.step, "resync")
    else:
        buf = torch.zeros(plain.numel() + sealing.TAG_BYTES, dtype=torch.uint8, device=plain.device)
    transport.broadcast(buf, 0, "resync")
    try:
        opened = sealer.open_rows(buf[None], transport.step, "resync", transport.rank)[0]
    except DeMoPayloadError as exc:
        raise DeMoSyncError(str(exc)) from None
    out = []
    for p, part in zip(params, opened.split([f.numel() for f in flat])):
        out.append(part.clone().view(p.dtype).view(p.shape))  # a copy first: its own, aligned storage
    return out


def pack_words(words: list[int]) -> torch.Tensor:
    """``words`` as int64 little-endian bytes on the host (``8 * len(words)`` uint8): a rank's row of a small
    all-gather (the vote, a shard group's verdicts, the DDP guard's check). :func:`unpack_words` reads them."""
    return torch.tensor(words, dtype=torch.int64, device="cpu").view(torch.uint8)


def unpack_words(rows: torch.Tensor, count: int) -> list[list[int]]:
    """Every rank's ``count`` words from the gathered rows of :func:`pack_words` (on any device)."""
    return rows.cpu().contiguous().view(torch.int64).reshape(-1, count).tolist()


def settling_row(transport, settled: int, word: int, row_bytes: int, secret, sealer, flags: int = 0) -> torch.Tensor:
    """This rank's row settling optimizer step ``settled``: a header with :data:`codec.FLAG_SETTLES` (and ``flags``:
    :data:`codec.FLAG_CONFIRM`, :data:`codec.FLAG_FINAL`) and its verdict ``word`` (:func:`verdict`), signed (or
    sealed) like a header, then zeros to ``row_bytes``, the size of the rows of the all-gather it takes part in.
    Sealed for step ``settled + 1``, as every row of the all-gather after those headers is (the next step's headers
    included), so that one all-gather can hold both kinds."""
    header = codec.Header(
        step=settled,
        layout_checksum=0,
        settings_checksum=0,
        flags=codec.FLAG_SETTLES | flags | (word << codec.VERDICT_SHIFT),
        world_size=transport.world,
        payload_bytes=0,
    )
    empty = torch.empty(0, dtype=torch.uint8, device="cpu")
    signed = codec.sign(header, empty, None if sealer is not None else secret)
    me = transport.global_rank(transport.rank)
    own = sealer.seal_header(signed, settled + 1, me) if sealer is not None else signed.to_bytes()
    return torch.cat([own, torch.zeros(row_bytes - own.numel(), dtype=torch.uint8, device="cpu")])


UNREAD = -1  # a settling row this rank could not trust (or of another kind than it waited for): a refusal
UNTRUSTED = 4  # a verdict word: this rank could not trust the verdict of the rank in the bits above the eighth
RELAYED = 8  # a later round's word: this rank read another rank's refusal in a round before
UNAUTHENTIC = 16  # with HEADER_REFUSED: the header failed its HMAC, did not open or claimed another signing
DEFERS = 32  # a refusal whose sender returned from step() and raises at its next step() or confirm() (settle)


def read_rows(transport, rows: torch.Tensor, settled: int, secret, sealer) -> list:
    """Every row of the all-gather after step ``settled``'s headers (or of confirm's rounds): the header it holds,
    or None where this rank cannot trust it (its CRC32, HMAC or AES-GCM fails, it is a replay, or, with a secret,
    it claims another signing than this rank's). This rank's own row is always read."""
    header_rows = rows[:, : codec.HEADER_BYTES].cpu()
    if sealer is not None:
        senders = [transport.global_rank(r) for r in range(rows.shape[0])]
        own = codec.Header(step=settled, layout_checksum=0, settings_checksum=0, flags=0, world_size=0, payload_bytes=0)
        headers, _ = sealer.open_headers(header_rows, settled + 1, senders, transport.rank, own)
        return [h if e is not None else None for h, e in zip(headers, sealer.envelopes)]
    return codec.receive_headers(header_rows, None, secret, transport.rank, settled + 1)[0]


def settling_words(read: list, settled: int) -> list[int]:
    """Every rank's verdict on step ``settled`` from :func:`read_rows`: a settling row's word, 0 for the next step's
    header (its sender received step ``settled`` whole and went on), :data:`UNREAD` for a row this rank cannot
    trust or that names another step."""
    out = []
    for h in read:
        word = codec.settles(h) if h is not None else None
        if word is not None and h.step == settled:
            out.append(word)
        else:
            out.append(0 if h is not None and word is None and h.step == settled + 1 else UNREAD)
    return out


def read_settling(transport, rows: torch.Tensor, settled: int, secret, sealer) -> list[int]:
    """:func:`settling_words` of the rows (:func:`read_rows`)."""
    return settling_words(read_rows(transport, rows, settled, secret, sealer), settled)


def finding(transport, words: list[int], own: int) -> int:
    """This rank's finding on a round of verdicts, as one verdict word: its own (``own``), else :data:`RELAYED`
    where it read a refusal, else :data:`UNTRUSTED` naming the first rank whose verdict it could not trust (0: all
    whole)."""
    if own:
        return own
    if any(w > 0 for w in words):
        return RELAYED
    unread = [r for r, w in enumerate(words) if w == UNREAD]
    return UNTRUSTED | (transport.global_rank(unread[0]) << 8) if unread else 0


ROUNDS = codec.FLAG_CONFIRM | codec.FLAG_FINAL  # which of confirm()'s rounds a settling row belongs to
RELAY_ROUND = codec.FLAG_CONFIRM | codec.FLAG_FINAL  # the second round: every rank's finding on the first
FINAL_ROUND = codec.FLAG_FINAL  # the third: every rank's finding after the second


def final_words(transport, read: list, settled: int, own: int, kind: int = FINAL_ROUND) -> list[int]:
    """Every rank's finding from the rows of one of confirm()'s later rounds (``kind``: :data:`RELAY_ROUND` or
    :data:`FINAL_ROUND`; :func:`read_rows`): a row this rank cannot trust is left out (0): these rounds follow a
    round whose every fault they report, and each finding is relayed once more, so where at most two messages of
    the rounds were corrupted the ranks decide alike; a trusted row of another kind (its sender is elsewhere: at
    another step, or in another round) is a refusal."""
    out = []
    for r, h in enumerate(read):
        if r == transport.rank:
            out.append(own)
        elif h is None:
            out.append(0)
        elif h.flags & ROUNDS == kind and codec.settles(h) is not None and h.step == settled:
            out.append(codec.settles(h))
        else:
            out.append(REFUSED)
    return out


def behind(read: list, step: int) -> list[int]:
    """The ranks whose trusted row names a step before ``step``: they did not keep the step before it (they refused
    it, or undid it, and run it again)."""
    return [r for r, h in enumerate(read) if h is not None and h.step < step]


def refused_everywhere(transport, settled: int, words: list[int], refusal, undone: str = "") -> DeMoPayloadError:
    """The error every rank raises when any rank's verdict on step ``settled`` is not whole: the refusing ranks
    named (and, for a header, whose header), ``refusal`` this rank's own (or None), ``undone`` what this rank put
    back."""
    refusing = [transport.global_rank(r) for r, v in enumerate(words) if v and v != RELAYED]
    refusing = refusing or [transport.global_rank(r) for r, v in enumerate(words) if v]
    headers = [
        f"rank {transport.global_rank(r)} refused the header from rank {transport.global_rank(v >> 8)}"
        for r, v in enumerate(words)
        if v > 0 and v & HEADER_REFUSED
    ]
    headers += [
        f"rank {transport.global_rank(r)} could not trust the verdict of rank {v >> 8}"
        for r, v in enumerate(words)
        if v > 0 and v & UNTRUSTED and not v & HEADER_REFUSED
    ]
    unread = [transport.global_rank(r) for r, v in enumerate(words) if v == UNREAD]
    me = transport.global_rank(transport.rank)
    notes = headers + ([f"rank {me} could not trust the verdict of rank(s) {unread}"] if unread else [])
    everyone = (
        f"every rank refused optimizer step {settled} because rank(s) {refusing} found what they received "
        f"corrupted{' (' + '; '.join(notes) + ')' if notes else ''}: nothing was applied on any rank{undone}, the "
        "replicas are still identical and the step can be run again (a faulty link, NIC or memory, or injected "
        "traffic, if it repeats)"
    )
    if refusal is not None:
        return DeMoPayloadError(f"{refusal}; {everyone}")
    return DeMoPayloadError(f"rank {me}: {everyone}")


def verdict(refusal: DeMoPayloadError | None) -> int:
    """What this rank says in the vote: 0 (whole), REFUSED (a payload), or HEADER_REFUSED with the sender of the
    header it refused in the bits above the eighth (:func:`codec.receive_headers`), and :data:`UNAUTHENTIC` where
    that header failed its HMAC, did not open or claimed another signing (not its CRC32)."""
    if refusal is None:
        return 0
    if getattr(refusal, "verdict_word", None) is not None:  # a verdict this rank could not trust (settle)
        return refusal.verdict_word
    sender = getattr(refusal, "header_sender", None)
    if sender is None:
        return REFUSED
    return HEADER_REFUSED | (UNAUTHENTIC if getattr(refusal, "unauthentic", False) else 0) | (sender << 8)


def vote(transport, refusal: DeMoPayloadError | None, device, sealer=None, secret=None, headers=None) -> None:
    """Every rank's verdict on what it received; raises on every rank when any refused (nothing committed). Each
    word travels with its tag (:func:`vote_tag`; with a sealer, sealed); a word that fails it is left out: the vote
    is the round after the exchange, so when it is corrupted the exchange was whole (one fault), and every rank
    that read the others' words decides alike. ``headers``: this step's, whose tags bind a word to its try."""
    mine = verdict(refusal)
    if sealer is not None:
        words = _sealed_verdicts(transport, pack_words([mine]), sealer, device)
    else:
        tag = vote_tag(transport, transport.rank, mine, secret, headers)
        rows = unpack_words(transport.all_gather(pack_words([mine, tag]).to(device), "vote"), 2)
        words = [w if vote_tag(transport, r, w, secret, headers) == t else 0 for r, (w, t) in enumerate(rows)]
    words[transport.rank] = mine
    if not any(words):
        return
    raise refused_everywhere(transport, transport.step, words, refusal) from refusal


def vote_tag(transport, r: int, word: int, secret, headers) -> int:
    """The tag of rank ``r``'s vote word (a signed int64): HMAC-SHA256 with the secret over the step, the sender's
    global rank, the word and the sender's header tag of this try; a CRC32 of the same without a secret."""
    import hashlib
    import hmac
    import zlib

    bound = headers[r].tag if headers is not None else b""
    body = b"hf-demo/vote" + struct.pack("<qqq", transport.step, transport.global_rank(r), word) + bound
    if secret is None:
        return zlib.crc32(body)
    return int.from_bytes(hmac.new(secret, body, hashlib.sha256).digest()[:8], "little", signed=True)


def _sealed_verdicts(transport, mine: torch.Tensor, sealer, device) -> list[int]:
    """Every rank's sealed verdict, opened one by one; one that does not open is left out (0)."""
    sealed = sealer.seal(mine, transport.step, "vote")
    rows = transport.all_gather(sealed.to(device), "vote").cpu()
    words = []
    for r in range(rows.shape[0]):
        try:
            opened = sealer.open_rows(rows, transport.step, "vote", transport.rank, only=[r])
            words.append(unpack_words(opened[r : r + 1], 1)[0][0])
        except DeMoPayloadError:
            words.append(0)
    return words
