"""Every rank steps every parameter with its own gradient, DeMo between all ranks."""

from __future__ import annotations

import torch

from hf_demo.exchange.transport import Transport
from hf_demo.optim.records import Chosen


def chosen(items: list, grads: list | None = None, views: list | None = None) -> Chosen:
    """The :class:`~hf_demo.optim.records.Chosen` of ``items`` stepped with ``grads`` (None: each param's own
    gradient, the flat topology's choice: ``FlatTopology.select``); ``views``: each param's local tensor (None: the
    params themselves, as on the flat topology)."""
    params, groups, layouts = [list(x) for x in zip(*items)] if items else ([], [], [])
    device = params[0].device if params else torch.device("cpu")
    grads = [p.grad for p in params] if grads is None else grads
    return Chosen(items, grads, params, groups, layouts, params if views is None else views, device)


class FlatTopology:
    name = "flat"
    sharded = False  # every parameter is a plain tensor: its own local view

    def __init__(self, transport: Transport):
        self.transport = transport  # the optimizer's exchange group

    @classmethod
    def build(cls, param_groups, process_group, device_mesh, initialised: bool, timeout: float) -> FlatTopology:
        """Over the optimizer's ``process_group`` (the world group where None) once ``initialised``, else alone."""
        return cls(Transport(process_group if initialised else None, timeout))

    select = staticmethod(chosen)  # select(items): this rank steps every item (``plan.items``) with its own gradient

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope) a saved state belongs to: the rank in the optimizer's group."""
        return self.transport.rank, self.transport.world, "group"

    def agree_step(self, transport, settings_ck: int, bits: int, secret, device) -> tuple[int, None]:
        return bits, None

    def node_settings(self, transport, mine: dict[str, str]) -> list:
        """This rank's settings, labelled with its rank, for a settings error to name (one row: no shard group)."""
        from hf_demo.wire.agreement import rank_label

        return [[rank_label(transport), mine]]

    def agree(self, transport, device, bits: int, name: str) -> int:
        """What every rank stepping the same model agrees on besides the headers: nothing more here."""
        return bits

    def agree_refusal(self, transport, device, refusal):
        return refusal

    def agree_figures(self, transport, device, exchange_ms: float, elapsed_ms: float, tier_bytes: list[float]):
        """The budget policy's figures: every rank steps the whole model, they are already the model's."""
        return exchange_ms, elapsed_ms, tier_bytes

    def mean_over_ranks(self, params, transport, name: str) -> dict:
        """Every rank's mean of ``params`` (dense all-reduces by device and dtype, fp32 or wider)."""
        return dense_mean(params, transport, name)

    def matrices(self, params: list, every: list, stepping) -> WholeMatrices:
        """Every parameter is whole on this rank: rules that need the whole matrix take the tensors as they are."""
        return WholeMatrices()


class WholeMatrices:
    """The view of parameters that are whole on every rank (see ``ShardedMatrices`` for shards): every rule runs
    on the tensors as they are."""

    def directions(self, rule, members: list[int], params: list, tensors: list, states: list) -> tuple[list, list]:
        """``rule.directions(params, tensors, states)`` (``members``: the parameters' positions, unused here)."""
        return rule.directions(params, tensors, states)


def dense_mean(params, transport, name: str) -> dict:
    """{param: its mean over the ranks of ``transport``}: one all-reduce per (device, dtype), in the same order on
    every rank, in fp32 or the parameters' wider dtype."""
    means = {}
    for key in sorted({(str(p.device), str(p.dtype)) for p in params}):
        part = [p for p in params if (str(p.device), str(p.dtype)) == key]
        flat = torch.cat([p.detach().reshape(-1).to(wide_dtype(part)) for p in part])
        transport.all_reduce(flat, name)
        flat /= transport.world
        start = 0
        for p in part:
            means[p] = flat[start : start + p.numel()].view(p.shape)
            start += p.numel()
    return {p: means[p] for p in params}


def wide_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """fp32, or the widest parameter dtype where wider (fp64): what dense collectives of parameters carry."""
    wide = torch.float32
    for p in params:
        wide = torch.promote_types(wide, p.dtype)
    return wide
