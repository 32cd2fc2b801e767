"""A slow, plain DeMo written straight from the algorithm, to hold hf_demo.DeMo to.

Momentum in the parameter domain (float64), one naive DCT basis built from the cosine formula, a Python
loop over blocks, int64 indices and float64 values gathered per tensor, and the mean over the ranks that
picked a coefficient computed with a dictionary.

A dimension the chunk does not divide is zero-padded up to a multiple of the block side (the side is
``min(chunk, dim)``), as ``hf_demo.compression`` does. The momentum lives on that padded matrix: error feedback
subtracts the inverse transform of the sent coefficients on the whole padded matrix, so a residual can remain
in the padding (as it does in the optimizer's DCT-domain momentum). Only the parameter's own positions of the
averaged update are applied.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def dct_basis(n: int) -> torch.Tensor:
    basis = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        for i in range(n):
            basis[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return basis


def orthogonal_directions(t: torch.Tensor) -> torch.Tensor:
    """5 quintic Newton-Schulz steps on the matrix (first dimension x the others) in float64, unscaled."""
    x = t.double().reshape(t.shape[0], -1)
    rows, cols = x.shape
    if rows > cols:
        x = x.T
    norm = math.sqrt(float((x * x).sum()))
    if norm == 0.0:
        return torch.zeros_like(t, dtype=torch.float64)
    x = x / norm
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if rows > cols else x).reshape(t.shape)


def orthogonalised(update: torch.Tensor) -> torch.Tensor:
    """Muon's step, in float64: :func:`orthogonal_directions` scaled by 0.2 sqrt(max(rows, cols)); a tensor of
    one dimension takes its sign."""
    if update.dim() < 2:
        return update.sign()
    return 0.2 * math.sqrt(max(update.shape[0], update[0].numel())) * orthogonal_directions(update)


def _bf16(x: float) -> float:
    return torch.tensor(x, dtype=torch.float64).to(torch.bfloat16).item()


def two_bit(values: torch.Tensor) -> torch.Tensor:
    """One block's selected values, 2 bits each: a magnitude at least the block's mean magnitude is *large*,
    else *small*; each class is sent as its members' mean magnitude rounded to bf16 (0 for an empty class),
    and each value decodes to its sign times its class's magnitude."""
    mags = [abs(v) for v in values.tolist()]
    mean = sum(mags) / len(mags)
    large = [m >= mean for m in mags]
    out = []
    for v, is_large in zip(values.tolist(), large):
        members = [x for x, c in zip(mags, large) if c == is_large]
        magnitude = _bf16(sum(members) / len(members))
        out.append(-magnitude if v < 0 else magnitude)
    return torch.tensor(out, dtype=torch.float64)


class ReferenceDeMo:
    def __init__(
        self,
        params,
        lr,
        decay=0.999,
        topk=32,
        chunk=64,
        weight_decay=0.0,
        sign_update=True,
        rule=None,
        delay=0,
        value_format="exact",
    ):
        """``delay=1``: each step's update (and its weight decay) is applied at the next step (``overlap``);
        ``flush()`` applies the last one. ``rule``: one rule for every parameter, or a list of one per parameter
        (per-group rules). ``value_format``: ``exact`` (the float64 values) or ``2bit`` (:func:`two_bit`)."""
        if value_format not in ("exact", "2bit"):
            raise ValueError(f"ReferenceDeMo value_format is 'exact' or '2bit', not {value_format!r}")
        self.value_format = value_format
        self.params = list(params)
        self.delay = delay
        self.pending = None
        self.lr, self.decay, self.topk, self.chunk = lr, decay, topk, chunk
        self.weight_decay = weight_decay
        rule = rule or ("sign" if sign_update else "raw")
        self.rules = list(rule) if isinstance(rule, (list, tuple)) else [rule] * len(self.params)
        self.second_moment = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        self.first_moment = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        self.signal_momentum = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]
        self.t = 0
        self.momentum = [torch.zeros(self._blocks(p)[4:], dtype=torch.float64) for p in self.params]

    def _side(self, n):
        """n if it fits in a chunk; a divisor of n no smaller than half the chunk; else the chunk, padded."""
        if n <= self.chunk:
            return n
        divisors = [d for d in range(1, self.chunk + 1) if n % d == 0 and 2 * d >= self.chunk]
        return max(divisors) if divisors else self.chunk

    def _v(self, p):
        return next(v for q, v in zip(self.params, self.second_moment) if q is p)

    def _blocks(self, p):
        """rows, cols of the parameter seen as a matrix; block sides b0, b1; padded rows, padded cols."""
        rows, cols = (1, p.numel()) if p.dim() <= 1 else (p.shape[0], p.numel() // p.shape[0])
        b0, b1 = self._side(rows), self._side(cols)
        return rows, cols, b0, b1, math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1

    @staticmethod
    def _forward(x, b0, b1):
        d0, d1 = dct_basis(b0), dct_basis(b1)
        out = []
        for r in range(0, x.shape[0], b0):
            for c in range(0, x.shape[1], b1):
                out.append((d0 @ x[r : r + b0, c : c + b1] @ d1.T).reshape(-1))
        return out

    @staticmethod
    def _inverse(coeffs, b0, b1, padded_rows, padded_cols):
        d0, d1 = dct_basis(b0), dct_basis(b1)
        x = torch.zeros(padded_rows, padded_cols, dtype=torch.float64)
        i = 0
        for r in range(0, padded_rows, b0):
            for c in range(0, padded_cols, b1):
                x[r : r + b0, c : c + b1] = d0.T @ coeffs[i].reshape(b0, b1) @ d1
                i += 1
        return x

    def _signal(self, p, grad, rule):
        """What of a gradient enters the momentum: orthogonalised (``orthogonal_signal``), or the orthogonalised
        Nesterov momentum (0.95) of this rank's gradients (``muon_signal``); else the gradient."""
        if p.dim() < 2 or rule not in ("orthogonal_signal", "muon_signal"):
            return grad
        if rule == "muon_signal":
            m = next(m for q, m in zip(self.params, self.signal_momentum) if q is p)
            m.mul_(0.95).add_(0.05 * grad)
            grad = 0.05 * grad + 0.95 * m
        return orthogonal_directions(grad)

    @torch.no_grad()
    def step(self):
        world = dist.get_world_size() if dist.is_initialized() else 1
        updates = []
        for p, m, rule in zip(self.params, self.momentum, self.rules):
            shape = self._blocks(p)
            rows, cols, b0, b1, prows, pcols = shape
            idx, val = self._compress(p, m, rule, shape)
            averaged = self._average(idx, val, world, b0 * b1)
            update = self._inverse(averaged, b0, b1, prows, pcols)[:rows, :cols].reshape(p.shape)
            updates.append(self._rule(p, update, rule))
        if self.delay:
            updates, self.pending = self.pending, updates
        self._apply(updates)
        self.t += 1

    def _compress(self, p, m, rule, shape):
        """Momentum decay, the signal in, each block's top-k out of the momentum: (positions, values).
        ``shape``: :meth:`_blocks` of ``p``."""
        rows, cols, b0, b1, prows, pcols = shape
        m.mul_(self.decay)
        if p.grad is not None:
            grad = self._signal(p, p.grad.double(), rule)
            m[:rows, :cols].add_(grad.reshape(rows, cols), alpha=self.lr)
        k = min(self.topk, b0 * b1)
        blocks = self._forward(m, b0, b1)
        idx = torch.stack([b.abs().topk(k).indices for b in blocks])
        val = torch.stack([b[i] for b, i in zip(blocks, idx)])
        if self.value_format == "2bit":  # what is sent is what receivers decode: the rest stays in m
            val = torch.stack([two_bit(v) for v in val])
        sent = [torch.zeros(b0 * b1, dtype=torch.float64) for _ in blocks]
        for s, i, v in zip(sent, idx, val):
            s[i] = v
        m.sub_(self._inverse(sent, b0, b1, prows, pcols))
        return idx, val

    @staticmethod
    def _average(idx, val, world, bsize):
        """Every rank's (positions, values) gathered; each block's mean over the ranks that sent a position."""
        all_idx, all_val = [idx], [val]
        if world > 1:
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            all_val = [torch.empty_like(val) for _ in range(world)]
            dist.all_gather(all_idx, idx)
            dist.all_gather(all_val, val)
        averaged = []
        for b in range(idx.shape[0]):
            sums, counts = {}, {}
            for ridx, rval in zip(all_idx, all_val):
                for j, v in zip(ridx[b].tolist(), rval[b].tolist()):
                    sums[j] = sums.get(j, 0.0) + v
                    counts[j] = counts.get(j, 0) + 1
            dense = torch.zeros(bsize, dtype=torch.float64)
            for j in sums:
                dense[j] = sums[j] / counts[j]
            averaged.append(dense)
        return averaged

    def _rule(self, p, update, rule):
        """The update rule's direction for the averaged update (its moments kept here, per parameter)."""
        if rule == "sign":
            return update.sign()
        if rule == "adam":  # Adam's second moment of the averaged update, bias-corrected
            v = self._v(p)
            v.mul_(0.999).add_(0.001 * update * update)
            return update / ((v / (1 - 0.999 ** (self.t + 1))).sqrt() + 1e-8)
        if rule == "adamw":  # AdamW's two moments (0.9, 0.95) of the averaged update, bias-corrected
            m = next(m for q, m in zip(self.params, self.first_moment) if q is p)
            v = self._v(p)
            m.mul_(0.9).add_(0.1 * update)
            v.mul_(0.95).add_(0.05 * update * update)
            t = self.t + 1
            return (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8)
        if rule in ("orthogonal", "orthogonal_signal", "muon_signal"):
            return orthogonalised(update)
        if rule == "orthogonal_momentum":  # Muon's Nesterov momentum (0.95) of the averaged update first
            if update.dim() >= 2:
                m = next(m for q, m in zip(self.params, self.first_moment) if q is p)
                m.mul_(0.95).add_(0.05 * update)
                update = 0.05 * update + 0.95 * m
            return orthogonalised(update)
        return update

    @torch.no_grad()
    def flush(self):
        self._apply(self.pending)
        self.pending = None

    def _apply(self, updates):
        for p, update in zip(self.params, updates or []):
            p.mul_(1 - self.lr * self.weight_decay)
            p.sub_(self.lr * update.to(p.dtype))
