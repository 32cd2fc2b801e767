"""The parameter groups DeMo trains a whole model with (:func:`model_groups`: ``create_optimizer``, DeMoTrainer).

Trainer's convention (:func:`decay_groups`): no weight decay on biases and normalisation weights. For the
orthogonal update rule (:func:`muon_style_groups`): Muon orthogonalises the hidden matrices of a network
(attention and MLP projections) and leaves the input embeddings, the output head, norms and biases to another
rule; :func:`is_hidden_matrix` is the test, on shapes and module types only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hf_demo.optim import update_rules

NO_DECAY_PATTERNS = ("bias", "norm", "layernorm", "rmsnorm")
HIDDEN = {"update_rule": "orthogonal"}
OTHERS = {"update_rule": "sign"}


def decays(name: str) -> bool:
    """Trainer's convention: weight decay on everything but biases and normalisation weights."""
    return not any(pat in name.lower() for pat in NO_DECAY_PATTERNS)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in a group with ``weight_decay`` and one without (:func:`decays`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def model_groups(model: torch.nn.Module, weight_decay: float, update_rule: str, inner_rule: str = "adam") -> list[dict]:
    """Muon-style groups (:func:`muon_style_groups`) when either rule is an orthogonal one
    (:data:`update_rules.ORTHOGONAL`): the hidden matrices take it, the embeddings, head, norms and biases take
    ``sign`` in its place (an ``update_rule``) or ``adam`` (an ``inner_rule``: local Adam steps, as Muon users
    give them AdamW); else :func:`decay_groups`."""
    hidden, others = {}, {}
    if update_rule in update_rules.ORTHOGONAL:
        hidden["update_rule"], others["update_rule"] = update_rule, "sign"
    if inner_rule in update_rules.ORTHOGONAL:
        hidden["inner_rule"], others["inner_rule"] = inner_rule, "adam"
    if hidden:
        return muon_style_groups(model, hidden=hidden, others=others, weight_decay=weight_decay)
    return decay_groups(model, weight_decay)


def embedding_and_head_ids(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter of an ``nn.Embedding`` and of the model's input and output embeddings
    (``get_input_embeddings()``/``get_output_embeddings()`` of a transformers model: the LM head)."""
    modules = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            found = getattr(model, getter)() if hasattr(model, getter) else None
        except NotImplementedError:  # a PreTrainedModel without that head
            found = None
        if isinstance(found, torch.nn.Module):
            modules.append(found)
    return {id(p) for m in modules for p in m.parameters()}


def is_hidden_matrix(name: str, param: torch.Tensor, excluded_ids: set[int], exclude: Iterable[str] = ()) -> bool:
    """2 or more dimensions, not an embedding or the output head (``excluded_ids``), and no substring of
    ``exclude`` in its name (a classifier head, say)."""
    return param.dim() >= 2 and id(param) not in excluded_ids and not any(s in name for s in exclude)


def muon_style_groups(
    model: torch.nn.Module,
    hidden: dict | None = None,
    others: dict | None = None,
    exclude: Iterable[str] = (),
    weight_decay: float | None = None,
) -> list[dict]:
    """Parameter groups for ``hf_demo.DeMo``: the hidden matrices with ``hidden``'s settings (default
    ``update_rule="orthogonal"``), every other trainable parameter (embeddings, output head, norms, biases,
    names containing a substring of ``exclude``) with ``others``' (default ``update_rule="sign"``).

    With ``weight_decay`` given, each group also sets it, and biases and normalisation weights go to groups
    of their own with no weight decay (Trainer's convention, :data:`NO_DECAY_PATTERNS`).
    Empty groups are left out; frozen parameters too.

    ``DeMo(muon_style_groups(model), lr=1e-3)``; local Muon steps between synchronisations:
    ``muon_style_groups(model, hidden={"inner_rule": "orthogonal"}, others={})`` with ``sync_every > 1``.
    """
    hidden = HIDDEN if hidden is None else hidden
    others = OTHERS if others is None else others
    exclude = tuple(exclude)
    excluded_ids = embedding_and_head_ids(model)
    buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = weight_decay is None or decays(name)
        buckets.setdefault((is_hidden_matrix(name, p, excluded_ids, exclude), decayed), []).append(p)
    groups = []
    for is_hidden in (True, False):
        for decayed in (True, False):
            params = buckets.get((is_hidden, decayed))
            if not params:
                continue
            group = {"params": params, **(hidden if is_hidden else others)}
            if weight_decay is not None:
                group["weight_decay"] = weight_decay if decayed else 0.0
            groups.append(group)
    return groups
