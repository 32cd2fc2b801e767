"""The site-packages corpus of the larger benchmarks (``benchmarks/benchlib/code_corpus.py``): which files it holds,
a package list that pins it, and a cache shared by every copy of one venv."""

from __future__ import annotations

import pytest
import torch

from benchlib import code_corpus


class _Bytes:
    """A stand-in for SmolLM2's tokenizer: a file's bytes are its tokens (no model files, no 20 s load)."""

    calls = 0

    def __call__(self, texts):
        _Bytes.calls += 1
        return [list(t.encode()) + [0] for t in texts]


@pytest.fixture
def corpus_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DEMO_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(code_corpus, "_Tokenizer", _Bytes)
    _Bytes.calls = 0
    return tmp_path


def _venv(root, packages=("alpha", "beta")):
    for name in packages:
        (root / name / "tests").mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"NAME = {name!r}\n")
        (root / name / "tests" / "test_it.py").write_text("assert True\n")
    (root / "alpha" / "_vendored.py").write_text("NAME = 'beta'\n")  # beta's __init__ again: read once
    (root / "gamma.py").write_text("X = 1\n")
    return root


def test_the_package_list_pins_the_corpus_and_names_what_is_missing(corpus_env):
    root = _venv(corpus_env / "site")
    every = code_corpus.source_files(root)
    assert [(pkg, p.relative_to(root).as_posix()) for pkg, p in every] == [
        ("alpha", "alpha/__init__.py"),
        ("alpha", "alpha/_vendored.py"),
        ("gamma", "gamma.py"),
    ]  # test folders out; beta/__init__.py has alpha/_vendored.py's bytes
    pinned = code_corpus.source_files(root, ("alpha", "gamma"))
    _venv(corpus_env / "site", ("delta",))  # a package installed later
    assert code_corpus.source_files(root, ("alpha", "gamma")) == pinned
    assert [pkg for pkg, _ in code_corpus.source_files(root)] == ["alpha", "alpha", "delta", "gamma"]
    with pytest.raises(ValueError, match=r"names omega, which .* does not hold"):
        code_corpus.source_files(root, ("alpha", "omega"))


def test_the_list_file_is_read_without_comments(tmp_path):
    listing = tmp_path / "packages.txt"
    listing.write_text("# the corpus\nbeta\nalpha  # a comment\n\nbeta\n")
    assert code_corpus.read_packages(listing) == ("alpha", "beta")


def test_two_copies_of_one_venv_share_the_cache(corpus_env):
    """Worktrees of one repository reach one venv by different paths: the corpus is tokenised once."""
    ids, spans = code_corpus.code_tokens(root=_venv(corpus_env / "a" / "site"))
    assert _Bytes.calls == 1 and ids.dtype == torch.int32
    again, same_spans = code_corpus.code_tokens(root=_venv(corpus_env / "b" / "site"))
    assert _Bytes.calls == 1, "another path to the same files tokenised them again"
    assert torch.equal(again, ids) and same_spans == spans
    assert not list((corpus_env / "cache").rglob("*.tmp"))


def test_convergence_keys_a_pinned_corpus_apart(tmp_path):
    import convergence

    listing = tmp_path / "packages.txt"
    listing.write_text("alpha\n")
    base = ["--corpus", "site-packages", "--methods", "muon", "--steps", "2", "--seeds", "0"]
    free = convergence.build_plan(convergence.parse_args(base))[0]
    pinned = convergence.build_plan(convergence.parse_args([*base, "--corpus-packages", str(listing)]))[0]
    assert pinned.corpus_packages == ("alpha",) and free.corpus_packages is None
    assert pinned.key() != free.key() and "corpus_packages" not in free.key()
    with pytest.raises(SystemExit, match="--corpus is stdlib"):
        convergence.build_plan(convergence.parse_args(["--corpus-packages", str(listing), "--steps", "2"]))
