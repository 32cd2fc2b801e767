"""Small models, data and optimizers shared by the tests."""

from __future__ import annotations

import io

import torch

import hf_demo

SMALL_DEMO = {"lr": 3e-3, "compression_topk": 4, "compression_chunk": 8}  # blocks a tiny_mlp is cut into


def tiny_mlp(seed: int = 0, hidden: int = 32, inputs: int = 16, outputs: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, outputs))


def small_demo(model, **settings) -> hf_demo.DeMo:
    """DeMo on ``model``'s parameters with :data:`SMALL_DEMO` (top-4 of 8-wide blocks) and ``settings`` on top."""
    return hf_demo.DeMo(model.parameters(), **{**SMALL_DEMO, **settings})


def awkward_mlp(seed: int = 0) -> torch.nn.Sequential:
    """An MLP whose shapes a chunk of 8 does not divide: 20 is cut in blocks of 5, 13 is padded to 16."""
    return tiny_mlp(seed, hidden=20, inputs=13, outputs=5)


def batch(rank: int, step: int, n: int = 32, inputs: int = 16, classes: int = 8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, inputs, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def loss_and_backward(model, rank, step):
    """The batch of (rank, step), made on the CPU and moved to the model's device, through forward and backward."""
    x, y = batch(rank, step, inputs=model[0].in_features, classes=model[-1].out_features)
    device = model[0].weight.device
    x, y = x.to(device, model[0].weight.dtype), y.to(device)
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def node_mean_backward(model, node: int, step: int, local_size: int = 2) -> None:
    """The gradients HSDP leaves on node ``node``'s shards (FSDP2 reduce-scatters inside the node): the mean over
    the node's ranks' batches of (rank, step), set as every parameter's ``.grad`` (flat DeMo between the nodes on
    these, each shard's rows apart, is HSDP-DeMo's slow spelling: tests/test_compose.py)."""
    grads = []
    for r in range(node * local_size, (node + 1) * local_size):
        loss_and_backward(model, r, step)
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, first, *rest in zip(model.parameters(), *grads):
        for g in rest:
            first = first + g
        p.grad = first / local_size


def restart(model, opt, make_opt):
    """What a fresh process does on resume: a new model (another init) and optimizer load the saved states."""
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    new_model = tiny_mlp(seed=7)
    new_opt = make_opt(new_model)
    new_model.load_state_dict(state["model"])
    new_opt.load_state_dict(state["opt"])
    return new_model, new_opt


REFERENCE_SETTINGS = dict(lr=3e-3, decay=0.9, topk=6, chunk=8, weight_decay=0.01)  # ReferenceDeMo's keywords


def demo_as_reference(params, **settings) -> hf_demo.DeMo:
    """DeMo with :data:`REFERENCE_SETTINGS` under its own names and fp32 values: what the slow reference
    (``hf_demo.optim.reference.ReferenceDeMo(params, **REFERENCE_SETTINGS)``) computes, to compare with it."""
    s = REFERENCE_SETTINGS
    return hf_demo.DeMo(
        params,
        lr=s["lr"],
        compression_decay=s["decay"],
        compression_topk=s["topk"],
        compression_chunk=s["chunk"],
        weight_decay=s["weight_decay"],
        **{"value_format": "fp32", **settings},
    )


class Regression(torch.nn.Module):
    """A two-layer regression for Trainer runs: ``x`` (8 features) and ``labels`` in, ``{"loss", "logits"}`` out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        y = self.l2(torch.tanh(self.l1(x))).squeeze(-1)
        return {"loss": ((y - labels) ** 2).mean(), "logits": y}
