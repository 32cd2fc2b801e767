"""hf_demo.elastic: the missing extra is named, and the modes it does not run are refused with the reason."""

import builtins

import pytest
import torch

import hf_demo
from hf_demo.errors import DeMoSetupError


def test_missing_torchft_names_the_extra(monkeypatch):
    from hf_demo import elastic

    real = builtins.__import__

    def no_torchft(name, *args, **kwargs):
        if name.startswith("torchft"):
            raise ImportError("No module named 'torchft'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchft)
    monkeypatch.setattr(elastic.importlib, "import_module", lambda n: no_torchft(n))
    with pytest.raises(ImportError, match=r"hf-demo\[ft\]"):
        elastic.require_torchft()


def test_overlap_and_local_steps_are_refused_with_the_reason():
    from hf_demo.elastic import refuse_modes

    model = torch.nn.Linear(8, 8)
    with pytest.raises(DeMoSetupError, match="overlap=True"):
        refuse_modes(hf_demo.DeMo(model.parameters(), overlap=True))
    with pytest.raises(DeMoSetupError, match="sync_every > 1"):
        refuse_modes(hf_demo.DeMo(model.parameters(), sync_every=4))
    refuse_modes(hf_demo.DeMo(model.parameters()))  # every-step DeMo runs
