"""Checks over many tensors with one read back to the host per device: non-finite values, exact fingerprints."""

from __future__ import annotations

import torch

from hf_demo.refusals import refuse


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Any NaN/Inf element (element-wise: a finite 1e30 is finite): :func:`nonfinite_or_zero`'s first answer."""
    return nonfinite_or_zero(tensors)[0]


def nonfinite_or_zero(tensors: list[torch.Tensor]) -> tuple[bool, bool]:
    """(any NaN/Inf element, every element zero) of ``tensors``, with one read back to the host per device.

    Fast path: a tensor's 2-norm is finite only when every element is (a NaN or an Inf makes it NaN or Inf), and
    zero only when every element is; ``torch._foreach_norm`` takes it for every tensor of a dtype at once, in one
    pass over each (as fast as a sum on a CPU, where ``isfinite().all()`` makes three). Only a tensor whose norm is
    not finite (a NaN/Inf, or finite values whose squares overflow) is checked element by element. No tensors (or
    only empty ones): (False, False).
    """
    tensors = [t for t in tensors if t.numel()]
    if any(t.is_sparse for t in tensors):
        refuse("sparse_gradients")
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for t in tensors:
        by_device.setdefault(t.device, {}).setdefault(t.dtype, []).append(t)
    nonfinite, zero = False, bool(tensors)
    for by_dtype in by_device.values():
        group = [t for ts in by_dtype.values() for t in ts]
        with torch.no_grad():
            norms = torch.cat([torch.stack(torch._foreach_norm(ts)).float() for ts in by_dtype.values()])
            bad = ~norms.isfinite()
            any_bad, all_zero = torch.stack([bad.any(), norms.eq(0).all()]).tolist()  # one read back
        zero = zero and all_zero
        if any_bad and any(not bool(group[i].isfinite().all()) for i in bad.nonzero().flatten().tolist()):
            nonfinite = True
    return nonfinite, zero


def gradient_fingerprint(signals: list[torch.Tensor | None]) -> int:
    """A non-zero fingerprint of the local gradients, or 0 when there are none or all are zero."""
    present = [s for s in signals if s is not None]
    if not present or not any(bool(s.detach().ne(0).any()) for s in present):
        return 0
    return fingerprint(present) or 1


FINGERPRINT_PERIOD = 65521  # the position weights of the fingerprint repeat with this period (a prime)


def fingerprint(params: list[torch.Tensor]) -> int:
    """An exact, order-sensitive fingerprint of the parameters' bits (integer sums: deterministic).

    Per parameter: the sum of its bits as integers, and their sum weighted by ``1 + position % 65521``. The
    weighted sum is taken over column sums (the bits laid out in rows of 65521), so no 64-bit copy or weight
    vector longer than one period is made, and the weights once per device."""
    int_of = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    period = FINGERPRINT_PERIOD
    weights: dict[torch.device, torch.Tensor] = {}  # 1..period, once per device
    sums = []  # integer sums: the same on every device; read back to the host at once
    for p in params:
        bits = p.detach().contiguous().view(int_of[p.element_size()]).reshape(-1)
        if bits.numel() <= period:  # one row: the bits are their own column sums
            columns = bits.to(torch.int64)
        else:
            full = bits.numel() - bits.numel() % period
            columns = bits[:full].view(-1, period).sum(0, dtype=torch.int64)
            columns[: bits.numel() - full] += bits[full:].to(torch.int64)
        if bits.device not in weights:
            weights[bits.device] = torch.arange(1, period + 1, dtype=torch.int64, device=bits.device)
        sums.append(torch.stack([columns.sum(), (columns * weights[bits.device][: columns.numel()]).sum()]))
    host = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [s.tolist() for s in sums]
    total = 0
    for plain, weighted in host:
        total = (total * 1_000_003 + plain * 31 + weighted) & ((1 << 62) - 1)
    return total
