"""What the planner's ``--orthogonal-overhead`` is, measured on a model: one Newton-Schulz run over every hidden
matrix against one forward+backward.

The orthogonalising rules (local Muon steps of the ``from_scratch`` presets, the orthogonal update rules) run
:func:`~hf_demo.optim.update_rules.newton_schulz` on each hidden matrix (those
:func:`~hf_demo.optim.param_groups.muon_style_groups` puts in its first group) once or twice per step, on every
rank. How long that takes against the forward and backward pass depends on the model's shapes and the tokens per
step, and on the device, so measure it where the training runs::

    from hf_demo.ops.compute_cost import orthogonal_overhead
    ratio = orthogonal_overhead(model, batch)   # batch: what model(**batch) takes, labels included
    # hf-demo plan ... --orthogonal-overhead <ratio>
"""

from __future__ import annotations

import statistics
import time

import torch

from hf_demo.optim.param_groups import embedding_and_head_ids, is_hidden_matrix
from hf_demo.optim.update_rules import OrthogonalRule, matrix_view, newton_schulz
from hf_demo.topology.dtensor import is_sharded


def hidden_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters an orthogonalising rule steps as matrices: the hidden matrices of ``muon_style_groups``."""
    excluded = embedding_and_head_ids(model)
    return [p for name, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(name, p, excluded)]


def _seconds(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def orthogonal_overhead(model: torch.nn.Module, batch: dict, repeats: int = 5) -> float:
    """Seconds of one Newton-Schulz run (the rules' steps, fp32) over every hidden matrix of ``model``, divided by
    the seconds of one forward+backward on ``batch`` (a dict ``model(**batch)`` takes, returning a loss): medians
    of ``repeats`` runs of each, taken in turn after one warm-up of each. The parameters do not change and
    the gradients they held before are theirs again after. A model sharded by FSDP2 is refused: measure it
    unsharded."""
    if repeats < 1:
        raise ValueError(f"orthogonal_overhead: repeats={repeats!r}: need at least 1")
    matrices = hidden_matrices(model)
    if not matrices:
        raise ValueError("orthogonal_overhead: the model has no hidden matrix (2-D, not an embedding or the head)")
    if any(is_sharded(p) for p in matrices):
        raise ValueError(
            "orthogonal_overhead: the model is sharded (FSDP2): measure it on the model before fully_shard, whose "
            "hidden matrices are whole as the rule orthogonalises them"
        )
    device = matrices[0].device
    kept = {p: p.grad for p in model.parameters()}

    def forward_backward():
        loss = model(**batch).loss
        loss.backward()
        for p in kept:
            p.grad = None

    def orthogonalise():
        with torch.no_grad():
            for p in matrices:
                newton_schulz(matrix_view(p.detach()), OrthogonalRule.ns_steps)

    times: dict[str, list[float]] = {"fb": [], "ns": []}
    try:
        for p in kept:
            p.grad = None
        for i in range(repeats + 1):
            for key, run in (("fb", forward_backward), ("ns", orthogonalise)):
                seconds = _seconds(run, device)
                if i:
                    times[key].append(seconds)
    finally:
        for p, grad in kept.items():
            p.grad = grad
    return statistics.median(times["ns"]) / statistics.median(times["fb"])
