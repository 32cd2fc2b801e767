"""A gloo script that never destroys its process group, with hf_demo's exit handler (tests/test_launch.py).

Two ranks run collectives on the world group and on a subgroup, then exit without
``destroy_process_group()``. Without a teardown, gloo's worker threads still hold work objects when the
interpreter finalises and some exits abort ("terminate called without an active exception"): 6 of 30 torchrun
launches of this script without the handler on a 2-core machine. ``--handler`` installs hf_demo's exit handler
(what DeMo's first step and DeMoTrainer do): 0 of 30. hf_demo is imported after the collectives on purpose:
imported first, its imports change the timing so much that the bare script rarely aborts here at all, and the
test could not tell a working handler from a missing one.
"""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
group = dist.new_group(ranks=[0, 1], use_local_synchronization=True)
x = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(x)
    out = torch.empty(2 * x.numel())
    dist.all_gather_into_tensor(out, x, group=group)
if "--handler" in sys.argv:
    from hf_demo.exchange import teardown

    teardown.install_exit_handler()
