"""What the ranks agree on in a step, beyond the payload: the headers, rank 0's replicas (a resync), the vote.

The vote makes a step all-or-nothing across ranks: a payload corrupted on its way to one rank fails that
rank's checks only (CRC32, HMAC, positions in range, finite values), so before anything is committed every
rank says whether what it received was whole. Any refusal raises :class:`~hf_demo.errors.DeMoPayloadError` on
every rank, naming the refusing ranks, and no rank applies the step: the replicas stay identical and the step
can be retried. It costs one all-gather of 8 bytes per rank per step (``commit_vote="off"`` leaves it out: a
refused payload then raises on the refusing rank only, and the drift check finds the replicas apart later).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.wire import codec

REFUSED = 1
VOTE_BYTES = 8  # what each rank sends in the vote


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU from pinned memory without making the host wait for the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_headers(
    transport, header: codec.Header, payload: torch.Tensor, secret, device, settings: Callable[[], dict[str, str]]
) -> list[codec.Header]:
    """Sign this rank's header for its payload, all-gather every rank's, check them (raises on every rank).
    ``settings``: this rank's settings by name (:func:`hf_demo.optim.groups.settings_view`), gathered only when the
    settings checksums differ, to name each setting that differs with every rank's value."""
    header = codec.sign(header, payload, secret)
    rows = transport.all_gather(to_device(header.to_bytes(), device), "header").cpu()  # one copy back for all ranks
    headers = [codec.Header.from_bytes(row) for row in rows]
    codec.verify_headers(headers, secret, transport.rank, transport.step)
    try:
        codec.check_headers(headers, transport.rank)
    except DeMoSyncError as exc:
        if not codec.settings_differ(headers):
            raise
        raise DeMoSyncError(f"{exc}\n{name_settings(transport, settings())}") from None
    return headers


def name_settings(transport, mine: dict[str, str]) -> str:
    """Every rank's settings gathered (on every rank alike, after headers that all ranks saw disagree), the
    differing ones named with each rank's value."""
    import torch.distributed as dist

    views = [mine]
    if transport.world > 1:
        views = [None] * transport.world
        dist.all_gather_object(views, mine, group=transport.transport.group)
    lines = differing_settings(views)
    if not lines:
        return "the settings by name agree: the difference is in a value not shown by name"
    return "settings that differ:\n    " + "\n    ".join(lines)


def differing_settings(views: list[dict[str, str]]) -> list[str]:
    """``name: rank 0 value, rank 1 value, ...`` for each setting on which ``views`` (one per rank) differ."""
    names = sorted({k for v in views for k in v}, key=lambda k: (k.startswith("param_groups"), k))
    return [
        f"{k}: " + ", ".join(f"rank {r} {v.get(k, '(none)')}" for r, v in enumerate(views))
        for k in names
        if len({v.get(k) for v in views}) > 1
    ]


def fetch_rank0(params: list[torch.Tensor], transport) -> list[torch.Tensor]:
    """Rank 0's values of ``params``, into copies (committed only with the step)."""
    out = []
    for p in params:
        buf = p.detach().clone().contiguous()
        transport.broadcast(buf, 0, "resync")
        out.append(buf)
    return out


def vote(transport, refusal: DeMoPayloadError | None, device) -> None:
    """Every rank's verdict on what it received; raises on every rank when any refused (nothing committed)."""
    mine = torch.tensor([REFUSED if refusal is not None else 0], dtype=torch.int64, device="cpu")
    rows = transport.all_gather(mine.view(torch.uint8).to(device), "vote").cpu().view(torch.int64).flatten().tolist()
    refusing = [transport.global_rank(r) for r, verdict in enumerate(rows) if verdict == REFUSED]
    if not refusing:
        return
    everyone = (
        f"every rank refused optimizer step {transport.step} because rank(s) {refusing} found what they received "
        "corrupted: nothing was applied on any rank, the replicas are still identical and the step can be "
        "run again (a faulty link, NIC or memory, or injected traffic, if it repeats)"
    )
    if refusal is not None:
        raise DeMoPayloadError(f"{refusal}; {everyone}") from refusal
    raise DeMoPayloadError(f"rank {transport.global_rank(transport.rank)}: {everyone}")
