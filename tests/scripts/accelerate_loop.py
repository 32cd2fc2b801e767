"""A custom Accelerate loop with DeMo: hf_demo.create_optimizer + hf_demo.prepare. Run with accelerate launch."""

import hashlib
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hf_demo


def digest(tensors):
    return hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def main(out_path):
    accelerator = Accelerator()
    torch.manual_seed(accelerator.process_index)  # different initial weights: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = hf_demo.create_optimizer(model, lr=1e-2, weight_decay=0.01, compression_topk=8, compression_chunk=16)
    model, optimizer = hf_demo.prepare(accelerator, model, optimizer)
    gen = torch.Generator().manual_seed(100 + accelerator.process_index)
    grads, losses = [], []
    for _ in range(30):
        x = torch.randn(32, 16, generator=gen)
        y = x[:, :4].argmax(1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        grads.append(digest(p.grad for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save(
        {"world": dist.get_world_size(), "params": digest(model.parameters()), "grad0": grads[0], "losses": losses},
        out_path.replace("RANK", str(accelerator.process_index)),
    )


if __name__ == "__main__":
    main(sys.argv[1])
