"""The benchmarks' job: a byte-level ``LlamaForCausalLM`` (vocab 256, random init from a seed) trained on the
Python standard library's own sources.

The last ``heldout`` fraction of the bytes is the held-out set (the same bytes whatever the shards); the rest is
split between the ``world`` ranks by ``shards`` (:data:`SHARDS`), and rank r draws its training windows only from
its own part, at offsets from a generator seeded with (seed, rank): every method sees exactly the same data in the
same order. Each rank's part is disjoint from every other rank's.

- ``contiguous`` (the default): ``world`` equal byte ranges of the sorted concatenation: rank r reads the r-th
  range, so ranks read different alphabetical ranges of the standard library (at W = 2, files ``__future__`` to
  ``idlelib`` against the rest).
- ``interleaved`` (IID): whole files dealt in sorted order, each to the rank with the fewest bytes so far (ties
  to the lower rank): every rank reads a mix of every package and of the top-level modules.
- ``by_directory`` (non-IID): whole packages: each folder at the top of the standard library (with its
  subfolders), and each top-level module on its own, goes to one rank, largest first to the rank with the fewest
  bytes so far (ties to the lower rank); no package is read by two ranks. At W = 8 one rank reads the
  ``encodings`` codec tables almost alone, another ``pydoc_data``'s prose.

The file modes read whole files up to the held-out cut (the file that straddles it contributes its part before
the cut); a rank's files are concatenated in sorted order.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from hf_demo.stdlib_corpus import stdlib_bytes, stdlib_files

__all__ = ["SHARDS", "Data", "byte_llama", "evaluate", "shard_ranges", "stdlib_bytes", "stdlib_spans"]

SHARDS = ("contiguous", "interleaved", "by_directory")


def stdlib_spans() -> list[tuple[str, int, int]]:
    """(package, start, end) of each file in :func:`stdlib_bytes`'s concatenation (its trailing newline included),
    in order; the package is the file's top folder under the standard library, or the file itself at the top."""
    root = Path(sysconfig.get_paths()["stdlib"])
    spans, offset = [], 0
    for f in stdlib_files():
        parts = f.relative_to(root).parts
        size = f.stat().st_size + 1
        spans.append((parts[0], offset, offset + size))
        offset += size
    return spans


def _least_loaded(load: list[int]) -> int:
    return min(range(len(load)), key=lambda i: (load[i], i))


def _deal_files(spans, world: int) -> list[int]:
    """The rank of each span under ``interleaved``: in order, each to the least-loaded rank."""
    load, owners = [0] * world, []
    for _, start, end in spans:
        owners.append(_least_loaded(load))
        load[owners[-1]] += end - start
    return owners


def _deal_packages(spans, world: int) -> list[int]:
    """The rank of each span under ``by_directory``: packages largest first, each to the least-loaded rank."""
    sizes: dict[str, int] = {}
    for pkg, start, end in spans:
        sizes[pkg] = sizes.get(pkg, 0) + end - start
    load, owner = [0] * world, {}
    for pkg in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = _least_loaded(load)
        owner[pkg] = r
        load[r] += sizes[pkg]
    return [owner[pkg] for pkg, _, _ in spans]


def shard_ranges(shards: str, rank: int, world: int, cut: int, spans=None) -> list[tuple[int, int]]:
    """The byte ranges of the concatenation, all below ``cut``, that rank ``rank`` of ``world`` trains on."""
    if shards not in SHARDS:
        raise ValueError(f"shards={shards!r}: expected one of {SHARDS}")
    if shards == "contiguous":
        shard = cut // world
        return [(rank * shard, (rank + 1) * shard)]
    if spans is None:
        raise ValueError(f"shards={shards!r} splits whole files: it needs the files' spans (stdlib_spans())")
    clipped = [(pkg, s, min(e, cut)) for pkg, s, e in spans if s < cut]
    owners = _deal_files(clipped, world) if shards == "interleaved" else _deal_packages(clipped, world)
    return [(s, e) for (_, s, e), r in zip(clipped, owners) if r == rank]


def byte_llama(
    *, hidden: int, intermediate: int, layers: int, heads: int, seq_len: int, seed: int, vocab: int = 256, tie=False
):
    """A randomly initialised Llama over bytes (no tokenizer; ``vocab`` another tokenizer's size): the same weights
    for the same arguments. ``tie``: the output head is the embedding matrix (as SmolLM2's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie,
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
        shards: str = "contiguous",
        spans=None,
    ):
        n = corpus.numel()
        cut = int(n * (1 - heldout))
        if shards != "contiguous" and spans is None:
            spans = stdlib_spans()
        if spans is not None and spans[-1][2] != n:
            raise ValueError(f"the files' spans end at byte {spans[-1][2]}, the corpus has {n}: not the same files")
        self.ranges = shard_ranges(shards, rank, world, cut, spans)
        self.train = torch.cat([corpus[s:e] for s, e in self.ranges])
        shard = self.train.numel()
        held = corpus[cut:]
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed * 1000003 + rank)
        n_eval = eval_batches * batch
        starts = torch.linspace(0, held.numel() - seq_len - 1, n_eval).long()
        windows = torch.stack([held[s : s + seq_len] for s in starts.tolist()]).long()
        self.eval = windows.split(batch)
        self.sizes = dict(
            shards=shards,
            corpus_bytes=n,
            train_bytes=cut,
            shard_bytes=shard,
            heldout_bytes=n - cut,
            eval_windows=n_eval,
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
