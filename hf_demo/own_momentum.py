"""Each replica's own momentum on its local disk, so that a restarted replica resumes it instead of starting at zero.

DeMo's momentum is each rank's residual of what it has not yet sent; it is never averaged, so no live peer holds
it and a replica that dies loses it. :class:`hf_demo.elastic.Elastic` with ``momentum_dir`` writes this replica's
own state entries (:data:`OWN_KEYS`: its momenta and its inner rule's state), in the one format of a rank's own
state (:func:`hf_demo.optim.own_state.own_state`: the pieces its rank file and a DCP checkpoint hold too), after
every ``momentum_every``-th committed step to ``momentum_dir/<replica id>.pt``; the process that takes the replica
id back (torchrun's restart, a warm standby told that id) loads them after the agreed state it receives from a
live peer. The snapshot is the state the replica had after that committed step: what it had not yet sent then is
still unsent (a dead replica sends nothing), so the restarted replica goes on as if it had paused, its residual a
few steps older than the parameters, like any replica that lags.

Each snapshot carries the run's identity, the replica's id and a SHA-256 of the whole. It is loaded only if it
fits: whole (its checksum matches: not torn or altered), the same run (the run identity the agreed state carries),
this replica's (not another replica's file copied or renamed), the same parameter shapes, a step no later than the
agreed one, and a finite momentum. Anything else is not loaded, and a warning names the file and why (the momentum
then starts at zero, as without ``momentum_dir``). A snapshot of format 2 (each entry in the optimizer's shape, one
dict per parameter) is read too.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from hf_demo.errors import DeMoStateError
from hf_demo.optim.own_state import OWN_KEYS, OWN_PREFIX, entry_shape, load_own_state, own_key, own_state

__all__ = ["OWN_KEYS", "OWN_PREFIX", "own_key", "save", "restore", "unfit", "checksum", "snapshot_path"]
FORMAT = 3  # 3: the pieces of hf_demo.optim.own_state by parameter position; 2: a list of shaped entries
READ = (2, 3)


def snapshot_path(folder: str | os.PathLike, replica_id: str) -> Path:
    """Where replica ``replica_id``'s snapshot lives (one file per replica id, replaced at each save)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(replica_id))
    return Path(folder) / f"replica-{safe}.pt"


def _params(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def save(path: Path, opt, step: int, replica_id: str) -> None:
    """``opt``'s own state entries after committed step ``step``, with the run's and replica ``replica_id``'s
    identity and a SHA-256 of the whole, written atomically to ``path`` (a reader sees the previous snapshot or
    this one, never a part)."""
    params = _params(opt)
    blob = {
        "format": FORMAT,
        "run_id": opt.run_id,
        "replica_id": str(replica_id),
        "step": int(step),
        "shapes": [list(p.shape) for p in params],
        "own": own_state({i: opt.state.get(p, {}) for i, p in enumerate(params)}),
    }
    blob["sha256"] = checksum(blob)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def checksum(blob: dict) -> str:
    """The SHA-256 of a snapshot's identity, step, shapes and every own entry's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(repr([blob["format"], blob["run_id"], blob["replica_id"], blob["step"], blob["shapes"]]).encode())
    own = blob["own"]
    for i, entries in sorted(own.items()) if isinstance(own, dict) else enumerate(own):
        for key in sorted(entries):
            value = entries[key]
            if torch.is_tensor(value):
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                h.update(repr((i, key, str(value.dtype), list(value.shape))).encode() + data)
            else:
                h.update(repr((i, key, value)).encode())
    return h.hexdigest()


def unfit(blob: dict, opt, step: int, replica_id: str) -> str | None:
    """Why snapshot ``blob`` cannot be replica ``replica_id``'s momentum at agreed step ``step`` (None: it can):
    its format, checksum, run, replica, parameter shapes, step, or a momentum that is not finite."""
    if not isinstance(blob, dict) or blob.get("format") not in READ:
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        return f"format {got!r}, not one of {READ}"
    try:
        intact = blob.get("sha256") == checksum(blob)
    except (KeyError, TypeError, AttributeError, RuntimeError) as exc:
        return f"not a whole snapshot ({type(exc).__name__}: {exc})"
    if not intact:
        return "its checksum does not match its contents (torn or altered on disk)"
    if blob["run_id"] != opt.run_id:
        return f"another run's (run {blob['run_id']}, this run {opt.run_id}): give each run its own momentum_dir"
    if blob["replica_id"] != str(replica_id):
        return f"replica {blob['replica_id']}'s, not replica {replica_id}'s (a file copied or renamed)"
    if blob["shapes"] != [list(p.shape) for p in _params(opt)]:
        return "saved for parameters of other shapes (another model)"
    if blob["step"] > step:
        return f"saved at step {blob['step']}, after the agreed step {step} (a later attempt of the run's)"
    own = sorted(_by_position(blob["own"]).items())
    bad = [f"{k} of parameter {i}" for i, entries in own for k, v in sorted(entries.items())
           if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]  # fmt: skip
    if bad:
        return f"it holds NaN or Inf ({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})"
    return None


def restore(path: Path, opt, step: int, replica_id: str) -> int | None:
    """Replica ``replica_id``'s snapshot at ``path`` loaded into ``opt`` (after the agreed state of step ``step``):
    the step it was saved at, or None where there is none or it does not fit (a warning names the file and why)."""
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn or foreign file: the momentum starts at zero, said aloud
        warnings.warn(
            f"hf_demo.elastic: {path} is not a momentum snapshot ({exc}); the momentum starts at zero", stacklevel=3
        )
        return None
    why = unfit(blob, opt, step, replica_id)
    if why is not None:
        warnings.warn(
            f"hf_demo.elastic: {path} not loaded: {why}; this replica's momentum starts at zero", stacklevel=3
        )
        return None
    params = _params(opt)
    chunk = [g["compression_chunk"] for g in opt.param_groups for _ in g["params"]]
    shape = lambda i, key: entry_shape(params[i].shape, key, chunk[i])  # noqa: E731 - the flat topology's shapes
    try:
        loaded = load_own_state(_by_position(blob["own"]), shape)
    except DeMoStateError as exc:  # pieces of another length: not this model's, said aloud like any unfit one
        warnings.warn(
            f"hf_demo.elastic: {path} not loaded: {exc}; this replica's momentum starts at zero", stacklevel=3
        )
        return None
    for i, own in loaded.items():
        opt.state[params[i]].update({k: v.to(params[i].device) if torch.is_tensor(v) else v for k, v in own.items()})
    return int(blob["step"])


def _by_position(own) -> dict:
    """A snapshot's own entries by parameter position (format 2 kept a list, with an empty dict for none)."""
    return dict(own) if isinstance(own, dict) else {i: entries for i, entries in enumerate(own) if entries}
