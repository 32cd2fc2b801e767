"""update_rule="orthogonal": Muon's Newton-Schulz step on DeMo's averaged update, held to a float64 reference.

The pure iteration and its scale; the rule against the slow reference on 1, 2 and 4 gloo ranks, alone and in
per-group settings (Muon-style groups); bitwise replicas and exact resume in every exchange; overlap; local Muon
steps (inner_rule) and the refusal of orthogonalised synchronisations. (FSDP2-sharded parameters refuse the rule:
tests/test_fsdp.py.)
"""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_demo
from dist_utils import RankError, expect_ok, run_ranks
from hf_demo.optim import update_rules
from hf_demo.optim.param_groups import muon_style_groups
from hf_demo.optim.reference import ReferenceDeMo, orthogonalised
from models import REFERENCE_SETTINGS, awkward_mlp, batch, demo_as_reference, loss_and_backward, restart, tiny_mlp

pytestmark = pytest.mark.ranks  # real gloo ranks in forked processes (most tests)

SETTINGS = REFERENCE_SETTINGS
MODELS = {"divisible": tiny_mlp, "padded": awkward_mlp}
HEAD = ("2.",)  # tiny_mlp's output layer: a 2-D parameter the user marks as not hidden


def _conditioned(rows, cols, seed=0):
    """A random matrix with singular values spread from 1 down to 0.05."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    s = torch.logspace(0, -1.3, min(rows, cols))
    return (u[:, : len(s)] * s) @ v[:, : len(s)].T


# ---------------------------------------------------------------------- the pure iteration
@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_keeps_the_singular_vectors_and_flattens_the_singular_values(shape):
    g = _conditioned(*shape)
    out = update_rules.newton_schulz(g)
    assert out.dtype == torch.float32 and out.shape == g.shape
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25  # Muon's quintic: U S' V^T, S' roughly in [0.7, 1.2]
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh  # the exact orthogonalisation U V^T
    assert torch.nn.functional.cosine_similarity(out.flatten(), polar.flatten(), dim=0) > 0.97
    torch.testing.assert_close(out.double(), orthogonalised(g) / (0.2 * max(shape) ** 0.5), atol=2e-5, rtol=0)


def test_the_rule_scales_to_adamws_update_rms_and_signs_vectors():
    rule = update_rules.get("orthogonal")
    update = _conditioned(96, 32)
    step = rule.direction(None, update.clone(), {})
    rms = step.pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.23  # 0.2 for an orthogonal matrix; S' in [0.7, 1.2]
    assert torch.equal(rule.direction(None, torch.tensor([0.5, -2.0, 0.0]), {}), torch.tensor([1.0, -1.0, 0.0]))
    assert torch.equal(rule.direction(None, torch.zeros(8, 4), {}), torch.zeros(8, 4))  # nothing sent: no step
    conv = torch.randn(4, 3, 2, 2)  # more than 2 dimensions: the matrix 4 x 12, as Muon flattens
    torch.testing.assert_close(rule.direction(None, conv.clone(), {}).double(), orthogonalised(conv), atol=1e-5, rtol=0)


def test_a_low_rank_update_gets_less_than_the_target_rms_unless_it_is_measured():
    """DeMo's decoded update is of low rank (top-k of each block): the shape's scale assumes full rank."""
    low_rank = _conditioned(64, 8) @ _conditioned(8, 64, seed=1)  # rank 8 of 64
    by_shape = update_rules.orthogonal_step(low_rank, 0.2, 5)
    measured = update_rules.orthogonal_step(low_rank, 0.2, 5, measured=True)
    assert by_shape.pow(2).mean().sqrt() < 0.1  # ~0.2 * sqrt(8 / 64)
    torch.testing.assert_close(measured.pow(2).mean().sqrt(), torch.tensor(0.2), atol=1e-6, rtol=0)
    torch.testing.assert_close(measured / measured.norm(), by_shape / by_shape.norm())


# ---------------------------------------------------------------------- the groups
def _tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_muon_style_groups_split_hidden_matrices_from_embeddings_head_and_norms():
    model = _tiny_llama()
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, others = muon_style_groups(model)
    assert hidden["update_rule"] == "orthogonal" and others["update_rule"] == "sign"
    assert sorted(names[id(p)].split(".")[-2] for p in hidden["params"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert {names[id(p)] for p in others["params"]} == {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    }
    # with weight decay: Trainer's convention splits off the norms; a marked matrix goes with the others
    groups = muon_style_groups(model, weight_decay=0.1, exclude=("o_proj",))
    assert [(g["update_rule"], g["weight_decay"], len(g["params"])) for g in groups] == [
        ("orthogonal", 0.1, 6),
        ("sign", 0.1, 3),
        ("sign", 0.0, 3),
    ]
    opt = hf_demo.create_optimizer(model, lr=1e-3, weight_decay=0.1, update_rule="orthogonal")
    assert [(g["update_rule"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        ("orthogonal", 0.1, 7),
        ("sign", 0.1, 2),
        ("sign", 0.0, 3),
    ]


def test_trainer_gives_the_orthogonal_rule_muon_style_groups(tmp_path):
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", optim="demo", demo_update_rule="orthogonal"
    )
    trainer = hf_demo.DeMoTrainer(model=_tiny_llama(), args=args)
    opt = hf_demo.hf.data_parallel.unwrap_optimizer(trainer.create_optimizer())
    assert [(g["update_rule"], len(g["params"])) for g in opt.param_groups] == [
        ("orthogonal", 7),
        ("sign", 2),
        ("sign", 3),
    ]


def test_local_muon_steps_get_muon_style_groups_from_the_factory_and_the_trainer(tmp_path):
    """``inner_rule="orthogonal"``: local Muon steps for the hidden matrices, local Adam steps for the rest."""
    expected = [("orthogonal", "sign", 7), ("adam", "sign", 2), ("adam", "sign", 3)]
    opt = hf_demo.create_optimizer(_tiny_llama(), weight_decay=0.1, sync_every=4, inner_rule="orthogonal")
    assert [(g["inner_rule"], g["update_rule"], len(g["params"])) for g in opt.param_groups] == expected
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", optim="demo", demo_sync_every=4,
        demo_inner_rule="orthogonal", weight_decay=0.1,
    )  # fmt: skip
    _, kwargs = hf_demo.DeMoTrainer.get_optimizer_cls_and_kwargs(args, _tiny_llama())
    assert [(g["inner_rule"], g.get("update_rule", "sign"), len(g["params"])) for g in kwargs["params"]] == expected


def test_the_from_scratch_preset_trains_local_muon_steps_in_muon_style_groups(tmp_path):
    opt = hf_demo.create_optimizer(_tiny_llama(), preset="from_scratch")
    assert [g["inner_rule"] for g in opt.param_groups] == ["orthogonal", "adam", "adam"]
    assert {g["update_rule"] for g in opt.param_groups} == {"sign"}
    settings = opt.settings
    assert (settings.sync_every, settings.value_format, settings.compression_chunk) == (2, "sign", 32)
    assert settings.compression_topk == 24
    args = hf_demo.DeMoTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", optim="demo", demo_preset="from_scratch"
    )
    _, kwargs = hf_demo.DeMoTrainer.get_optimizer_cls_and_kwargs(args, _tiny_llama())
    assert [g["inner_rule"] for g in kwargs["params"]] == ["orthogonal", "adam", "adam"]


def test_an_unknown_rule_in_a_group_is_refused():
    model = tiny_mlp()
    with pytest.raises(ValueError, match="invalid update_rule='muon' in a parameter group; expected one of"):
        hf_demo.DeMo([{"params": model.parameters(), "update_rule": "muon"}])


# ---------------------------------------------------------------------- against the slow reference
def _fast(model, groups=False, others="sign", **kw):
    params = muon_style_groups(model, others={"update_rule": others}, exclude=HEAD) if groups else model.parameters()
    return demo_as_reference(params, update_rule="orthogonal", **kw)


def _train_both(rank, world, model="divisible", groups=False, others="sign", overlap=False):
    fast_model, ref_model = MODELS[model](), MODELS[model]()
    fast = _fast(fast_model, groups, others, overlap=overlap)
    # the reference: one rule per parameter (the weight of layer 0 is the only hidden matrix of the groups)
    rules = ["orthogonal", others, others, others] if groups else "orthogonal"
    ref = ReferenceDeMo(ref_model.parameters(), rule=rules, delay=int(overlap), **SETTINGS)
    for step in range(20):
        loss_and_backward(fast_model, rank, step)
        loss_and_backward(ref_model, rank, step)
        fast.step()
        ref.step()
    if overlap:
        fast.flush()
        ref.flush()
    return [p.detach().clone() for p in fast_model.parameters()], [p.detach().clone() for p in ref_model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world,model", [(1, "divisible"), (1, "padded"), (2, "divisible"), (4, "divisible")])
def test_matches_the_float64_reference(world, model):
    results = expect_ok(run_ranks(_train_both, world, model))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    start = [p.detach() for p in MODELS[model]().parameters()]
    assert _max_diff(results[0][0], start) > 1e-3  # a hundred times the tolerance


@pytest.mark.parametrize("others", ["sign", "adam"])
def test_per_group_rules_match_the_reference(others):
    """Muon-style groups: the hidden matrix orthogonalised, the marked head and the biases by ``others``."""
    results = expect_ok(run_ranks(_train_both, 2, "divisible", True, others))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5
    everywhere = expect_ok(run_ranks(_train_both, 2, "divisible"))  # the head orthogonalised too: another run
    assert _max_diff(results[0][0], everywhere[0][0]) > 1e-3


def test_overlap_matches_the_reference_applied_one_step_late():
    results = expect_ok(run_ranks(_train_both, 2, "padded", True, "sign", True))
    for fast, ref in results:
        assert _max_diff(fast, ref) <= 1e-5


# ---------------------------------------------------------------------- replicas, resume, agreement
MODES = {
    "all_gather": {},
    "all_gather+sign values": {"value_format": "sign"},
    "all_reduce": {"exchange": "all_reduce"},
}


def _make(model, hidden_rule="orthogonal", **kw):
    groups = muon_style_groups(model, hidden={"update_rule": hidden_rule}, exclude=HEAD)
    return hf_demo.DeMo(groups, **{"lr": 3e-3, "compression_topk": 4, "compression_chunk": 8, **kw})


def _train(rank, world, kw, steps, resume_at=None):
    model = tiny_mlp()
    opt = _make(model, **kw)
    for step in range(steps):
        if step == resume_at:  # a fresh process: new model and optimizer, both loaded
            model, opt = restart(model, opt, lambda m: _make(m, **kw))
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_replicas_stay_bitwise_identical(mode, world):
    results = expect_ok(run_ranks(_train, world, MODES[mode], 20))
    for params in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], params))
    signed = expect_ok(run_ranks(_train, 2, {**MODES[mode], "hidden_rule": "sign"}, 20))[0]
    assert _max_diff(results[0], signed) > 1e-3  # the rule ran


@pytest.mark.parametrize("mode", [*MODES, "overlap"])
def test_resumes_exactly(mode):
    kw = {"overlap": True} if mode == "overlap" else MODES[mode]
    straight = expect_ok(run_ranks(_train, 2, kw, 12))
    resumed = expect_ok(run_ranks(_train, 2, kw, 12, 6))
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _disagree(rank, world):
    model = tiny_mlp()
    hidden = {"update_rule": "orthogonal" if rank == 0 else "sign"}
    opt = hf_demo.DeMo(muon_style_groups(model, hidden=hidden, exclude=HEAD), lr=3e-3, compression_chunk=8)
    loss_and_backward(model, rank, 0)
    opt.step()


def test_ranks_with_another_rule_in_a_group_are_refused():
    for r in run_ranks(_disagree, 2):
        assert (
            isinstance(r, RankError) and r.type == "DeMoSettingsError" and "different optimizer settings" in r.message
        )


# ---------------------------------------------------------------------- local steps (sync_every > 1)
def test_orthogonalised_synchronisations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="no update rule would ever orthogonalise.*inner_rule='orthogonal'"):
        hf_demo.DeMo(tiny_mlp().parameters(), update_rule="orthogonal", sync_every=4)
    with pytest.raises(ValueError, match="update_rule='orthogonal' with sync_every=4"):
        hf_demo.DeMo(muon_style_groups(tiny_mlp()), sync_every=4)


def test_orthogonal_updates_with_a_budget_whose_tiers_take_local_steps_are_refused_with_the_fix():
    # the policy's local-step tiers apply the averaged change as it is: the rule would silently stop running
    with pytest.raises(ValueError, match="comm_budget.*policy_sync_every=8.*policy_sync_every=1"):
        hf_demo.DeMo(tiny_mlp().parameters(), update_rule="orthogonal", comm_budget=0.2)
    with pytest.raises(ValueError, match="update_rule='orthogonal' with comm_budget"):
        hf_demo.create_optimizer(tiny_mlp(), update_rule="orthogonal", comm_budget=0.2)
    opt = hf_demo.DeMo(tiny_mlp().parameters(), update_rule="orthogonal", comm_budget=0.2, policy_sync_every=1)
    assert all(t.sync_every == 1 for t in opt.tiers)  # every tier runs the rule


def test_a_rule_no_step_would_run_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="update_rule='adam' with sync_every=2: no step would run it.*inner_rule"):
        hf_demo.DeMo(tiny_mlp().parameters(), update_rule="adam", sync_every=2)
    with pytest.raises(ValueError, match="inner_rule='orthogonal' without local steps.*sync_every > 1"):
        hf_demo.DeMo(tiny_mlp().parameters(), inner_rule="orthogonal")
    with pytest.raises(ValueError, match="inner_rule='adamw' without local steps.*policy_sync_every=1"):
        hf_demo.DeMo(tiny_mlp().parameters(), inner_rule="adamw", comm_budget=0.2, policy_sync_every=1)
    hf_demo.DeMo(tiny_mlp().parameters(), inner_rule="adamw", comm_budget=0.2)  # the policy's last tier runs it
    hf_demo.DeMo(tiny_mlp().parameters(), update_rule="adam", comm_budget=0.2)  # its every-step tiers run it


def test_a_local_step_with_the_orthogonal_inner_rule_is_muons():
    model = tiny_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hf_demo.DeMo(model.parameters(), lr=1e-2, sync_every=4, inner_rule="orthogonal")  # one process
    x, y = batch(0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()  # a local step: inner momentum 0.1 * grad, orthogonalised (biases: its sign)
    for p, p0, g in zip(model.parameters(), start, grads):
        expected = p0.double() - 1e-2 * orthogonalised(0.1 * g.double())
        torch.testing.assert_close(p.detach().double(), expected, atol=1e-6, rtol=0)


LOCAL = dict(lr=3e-3, compression_topk=4, compression_chunk=8, sync_every=4)


def _local(rank, world, steps, resume_at=None):
    def make(m):
        groups = muon_style_groups(m, hidden={"inner_rule": "orthogonal"}, others={}, exclude=HEAD)
        return hf_demo.DeMo(groups, **LOCAL)

    model = tiny_mlp()
    opt = make(model)
    for step in range(steps):
        if step == resume_at:
            model, opt = restart(model, opt, make)
        loss_and_backward(model, rank, step)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_local_muon_steps_synchronise_and_resume_exactly():
    straight = expect_ok(run_ranks(_local, 2, 8))
    assert all(torch.equal(a, b) for a, b in zip(*straight))  # step 8 synchronised the replicas
    resumed = expect_ok(run_ranks(_local, 2, 8, 5))  # inside a local phase
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- the benchmark's methods
def test_convergence_benchmark_runs_ddp_muon_and_the_orthogonal_rule(tmp_path):
    import json
    import subprocess
    import sys

    from launch_utils import ROOT

    tiny = "--hidden 32 --intermediate 64 --layers 1 --heads 2 --seq-len 32 --batch-size 2 --eval-batches 1".split()
    run = f"--tag smoke --results-dir {tmp_path} --steps 3 --eval-every 3 --warmup 1 --topk 4 --chunk 8".split()
    configs = (
        "update_rule=orthogonal;update_rule=orthogonal,others=adam,others_lr=0.5,ortho_rms=0.3;"
        "update_rule=orthogonal_signal;update_rule=orthogonal_momentum,ortho_beta=0.9;"
        "update_rule=muon_signal,ns_steps=3,shared_positions=true;sync_every=2,inner_rule=orthogonal;"
        "sync_every=2,inner_rule=orthogonal,mlp_topk=2"
    )
    methods = ["--methods", "muon", "demo", "--demo-configs", configs]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convergence.py"), *run, *methods, *tiny]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "convergence_smoke.json").read_text())
    assert [r["ok"] for r in runs] == [True] * 8, [r.get("error") for r in runs]
    assert runs[0]["bytes_per_param_step"] == 4.0 and runs[1]["bytes_per_param_step"] < 0.5
    assert runs[7]["bytes_per_param_step"] < runs[6]["bytes_per_param_step"]  # top-2 of the MLP's blocks, not 4
    assert "| DDP-Muon | 0.001 |" in (tmp_path / "convergence_smoke.md").read_text()
