"""Checkpoints you can trust: a manifest written last, checked before anything is loaded.

``DeMoTrainer`` saves a checkpoint as Trainer does (every rank writes its own files: ``optimizer.pt``
for rank 0, ``optimizer.rank<r>.pt`` and ``rng_state_<r>.pth`` for the others), then, after a barrier,
rank 0 writes :data:`MANIFEST` (world size, global step, every file with its size and SHA-256) and a
second barrier makes every rank wait for it. A checkpoint without a manifest is incomplete (the run died
while saving). Resuming checks the manifest on every rank, reading the same files, so every rank stops
with the same message.

``last_complete_checkpoint(output_dir)`` is ``transformers.trainer_utils.get_last_checkpoint`` that skips
incomplete checkpoints; ``trainer.train(resume_from_checkpoint=True)`` uses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings

from hf_demo.errors import DeMoStateError

MANIFEST = "hf_demo_manifest.json"
FORMAT = 1
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(DeMoStateError):
    """A checkpoint is incomplete, corrupted, or was saved by another number of processes."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str, world_size: int, global_step: int | None = None, skip: tuple[str, ...] = ()) -> dict:
    """Write ``folder/MANIFEST`` for the files in ``folder`` now (atomically: temporary file, then rename).

    Call it once every rank has written its files (``DeMoTrainer`` does, after a barrier). Also the way to
    vouch, by hand, for a checkpoint written by something else. ``skip``: files written after the manifest.
    """
    manifest = {
        "format": FORMAT,
        "world_size": int(world_size),
        "global_step": global_step,
        "files": {
            rel: {"bytes": os.path.getsize(os.path.join(folder, rel)), "sha256": _sha256(os.path.join(folder, rel))}
            for rel in _files(folder)
            if rel not in skip
        },
    }
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    return manifest


def read_manifest(folder: str) -> dict | None:
    """The manifest of ``folder``, or None when there is none (an incomplete checkpoint)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder}: its manifest {MANIFEST} is unreadable ({exc})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not a manifest this hf_demo reads")
    return manifest


def verify_checkpoint(folder: str, world_size: int | None = None) -> dict:
    """Check ``folder`` against its manifest; return the manifest or raise :class:`CheckpointError`.

    Every problem is listed in one message: a missing manifest (incomplete save), missing files, files
    whose size or SHA-256 differ (corrupted), and, when ``world_size`` is given, a different number of
    processes (each rank's DeMo momentum is its own).
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise CheckpointError(
            f"checkpoint {folder} is incomplete: it has no {MANIFEST}, which hf_demo writes last (DeMoTrainer, or "
            "accelerator.save_state after hf_demo.prepare), once every "
            "process has saved its files (the run stopped while saving?). Resume from an earlier checkpoint, "
            "or, if you know the files are whole, vouch for them with "
            f"hf_demo.hf.checkpoint.write_manifest({folder!r}, world_size)."
        )
    problems = []
    for rel, meta in sorted(manifest["files"].items()):
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(path) != meta["bytes"]:
            problems.append(f"{rel} has {os.path.getsize(path)} bytes, the manifest says {meta['bytes']}")
        elif _sha256(path) != meta["sha256"]:
            problems.append(f"{rel} is corrupted (its SHA-256 differs from the manifest's)")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} cannot be trusted: " + "; ".join(problems) + ". Resume from another checkpoint."
        )
    saved = manifest["world_size"]
    if world_size is not None and saved != world_size:
        raise CheckpointError(
            f"checkpoint {folder} was saved with {saved} process(es) but this run has {world_size}: each "
            f"process's DeMo momentum is its own; resume with {saved} processes (or start the optimizer afresh)."
        )
    return manifest


def verify_on_every_rank(folder: str, world_size: int | None = None) -> dict | None:
    """:func:`verify_checkpoint` on every rank, then :func:`check_model_files`, the verdicts compared: every rank
    raises the same :class:`CheckpointError` when any rank found a problem (one that sees another folder is
    named). Call it on every rank of the default process group. Returns this rank's manifest."""
    manifest = problem = None
    try:
        manifest = verify_checkpoint(folder, world_size)
        check_model_files(folder)
    except CheckpointError as exc:
        problem = str(exc)
    agree_on_every_rank(problem, CheckpointError, "do all processes see the same checkpoint folder?")
    return manifest


def _damaged(path: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}): the file is damaged (truncated?), "
        "though its checkpoint's manifest vouches for it (a manifest written by hand with write_manifest after "
        "the damage). Resume from another checkpoint"
    )


def check_model_files(folder: str) -> None:
    """Raise :class:`CheckpointError` naming the first ``*.safetensors`` file of ``folder`` whose header does not
    cover the file (truncated), before any rank loads it (reading each header only, not the weights)."""
    from safetensors import safe_open

    for rel in _files(folder):
        if rel.endswith(".safetensors"):
            path = os.path.join(folder, rel)
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as exc:  # noqa: BLE001 - safetensors' own error types: the file is named instead
                raise _damaged(path, exc) from None


def read_state(path: str) -> dict:
    """``torch.load`` of an optimizer state file on the CPU (``weights_only``), a damaged file (truncated zip,
    broken pickle) raised as :class:`CheckpointError` naming it: raise it through :func:`agree_on_every_rank`."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ...
        raise _damaged(path, exc) from None


_AGREED = [0]  # agreements gathered in this process (the store keys of each one's leaving)


def agree_on_every_rank(problem: str | None, error: type, hint: str) -> None:
    """Every rank's finding (None: fine) gathered over the default process group, so that every rank raises the
    same ``error`` (a rank raising alone would leave the others waiting in their next collective, and they would
    see a raw gloo error); ``hint`` is added where the ranks found different problems. Rank 0 raises last
    (:func:`hf_demo.exchange.teardown.leave_together`); a peer gone during the gather is named in ``error``."""
    import torch.distributed as dist

    problems = [problem]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems = _gathered(problem, error)
    failed = [(rank, p) for rank, p in enumerate(problems) if p]
    if not failed:
        return
    message = failed[0][1]
    if len(failed) < len(problems) or any(p != message for _, p in failed):
        prefix = f"rank {failed[0][0]}: "  # a message naming its rank already is not prefixed twice
        message = (
            f"{'' if message.startswith(prefix) else prefix}{message} (ranks {[r for r, _ in failed]} of "
            f"{len(problems)} found problems: {hint})"
        )
    if len(problems) > 1:
        from hf_demo.exchange import liveness, teardown

        timeout = liveness._group_timeout(dist.distributed_c10d._get_default_group())
        teardown.leave_together(f"hf_demo/agreed/{_AGREED[0]}", list(range(len(problems))), _seconds(timeout))
    raise error(message)


def _gathered(problem: str | None, error: type) -> list:
    """Every rank's ``problem``, in rank order (the default group's all-gather); a rank that could not take part
    (gone, frozen) raises ``error`` naming it, not the backend's raw error."""
    import torch.distributed as dist

    problems = [None] * dist.get_world_size()
    _AGREED[0] += 1
    try:
        dist.all_gather_object(problems, problem)
    except Exception as exc:  # noqa: BLE001 - DistBackendError, RuntimeError: the backend's words, quoted
        said = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise error(
            f"rank {dist.get_rank()}: not every rank took part in the check every rank makes here (one stopped, "
            f"froze or was killed){f': {problem}' if problem else ''}. Backend said: {type(exc).__name__}: {said}"
        ) from None
    return problems


def _seconds(timeout) -> float:
    return timeout.total_seconds() if timeout is not None else 300.0


def checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-<step>`` folders of ``output_dir``, oldest (lowest step) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    return [os.path.join(output_dir, name) for _, name in sorted(found)]


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint of ``output_dir`` that has a manifest, or None.

    Newer ones without a manifest (saves that did not finish) are skipped with a warning. The one returned
    is not verified here: :func:`verify_checkpoint` does that when it is loaded.
    """
    skipped = []
    for folder in reversed(checkpoints(output_dir)):
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            if skipped:
                warnings.warn(
                    f"hf_demo: skipping incomplete checkpoint(s) {', '.join(skipped)} (no {MANIFEST}); "
                    f"resuming from {folder}",
                    stacklevel=2,
                )
            return folder
        skipped.append(os.path.basename(folder))
    return None
