"""What the ranks agree on in a step, beyond the payload: the headers, rank 0's replicas (a resync), the vote.

The vote makes a step all-or-nothing across ranks: a payload corrupted on its way to one rank fails that
rank's checks only (CRC32, HMAC, positions in range, finite values), so before anything is committed every
rank says whether what it received was whole. Any refusal raises :class:`~hf_demo.errors.DeMoPayloadError` on
every rank, naming the refusing ranks, and no rank applies the step: the replicas stay identical and the step
can be retried. It costs one all-gather of 8 bytes per rank per step (``commit_vote="off"`` leaves it out: a
refused payload then raises on the refusing rank only, and the drift check finds the replicas apart later).
"""

from __future__ import annotations

import torch

from hf_demo.errors import DeMoPayloadError
from hf_demo.wire import codec

REFUSED = 1  # a payload failed this rank's checks
HEADER_REFUSED = 2  # a header failed this rank's checks (its sender in the bits above the eighth)
VOTE_BYTES = 8  # what each rank sends in the vote


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU from pinned memory without making the host wait for the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_headers(transport, header: codec.Header, payload: torch.Tensor, secret, device) -> tuple[list, object]:
    """Sign this rank's header for its payload, all-gather every rank's, check them -> (headers, refusal).

    A disagreement between intact headers raises here, on every rank alike (they all hold the same headers). A
    header this rank cannot trust (its CRC32 or HMAC fails: :func:`codec.receive_headers`) is the refusal
    returned, a :class:`DeMoPayloadError`: this rank goes on into the step's collectives like the others and
    the commit vote makes every rank raise it."""
    header = codec.sign(header, payload, secret)
    rows = transport.all_gather(to_device(header.to_bytes(), device), "header").cpu()  # one copy back for all ranks
    headers, refusal = codec.receive_headers(rows, header, secret, transport.rank, transport.step)
    codec.check_headers(headers, transport.rank)
    return headers, refusal


def fetch_rank0(params: list[torch.Tensor], transport) -> list[torch.Tensor]:
    """Rank 0's values of ``params``, into copies (committed only with the step)."""
    out = []
    for p in params:
        buf = p.detach().clone().contiguous()
        transport.broadcast(buf, 0, "resync")
        out.append(buf)
    return out


def verdict(refusal: DeMoPayloadError | None) -> int:
    """What this rank says in the vote: 0 (whole), REFUSED (a payload), or HEADER_REFUSED with the sender of the
    header it refused in the bits above (:func:`codec.receive_headers`)."""
    if refusal is None:
        return 0
    sender = getattr(refusal, "header_sender", None)
    return REFUSED if sender is None else HEADER_REFUSED | (sender << 8)


def vote(transport, refusal: DeMoPayloadError | None, device) -> None:
    """Every rank's verdict on what it received; raises on every rank when any refused (nothing committed)."""
    mine = torch.tensor([verdict(refusal)], dtype=torch.int64, device="cpu")
    rows = transport.all_gather(mine.view(torch.uint8).to(device), "vote").cpu().view(torch.int64).flatten().tolist()
    refusing = [transport.global_rank(r) for r, v in enumerate(rows) if v]
    if not refusing:
        return
    headers = [
        f"rank {transport.global_rank(r)} refused the header from rank {transport.global_rank(v >> 8)}"
        for r, v in enumerate(rows)
        if v & HEADER_REFUSED
    ]
    everyone = (
        f"every rank refused optimizer step {transport.step} because rank(s) {refusing} found what they received "
        f"corrupted{' (' + '; '.join(headers) + ')' if headers else ''}: nothing was applied on any rank, the "
        "replicas are still identical and the step can be run again (a faulty link, NIC or memory, or injected "
        "traffic, if it repeats)"
    )
    if refusal is not None:
        raise DeMoPayloadError(f"{refusal}; {everyone}") from refusal
    raise DeMoPayloadError(f"rank {transport.global_rank(transport.rank)}: {everyone}")
