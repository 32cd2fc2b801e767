"""The per-parameter math of DeMo as pure functions, in the order a gradient meets them.

momentum (kept in the DCT domain) -> select top-k -> error feedback -> [pack, gather, unpack: codec/comm]
-> mean over the ranks that selected each coefficient -> inverse DCT -> the update rule's direction
(:mod:`hf_demo.optim.update_rules`) -> decoupled weight decay and the step.

Momentum lives in the DCT domain: the transform is linear and orthonormal, so
``DCT(decay*m + lr*g) == decay*DCT(m) + lr*DCT(g)``, and each step needs one forward transform (of the
gradient) and one inverse (of the averaged update) instead of the reference's three.
"""

from __future__ import annotations

import torch

from hf_demo.compression import buckets
from hf_demo.compression.blocks import BlockLayout, encode


def accumulate(
    momentum: torch.Tensor, grad: torch.Tensor | None, layout: BlockLayout, decay: float, lr: float, transform=None
) -> torch.Tensor:
    """``decay*momentum + lr*T(grad)`` as a new tensor (fp32; ``momentum`` is left as it is, so a step
    that fails commits nothing), ``T`` the transform (:mod:`hf_demo.compression.transforms`, default the DCT).
    A missing grad counts as zero."""
    out = momentum.mul(decay)
    if grad is not None:
        out.add_((transform.encode if transform is not None else encode)(grad, layout), alpha=lr)
    return out


def accumulate_many(momenta: list, signals: list, layouts: list, factors: list, transform) -> buckets.Bucketed:
    """:func:`accumulate` of every parameter, once per bucket: ``decay * momentum + scale * T(signal)`` with
    ``factors[i] = (decay, scale)``; the per-parameter results are row views of the buckets' new tensors (the
    momenta are left as they are). Bitwise what :func:`accumulate` gives each parameter."""
    bucketing = buckets.plan(tuple(layouts))
    out = []
    for bucket in bucketing.buckets:
        m = torch.cat([momenta[i] for i in bucket.members])
        coeffs = _transformed(signals, bucket, transform)
        own = [factors[i] for i in bucket.members]
        if len(set(own)) == 1:  # one decay and scale for the bucket (one parameter group): one op each
            decay, scale = own[0]
            m.mul_(decay)
            if coeffs is not None:
                m.add_(coeffs, alpha=scale)
        else:  # parameter groups of other decays or learning rates share the bucket: row by row
            start = 0
            for (decay, scale), n in zip(own, bucket.member_blocks):
                m[start : start + n].mul_(decay)
                if coeffs is not None:
                    m[start : start + n].add_(coeffs[start : start + n], alpha=scale)
                start += n
        out.append(m)
    return buckets.Bucketed.of(out, bucketing)


def _transformed(signals: list, bucket: buckets.Bucket, transform) -> torch.Tensor | None:
    """``T`` of the bucket members' signals, (rows, bsize) (a missing signal is zero; None: all are missing)."""
    if all(signals[i] is None for i in bucket.members):
        return None
    parts = []
    for run in bucket.runs:
        if all(signals[i] is None for i in run.members):
            parts.append(torch.zeros(run.rows, bucket.bsize, device=next(s for s in signals if s is not None).device))
            continue
        coeffs = transform.encode_blocks(buckets.stacked_blocks(signals, run))
        parts.append(coeffs.reshape(run.rows, bucket.bsize))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def decode_many(coeffs: list, layouts: list, transform) -> list[torch.Tensor]:
    """Coefficients (nblocks, bsize) of every parameter -> parameter-shaped fp32 tensors, the inverse transform
    once per bucket (``coeffs`` best :class:`~hf_demo.compression.buckets.Bucketed`, as the exchanges return
    them). Bitwise what ``transform.decode`` gives each parameter."""
    bucketing = buckets.plan(tuple(layouts))
    out: list = [None] * len(layouts)
    for bucket, rows in zip(bucketing.buckets, buckets.rows(coeffs, bucketing)):
        blocks = transform.decode_blocks(rows.view(bucket.rows, bucket.b0, bucket.b1))
        for run, part in zip(bucket.runs, buckets.run_rows(blocks.reshape(bucket.rows, bucket.bsize), bucket)):
            for i, value in zip(run.members, buckets.unstacked(part, run)):
                out[i] = value
    return out


def select(momentum: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest-magnitude coefficients of each block: (positions (nblocks, k) int64, values), the
    positions of a block in increasing order (what the Elias-Fano index code needs; the 16-bit code sends
    the same order, so both codes lead to the same bits everywhere)."""
    idx = momentum.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, momentum.gather(1, idx)


def feedback(momentum: torch.Tensor, idx: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback: subtract exactly what receivers will decode; the rest stays as the residual."""
    momentum.scatter_add_(1, idx, -sent)


def _rank_runs(idx: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(world, nblocks, k) -> per block the ranks' runs one after the other, (nblocks, world*k) each."""
    world, nblocks, k = idx.shape
    return idx.permute(1, 0, 2).reshape(nblocks, world * k), values.permute(1, 0, 2).reshape(nblocks, world * k)


def mean_weights(idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients of all ranks (world, nblocks, k) -> per block (positions, values) of length world*k.

    Each value is divided by the number of ranks that selected its position, so that summing the
    duplicates gives the mean over the ranks that selected it (the reference's rule, every-step DeMo).
    """
    world, nblocks = idx.shape[:2]
    idx, values = _rank_runs(idx, values)
    if world == 1:
        return idx, values
    # a count is at most the world size: the payload check refuses a run that names one position twice
    # (codec: repeated positions), so a uint8 count cannot wrap below 256 ranks
    count_dtype = torch.uint8 if world < 256 else torch.int32
    count = torch.zeros(nblocks, layout.bsize, dtype=count_dtype, device=idx.device)
    count.scatter_add_(1, idx, torch.ones(idx.shape, dtype=count_dtype, device=idx.device))
    return idx, values / count.gather(1, idx).to(values.dtype)


def world_weights(idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`mean_weights`, but each value is divided by the world size: summed, a coefficient is the mean
    over every rank, a rank that did not select it counting zero. This is the average of the ranks' sparse
    pseudo-gradients at a synchronisation (DiLoCo's and SparseLoCo's outer step): the mean over the ranks
    that selected a coefficient would apply one rank's change at full weight where the others sent nothing."""
    world = idx.shape[0]
    idx, values = _rank_runs(idx, values)
    return idx, values / world


def first_occurrences(idx: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Ranks' nominated positions (world, nblocks, k) -> (nblocks, world*k): 1.0 where a position appears
    for the first time in rank order, 0.0 where an earlier rank already nominated it (the union of the
    nominations, each position counted once; every rank computes the same mask from the same rows)."""
    world, nblocks, _ = idx.shape
    seen = torch.zeros(nblocks, layout.bsize, dtype=torch.bool, device=idx.device)
    keep = []
    for run in idx:  # a run (one rank's top-k) never repeats a position
        keep.append(~seen.gather(1, run))
        seen.scatter_(1, run, True)
    return torch.cat(keep, dim=1).float()


WEIGHTS = {"pickers": mean_weights, "world": world_weights}  # how an all-gather averages; see exchange.py


def densify(idx: torch.Tensor, values: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Sparse per-block coefficients -> dense (nblocks, bsize), duplicates summed in rank order.

    ``idx`` and ``values`` hold one run of ``layout.k`` positions per rank (rank after rank, as
    :func:`mean_weights` lays them out); a run never repeats a position (a top-k). The runs are added one
    after the other, so a position picked by several ranks is summed in rank order on every device: one
    ``scatter_add_`` over all runs would sum duplicates with atomics on CUDA, in an order that changes from
    call to call, and the replicas would drift apart. On the CPU, where ``scatter_add_`` goes through the
    positions in order, the result is bitwise the same as one call.
    """
    out = values.new_zeros(idx.shape[0], layout.bsize)
    k = layout.k
    for start in range(0, idx.shape[1], k):
        out.scatter_add_(1, idx[:, start : start + k], values[:, start : start + k])
    return out


def apply_step(
    param: torch.Tensor,
    direction: torch.Tensor,
    lr: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """``param <- param * (1 - lr*weight_decay) - lr * direction`` (decoupled weight decay, then the step).

    With a ``generator`` and a bf16 parameter the result is computed in fp32 and rounded
    *stochastically* to the parameter's dtype (unbiased: small steps move weights on average instead of
    vanishing below the format's resolution). The same generator state on every rank gives the same bits.
    """
    if generator is None or param.dtype == torch.float32 or param.dtype == torch.float64:
        if weight_decay:
            param.mul_(1.0 - lr * weight_decay)
        param.add_(direction.to(param.dtype), alpha=-lr)
        return
    exact = param.float()
    if weight_decay:
        exact.mul_(1.0 - lr * weight_decay)
    exact.add_(direction.float(), alpha=-lr)
    param.copy_(stochastic_round(exact, param.dtype, generator))


def apply_steps(params: list, directions: list, lrs: list, weight_decays: list, generator=None) -> None:
    """:func:`apply_step` of every parameter: ``torch._foreach_*`` once per (learning rate, weight decay) for the
    parameters rounded to nearest (bitwise the same as one at a time), then stochastic rounding parameter by
    parameter in order (its noise is drawn in parameter order)."""
    nearest: dict[tuple[float, float], list[int]] = {}
    rounded = []
    for i, p in enumerate(params):
        if generator is None or p.dtype == torch.float32 or p.dtype == torch.float64:
            nearest.setdefault((lrs[i], weight_decays[i]), []).append(i)
        else:
            rounded.append(i)
    for (lr, wd), members in nearest.items():
        ps = [params[i] for i in members]
        if wd:
            torch._foreach_mul_(ps, 1.0 - lr * wd)
        torch._foreach_add_(ps, [directions[i].to(params[i].dtype) for i in members], alpha=-lr)
    for i in rounded:
        apply_step(params[i], directions[i], lrs[i], weight_decays[i], generator)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability equal to the distance to the lower neighbour
    (in units of the last place): ``E[round(x)] = x``. Other dtypes round to nearest."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    generator = generator_on(x.device, generator)
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def generator_on(device: torch.device, generator: torch.Generator) -> torch.Generator:
    """A generator on ``device`` for noise made where the tensor lives.

    ``generator`` itself when it is on ``device`` (a CPU parameter: the noise is what it always was);
    otherwise a new generator on ``device`` seeded with one draw from ``generator``. The optimizer seeds
    ``generator`` identically on every rank and every rank draws in the same order, so every rank gets the
    same seeds and, on the same kind of accelerator, the same noise (CUDA's random kernels lay the stream
    out by the GPU's number of SMs: different GPU models give different noise, which the drift check sees).
    """
    device = torch.device(device)
    if generator.device.type == device.type and (device.index is None or generator.device.index == device.index):
        return generator
    seed = int(torch.randint(0, 1 << 62, (), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


PARAM_NOISE_SEED = 0x5EED0000  # stochastic rounding: the same noise on every rank, a new draw every step


def rounding_noise(param_rounding: str, step: int) -> torch.Generator | None:
    """The generator of ``param_rounding="stochastic"`` for optimizer step ``step``, seeded alike on every rank
    (None: round to nearest)."""
    if param_rounding != "stochastic":
        return None
    return torch.Generator().manual_seed(PARAM_NOISE_SEED + step)
