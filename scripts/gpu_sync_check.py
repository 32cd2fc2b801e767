"""Host synchronisations of a steady-state DeMo step on CUDA, for scripts/gpu_check.sh.

    torchrun --standalone --nproc_per_node N scripts/gpu_sync_check.py [--tensors 128]

After two warm-up steps, one step runs under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that
makes the host wait for the device warns once, and the warnings are counted (``"error"`` would stop at the first;
the collectives themselves need some). The check passes when the count does not grow with the number of
parameter tensors (the same at --tensors and at 4x as many) and is at most the budget (--budget, default 4 plus
what the collectives need: 2 per step on NCCL for the header and the vote read back to the host).
Then one step is tried under CUDA-graph capture and the result is printed: DeMo decides on the host from the
headers of every rank, so a whole step is not expected to be capturable.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch
import torch.distributed as dist

import hf_demo

SHAPES = [(256, 256), (256,), (256, 688), (688, 256)]


def make(tensors: int, device) -> tuple[list[torch.nn.Parameter], hf_demo.DeMo]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SHAPES[i % 4], device=device)) for i in range(tensors)]
    return params, hf_demo.DeMo(params, lr=1e-3)


def step(params, opt, seed: int) -> None:
    g = torch.Generator(device=params[0].device).manual_seed(seed + 1000 * dist.get_rank())
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device, generator=g)
    opt.step()


def syncs_of_one_step(tensors: int, device) -> collections.Counter:
    """The host synchronisations of one steady-state step, counted by call site (``file:line``)."""
    params, opt = make(tensors, device)
    for s in range(2):
        step(params, opt, s)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(params, opt, 2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(
        f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()
    )


def try_graph(device) -> str:
    params, opt = make(8, device)
    for s in range(2):
        step(params, opt, s)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            opt.step()
    except Exception as exc:  # noqa: BLE001 - what capture refused is the finding
        return f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return "captured"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=128)
    parser.add_argument("--budget", type=int, default=6)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    syncs_of_one_step(8, device)  # discarded: the first window under the debug mode also counts CUDA's one-time set-up
    few, many = syncs_of_one_step(args.tensors, device), syncs_of_one_step(4 * args.tensors, device)
    graph = try_graph(device)
    n_few, n_many = sum(few.values()), sum(many.values())
    ok = n_few == n_many and n_many <= args.budget
    if dist.get_rank() == 0:
        print(f"  host syncs of one step: {n_few} at {args.tensors} tensors, {n_many} at {4 * args.tensors} tensors "
              f"(budget {args.budget}): {'ok' if ok else 'FAIL'}")  # fmt: skip
        for site in sorted(few | many, key=lambda s: -many[s]):
            print(f"    {few[site]} / {many[site]} x {site}")
        print(f"  CUDA graph of a whole step: {graph}")
    hf_demo.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
