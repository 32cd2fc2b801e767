"""A slow, plain DeMo written straight from the algorithm, to hold hf_demo.DeMo to.

Momentum in the parameter domain (float64), one naive DCT basis built from the cosine formula, a Python
loop over blocks, int64 indices and float64 values gathered per tensor, and the mean over the ranks that
picked a coefficient computed with a dictionary. Only for shapes the chunk divides.
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


class ReferenceDeMo:
    def __init__(self, params, lr, decay=0.999, topk=32, chunk=64, weight_decay=0.0, sign_update=True):
        self.params = list(params)
        self.lr, self.decay, self.topk, self.chunk = lr, decay, topk, chunk
        self.weight_decay, self.sign_update = weight_decay, sign_update
        self.momentum = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]

    def _blocks(self, p):
        rows, cols = (1, p.numel()) if p.dim() <= 1 else (p.shape[0], p.numel() // p.shape[0])
        b0, b1 = min(self.chunk, rows), min(self.chunk, cols)
        assert rows % b0 == 0 and cols % b1 == 0, "the reference only handles shapes the chunk divides"
        return rows, cols, b0, b1

    def _forward(self, x, rows, cols, b0, b1):
        d0, d1 = dct_basis(b0), dct_basis(b1)
        x = x.reshape(rows, cols)
        out = []
        for r in range(0, rows, b0):
            for c in range(0, cols, b1):
                out.append((d0 @ x[r:r + b0, c:c + b1] @ d1.T).reshape(-1))
        return out

    def _inverse(self, coeffs, rows, cols, b0, b1, shape):
        d0, d1 = dct_basis(b0), dct_basis(b1)
        x = torch.zeros(rows, cols, dtype=torch.float64)
        i = 0
        for r in range(0, rows, b0):
            for c in range(0, cols, b1):
                x[r:r + b0, c:c + b1] = d0.T @ coeffs[i].reshape(b0, b1) @ d1
                i += 1
        return x.reshape(shape)

    @torch.no_grad()
    def step(self):
        world = dist.get_world_size() if dist.is_initialized() else 1
        for p, m in zip(self.params, self.momentum):
            p.mul_(1 - self.lr * self.weight_decay)
            if p.grad is not None:
                m.mul_(self.decay).add_(p.grad.double(), alpha=self.lr)
            else:
                m.mul_(self.decay)
            rows, cols, b0, b1 = self._blocks(p)
            k = min(self.topk, b0 * b1)
            blocks = self._forward(m, rows, cols, b0, b1)
            idx = torch.stack([b.abs().topk(k).indices for b in blocks])
            val = torch.stack([b[i] for b, i in zip(blocks, idx)])
            sent = [torch.zeros(b0 * b1, dtype=torch.float64) for _ in blocks]
            for s, i, v in zip(sent, idx, val):
                s[i] = v
            m.sub_(self._inverse(sent, rows, cols, b0, b1, p.shape))

            all_idx, all_val = [idx], [val]
            if world > 1:
                all_idx = [torch.empty_like(idx) for _ in range(world)]
                all_val = [torch.empty_like(val) for _ in range(world)]
                dist.all_gather(all_idx, idx)
                dist.all_gather(all_val, val)
            averaged = []
            for b in range(len(blocks)):
                sums, counts = {}, {}
                for ridx, rval in zip(all_idx, all_val):
                    for j, v in zip(ridx[b].tolist(), rval[b].tolist()):
                        sums[j] = sums.get(j, 0.0) + v
                        counts[j] = counts.get(j, 0) + 1
                dense = torch.zeros(b0 * b1, dtype=torch.float64)
                for j in sums:
                    dense[j] = sums[j] / counts[j]
                averaged.append(dense)
            update = self._inverse(averaged, rows, cols, b0, b1, p.shape)
            if self.sign_update:
                update = update.sign()
            p.sub_(self.lr * update.to(p.dtype))
