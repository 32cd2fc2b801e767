"""The dense baselines DeMo is measured against: DDP-AdamW, DDP-AdamW with torch's PowerSGD hook and DDP-Muon,
and the bytes PowerSGD hands to its all-reduces, from the parameter shapes."""

from __future__ import annotations

import math

import torch

POWERSGD_START_ITER = 2  # plain all-reduces before PowerSGD starts (torch's default is 1000)


def ddp_baseline(model: torch.nn.Module, method: str, *, powersgd_rank: int = 4, bucket_cap_mb: float | None = None):
    """``model`` in DistributedDataParallel: ``adamw`` and ``muon`` (its optimizer: :func:`ddp_muon`) with DDP's
    own fp32 all-reduce, ``powersgd`` with torch's ``powerSGD_hook`` (rank ``powersgd_rank``, plain all-reduce for
    the first :data:`POWERSGD_START_ITER` steps).

    PowerSGD's hook launches its P and Q all-reduces from future callbacks; with more than one DDP bucket on gloo
    their order can differ between ranks ("Received data size doesn't match expected size"), so PowerSGD gets one
    bucket holding every gradient unless ``bucket_cap_mb`` says otherwise. AdamW and Muon keep DDP's default.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if method not in ("adamw", "powersgd", "muon"):
        raise ValueError(f"a DDP baseline is adamw, powersgd or muon, not {method!r}")
    cap = bucket_cap_mb if bucket_cap_mb is not None else (1024 if method == "powersgd" else None)
    net = DDP(model, bucket_cap_mb=cap)
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=POWERSGD_START_ITER
        )
        net.register_comm_hook(state, ps.powerSGD_hook)
    return net


def powersgd_bytes(shapes, rank: int, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank hands to PowerSGD's all-reduces per step once it has started (fp32; torch's rule,
    ``_should_compress``): a tensor viewed as (shape[0], -1) whose rank-r factors are smaller than
    1/min_compression_rate of it sends P (n x r) and Q (m x r); 1-D tensors and the other matrices go whole."""
    floats = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) <= 1:
            floats += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        floats += (n + m) * r if (n + m) * r * min_compression_rate < n * m else numel
    return 4 * floats


class Optimizers:
    """Several optimizers stepped as one (DDP-Muon: Muon for the hidden matrices, AdamW for the rest)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:  # read afresh: load_state_dict replaces each optimizer's groups
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, sd in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(sd)


def ddp_muon(model, lr: float) -> Optimizers:
    """``torch.optim.Muon`` (momentum 0.95, Nesterov, 5 Newton-Schulz steps, ``adjust_lr_fn="match_rms_adamw"``:
    AdamW's lr carries over) on the hidden matrices of ``muon_style_groups``, AdamW (0.9/0.95) on the rest; no
    weight decay. torch's Newton-Schulz runs in bf16, ~20x slower on a CPU: it is replaced here, in this run's
    process, by hf_demo's fp32 iteration (the one ``update_rule="orthogonal"`` uses)."""
    from torch.optim import _muon

    from hf_demo.optim.param_groups import muon_style_groups
    from hf_demo.optim.update_rules import newton_schulz

    _muon._zeropower_via_newtonschulz = lambda grad, coefficients, steps, eps: newton_schulz(grad, steps, coefficients)
    hidden, others = muon_style_groups(model, hidden={}, others={})
    muon = torch.optim.Muon(hidden["params"], lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(others["params"], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    return Optimizers(muon, adamw)
