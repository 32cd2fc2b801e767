"""Every refusal, once: what hf_demo declines to run, why, the fix, and where it is checked.

A refusal is a set-up that is well formed (each value allowed on its own, and PyTorch would run it) which DeMo
does not run: two settings that do not compose, a setting on a layout of parameters, a mode under
:mod:`hf_demo.elastic`, a saved state this run could only resume wrongly, an integration (DeepSpeed, fp16 ...).
Each is raised before any state changed, with its reason and its fix, on every rank alike. A single value out of
its range or type is not a refusal: :class:`hf_demo.settings.DeMoSettings` checks those where each is declared.

Every site raises from :data:`REFUSALS` (:func:`refuse`, :func:`error`, :func:`text`); ``python -m hf_demo.refusals``
writes docs/reference/refusals.md, and DESIGN.md's list of the pairs that do not compose is :func:`pairs_table`
(tests/test_refusals.py checks both, triggers every entry and finds no refusal raised outside the table).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import NoReturn

from hf_demo.errors import DeMoSetupError, DeMoStateError

KINDS = {
    "construction": "settings that do not compose, refused when DeMo (or its settings) is built",
    "layout": "parameters DeMo does not step (FSDP2 layouts, complex or sparse tensors) and settings it does not run "
    "on FSDP2-sharded parameters (construction, first step)",
    "elastic": "what hf_demo.elastic (torchft) does not run, refused when Elastic is built",
    "resume": "a saved optimizer state this run could only resume wrongly, refused before anything is loaded (or a "
    "state a sharded checkpoint cannot hold, refused before anything is written)",
    "integration": "Trainer, Accelerate and launch set-ups DeMo cannot train in, refused at start-up",
    "retired": "settings that once were, refused naming what replaces them",
}


@dataclass(frozen=True)
class Refusal:
    """One refusal: ``message`` (a ``str.format`` template of ``fields``, naming the reason and the fix) raised as
    ``error`` where ``checked`` says, when ``condition`` holds."""

    key: str
    kind: str  # one of KINDS
    condition: str  # when it is refused, in words (Markdown), for the docs
    checked: str  # the function that checks it
    message: str
    error: type[Exception] = ValueError
    involves: tuple[str, ...] = ()  # the settings or arguments it names (a retired one: its setting)

    def text(self, **fields) -> str:
        return self.message.format(**fields)

    def error_of(self, **fields) -> Exception:
        return self.error(self.text(**fields))


_ORTHO_SYNC = (
    "a synchronisation applies the ranks' averaged change times outer_lr (DiLoCo's outer step without momentum), "
    "so no update rule would ever orthogonalise anything. For Muon steps between synchronisations set "
    "inner_rule='orthogonal' (muon_style_groups(model, hidden={{'inner_rule': 'orthogonal'}}, "
    "others={{'inner_rule': 'adam'}})) and leave update_rule at 'sign'; or synchronise every step"
)
ELASTIC_PREFIX = "hf_demo.elastic does not run with "  # the elastic mode refusals found together, joined by "; "

_TABLE = (
    # -------------------------------------------------------------------------------------------- construction
    Refusal(
        "overlap_local_steps", "construction",
        "`overlap=True` × `sync_every > 1` (and `comm_budget`, whose tiers have local steps)",
        "hf_demo.settings.refusals",
        "DeMo: overlap=True needs sync_every=1 and no comm_budget (whose tiers have local steps): a synchronisation "
        "that lands one step late would apply the mean change after a local step moved each rank apart",
        involves=("overlap", "sync_every", "comm_budget"),
    ),
    Refusal(
        "outer_lr_without_local_steps", "construction",
        "`outer_lr ≠ 1` or an `outer_lr_scaling` other than `\"none\"` without local steps (`sync_every=1`, and no "
        "`comm_budget` tier with `policy_sync_every > 1`)",
        "hf_demo.settings.refusals",
        "DeMo: outer_lr={outer_lr!r}, outer_lr_scaling={scaling!r} without local steps (sync_every=1{why}): no "
        "synchronisation applies a mean change of local steps, so the outer learning rate would never act. Set "
        "sync_every > 1 (the from_scratch presets), or scale lr instead",
        involves=("outer_lr", "outer_lr_scaling", "sync_every", "comm_budget", "policy_sync_every"),
    ),
    Refusal(
        "inner_rule_not_inner", "construction",
        "`inner_rule` in `orthogonal_momentum`, `orthogonal_signal`, `muon_signal` (rules that may not be inner)",
        "hf_demo.settings.DeMoSettings.check_group",
        "DeMo: inner_rule={rule!r}: a local step's rule runs on the local momentum (inner_momentum) alone, which is "
        "neither DeMo's momentum nor an averaged update; set inner_rule='orthogonal' (Muon's local step)",
        involves=("inner_rule",),
    ),
    Refusal(
        "orthogonal_local_steps", "construction",
        "`update_rule` orthogonal (any Muon-style rule) × `sync_every > 1`",
        "hf_demo.settings.DeMoSettings.check_group",
        "DeMo: update_rule={rule!r} with sync_every={sync_every}: " + _ORTHO_SYNC,
        involves=("update_rule", "sync_every"),
    ),
    Refusal(
        "update_rule_unrun", "construction",
        "`update_rule` away from its default × `sync_every > 1` (no step would run it)",
        "hf_demo.settings.DeMoSettings.check_group",
        "DeMo: update_rule={rule!r} with sync_every={sync_every}: no step would run it (a synchronisation applies "
        "the ranks' averaged change times outer_lr, DiLoCo's outer step). Leave update_rule at its default "
        "and choose the local steps' rule with inner_rule, or synchronise every step (sync_every=1)",
        involves=("update_rule", "sync_every"),
    ),
    Refusal(
        "inner_rule_unrun", "construction",
        "`inner_rule` away from its default without local steps (`sync_every=1`, and no `comm_budget` tier with "
        "`policy_sync_every > 1`)",
        "hf_demo.settings.DeMoSettings.check_group",
        "DeMo: inner_rule={rule!r} without local steps: no step would run it (sync_every=1{why}). Set "
        "sync_every > 1 (the from_scratch preset: sync_every=2, inner_rule='orthogonal'), or leave inner_rule at "
        "its default",
        involves=("inner_rule", "sync_every", "comm_budget"),
    ),
    Refusal(
        "orthogonal_budget_tiers", "construction",
        "`update_rule` orthogonal × `comm_budget` with `policy_sync_every > 1`",
        "hf_demo.settings.DeMoSettings.check_group",
        "DeMo: update_rule={rule!r} with comm_budget: the budget policy's local-step tiers "
        "(policy_sync_every={policy_sync_every}) apply the ranks' averaged change times outer_lr, so the orthogonal "
        "rule would stop running whenever the policy moved down. Set policy_sync_every=1 (every tier synchronises "
        "every step), or take Muon steps between synchronisations with inner_rule='orthogonal' (the from_scratch "
        "preset) and update_rule='sign'",
        involves=("update_rule", "comm_budget", "policy_sync_every"),
    ),
    Refusal(
        "all_reduce_scaled_values", "construction",
        "`exchange=\"all_reduce\"` × `value_format` `sign` or `2bit`",
        "hf_demo.exchange.transport.AllReduceExchange",
        "exchange='all_reduce' sums values, so value_format must be one of {allowed} (got {value_format!r}: each "
        "rank's values carry their own scales, which a sum cannot add); use exchange='all_gather' for {value_format}",
        involves=("exchange", "value_format"),
    ),
    Refusal(
        "encrypted_all_reduce", "construction",
        "`HF_DEMO_ENCRYPT=1` × `exchange=\"all_reduce\"`",
        "hf_demo.wire.sealing.from_env",
        "DeMo: {env}=1 needs exchange='all_gather': exchange={exchange!r} sums the ranks' values inside the "
        "all-reduce as they travel, and encrypted values cannot be summed (an AES-GCM ciphertext of a sum is not the "
        "sum of ciphertexts, and each rank seals with its own key): the values would have to travel in the clear",
        involves=("exchange",),
    ),
    Refusal(
        "encrypted_without_secret", "construction",
        "`HF_DEMO_ENCRYPT=1` without `HF_DEMO_SECRET`",
        "hf_demo.wire.sealing.from_env",
        "DeMo: {env}=1 derives its keys from HF_DEMO_SECRET, which is not set: set the same HF_DEMO_SECRET on every "
        "rank (see SECURITY.md)",
    ),
    Refusal(
        "mesh_and_group", "construction",
        "`process_group` × `device_mesh`",
        "hf_demo.optim.optimizer.DeMo",
        "DeMo: pass process_group or device_mesh, not both (the mesh names the group)",
        involves=("process_group", "device_mesh"),
    ),
    Refusal(
        "sign_update_contradicts", "construction",
        "`sign_update` × an `update_rule` it contradicts",
        "hf_demo.optim.optimizer.DeMo",
        "sign_update={sign_update} contradicts update_rule={rule!r}",
        involves=("sign_update", "update_rule"),
    ),
    # -------------------------------------------------------------------------------------------------- layout
    Refusal(
        "unshardable_rule", "layout",
        "`update_rule` / `inner_rule` in `orthogonal_momentum`, `orthogonal_signal`, `muon_signal` × FSDP2-sharded "
        "parameters",
        "hf_demo.topology.sharded.refuse_unshardable",
        "DeMo: update_rule/inner_rule={rule!r} is not combined with FSDP2-sharded parameters: it orthogonalises each "
        "rank's own gradient or keeps a matrix-shaped state, which would need the whole matrix on every rank at "
        "every step. Use update_rule='orthogonal' (orthogonalised as if unsharded) or inner_rule='orthogonal' (the "
        "from_scratch preset) for these groups",
        involves=("update_rule", "inner_rule"),
    ),
    Refusal(
        "sharded_and_plain", "layout",
        "FSDP2-sharded parameters × plain ones in one optimizer",
        "hf_demo.topology.sharded.ShardSpec.of",
        "DeMo was given {sharded} FSDP2-sharded parameter(s) (DTensor) and {plain} plain one(s): a plain parameter "
        "beside FSDP2 gets no gradient reduction inside the shard group, so its copies would drift apart. Shard the "
        "modules that hold them too (fully_shard the root module, as hf_demo.fsdp.shard_model does), or give them "
        "to another optimizer",
    ),
    Refusal(
        "several_meshes", "layout",
        "parameters sharded over more than one device mesh",
        "hf_demo.topology.sharded.ShardSpec.of",
        "DeMo's parameters are sharded over more than one device mesh: use one mesh for the model",
    ),
    Refusal(
        "fsdp_own_hsdp", "layout",
        "parameters sharded on a 2-D mesh (FSDP2's own HSDP, which all-reduces gradients densely)",
        "hf_demo.topology.sharded.ShardSpec.of",
        "DeMo's parameters are FSDP2 DTensors on a {ndim}-D mesh {names} with placements (Replicate(), Shard(0)): "
        "that is FSDP2's own HSDP, which all-reduces every gradient densely across the replicate dimension, the "
        "traffic DeMo replaces. Shard on the shard dimension only, fully_shard(module, mesh=mesh['shard']) "
        "(hf_demo.fsdp.shard_model(model, mesh)), and give DeMo device_mesh=mesh",
    ),
    Refusal(
        "not_shard_placement", "layout",
        "DTensor parameters placed otherwise than `Shard`",
        "hf_demo.topology.sharded.ShardSpec.of",
        "DeMo steps FSDP2-sharded parameters (Shard placements); got placements {placements}",
    ),
    Refusal(
        "complex_parameters", "layout",
        "complex parameters",
        "hf_demo.optim.groups.check_param",
        "DeMo does not support complex parameters (shape {shape}): view them as real (torch.view_as_real) or optimise "
        "them with another optimizer",
    ),
    Refusal(
        "sparse_gradients", "layout",
        "sparse gradients",
        "hf_demo.guards.nonfinite_or_zero",
        "DeMo does not support sparse gradients",
    ),
    # ------------------------------------------------------------------------------------------------- elastic
    Refusal(
        "elastic_mesh", "elastic",
        "`hf_demo.elastic` × `device_mesh` or `process_group`",
        "hf_demo.elastic.refuse_modes",
        "device_mesh or process_group: under torchft the replicate dimension is the quorum's managed group, rebuilt "
        "at every change of the quorum; for HSDP shard the model over the replica group's own processes "
        "(fully_shard(model, mesh=init_device_mesh(device, (WORLD_SIZE,)))) and give DeMo neither",
        DeMoSetupError,
        ("device_mesh", "process_group"),
    ),
    Refusal(
        "elastic_overlap_hsdp", "elastic",
        "`hf_demo.elastic` on HSDP replica groups × `overlap=True`",
        "hf_demo.elastic.mode_refusals",
        "overlap=True on HSDP replica groups: a sharded state holds no exchange in flight, so a live replica could "
        "not send its state to a recovering one mid-run",
        DeMoSetupError,
        ("overlap",),
    ),
    Refusal(
        "elastic_local_steps_hsdp", "elastic",
        "`hf_demo.elastic` on HSDP replica groups × `sync_every > 1` (or `comm_budget`'s local-step tiers)",
        "hf_demo.elastic.mode_refusals",
        "local steps (sync_every > 1, or comm_budget's local-step tiers) on HSDP replica groups: a sharded state "
        "holds no parameters of a rank's own, so a replica that lagged inside a local phase could not receive a "
        "peer's; not run elastically yet (every-step DeMo on HSDP is)",
        DeMoSetupError,
        ("sync_every", "comm_budget"),
    ),
    Refusal(
        "elastic_momentum_dir_hsdp", "elastic",
        "`Elastic(momentum_dir=...)` × FSDP2-sharded parameters (HSDP)",
        "hf_demo.elastic.Elastic",
        "Elastic: momentum_dir is not supported on HSDP (each shard rank's momentum is blocked on its own shard): "
        "leave it out, and a restarted node's momentum starts at zero",
        DeMoSetupError,
    ),
    Refusal(
        "elastic_processes_unsharded", "elastic",
        "`hf_demo.elastic` × a replica group of several processes with whole (unsharded) parameters",
        "hf_demo.elastic.Elastic",
        "hf_demo.elastic runs a replica group of {world} processes (WORLD_SIZE) only as HSDP, its parameters sharded "
        "over them (fully_shard on the node's mesh); with whole parameters launch one torchrun --nproc_per_node=1 "
        "per replica group",
        DeMoSetupError,
    ),
    Refusal(
        "wrapped_step", "elastic",
        "`DeMo.step()` (or `prepare_step()` without `elastic=True`) × a DeMo that `hf_demo.elastic.Elastic` wraps",
        "hf_demo.optim.optimizer.DeMo.prepare_step",
        "DeMo.step() on a DeMo that hf_demo.elastic.Elastic wraps: torchft would not decide that step (no quorum "
        "check, no should_commit), so a replica could apply a step the others refused. Call elastic.step() in place "
        "of optimizer.step() (DeMoTrainer with demo_elastic steps the wrapper itself)",
        DeMoSetupError,
    ),
    Refusal(
        "elastic_hsdp_partial", "elastic",
        "`hf_demo.elastic` × parameters sharded over some of the replica group's processes only",
        "hf_demo.elastic.node_shards",
        "hf_demo.elastic with FSDP2-sharded parameters (HSDP): each replica group is one shard group, so shard the "
        "model over every process of the replica group (torch.distributed initialised by its launcher, "
        "fully_shard(model, mesh=init_device_mesh(device, (WORLD_SIZE,)))); torchft's quorum is the replicate "
        "dimension. Got parameters sharded over ranks {ranks}",
        DeMoSetupError,
    ),
    # -------------------------------------------------------------------------------------------------- resume
    Refusal(
        "resume_in_flight_local_steps", "resume",
        "a state saved with an exchange in flight (`overlap=True`) × `sync_every > 1`",
        "hf_demo.optim.checkpointing.refuse_unfit",
        "this optimizer state holds an exchange still in flight (saved with overlap=True), which local steps "
        "(sync_every > 1) cannot apply: resume it with the settings it was saved with, call optimizer.flush(), save "
        "again, and resume that checkpoint with the new settings",
        DeMoStateError,
        ("overlap", "sync_every"),
    ),
    Refusal(
        "resume_local_phase_every_step", "resume",
        "a state saved inside a local phase (several ranks) × a run with no local steps in that tier",
        "hf_demo.optim.checkpointing.refuse_unfit",
        "this optimizer state was saved inside a local phase (optimizer step {step}, synchronising every "
        "{saved_every} steps): each rank's parameters are still its own, and this run has no local steps "
        "(sync_every=1), so its first exchange would find the ranks apart and copy rank 0's parameters over the "
        "others'. Resume it with the settings it was saved with (sync_every={saved_every}), call optimizer.flush() "
        "on every rank (end_local_phase='average' averages the ranks), save again, and resume that checkpoint with "
        "the new settings",
        DeMoStateError,
        ("sync_every",),
    ),
    Refusal(
        "resume_other_mesh", "resume",
        "a state saved on a (replicate x shard) mesh × a flat run, or the other way round",
        "hf_demo.optim.optimizer.DeMo.check_saved_world",
        "optimizer state was saved on a {saved} (replicate x shard) but this run has a {now}: each rank's momentum is "
        "blocked on its own shard. Resume on the mesh it was saved on (or start the optimizer afresh)",
        DeMoStateError,
    ),
    Refusal(
        "resume_other_world", "resume",
        "a state saved with another number of processes",
        "hf_demo.optim.optimizer.DeMo.check_saved_world",
        "optimizer state was saved with {saved_world} process(es) but this run has {world}: each rank's momentum is "
        "its own, resume with {saved_world} processes (or start the optimizer afresh)",
        DeMoStateError,
    ),
    Refusal(
        "resume_dcp_other_mesh", "resume",
        "a DCP checkpoint of FSDP2-sharded DeMo × a mesh of another shape",
        "hf_demo.fsdp.load_checkpoint",
        "this checkpoint's optimizer state was saved on a {saved!r} layout (replicate x shard), this run has {now!r}: "
        "DeMo's momentum is blocked on each rank's own shard and cannot move to another shard size. Resume on the "
        "same mesh, or load the model only (hf_demo.fsdp.load_checkpoint(path, model)) and start the optimizer "
        "afresh. Nothing was loaded",
        DeMoStateError,
    ),
    Refusal(
        "resume_dcp_other_settings", "resume",
        "a DCP checkpoint holding state this optimizer's settings would not load",
        "hf_demo.fsdp.load_checkpoint",
        "this checkpoint holds optimizer state this optimizer would not load ({entries}): other settings "
        "(update_rule, sync_every, overlap) than the run that saved it? Resume with the same settings. Nothing was "
        "loaded",
        DeMoStateError,
        ("update_rule", "sync_every", "overlap"),
    ),
    Refusal(
        "sharded_save_own_state", "resume",
        "saving FSDP2-sharded DeMo × an exchange in flight (`overlap=True`) or inside a local phase",
        "hf_demo.optim.sharded_checkpoint.check_saveable",
        "a checkpoint of FSDP2-sharded DeMo holds no exchange in flight (overlap=True: call optimizer.flush() first) "
        "and no parameter of a rank's own (inside a local phase of sync_every > 1: save at a synchronisation, after "
        "a step that is a multiple of sync_every); optimizer step {step}",
        DeMoStateError,
        ("overlap", "sync_every"),
    ),
    # --------------------------------------------------------------------------------------------- integration
    Refusal(
        "deepspeed", "integration",
        "DeepSpeed",
        "hf_demo.hf.data_parallel.check_supported",
        "DeMo cannot run under DeepSpeed: DeepSpeed owns the optimizer step and all-reduces gradients itself. Use "
        "plain DDP (an accelerate config with distributed_type: MULTI_GPU), or FSDP2.",
    ),
    Refusal(
        "fsdp1", "integration",
        "FSDP other than FSDP2 (`fsdp_version` 1)",
        "hf_demo.hf.data_parallel.check_supported",
        "DeMo runs on FSDP2's sharded parameters, not FSDP{version}'s flat ones: set fsdp_version: 2 in the "
        "accelerate config (accelerate_configs/fsdp2_hsdp.yaml), or --fsdp_config with fsdp_version 2",
    ),
    Refusal(
        "late_checkpoint_object", "integration",
        "An object registered with `accelerator.register_for_checkpointing` after the accelerator's first "
        "`save_state` or `load_state`",
        "hf_demo.hf.accelerated.AcceleratorCheckpoints._registered_last",
        "an object was registered with accelerator.register_for_checkpointing after this accelerator's first "
        "save_state or load_state: its file would be saved after hf_demo's manifest, which covers every other file "
        "of a checkpoint and must be saved last. Register every object before the first save_state or load_state",
        DeMoSetupError,
    ),
    Refusal(
        "fsdp_not_run", "integration",
        "FSDP asked for (`--fsdp`, an FSDP accelerate config) where Accelerate does not run it (the CPU)",
        "hf_demo.hf.launch_env.refuse_fsdp_on_cpu",
        "FSDP was asked for (--fsdp, or an accelerate config with distributed_type: FSDP) but Accelerate does not "
        "run it here: it runs FSDP only on GPUs, and this run would train plain DDP + DeMo instead (or stop in "
        "Accelerate's ParallelismConfig check). On CPU, drop the FSDP setting to train DDP-DeMo, or shard in a "
        "custom loop with hf_demo.fsdp (torchrun + fully_shard, docs/guides/large-models.md); or run on GPUs",
        DeMoSetupError,
    ),
    Refusal(
        "fp16", "integration",
        "fp16 mixed precision (a `GradScaler`)",
        "hf_demo.hf.data_parallel.check_supported",
        "DeMo does not support fp16 with a GradScaler yet: the scaler's inf check would need to agree across ranks "
        "before DeMo's step. Use --bf16 (or fp32) instead.",
    ),
    Refusal(
        "trainer_world_apart", "integration",
        "`torch.distributed`'s world size × a different one seen by Trainer (a launch without the CPU switch)",
        "hf_demo.hf.trainer.DeMoTrainerMixin",
        "torch.distributed has {world} processes but Trainer sees world size {trainer_world}: each process would "
        "train alone on the same batches. On a machine without GPU, launch with ACCELERATE_USE_CPU=1 or pass "
        "--use_cpu true (use_cpu=True in the arguments); `use_cpu: true` in an accelerate config file is not "
        "passed on.",
        DeMoSetupError,
    ),
    Refusal(
        "elastic_without_demo", "integration",
        "`demo_elastic` × an optimizer that is not DeMo",
        "hf_demo.hf.trainer.DeMoTrainerMixin",
        "demo_elastic trains DeMo elastically: give --optim demo (or a DeMo optimizer)",
        DeMoSetupError,
        ("demo_elastic",),
    ),
    Refusal(
        "elastic_trainer_processes", "integration",
        "`demo_elastic` × several processes per replica group under Trainer",
        "hf_demo.hf.trainer.DeMoTrainerMixin",
        "demo_elastic runs one process per replica group; Trainer sees {world}: launch one torchrun "
        "--nproc_per_node 1 per replica group (docs/guides/trainer-and-trl.md)",
        DeMoSetupError,
        ("demo_elastic",),
    ),
    Refusal(
        "plain_trainer", "integration",
        "`optim=\"demo\"` × a trainer that is not DeMo-aware",
        "hf_demo.hf.training_args.plain_trainer_fix",
        "optim='demo' needs a DeMo-aware trainer: {fix}. hf_demo.with_demo(TrainerClass, ConfigClass) makes any "
        "trainer class DeMo-aware (so does a subclass with hf_demo.DeMoTrainerMixin first); one that is not would "
        "keep DDP's gradient all-reduce under DeMo.",
    ),
    # ------------------------------------------------------------------------------------------------- retired
    Refusal(
        "retired_hierarchy", "retired",
        "`hierarchy` (any value)",
        "hf_demo.settings.refuse_retired",
        "DeMo: the hierarchy setting is retired. hierarchy='flat' is what DeMo always does (drop the setting); "
        "hierarchy='node' (dense averaging inside a node, DeMo between nodes) is replaced by HSDP on PyTorch's "
        "FSDP2, which also shards the parameters, gradients and optimizer state inside the node: "
        "mesh = hf_demo.fsdp.hsdp_mesh(); hf_demo.fsdp.shard_model(model, mesh); "
        "DeMo(model.parameters(), device_mesh=mesh). See docs/guides/large-models.md",
        involves=("hierarchy",),
    ),
)  # fmt: skip

REFUSALS: dict[str, Refusal] = {r.key: r for r in _TABLE}
assert len(REFUSALS) == len(_TABLE) and all(r.kind in KINDS for r in _TABLE), "refusal keys are unique, kinds known"


def text(key: str, **fields) -> str:
    """The message of refusal ``key`` (for checks that collect several before raising)."""
    return REFUSALS[key].text(**fields)


def error(key: str, **fields) -> Exception:
    """The exception of refusal ``key``, to raise (``raise refusals.error(...) from None``)."""
    return REFUSALS[key].error_of(**fields)


def refuse(key: str, **fields) -> NoReturn:
    """Raise refusal ``key``."""
    raise REFUSALS[key].error_of(**fields)


def elastic_error(texts: list[str]) -> DeMoSetupError:
    """The elastic mode refusals found together (:func:`hf_demo.elastic.refuse_modes`), as one error."""
    return DeMoSetupError(ELASTIC_PREFIX + "; ".join(texts))


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


def _template(r: Refusal) -> str:
    """The message with each field shown as ``<name>``."""
    parts = []
    for literal, name, _, _ in string.Formatter().parse(r.message):
        parts.append(literal)
        if name is not None:
            parts.append(f"<{name}>")
    return _cell("".join(parts))


def markdown_table() -> str:
    """Every refusal as Markdown, by kind (docs/reference/refusals.md is this, checked by the tests)."""
    rows = []
    for kind, what in KINDS.items():
        rows += [f"## {kind}", "", f"{what[0].upper()}{what[1:]}.", ""]
        rows += ["| refused | checked in | error |", "|---|---|---|"]
        for r in _TABLE:
            if r.kind == kind:
                rows.append(f"| {_cell(r.condition)} | `{r.checked}` | {r.error.__name__}: {_template(r)} |")
        rows.append("")
    return "\n".join(rows).rstrip() + "\n"


def pairs_table() -> str:
    """The settings that do not compose (construction and layout refusals that name settings): DESIGN.md's list."""
    rows = ["| refused | kind | checked in |", "|---|---|---|"]
    for r in _TABLE:
        if r.kind in ("construction", "layout") and r.involves:
            rows.append(f"| {_cell(r.condition)} | {r.kind} | `{r.checked}` |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m hf_demo.refusals > docs/reference/refusals.md
    print(
        "# Refusals\n\nGenerated from `hf_demo.refusals.REFUSALS` (`python -m hf_demo.refusals > "
        "docs/reference/refusals.md`): every set-up hf_demo declines to run, where it is checked and the error it "
        f"raises (its reason and its fix). {len(_TABLE)} in all; every other combination runs.\n"
    )
    print(markdown_table(), end="")
