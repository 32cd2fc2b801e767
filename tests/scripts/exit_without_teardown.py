"""DeMo on 2 gloo ranks for a few steps, a few collectives of the user's own (as an evaluation gathering its
metrics would), then exit WITHOUT destroying the process group, as users forget to.

hf_demo's exit handler must tear the group down: without it, gloo's worker threads still hold work objects when
the interpreter finalises and some exits abort ("terminate called without an active exception"). Run with
torchrun --nproc_per_node 2 (tests/test_launch.py).
"""

import torch
import torch.distributed as dist

import hf_demo

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
optimizer = hf_demo.DeMo(model.parameters(), lr=1e-3, compression_topk=4, compression_chunk=8)
gen = torch.Generator().manual_seed(dist.get_rank())
for _ in range(5):
    model(torch.randn(16, 32, generator=gen)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
metrics_group = dist.new_group(ranks=[0, 1], use_local_synchronization=True)
metrics = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(metrics)
    gathered = torch.empty(2 * metrics.numel())
    dist.all_gather_into_tensor(gathered, metrics, group=metrics_group)
