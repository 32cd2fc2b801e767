"""Small models and data shared by the tests."""
import torch


def tiny_mlp(seed: int = 0, hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 8))


def batch(rank: int, step: int, n: int = 32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 16, generator=g)
    y = torch.randint(0, 8, (n,), generator=g)
    return x, y


def loss_and_backward(model, rank, step):
    x, y = batch(rank, step)
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()
