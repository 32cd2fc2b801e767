"""DeMo's user-facing settings: names, defaults, parsing of ``--optim_args`` strings, the factory."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hf_demo.optim.optimizer import DeMo
from hf_demo.optim.param_groups import model_groups
from hf_demo.settings import DeMoSettings, refuse_retired

# key -> (type, default, help): derived from DeMoSettings, the one source of truth.
SETTINGS: dict[str, tuple[type, object, str]] = {
    name: (kind, default, help) for name, kind, default, help, _ in DeMoSettings.describe()
}


# where DeMo communicates, not how it steps: passed to DeMo as they are, never settings
PLACEMENT = ("process_group", "device_mesh")


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
        refuse_retired([key])
        if key not in SETTINGS and key != "preset":
            raise ValueError(
                f"unknown DeMo setting {key!r} in --optim_args; known settings: preset, {', '.join(SETTINGS)}"
            )
        out[key] = _convert(key, raw)
    return out


def optimizer_cls_and_kwargs(lr: float = 1e-3, weight_decay: float = 0.0, **settings) -> tuple[type, dict]:
    """``(DeMo, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)`` (Trainer builds the groups)."""
    refuse_retired(settings)
    unknown = set(settings) - set(SETTINGS) - set(PLACEMENT) - {"preset"}
    if unknown:
        raise ValueError(f"unknown DeMo setting(s) {sorted(unknown)}; known settings: {', '.join(SETTINGS)}")
    return DeMo, {"lr": lr, "weight_decay": weight_decay, **settings}


def create_optimizer(
    model_or_params: torch.nn.Module | Iterable, lr: float = 1e-3, weight_decay: float = 0.0, **settings
) -> DeMo:
    """Build a DeMo optimizer for a model (its groups from :func:`hf_demo.optim.param_groups.model_groups`:
    decay/no-decay as Trainer makes them, Muon-style for an orthogonal ``update_rule`` or ``inner_rule``) or
    parameters. ``process_group`` or ``device_mesh`` (a model sharded by FSDP2: :mod:`hf_demo.fsdp`) say where DeMo
    exchanges, as for :class:`hf_demo.DeMo`."""
    cls, kwargs = optimizer_cls_and_kwargs(lr=lr, weight_decay=weight_decay, **settings)
    params = model_or_params
    if isinstance(model_or_params, torch.nn.Module):
        chosen = {k: v for k, v in settings.items() if k not in PLACEMENT and k != "preset"}
        resolved = DeMoSettings.resolve(settings.get("preset"), **chosen)
        params = model_groups(model_or_params, weight_decay, resolved.update_rule, resolved.inner_rule)
    return cls(params, **kwargs)
