"""What the launch environment gets wrong, fixed before the process group exists.

* :func:`launched_on_cpu_without_switch`: ``accelerate launch`` with a multi-process config on a machine
  without GPU and without ``ACCELERATE_USE_CPU=1`` / ``--use_cpu true``: accelerate initialises a gloo
  group of N ranks but reports "no distributed training", so Trainer sees world size 1 and every process
  trains alone on the same batches.
* :func:`init_after_elastic_restart`: after ``torchrun --max-restarts`` restarts the workers, they
  rendezvous through the agent's TCP store, which outlives the workers (static rendezvous always; c10d unless
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). torch puts no per-attempt prefix on the keys, so a new worker
  can read a dead worker's gloo address and fail with "Gloo connectFullMesh failed ... Connection refused".
  Initialising the default group with the store under an ``attempt_<n>`` prefix avoids it.

``DeMoTrainingArguments`` (and any config class made by ``with_demo_arguments``) apply both in
``__post_init__``, before Trainer sets up the devices.

* :func:`refuse_fsdp_on_cpu`: FSDP asked for (``--fsdp``, ``ACCELERATE_USE_FSDP``) on the CPU, where Accelerate
  does not run it: refused at DeMo's first use (the arguments, DeMoTrainer, ``DeMo(...)``, ``hf_demo.prepare``).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from hf_demo.refusals import refuse

logger = logging.getLogger(__name__)


def _no_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return not acc.is_available()
    return not torch.cuda.is_available()  # pragma: no cover - torch < 2.6


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def fsdp_requested(args=None) -> bool:
    """Whether the training arguments (``--fsdp``) or the launch (``ACCELERATE_USE_FSDP``) ask for FSDP."""
    asked = bool(getattr(args, "fsdp", None)) if args is not None else False
    return asked or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes")


def on_cpu(args=None) -> bool:
    """Whether this process trains on the CPU: ``use_cpu`` in ``args``, ``ACCELERATE_USE_CPU``, or no accelerator."""
    if args is not None and getattr(args, "use_cpu", False):
        return True
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    return _no_accelerator()


def refuse_fsdp_on_cpu(args=None) -> None:
    """Refuse (``fsdp_not_run``, :mod:`hf_demo.refusals`) FSDP asked for (:func:`fsdp_requested`) on the CPU: called
    at DeMo's first use, before Accelerate's own checks where the arguments or the trainer come first."""
    if fsdp_requested(args) and on_cpu(args):
        refuse("fsdp_not_run")


def launched_on_cpu_without_switch(use_cpu: bool) -> bool:
    """Several launched processes (``LOCAL_RANK``, ``WORLD_SIZE`` > 1), no GPU, and no CPU switch."""
    launched = int(os.environ.get("LOCAL_RANK", "-1")) != -1 and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return launched and not use_cpu and not _env_true("ACCELERATE_USE_CPU") and _no_accelerator()


def init_after_elastic_restart(backend: str | None, timeout_s: float = 1800) -> bool:
    """After a torchrun restart, initialise the default group on a per-attempt prefix of the agent's store.

    Does nothing (returns False) on the first attempt, outside torchrun, without the shared agent store,
    or when a group already exists. ``backend`` None: gloo without GPU, nccl with.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (
        attempt == 0
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or not dist.is_available()
        or dist.is_initialized()
    ):
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"hf_demo/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    logger.warning("hf_demo: restart %d of torchrun: process group initialised on a fresh store prefix", attempt)
    return True


def prepare_launch(args) -> None:
    """Both fixes for TrainingArguments ``args`` (in ``__post_init__``, before the devices are set up)."""
    if launched_on_cpu_without_switch(bool(args.use_cpu)):
        logger.warning(
            "hf_demo: %s processes launched on a machine without GPU: setting use_cpu=True so they "
            "train together over gloo (pass --use_cpu true or set ACCELERATE_USE_CPU=1 to say so)",
            os.environ.get("WORLD_SIZE"),
        )
        args.use_cpu = True
    backend = args.ddp_backend or ("gloo" if args.use_cpu or _env_true("ACCELERATE_USE_CPU") else None)
    init_after_elastic_restart(backend, args.ddp_timeout)
