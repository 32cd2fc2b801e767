"""One table of refusals (``hf_demo.refusals.REFUSALS``): every entry is triggered by a configuration and raises
exactly its error (class and message), every site in the package raises from the table (an AST scan finds no
refusal raised outside it), and the docs' lists are generated from it."""

from __future__ import annotations

import ast
import dataclasses
import re
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hf_demo
from hf_demo import refusals
from hf_demo.refusals import ELASTIC_PREFIX, REFUSALS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_demo"


def _params():
    return [torch.nn.Parameter(torch.zeros(4, 4))]


def _demo(**settings):
    return hf_demo.DeMo(_params(), **settings)


def _encrypted(monkeypatch, secret: str | None, **settings):
    monkeypatch.setenv("HF_DEMO_ENCRYPT", "1")
    if secret is None:
        monkeypatch.delenv("HF_DEMO_SECRET", raising=False)
    else:
        monkeypatch.setenv("HF_DEMO_SECRET", secret)
    return _demo(**settings)


def _refuse_modes(**opt):
    from hf_demo.elastic import refuse_modes

    demo = _demo()
    fields = dict(device_mesh=None, process_group=None, settings=demo.settings, tiers=demo.tiers)
    refuse_modes(SimpleNamespace(**{**fields, **opt}, param_groups=demo.param_groups))


def _elastic_world(monkeypatch):
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from hf_demo.elastic import Elastic

    monkeypatch.setenv("WORLD_SIZE", "2")
    Elastic._manager(SimpleNamespace(node=None), None, None, 1, 1.0, 1.0)


def _wrapped_step():
    from hf_demo.exchange.transport import Transport
    from hf_demo.topology.flat import FlatTopology

    demo = _demo()
    demo.reset_peers(FlatTopology(Transport.alone()))  # as hf_demo.elastic.Elastic does at every new quorum
    demo.step()


def _resume_in_flight():
    from hf_demo.optim.checkpointing import refuse_unfit

    refuse_unfit(_demo(sync_every=2, inner_rule="adam"), SimpleNamespace(pending=object()))


def _resume_local_phase():
    from hf_demo.optim.checkpointing import refuse_unfit

    counters = SimpleNamespace(unsynced=3, steps=10)
    saved = SimpleNamespace(pending=None, counters=counters, world_size=2, tier_spec=("bf16", 1, 4), policy={})
    refuse_unfit(_demo(), saved)


def _saved_world(rank: int, world: int, scope: str | None):
    opt = _demo()
    saved_world = (rank, world, scope or opt.identity()[2])
    opt.run_state = dataclasses.replace(opt.run_state, saved_world=saved_world, saved_identity=(None, None, None))
    opt.check_saved_world()


def _sparse_step():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = hf_demo.DeMo([p])
    p.grad = torch.zeros(4, 4).to_sparse()
    opt.step()


def _sharded_save():
    from hf_demo.optim.sharded_checkpoint import check_saveable

    check_saveable(False, True, 3)


def _accelerator(fsdp_version: int):
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(fsdp_version=fsdp_version)
    return SimpleNamespace(
        distributed_type=DistributedType.FSDP, mixed_precision="no", state=SimpleNamespace(fsdp_plugin=plugin)
    )


def _check_supported(*args, **kwargs):
    from hf_demo.hf.data_parallel import check_supported

    check_supported(*args, **kwargs)


def _fsdp_on_cpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    _demo()  # DeMo's first use refuses it (nothing is raised at import)


def _trainer_world(monkeypatch):
    from hf_demo.hf import trainer

    monkeypatch.setattr(trainer, "_distributed", lambda: True)
    monkeypatch.setattr(trainer.dist, "get_world_size", lambda *a: 2)
    trainer.refuse_world_apart(1)


def _elastic_trainer(uses_demo: bool, world: int):
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from hf_demo.hf.trainer import DeMoTrainerMixin

    DeMoTrainerMixin._start_elastic(SimpleNamespace(uses_demo=uses_demo, args=SimpleNamespace(world_size=world)))


def _plain_trainer(tmp_path):
    from transformers import TrainingArguments

    from hf_demo.hf.training_args import _refuse_plain_trainer

    _refuse_plain_trainer(SimpleNamespace(args=TrainingArguments(output_dir=str(tmp_path), report_to="none")))


# each entry of the table: a configuration that triggers it (in this process; LAYOUT: in a process of its own)
def _late_checkpoint_object():
    """An object registered after hf_demo's (its first save_state): the next save or load is refused."""
    from hf_demo.hf.accelerated import AcceleratorCheckpoints

    class Accelerator:  # the two things AcceleratorCheckpoints uses of accelerate.Accelerator
        def __init__(self):
            self._custom_objects = []

        def register_for_checkpointing(self, *objects):
            self._custom_objects.extend(objects)

    accelerator = Accelerator()
    ours = AcceleratorCheckpoints(accelerator)
    ours._registered_last()  # the first save_state
    accelerator.register_for_checkpointing(object())
    ours._registered_last()


TRIGGERS = {
    "overlap_local_steps": lambda mp, tmp: _demo(overlap=True, sync_every=2),
    "outer_lr_without_local_steps": lambda mp, tmp: _demo(outer_lr=2.0),
    "inner_rule_not_inner": lambda mp, tmp: _demo(inner_rule="muon_signal", sync_every=2),
    "orthogonal_local_steps": lambda mp, tmp: _demo(update_rule="orthogonal", sync_every=2),
    "update_rule_unrun": lambda mp, tmp: _demo(update_rule="adam", sync_every=2),
    "inner_rule_unrun": lambda mp, tmp: _demo(inner_rule="sign"),
    "orthogonal_budget_tiers": lambda mp, tmp: _demo(update_rule="orthogonal", comm_budget=0.1),
    "all_reduce_scaled_values": lambda mp, tmp: _demo(exchange="all_reduce", value_format="sign"),
    "encrypted_all_reduce": lambda mp, tmp: _encrypted(mp, "s3cret", exchange="all_reduce"),
    "encrypted_without_secret": lambda mp, tmp: _encrypted(mp, None),
    "mesh_and_group": lambda mp, tmp: hf_demo.DeMo(_params(), process_group=object(), device_mesh=object()),
    "sign_update_contradicts": lambda mp, tmp: _demo(sign_update=True, update_rule="adam"),
    "complex_parameters": lambda mp, tmp: hf_demo.DeMo([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.cfloat))]),
    "sparse_gradients": lambda mp, tmp: _sparse_step(),
    "elastic_mesh": lambda mp, tmp: _refuse_modes(device_mesh=object()),
    "elastic_processes_unsharded": lambda mp, tmp: _elastic_world(mp),
    "wrapped_step": lambda mp, tmp: _wrapped_step(),
    "resume_in_flight_local_steps": lambda mp, tmp: _resume_in_flight(),
    "resume_local_phase_every_step": lambda mp, tmp: _resume_local_phase(),
    "resume_other_mesh": lambda mp, tmp: _saved_world(0, 1, "mesh 1x1"),
    "resume_other_world": lambda mp, tmp: _saved_world(0, 2, None),
    "sharded_save_own_state": lambda mp, tmp: _sharded_save(),
    "deepspeed": lambda mp, tmp: _check_supported(deepspeed=True),
    "fsdp1": lambda mp, tmp: _check_supported(_accelerator(1)),
    "fsdp_not_run": lambda mp, tmp: _fsdp_on_cpu(mp),
    "late_checkpoint_object": lambda mp, tmp: _late_checkpoint_object(),
    "fp16": lambda mp, tmp: _check_supported(fp16=True),
    "trainer_world_apart": lambda mp, tmp: _trainer_world(mp),
    "elastic_without_demo": lambda mp, tmp: _elastic_trainer(False, 1),
    "elastic_trainer_processes": lambda mp, tmp: _elastic_trainer(True, 2),
    "plain_trainer": lambda mp, tmp: _plain_trainer(tmp),
    "retired_hierarchy": lambda mp, tmp: _demo(hierarchy="node"),
}


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    return model


def _layout_triggers(rank, world):
    """On one gloo rank: each FSDP2 layout and HSDP elastic entry's configuration, (error class, message) each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hf_demo.elastic import Elastic, node_shards, refuse_modes

    def sharded(**settings):
        return hf_demo.DeMo(_shard(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1,))).parameters(), **settings)

    def other_checkpoint(update_rule: str, layout: str | None):
        import tempfile

        import hf_demo.fsdp as fsdp

        model = _shard(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1,)))
        opt = hf_demo.DeMo(model.parameters(), update_rule="adam")
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        with tempfile.TemporaryDirectory() as path:
            fsdp.save_checkpoint(path, model, opt)
            other = hf_demo.DeMo(model.parameters(), update_rule=update_rule)
            real = fsdp.layout_of
            fsdp.layout_of = (lambda optimizer: layout) if layout else real
            try:
                fsdp.load_checkpoint(path, model, other)
            finally:
                fsdp.layout_of = real

    def partial():
        opt, real = sharded(), torch.distributed.get_world_size
        torch.distributed.get_world_size = lambda *a: 2  # the parameters sharded over 1 of a replica group's 2
        try:
            node_shards(opt, 5.0)
        finally:
            torch.distributed.get_world_size = real

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    (
        _shard(a, init_device_mesh("cpu", (1,), mesh_dim_names=("a",))),
        _shard(b, init_device_mesh("cpu", (1,), mesh_dim_names=("b",))),
    )
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (1,)), [Replicate()]))
    hsdp = _shard(torch.nn.Linear(4, 4), init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    plain = torch.nn.Parameter(torch.zeros(4))
    cases = {
        "unshardable_rule": lambda: sharded(update_rule="orthogonal_signal").topology,
        "sharded_and_plain": lambda: hf_demo.DeMo([*a.parameters(), plain]).topology,
        "several_meshes": lambda: hf_demo.DeMo([*a.parameters(), *b.parameters()]).topology,
        "fsdp_own_hsdp": lambda: hf_demo.DeMo(hsdp.parameters()).topology,
        "not_shard_placement": lambda: hf_demo.DeMo([replicated]).topology,
        "elastic_overlap_hsdp": lambda: refuse_modes(sharded(overlap=True)),
        "elastic_local_steps_hsdp": lambda: refuse_modes(sharded(sync_every=2)),
        "elastic_momentum_dir_hsdp": lambda: Elastic._snapshot_path("unused", 1, "a", sharded()),
        "elastic_hsdp_partial": partial,
        "resume_dcp_other_mesh": lambda: other_checkpoint("adam", "mesh 1x2"),
        "resume_dcp_other_settings": lambda: other_checkpoint("sign", None),
    }
    out = {}
    for key, trigger in cases.items():
        try:
            trigger()
            out[key] = None
        except Exception as exc:  # what each raised, compared with the table in the test
            out[key] = (type(exc).__name__, str(exc))
    return out


LAYOUT = (
    "unshardable_rule",
    "sharded_and_plain",
    "several_meshes",
    "fsdp_own_hsdp",
    "not_shard_placement",
    "elastic_overlap_hsdp",
    "elastic_local_steps_hsdp",
    "elastic_momentum_dir_hsdp",
    "elastic_hsdp_partial",
    "resume_dcp_other_mesh",
    "resume_dcp_other_settings",
)


def pattern(key: str) -> re.Pattern:
    """The messages entry ``key`` raises: its template, each field any text (elastic modes: after the prefix)."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(REFUSALS[key].message):
        parts.append(re.escape(literal))
        if name is not None:
            parts.append(".+?")
    body = "".join(parts)
    return re.compile(f"(?:{re.escape(ELASTIC_PREFIX)})?{body}", re.S)


def assert_is(key: str, raised: tuple[str, str] | None) -> None:
    entry = REFUSALS[key]
    assert raised is not None, f"{key}: its configuration was not refused"
    name, message = raised
    assert name == entry.error.__name__ or issubclass(entry.error, ValueError) and name == "DeMoSetupError", (
        key,
        name,
    )
    assert pattern(key).fullmatch(message), f"{key} raised another message:\n{message}"


def test_every_entry_has_a_configuration_that_triggers_it():
    assert set(TRIGGERS) | set(LAYOUT) == set(REFUSALS) and not set(TRIGGERS) & set(LAYOUT)


@pytest.mark.parametrize("key", sorted(TRIGGERS))
def test_each_entry_raises_exactly_its_error(key, monkeypatch, tmp_path):
    with pytest.raises(Exception) as caught:
        TRIGGERS[key](monkeypatch, tmp_path)
    assert type(caught.value) is REFUSALS[key].error, (key, type(caught.value))
    assert_is(key, (type(caught.value).__name__, str(caught.value)))


@pytest.mark.ranks
def test_each_layout_and_hsdp_elastic_entry_raises_exactly_its_error():
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from dist_utils import expect_ok, run_ranks

    (out,) = expect_ok(run_ranks(_layout_triggers, 1))
    for key in LAYOUT:
        assert_is(key, out[key])


# ---------------------------------------------------------------------------------- no refusal outside the table
ERRORS = {"ValueError", "TypeError", "DeMoSetupError", "DeMoSettingsError", "DeMoStateError"}
# the raises of those errors that are no refusal, by function (path::function: how many, why); a new raise of one
# of them anywhere else fails the test until it is a table entry or listed here with its reason
VALUE = "a value out of its range or type"
PARSE = "input of the planner or the ops tools that cannot be read"
INVARIANT = "an internal invariant (a bug, not a set-up)"
STATE = "a saved state that is damaged, another run's or another model's"
RUNTIME = "a finding at run time (ranks disagree, a wrapper averages, a call out of order)"
ARGUMENT = "an argument that is missing or wrong (names the fix)"
NOT_REFUSALS: dict[str, tuple[int, str]] = {
    "hf_demo/compression.py::plan": (1, VALUE + ": an empty parameter"),
    "hf_demo/compression.py::stacked_blocks": (1, INVARIANT),
    "hf_demo/elastic.py::Elastic.__init__": (1, VALUE + ": batch_size"),
    "hf_demo/elastic.py::Elastic._manager": (1, ARGUMENT + ": no Lighthouse address"),
    "hf_demo/elastic.py::Elastic._snapshot_path": (2, VALUE + ": momentum_every; " + ARGUMENT + ": no replica id"),
    "hf_demo/elastic.py::Elastic._check_armed": (1, RUNTIME),
    "hf_demo/elastic.py::placed_optimizer_state": (1, INVARIANT),
    "hf_demo/errors.py::lookup": (1, VALUE + ": a name no registry holds"),
    "hf_demo/exchange/collectives.py::CollectiveSpec.__post_init__": (1, INVARIANT),
    "hf_demo/exchange/transport.py::AllGatherExchange.finish": (1, STATE + ": sealed traffic in flight without a key"),
    "hf_demo/exchange/transport.py::AllReduceExchange.__init__": (1, INVARIANT + ": the all-reduce's average"),
    "hf_demo/exchange/transport.py::CommStats.add": (1, INVARIANT),
    "hf_demo/fsdp.py::hsdp_mesh": (3, ARGUMENT),
    "hf_demo/guards.py::check_gradients_differ": (2, RUNTIME),
    "hf_demo/guards.py::first_step_check": (2, RUNTIME),
    "hf_demo/hf/data_parallel.py::log_metrics": (1, ARGUMENT),
    "hf_demo/hf/elastic.py::data_shard": (2, VALUE + ": replica_id, replicas"),
    "hf_demo/hf/elastic.py::options": (1, VALUE + ": demo_elastic"),
    "hf_demo/hf/runtime_classes.py::remake": (1, STATE),
    "hf_demo/hf/trainer_private.py::PrivateTrainerHooks._load_optimizer_and_scheduler": (
        1,
        STATE + ": a rank's file missing",
    ),
    "hf_demo/ops/methods.py::Estimate.rank_bytes": (1, ARGUMENT + ": an unknown group"),
    "hf_demo/hf/trainer.py::DeMoTrainerMixin.train": (
        1,
        ARGUMENT + ": no checkpoint to resume (Trainer's own message)",
    ),
    "hf_demo/hf/trainer.py::with_demo": (2, ARGUMENT),
    "hf_demo/ops/callbacks.py::for_trainer": (1, VALUE + ": demo_ops"),
    "hf_demo/ops/cli.py::_number.convert": (2, PARSE),
    "hf_demo/ops/compute_cost.py::orthogonal_overhead": (3, PARSE),
    "hf_demo/ops/links.py::_finite": (1, PARSE),
    "hf_demo/ops/links.py::collective_seconds": (1, INVARIANT),
    "hf_demo/ops/links.py::parse_rate": (1, PARSE),
    "hf_demo/ops/links.py::parse_time": (1, PARSE),
    "hf_demo/ops/monitor.py::StepMonitor.phase_done": (1, INVARIANT),
    "hf_demo/ops/monitor.py::_ElasticWindow.add": (1, INVARIANT),
    "hf_demo/ops/prices.py::_table": (2, PARSE),
    "hf_demo/ops/prices.py::load": (4, PARSE),
    "hf_demo/ops/prices.py::price": (2, PARSE),
    "hf_demo/ops/settings.py::OpsSettings.__post_init__": (2, VALUE),
    "hf_demo/ops/settings.py::_from_env": (1, VALUE),
    "hf_demo/ops/shapes.py::_gguf_shapes": (1, PARSE),
    "hf_demo/ops/shapes.py::check_config": (5, PARSE),
    "hf_demo/ops/shapes.py::check_size": (2, PARSE),
    "hf_demo/ops/shapes.py::from_config": (3, PARSE),
    "hf_demo/ops/shapes.py::from_count": (1, PARSE),
    "hf_demo/ops/shapes.py::from_gguf": (1, PARSE),
    "hf_demo/ops/shapes.py::from_model": (2, PARSE),
    "hf_demo/ops/shapes.py::parse_shapes": (4, PARSE),
    "hf_demo/optim/checkpointing.py::check_model": (1, STATE),
    "hf_demo/optim/checkpointing.py::compare_resumed": (2, STATE),
    "hf_demo/optim/own_state.py::unpadded": (1, STATE + ": another model's"),
    "hf_demo/optim/factory.py::_convert": (2, VALUE),
    "hf_demo/optim/factory.py::optimizer_cls_and_kwargs": (1, VALUE + ": an unknown setting"),
    "hf_demo/optim/factory.py::parse_optim_args": (2, VALUE + ": --optim_args"),
    "hf_demo/optim/groups.py::check_param": (1, VALUE + ": an empty parameter"),
    "hf_demo/optim/groups.py::replan_momentum": (1, STATE),
    "hf_demo/optim/view.py::validate_group.bad": (1, VALUE),
    "hf_demo/optim/checkpointing.py::check_saved_world": (1, STATE + ": another rank's file"),
    "hf_demo/settings.py::with_sign_update": (2, VALUE + ": sign_update; an unknown setting"),
    "hf_demo/optim/overlap.py::targets": (1, STATE),
    "hf_demo/optim/reference.py::ReferenceDeMo.__init__": (1, VALUE + " (the tests' slow reference)"),
    "hf_demo/optim/state.py::SavedState.from_dict": (3, STATE),
    "hf_demo/optim/state.py::_check_types": (4, STATE),
    "hf_demo/optim/state.py::_require": (1, STATE),
    "hf_demo/optim/phases.py::momentum": (1, RUNTIME + ": compression_chunk changed during training"),
    "hf_demo/settings.py::DeMoSettings.__post_init__": (11, VALUE),
    "hf_demo/optim/local_steps.py::outer_factor": (1, VALUE + ": an unknown outer_lr_scaling"),
    "hf_demo/settings.py::DeMoSettings.check_group": (1, VALUE + ": a rule no registry holds"),
    "hf_demo/settings.py::DeMoSettings.resolve": (1, VALUE + ": an unknown preset"),
    "hf_demo/settings.py::check_blocks": (3, VALUE),
    "hf_demo/topology/owners.py::owners": (1, INVARIANT),
    "hf_demo/topology/sharded.py::ShardedMatrices.__init__": (1, INVARIANT + " (a benchmark's scheme name)"),
    "hf_demo/topology/sharded.py::ShardedMatrices._rows_of": (1, ARGUMENT + ": rows not FSDP2's Shard(0)"),
    "hf_demo/topology/sharded.py::ShardedMatrices._whole_directions": (
        1,
        INVARIANT + ": a rule missing from WHOLE_STATE",
    ),
    "hf_demo/topology/sharded.py::ShardedTopology.build": (1, ARGUMENT + ": torch.distributed not initialised"),
    "hf_demo/topology/sharded.py::exchange_group": (3, ARGUMENT + ": device_mesh or process_group"),
    "hf_demo/wire/agreement.py::_raise_disagreement": (1, RUNTIME + ": the ranks' settings differ"),
    "hf_demo/wire/sealing.py::from_env": (1, VALUE + ": HF_DEMO_ENCRYPT"),
}


def _functions(tree):
    """(qualified name, node) of every function, its class's name first."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree, "")


def _own_raises(fn):
    """The raise statements of ``fn`` itself (not of the functions defined inside it)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else None


def scan() -> tuple[dict[str, int], set[str]]:
    """({path::function: raises of ERRORS in it, outside the table}, {the keys the sites name})."""
    raises, keys = {}, set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "hf_demo/refusals.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # a site names its entry by key: refuse("key", ...), text("key"), error("key")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in REFUSALS:
                keys.add(node.value)
        for qual, fn in _functions(tree):
            count = sum(1 for n in _own_raises(fn) if _raised_name(n) in ERRORS)
            if count:
                raises[f"{rel}::{qual}"] = count
    return raises, keys


def test_every_site_names_an_entry_and_every_entry_has_a_site():
    _, keys = scan()
    retired = {r.key for r in REFUSALS.values() if r.kind == "retired"}  # raised through settings.RETIRED_KEYS
    assert keys | retired == set(REFUSALS), sorted(set(REFUSALS) - keys - retired)


def test_no_refusal_is_raised_outside_the_table():
    raises, _ = scan()
    listed = {k: n for k, (n, _) in NOT_REFUSALS.items()}
    new = {k: n for k, n in raises.items() if listed.get(k) != n}
    assert not new, (
        "raises outside hf_demo.refusals that are not listed as no refusal (a refusal goes in the table; a value "
        f"check, a parse error or an internal invariant is listed in NOT_REFUSALS with its reason): {new}"
    )
    assert not set(listed) - set(raises), f"listed but gone: {sorted(set(listed) - set(raises))}"


# ------------------------------------------------------------------------------------------------- the docs
def test_the_refusals_page_and_design_list_are_generated_from_the_table():
    page = (ROOT / "docs" / "reference" / "refusals.md").read_text()
    assert refusals.markdown_table() in page, (
        "docs/reference/refusals.md is stale: python -m hf_demo.refusals > docs/reference/refusals.md"
    )
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    block = design.split("<!-- refusals:pairs -->\n")[1].split("\n<!-- /refusals:pairs -->")[0]
    assert block == refusals.pairs_table(), "DESIGN.md's list of pairs is stale: paste hf_demo.refusals.pairs_table()"
