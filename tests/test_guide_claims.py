"""The guides' statements on which modes combine hold: each claim checked against what DeMo does (no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_demo

ROOT = Path(__file__).resolve().parent.parent
CHOOSING = (ROOT / "docs/guides/choosing-settings.md").read_text()
SLOW_LINKS = (ROOT / "docs/guides/multi-node-and-slow-links.md").read_text()


def _demo(**kw):
    return hf_demo.DeMo(torch.nn.Linear(8, 8).parameters(), lr=1e-3, **kw)


@pytest.mark.parametrize("fmt", ["sign", "2bit"])
def test_all_reduce_refuses_scaled_value_formats_as_the_guide_says(fmt):
    with pytest.raises(ValueError, match="exchange='all_reduce' sums values"):
        _demo(exchange="all_reduce", value_format=fmt)
    assert "`sign` and `2bit` carry each rank's own scales" in CHOOSING


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_all_reduce_takes_the_formats_a_sum_can_add(fmt):
    _demo(exchange="all_reduce", value_format=fmt)
    assert 'takes `value_format="fp32"` or `"bf16"`' in CHOOSING


def test_the_slow_links_guide_says_hsdp_combines_with_the_budget_and_the_orthogonal_rule():
    # tests/test_fsdp.py runs both on sharded parameters (comm_budget; the from_scratch preset's orthogonal rule)
    text = " ".join(SLOW_LINKS.split())
    assert "not with `comm_budget` or the orthogonal rule" not in text
    assert "It combines with `sync_every > 1`, `comm_budget` and the orthogonal rule" in text
