"""One rank's own state in the one format every path saves it in: rank files, DCP and torchft's snapshots.

A rank's own state is what no other rank holds: its momenta (DeMo's residual of what it has not yet sent, a
Muon-style rule's ``signal_momentum``) and its inner rule's state between synchronisations (``inner_*``). It is
never averaged, so each rank saves and loads its own. :func:`own_state` gives it as **pieces**: each entry with
dimensions flattened, zero-padded to the widest rank's length, keyed by the parameter's position among the
optimizer's parameters (torch's state-dict id) and the entry's name. Rank ``r``'s piece is its part of a
``Shard(0)`` DTensor over the 1-D mesh of every rank (Dion's placement of a rank's state: like the parameter it
belongs to). A counter (a 0-dim tensor, the same on every rank) is kept as it is. The paths:

- a rank's file (``DeMoTrainer``'s ``optimizer.rank<r>.pt``, ``accelerator.save_state``'s ``optimizer.rank<r>.bin``,
  ``torch.save(optimizer.state_dict())``): the pieces, in ``state_dict()["state"]`` beside the agreed entries;
- ``torch.distributed.checkpoint`` (FSDP2-sharded DeMo): the same pieces as the DTensor over every rank
  (:mod:`hf_demo.optim.sharded_checkpoint`), so DCP writes each rank's piece once;
- torchft's momentum snapshot (:mod:`hf_demo.own_momentum`): the same pieces, with the replica's identity.

:func:`load_own_state` is the one reader: each piece's values viewed in the shape the parameter needs now. An
entry already shaped (a rank file or snapshot written before this format) is taken as it is, so older
checkpoints load bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hf_demo.errors import DeMoStateError

FORMAT = 1  # the pieces above (before it: each own entry in the shape the optimizer keeps it)
OWN_KEYS = ("momentum", "signal_momentum", "inner_momentum")  # each rank's own: never sent, kept by a healed one
OWN_PREFIX = "inner_"  # the inner rule's state of local steps (sync_every > 1): each rank's own too

Pieces = dict[int, dict[str, torch.Tensor]]  # {parameter position: {entry: piece (1-D) or counter (0-dim)}}


def own_key(key: str) -> bool:
    """Whether a per-parameter state entry is this rank's own (its momenta, its inner rule's state) rather than
    agreed by every rank (the anchor, an update rule's state driven by the mean update)."""
    return key in OWN_KEYS or key.startswith(OWN_PREFIX)


def entry_shape(shard: tuple[int, ...], key: str, chunk: int) -> tuple[int, ...]:
    """The shape of a state entry of a parameter (shard) of shape ``shard``: the momentum is blocked (nblocks, block
    size) by ``chunk``, the rest has the shard's shape."""
    from hf_demo.compression import plan

    if key != "momentum":
        return tuple(shard)
    layout = plan(tuple(shard), chunk, 1)
    return (layout.nblocks, layout.bsize)


def piece(value: torch.Tensor, width: int) -> torch.Tensor:
    """``value`` flattened, zero-padded to ``width`` values (itself, flattened, where it has ``width`` already)."""
    flat = value.reshape(-1)
    if flat.numel() == width:
        return flat
    out = torch.zeros(width, dtype=value.dtype, device=value.device)
    out[: flat.numel()] = flat
    return out


def own_state(entries: Mapping[int, Mapping], width: Callable[[int, str], int] | None = None) -> Pieces:
    """This rank's own state of ``entries`` ({parameter position: its state entries}) as pieces: each own tensor
    entry flattened, zero-padded to ``width(position, key)`` values (default: its own length; under FSDP2 the
    widest shard's, so that every rank's piece has one length), counters as they are. Positions without an own
    entry are left out."""
    out: Pieces = {}
    for pid, entry in entries.items():
        mine = {}
        for key, value in entry.items():
            if not (torch.is_tensor(value) and own_key(key)):
                continue
            mine[key] = value if value.dim() == 0 else piece(value, value.numel() if width is None else width(pid, key))
        if mine:
            out[pid] = mine
    return out


def load_own_state(
    pieces: Mapping[int, Mapping], shape: Callable[[int, str], tuple], width: Callable[[int, str], int] | None = None
) -> Pieces:
    """The inverse of :func:`own_state`: each piece, of ``width(position, key)`` values (default: as many as the
    shape holds), viewed in ``shape(position, key)``, the shape the parameter at that position needs now; other
    entries, counters, and entries already shaped (written before this format), as they are. Raises
    :class:`DeMoStateError` for a piece of another length (another model's state)."""
    return {i: {k: _shaped(v, shape, width, i, k) for k, v in entry.items()} for i, entry in pieces.items()}


def _shaped(value, shape, width, pid: int, key: str):
    if not (torch.is_tensor(value) and own_key(key) and value.dim() == 1):
        return value
    want = tuple(shape(pid, key))
    return unpadded(value, want, torch.Size(want).numel() if width is None else width(pid, key), pid, key)


def unpadded(value: torch.Tensor, shape: tuple[int, ...], width: int, pid: int, key: str) -> torch.Tensor:
    """A piece of ``width`` values, its first ones viewed in ``shape``; a piece of another length raised, naming
    the parameter."""
    if value.numel() != width:
        raise DeMoStateError(
            f"saved {key!r} of parameter {pid} has {value.numel()} values, this model needs {width} (shape {shape}): "
            "the optimizer state was saved for another model. Resume with the model it was saved with (or start "
            "the optimizer afresh)"
        )
    return value[: torch.Size(shape).numel()].view(shape)
