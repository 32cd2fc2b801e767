"""Errors raised by hf_demo. Each names the problem; none is raised after state was half-changed."""


class DeMoError(RuntimeError):
    """Base class of every error hf_demo raises on purpose."""


class DeMoSyncError(DeMoError):
    """Ranks disagree (model layout, settings, step, world size), or received data is invalid.

    Raised on every rank of the step, because every rank sees every header.
    """


class DeMoSettingsError(DeMoSyncError):
    """The ranks' settings differ (learning rate, top-k, value format...): each differing setting is named with
    every rank's value. Raised on every rank alike; a retry cannot help, so an elastic run raises it too instead of
    refusing the step and trying again."""


class DeMoPayloadError(DeMoSyncError):
    """What this rank received failed its checks (CRC32, HMAC, positions in range, finite values). Found on
    the receiving rank only; the ranks vote before they commit, so every rank refuses the step alike."""


class DeMoNonFiniteError(DeMoError):
    """A rank's local gradients hold NaN or Inf and the policy is ``nonfinite="raise"``."""


class DeMoStateError(DeMoError):
    """A saved optimizer state does not fit this run (other world size, rank, layout or version)."""


class DeMoSetupError(DeMoError, ValueError):
    """DeMo runs in a set-up that would silently train something else (DDP still averaging gradients, every
    rank reading the same batches, a launch that Trainer sees as one process)."""


DDP_ALLREDUCES = (
    "DeMo's parameters are inside a DistributedDataParallel model that still all-reduces gradients "
    "(a plain Trainer/SFTTrainer given optimizers=(DeMo, ...), or accelerator.prepare without hf_demo): "
    "every rank would step on the averaged gradient. Use hf_demo.DeMoTrainer (--optim demo), a trainer "
    "class with hf_demo.DeMoTrainerMixin first (hf_demo.with_demo(TrainerClass, ConfigClass) makes one for any "
    "trainer; hf_demo.trl.DeMoSFTTrainer for TRL's SFT), "
    "hf_demo.prepare(accelerator, model, optimizer) in a custom loop, or call "
    "hf_demo.disable_gradient_allreduce(ddp_model) before the first backward (or `del` a wrapper no longer used)."
)


def lookup(table: dict, what: str, name: str):
    """``table[name]``, or a ValueError naming ``what`` was asked for and every name there is."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {what} {name!r}; expected one of {', '.join(table)}") from None
