"""DeMo's user-facing settings: names, defaults, parsing of ``--optim_args`` strings, the factory."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hf_demo.optim.optimizer import DeMo
from hf_demo.settings import DeMoSettings

# key -> (type, default, help): derived from DeMoSettings, the one source of truth.
SETTINGS: dict[str, tuple[type, object, str]] = {
    name: (kind, default, help) for name, kind, default, help, _ in DeMoSettings.describe()
}


def _convert(key: str, raw: str):
    if key == "preset":
        return raw
    kind = SETTINGS[key][0]
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return low in ("true", "1", "yes")
        return kind(raw)
    except ValueError:
        raise ValueError(f"DeMo setting {key}={raw!r} is not a valid {kind.__name__}") from None


def parse_optim_args(text: str | None) -> dict:
    """``"compression_topk=16,value_format=sign"`` -> ``{"compression_topk": 16, "value_format": "sign"}``.

    Unknown keys and malformed entries raise ``ValueError`` naming them.
    """
    out = {}
    if not text:
        return out
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        if entry.count("=") != 1:
            raise ValueError(f"malformed --optim_args entry {entry!r}: expected key=value")
        key, raw = (s.strip() for s in entry.split("="))
        if key not in SETTINGS and key != "preset":
            raise ValueError(
                f"unknown DeMo setting {key!r} in --optim_args; known settings: preset, {', '.join(SETTINGS)}"
            )
        out[key] = _convert(key, raw)
    return out


NO_DECAY_PATTERNS = ("bias", "norm", "layernorm", "rmsnorm")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainer's convention: no weight decay on biases and normalisation weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if any(pat in name.lower() for pat in NO_DECAY_PATTERNS) else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def optimizer_cls_and_kwargs(lr: float = 1e-3, weight_decay: float = 0.0, **settings) -> tuple[type, dict]:
    """``(DeMo, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)`` (Trainer builds the groups)."""
    unknown = set(settings) - set(SETTINGS) - {"process_group", "preset"}
    if unknown:
        raise ValueError(f"unknown DeMo setting(s) {sorted(unknown)}; known settings: {', '.join(SETTINGS)}")
    return DeMo, {"lr": lr, "weight_decay": weight_decay, **settings}


def create_optimizer(
    model_or_params: torch.nn.Module | Iterable, lr: float = 1e-3, weight_decay: float = 0.0, **settings
) -> DeMo:
    """Build a DeMo optimizer for a model (decay/no-decay groups as Trainer makes them) or parameters."""
    cls, kwargs = optimizer_cls_and_kwargs(lr=lr, weight_decay=weight_decay, **settings)
    params = (
        param_groups(model_or_params, weight_decay) if isinstance(model_or_params, torch.nn.Module) else model_or_params
    )
    return cls(params, **kwargs)
