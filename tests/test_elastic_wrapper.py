"""hf_demo.elastic.Elastic is a wrapper around an untouched DeMo, as torchft's OptimizerWrapper is around any
optimizer: DeMo holds no reference to it (its source has no ``replication``), the wrapper's ``step()`` runs DeMo's
public phases (``prepare_step``, then ``commit()`` or ``discard()`` as torchft's ``should_commit`` says), DeMo's own
``step()`` is refused while it is wrapped, and torchft's group is the backend of DeMo's transport by composition."""

from pathlib import Path

import pytest
import torch

import hf_demo
from hf_demo.errors import DeMoSetupError, DeMoSyncError
from test_elastic import _Manager

ROOT = Path(__file__).resolve().parent.parent


def _torchft():
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")


def _pair(seed: int = 0):
    """(model, DeMo) built alike from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, hf_demo.DeMo(model.parameters(), lr=1e-2, compression_topk=4)


def _backward(model, step: int) -> None:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(100 + step)
    model(torch.randn(4, 8)).square().mean().backward()


def test_demos_source_holds_no_replication():
    source = (ROOT / "hf_demo" / "optim" / "optimizer.py").read_text()
    assert "replication" not in source
    for path in (ROOT / "hf_demo").rglob("*.py"):  # nobody hands DeMo an elastic object any more
        assert ".replication" not in path.read_text(), path


def test_the_wrapper_steps_an_untouched_demo_as_a_plain_run_steps_it():
    """Five steps through ``Elastic.step`` (a quorum of one: torchft's step commits) end where five plain
    ``DeMo.step`` calls end, bit for bit, and the wrapped DeMo has the same attributes as the plain one, none of
    them the wrapper or anything of it."""
    _torchft()
    from hf_demo.elastic import Elastic

    plain_model, plain = _pair()
    model, opt = _pair()
    manager = _Manager()
    manager.world = 1
    elastic = Elastic(opt, model, manager=manager)
    for step in range(5):
        _backward(plain_model, step)
        plain.step()
        elastic.start_step()
        _backward(model, step)
        elastic.step()
    assert manager.step == 5 and elastic.stats.committed_steps == 5 and opt.steps == plain.steps == 5
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert opt.state[p].keys() == plain.state[q].keys()
        assert all(
            torch.equal(opt.state[p][k], plain.state[q][k])
            for k in opt.state[p]
            if torch.is_tensor(v := opt.state[p][k]) and v is not None
        )
    assert vars(opt).keys() == vars(plain).keys()
    held = [v for v in vars(opt).values() if v is elastic or getattr(v, "__self__", None) is elastic]
    assert held == [], held
    assert elastic.param_groups is opt.param_groups and elastic.state is opt.state
    assert elastic.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_a_step_torchft_refuses_is_discarded_and_applies_nothing():
    _torchft()
    from hf_demo.elastic import Elastic

    model, opt = _pair()
    manager = _Manager()
    manager.world, manager.commit = 1, False
    elastic = Elastic(opt, model, manager=manager)
    before = [p.detach().clone() for p in model.parameters()]
    elastic.start_step()
    _backward(model, 0)
    elastic.step()
    assert not elastic.last_committed and elastic.stats.refused_steps == 1 and manager.step == 0
    assert opt.steps == 0 and not any(opt.state.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_plain_step_of_a_wrapped_demo_is_refused_naming_the_wrappers():
    """Stepping the DeMo under the wrapper would take a step torchft does not decide: refused, naming
    ``elastic.step()``; once the wrapper is shut down DeMo steps on its own again."""
    _torchft()
    from hf_demo.elastic import Elastic

    model, opt = _pair()
    manager = _Manager()
    manager.world = 1
    elastic = Elastic(opt, model, manager=manager)
    _backward(model, 0)
    with pytest.raises(DeMoSetupError, match=r"elastic\.step\(\) in place of optimizer\.step\(\)"):
        opt.step()
    with pytest.raises(DeMoSetupError, match=r"elastic\.step\(\)"):
        opt.prepare_step()
    with pytest.raises(DeMoSetupError, match=r"call elastic\.start_step\(\) before each elastic\.step\(\)"):
        elastic.step()
    assert opt.steps == 0 and not any(opt.state.values())  # nothing ran
    elastic.shutdown()
    opt.step()
    assert opt.steps == 1


def test_an_error_of_the_step_is_told_to_torchft_and_a_lost_peers_only_refuses_it(monkeypatch):
    _torchft()
    from hf_demo.elastic import Elastic

    model, opt = _pair()
    manager = _Manager()
    manager.world = 1
    elastic = Elastic(opt, model, manager=manager)

    def failing(**kwargs):
        raise DeMoSyncError("a peer died")

    monkeypatch.setattr(opt, "prepare_step", failing)
    elastic.start_step()
    elastic.step()
    assert not elastic.last_committed and elastic.stats.last_error == "a peer died" and manager.step == 0

    def buggy(**kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(opt, "prepare_step", buggy)
    elastic.start_step()
    with pytest.raises(KeyError, match="a bug"):
        elastic.step()
    assert elastic.stats.refused_steps == 2


def test_torchfts_group_is_the_backend_of_a_whole_transport():
    """ManagedTransport is a Transport built through its own __init__, its collectives on torchft's group (a
    ManagedGroup); a plain Transport's are torch.distributed's."""
    _torchft()
    from hf_demo.elastic import ManagedGroup, ManagedTransport
    from hf_demo.exchange.transport import DistBackend, Transport

    class Group:
        def getBackendName(self):  # noqa: N802 - torch's name
            return "gloo"

    managed = ManagedTransport(Group(), 1, 3, 5.0, "r1")
    assert isinstance(managed.collectives, ManagedGroup) and managed.collectives.group.__class__ is Group
    assert (managed.rank, managed.world, managed.backend, managed.failures, managed.timeout) == (1, 3, "gloo", 0, 5.0)
    assert managed.replica_name == "r1" and managed._unanswered_ranks(3) == []
    assert isinstance(Transport(None, 0).collectives, DistBackend) and Transport.alone().world == 1
