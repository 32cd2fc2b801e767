"""The benchmarks' job: a byte-level ``LlamaForCausalLM`` (vocab 256, random init from a seed) trained on the
Python standard library's own sources.

The last ``heldout`` fraction of the bytes is the held-out set; the rest is cut into ``world`` contiguous
shards, and rank r draws its training windows only from shard r, at offsets from a generator seeded with
(seed, rank): every method sees exactly the same data in the same order.
"""

from __future__ import annotations

import torch

from hf_demo.stdlib_corpus import stdlib_bytes

__all__ = ["Data", "byte_llama", "evaluate", "stdlib_bytes"]


def byte_llama(*, hidden: int, intermediate: int, layers: int, heads: int, seq_len: int, seed: int):
    """A randomly initialised Llama over bytes (no tokenizer): the same weights for the same arguments."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


class Data:
    """Rank ``rank``'s training windows (:meth:`next_batch`) and the held-out windows (``eval``, the same on every
    rank)."""

    def __init__(
        self,
        corpus: torch.Tensor,
        rank: int,
        world: int,
        seq_len: int,
        batch: int,
        seed: int,
        heldout: float,
        eval_batches: int,
    ):
        n = corpus.numel()
        cut = int(n * (1 - heldout))
        shard = cut // world
        self.train = corpus[rank * shard : (rank + 1) * shard]
        held = corpus[cut:]
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed * 1000003 + rank)
        n_eval = eval_batches * batch
        starts = torch.linspace(0, held.numel() - seq_len - 1, n_eval).long()
        windows = torch.stack([held[s : s + seq_len] for s in starts.tolist()]).long()
        self.eval = windows.split(batch)
        self.sizes = dict(
            corpus_bytes=n, train_bytes=cut, shard_bytes=shard, heldout_bytes=n - cut, eval_windows=n_eval
        )

    def next_batch(self) -> torch.Tensor:
        starts = torch.randint(0, self.train.numel() - self.seq_len, (self.batch,), generator=self.gen)
        return torch.stack([self.train[s : s + self.seq_len] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model, batches) -> float:
    """The mean loss over ``batches`` (the held-out windows), in eval mode."""
    model.eval()
    losses = [float(model(input_ids=b, labels=b).loss) for b in batches]
    model.train()
    return sum(losses) / len(losses)
