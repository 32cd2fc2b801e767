"""Every DeMo setting, once: name, type, default, allowed values and help.

``DeMo(**settings)``, ``--optim_args``, the ``--demo_*`` fields of ``DeMoTrainingArguments`` and the
settings checksum that ranks compare all read :class:`DeMoSettings`. Allowed values come from the
registries of the modules that implement them (value formats in :mod:`hf_demo.wire.codec`, exchanges in
:mod:`hf_demo.exchange.transport`, update rules in :mod:`hf_demo.optim.update_rules`), so adding one touches one module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from hf_demo import compression
from hf_demo.compression import MAX_BLOCK_SIZE
from hf_demo.exchange import transport as exchanges
from hf_demo.optim import local_steps, update_rules
from hf_demo.refusals import REFUSALS, refuse
from hf_demo.wire import codec

NONFINITE_POLICIES = ("skip", "raise")
DRIFT_POLICIES = ("raise", "resync")


# settings that once were: each raises naming what replaces it, where unknown settings are refused
RETIRED = {r.involves[0]: r.message for r in REFUSALS.values() if r.kind == "retired"}
RETIRED_KEYS = {r.involves[0]: r.key for r in REFUSALS.values() if r.kind == "retired"}


def refuse_retired(names) -> None:
    """Raise ``ValueError`` naming the replacement of the first retired setting among ``names``."""
    for name in sorted(set(names) & set(RETIRED)):
        refuse(RETIRED_KEYS[name])


def with_sign_update(sign_update, settings: dict) -> dict:
    """``DeMo(sign_update=...)``, the reference's switch, as ``update_rule``; unknown settings refused with the known
    ones."""
    if sign_update is not None:
        if not isinstance(sign_update, bool):
            raise ValueError(f"DeMo: invalid sign_update={sign_update!r}: must be True or False")
        rule = "sign" if sign_update else "raw"
        if settings.setdefault("update_rule", rule) != rule:
            refuse("sign_update_contradicts", sign_update=sign_update, rule=settings["update_rule"])
    refuse_retired(settings)
    unknown = set(settings) - set(DeMoSettings.names())
    if unknown:
        raise ValueError(
            f"unknown DeMo setting(s) {sorted(unknown)}; known settings: {', '.join(DeMoSettings.names())}"
        )
    return settings


def check_blocks(chunk, topk) -> None:
    """Refuse a block side or a top-k DeMo cannot run (ValueError): the one check of both, for the optimizer's
    settings (:class:`DeMoSettings`) and for every parameter group (:func:`hf_demo.optim.view.validate_group`)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk * chunk <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"DeMo: invalid compression_chunk={chunk!r}: must be an integer in [1, 256] (positions inside a block "
            "fit 16 bits)"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"DeMo: invalid compression_topk={topk!r}: must be an integer >= 1")
    if topk > chunk * chunk:
        raise ValueError(
            f"DeMo: invalid compression_topk={topk!r}: cannot exceed the block size chunk*chunk = {chunk * chunk}"
        )


def _setting(default, help: str, choices=None, per_group: bool = False):
    meta = {"help": help, "per_group": per_group}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DeMoSettings:
    """DeMo's settings besides ``lr`` and ``weight_decay`` (keyword arguments of :class:`hf_demo.DeMo`).

    Settings marked per-group may be overridden in a parameter group; the others hold for the optimizer.
    """

    compression_decay: float = _setting(0.999, "momentum decay in [0, 1]", per_group=True)
    compression_topk: int = _setting(32, "DCT coefficients sent per block", per_group=True)
    compression_chunk: int = _setting(
        64, "block side: chunk x chunk blocks for matrices, chunk for vectors (1..256)", per_group=True
    )
    transform: str = _setting(
        "dct",
        "what top-k selects from: dct (the blockwise DCT-II, DeMo's) or identity (the raw blocks: an ablation)",
        compression.TRANSFORM_NAMES,
    )
    value_format: str = _setting(
        "bf16",
        "wire format of the values: bf16, fp32, sign (1 bit + a bf16 scale per block) or 2bit (a sign and a "
        "magnitude class per coefficient + two bf16 magnitudes per block, as SparseLoCo; exchange='all_gather')",
        codec.VALUE_FORMATS,
    )
    index_coding: str = _setting(
        "elias_fano",
        "wire format of the positions: uint16 (16 bits each) or elias_fano (each block's sorted positions, "
        "~log2(block/topk)+2 bits each: 9 for top-32 of 64x64; lossless: training is bitwise the same)",
        codec.INDEX_CODINGS,
    )
    exchange: str = _setting(
        "all_gather",
        "how coefficients move: all_gather (each rank picks its own top-k) or all_reduce (every rank's values "
        "summed at agreed positions, see reduce_positions: traffic flat in the number of ranks)",
        exchanges.EXCHANGES,
    )
    reduce_positions: str = _setting(
        "union",
        "how exchange=all_reduce agrees on positions: union (each of the W ranks nominates its top k/W per "
        "block, the union is summed) or leader (one rank per step, rotating, picks all k)",
        exchanges.REDUCE_POSITIONS,
    )
    overlap: bool = _setting(
        False,
        "run step t's exchange in the background while step t+1 computes; its update is applied at step t+1 "
        "(one step late, as Psyche does; the late step costs loss, more at larger learning rates: "
        "docs/guides/choosing-settings.md). Every-step synchronisation, no comm_budget",
    )
    update_rule: str = _setting(
        "sign",
        "how the averaged update becomes a step: sign (the paper's), raw, adam (second-moment "
        "normalised), adamw (AdamW's two moments, betas 0.9/0.95) or orthogonal (Muon's: each matrix "
        "orthogonalised by 5 Newton-Schulz steps and scaled by 0.2 sqrt(max(rows, cols)); its best lr is higher "
        "than AdamW's (16x on the benchmark's 0.46M Llama); 1-D tensors take sign steps; give embeddings and the "
        "output head sign in a group of their own: hf_demo.muon_style_groups), orthogonal_signal (orthogonal, and "
        "each rank's gradient of a matrix is orthogonalised too before it enters the momentum, so top-k selects "
        "from a momentum of orthogonalised gradients), muon_signal (orthogonal, and what of each rank's gradient of "
        "a matrix enters the momentum is Muon's own direction: a Newton-Schulz iterate of a Nesterov momentum, "
        "0.95, of the rank's gradients, 4 bytes per parameter: the best every-step rule) or orthogonal_momentum "
        "(orthogonal on a Nesterov momentum, 0.95, of the averaged updates); every rule runs identically on every "
        "rank: no extra traffic. Synchronisations of sync_every > 1 apply the averaged change times outer_lr; "
        "their local steps follow inner_rule",
        update_rules.UPDATE_RULES,
        per_group=True,
    )
    param_rounding: str = _setting(
        "nearest",
        "how a bf16 parameter takes its step: nearest, or stochastic (unbiased rounding, identical noise on "
        "every rank; no extra memory) so steps below bf16's resolution still move the weights",
        ("nearest", "stochastic"),
    )
    sync_every: int = _setting(
        1,
        "synchronise every this many steps (1 = every step); in between each rank takes local steps and "
        "the accumulated change goes through DeMo at the synchronisation (DiLoCo/SparseLoCo style)",
    )
    sync_decay: float = _setting(
        0.86,
        "error-feedback decay of synchronisations (sync_every > 1, the policy's local-step tiers) per 1% of "
        "a block's coefficients sent: a block that sends a fraction f keeps sync_decay**(100 f) of its "
        "residue (0.70 at top-96 of 64x64, 0.89 at top-32, 0.985 at top-4): what top-k has not sent fades "
        "as fast as the buffer is drained, instead of piling up behind the agreed model",
    )
    inner_rule: str = _setting(
        "adam",
        "the local optimizer between synchronisations: an update rule applied to the local momentum (adam: "
        "local Adam steps, as DiLoCo/SparseLoCo's inner AdamW; sign: local Signum; orthogonal: local Muon steps)",
        update_rules.UPDATE_RULES,
        per_group=True,
    )
    outer_lr: float = _setting(
        1.0,
        "each synchronisation of local steps (sync_every > 1, the policy's local-step tiers) moves every rank's "
        "anchor by the ranks' mean change times this (DiLoCo's outer learning rate, without momentum); with "
        "outer_lr_scaling times sqrt(W/2) or (W/2)^(1/4) too (end_local_phase's dense average is not scaled). Refused "
        "without local steps (sync_every=1, no comm_budget): no synchronisation applies a mean change there, scale "
        "lr instead",
    )
    outer_lr_scaling: str = _setting(
        "none",
        "none (outer_lr as given), sqrt_world (outer_lr x sqrt(W/2), W the ranks the change is averaged over, "
        "read at each synchronisation: 1 at W=2, 2 at W=8) or fourth_root_world (outer_lr x (W/2)^(1/4): 1 at W=2, "
        "1.41 at W=8). The mean of W ranks' local changes is about sqrt(W) shorter than one rank's, since each is "
        "mostly its own noise; sqrt_world gives the applied change the same size at every W, fourth_root_world "
        "half of that growth in log scale (the from_scratch presets: docs/guides/choosing-settings.md)",
        local_steps.OUTER_LR_SCALINGS,
    )
    comm_budget: float = _setting(
        0.0,
        "at most this fraction of training time waiting on DeMo's exchange (e.g. 0.15); the policy moves "
        "between tiers of fewer bytes as the network changes (0 = fixed settings)",
    )
    policy_patience: int = _setting(
        3,
        "communicating steps over (or well under) budget before the tier changes (a step more than 4x over "
        "budget moves down at once)",
    )
    policy_sync_every: int = _setting(8, "sync_every of the policy's last tier")
    nonfinite: str = _setting(
        "skip", "NaN/Inf local gradients: skip the step on every rank, or raise", NONFINITE_POLICIES
    )
    nonfinite_patience: int = _setting(10, "warn after this many consecutive skipped (non-finite) steps")
    comm_timeout: float = _setting(
        300.0, "seconds DeMo's collectives wait for every rank before raising DeMoSyncError (0 = no limit)"
    )
    check_every: int = _setting(
        100,
        "every this many steps, and at a process's first exchange, a fingerprint of the parameters is compared "
        "across ranks (0 = at the first exchange only)",
    )
    drift: str = _setting(
        "resync",
        "when fingerprints differ: resync (copy rank 0's parameters, logged, counted) or raise",
        DRIFT_POLICIES,
    )
    identical_gradients: str = _setting(
        "raise",
        "at a process's first exchange, local gradients bitwise identical on every rank (DDP still averaging "
        "them, or every rank reading the same batches): raise, or allow (a deliberate set-up)",
        ("raise", "allow"),
    )
    full_sync_every: int = _setting(0, "every this many steps, copy rank 0's parameters to every rank (0 = never)")
    commit_vote: str = _setting(
        "on",
        "every rank's verdict on what it received (passed its checks or not) reaches every rank, and a refusal on "
        "any rank stops the step on every rank, so the replicas stay identical. on: in steady state the verdict "
        "rides in the next exchange (the step commits tentatively and is undone on every rank if any refused: "
        "one round trip per step, with the defaults), in a small all-gather of its own where the mode needs it; "
        "separate: always in a small all-gather of its own (two round trips); off: no verdict is exchanged, a "
        "refusal raises on the refusing rank only and the drift check finds the replicas apart",
        ("on", "separate", "off"),
    )
    end_local_phase: str = _setting(
        "average",
        "when training ends inside a local phase (sync_every > 1, a policy's local-step tier), what flush() does: "
        "average (dense all-reduces, in fp32 or the parameter's dtype where wider, make every rank's parameters "
        "their mean) or warn (each rank keeps "
        "its own until the next synchronisation)",
        ("average", "warn"),
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ValueError(f"DeMo: invalid {f.name}={value!r}; expected one of {', '.join(choices)}")
            kind = _TYPES[f.name]
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"DeMo: invalid {f.name}={value!r}; expected True or False")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"DeMo: invalid {f.name}={value!r}; expected an integer")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"DeMo: invalid {f.name}={value!r}; expected a number")
        check_blocks(self.compression_chunk, self.compression_topk)
        for name in ("compression_decay", "sync_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DeMo: invalid {name}={getattr(self, name)!r}: must be in [0, 1]")
        if not (math.isfinite(self.comm_timeout) and self.comm_timeout >= 0):
            raise ValueError(f"DeMo: invalid comm_timeout={self.comm_timeout!r}: seconds >= 0 (0 = no limit)")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"DeMo: invalid outer_lr={self.outer_lr!r}: a finite number > 0 (1 = the mean change)")
        if not (math.isfinite(self.comm_budget) and 0 <= self.comm_budget < 1):
            raise ValueError(f"DeMo: invalid comm_budget={self.comm_budget!r}: a fraction in [0, 1) (0 = off)")
        if self.policy_patience < 1 or self.policy_sync_every < 1:
            raise ValueError("DeMo: policy_patience and policy_sync_every must be >= 1")
        for key, fields in refusals(self):
            refuse(key, **fields)
        if self.sync_every < 1:
            raise ValueError(f"DeMo: invalid sync_every={self.sync_every!r}: must be >= 1")
        self.check_group({"update_rule": self.update_rule, "inner_rule": self.inner_rule})
        for name in ("check_every", "full_sync_every", "nonfinite_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeMo: invalid {name}={getattr(self, name)!r}: must be >= 0")

    def check_group(self, group: dict) -> None:
        """Refuse a parameter group's settings that these optimizer-wide ones cannot honour (``group`` holds the
        per-group settings, the optimizer's defaults filled in)."""
        for name in ("update_rule", "inner_rule"):
            if group[name] not in update_rules.UPDATE_RULES:
                raise ValueError(
                    f"DeMo: invalid {name}={group[name]!r} in a parameter group; expected one of "
                    f"{', '.join(update_rules.UPDATE_RULES)}"
                )
        if group["inner_rule"] in update_rules.NOT_INNER:
            refuse("inner_rule_not_inner", rule=group["inner_rule"])
        if group["update_rule"] in update_rules.ORTHOGONAL and self.sync_every > 1:
            refuse("orthogonal_local_steps", rule=group["update_rule"], sync_every=self.sync_every)
        self._check_rules_run(group)
        if group["update_rule"] in update_rules.ORTHOGONAL and self.comm_budget > 0 and self.policy_sync_every > 1:
            refuse("orthogonal_budget_tiers", rule=group["update_rule"], policy_sync_every=self.policy_sync_every)

    def _check_rules_run(self, group: dict) -> None:
        """A rule named away from its default must run: ``update_rule`` in steps that synchronise every step,
        ``inner_rule`` in local steps (``sync_every > 1``, or a budget policy whose tiers take local steps)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        local_tiers = self.sync_every > 1 or (self.comm_budget > 0 and self.policy_sync_every > 1)
        if group["update_rule"] != defaults["update_rule"] and self.sync_every > 1:
            refuse("update_rule_unrun", rule=group["update_rule"], sync_every=self.sync_every)
        if group["inner_rule"] != defaults["inner_rule"] and not local_tiers:
            why = ", no comm_budget" if self.comm_budget == 0 else ", policy_sync_every=1"
            refuse("inner_rule_unrun", rule=group["inner_rule"], why=why)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def per_group_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["per_group"])

    @classmethod
    def describe(cls) -> list[tuple[str, type, object, str, tuple | None]]:
        """(name, type, default, help, choices) of every setting, for argument parsers and docs."""
        return [
            (f.name, _TYPES[f.name], f.default, f.metadata["help"], f.metadata.get("choices"))
            for f in dataclasses.fields(cls)
        ]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @functools.cached_property
    def reprs(self) -> dict[str, str]:
        """Every setting's ``repr``, by name, sorted: what the ranks compare (:func:`hf_demo.optim.view.plan_items`);
        taken once, the settings being frozen."""
        return {k: repr(v) for k, v in sorted(self.as_dict().items())}

    @classmethod
    def resolve(cls, preset: str | None = None, **chosen) -> DeMoSettings:
        """The settings of ``preset`` (see :data:`PRESETS`) with ``chosen`` on top; validated."""
        refuse_retired(chosen)
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"DeMo: unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS.get(preset, {}), **chosen})


def refusals(s: DeMoSettings) -> list[tuple[str, dict]]:
    """The keys (:data:`hf_demo.refusals.REFUSALS`) and message fields of the combinations of optimizer-wide
    settings DeMo refuses; the per-group ones are :meth:`DeMoSettings.check_group`'s."""
    out = []
    if s.overlap and (s.sync_every > 1 or s.comm_budget > 0):
        # a synchronisation resets every rank to anchor - mean change; landing that one step late would move the
        # anchor after a local step already left it, so the ranks would apply it to different parameters
        out.append(("overlap_local_steps", {}))
    local_tiers = s.sync_every > 1 or (s.comm_budget > 0 and s.policy_sync_every > 1)
    if (s.outer_lr != 1.0 or s.outer_lr_scaling != "none") and not local_tiers:
        why = ", no comm_budget" if s.comm_budget == 0 else ", policy_sync_every=1"
        out.append(
            ("outer_lr_without_local_steps", {"outer_lr": s.outer_lr, "scaling": s.outer_lr_scaling, "why": why})
        )
    return out


# Named starting points, ordered by bytes. Where a setting's value comes from, lowest to highest: the
# default above, the preset, the setting given by name. Bytes/param/step are exact (codec.segment_bytes) on
# SmolLM2-135M, where 64 divides every dimension, with the default Elias-Fano positions (16-bit positions in
# brackets). Which to choose, and what each costs in loss: docs/guides/choosing-settings.md.
PRESETS: dict[str, dict] = {
    "balanced": {"value_format": "sign", "compression_topk": 64},  # 1-bit values, top-64: 0.018 [0.034]
    "lean": {"value_format": "sign"},  # 1-bit values, top-32: 0.010 [0.017]
    "extreme": {"value_format": "sign", "compression_topk": 4},  # Psyche's production setting: 0.0021 [0.0026]
    # many ranks: the union all-reduce at 4x the default top-k; its bytes per rank stay below 2x those at W=2
    # for any W (a ring all-reduce), where the all-gather's grow as W-1
    "many_nodes": {"exchange": "all_reduce", "compression_topk": 128},
    # training from scratch: local Muon steps (inner_rule="orthogonal" for the hidden matrices, local Adam for
    # the rest: the Muon-style groups that create_optimizer and DeMoTrainer build) between synchronisations every
    # 2 steps, each sending 1-bit values, top-24 of 32x32, of the change since the last one (0.014 B/param/step
    # on the 0.46M Llama, 0.020 on the 3.3M one). Its best lr was 2e-2 on both (20x AdamW's) at 2 ranks; the
    # mean change is applied x sqrt(2) (W/2)^(1/4) (outer_lr sqrt(2) on fourth_root_world: 1.41 at 2 ranks, 1.68 at
    # 4, 2 at 8), so that its size does not fall as 1/sqrt(W) with more ranks: of the factors measured, the best
    # grew more slowly than sqrt(W). Its figures against DDP-AdamW and DDP-Muon: docs/results.md
    "from_scratch": {
        "sync_every": 2,
        "inner_rule": "orthogonal",
        "value_format": "sign",
        "compression_chunk": 32,
        "compression_topk": 24,
        "outer_lr": math.sqrt(2),
        "outer_lr_scaling": "fourth_root_world",
    },
    # the from_scratch recipe at Psyche's bytes: synchronising every 4 steps with top-16 of 64x64 (0.0020
    # B/param/step on the 0.46M Llama, 0.0019 on the 3.3M one, 0.0015 on SmolLM2-135M): 1.05x and 1.03x the
    # from_scratch recipe's held-out loss after 1000 steps for 7x and 10x fewer bytes, 1.01x after 3000 steps on
    # the 0.46M Llama (2 ranks, each applying the mean change x 1). It applies the mean change x sqrt(W) (outer_lr
    # sqrt(2) on sqrt_world: its change carries 4 local steps), better than x sqrt(W/2) at W = 2, 4 and 8 on every
    # seed measured over 300 steps and level with x 1 after 1000 steps at 2 ranks. 64-wide blocks cut both
    # Llamas' MLP dimensions (344, 688) into 43-wide blocks, the same share sent on each, where 32-wide ones pad 344
    # and cut 688 into 16s (twice the share); a shorter interval with fewer coefficients beat a longer one with more
    # at equal bytes (docs/results.md)
    "from_scratch_few_bytes": {
        "sync_every": 4,
        "inner_rule": "orthogonal",
        "value_format": "sign",
        "compression_chunk": 64,
        "compression_topk": 16,
        "outer_lr": math.sqrt(2),
        "outer_lr_scaling": "sqrt_world",
    },
}

_TYPES = {
    f.name: {"float": float, "int": int, "str": str, "bool": bool}[f.type] for f in dataclasses.fields(DeMoSettings)
}


def markdown_table() -> str:
    """The settings as a Markdown table (docs/reference/settings.md is this, checked by the tests)."""
    rows = ["| setting | default | allowed | per group | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(DeMoSettings):
        choices = ", ".join(f.metadata.get("choices") or ()) or _TYPES[f.name].__name__
        per_group = "yes" if f.metadata["per_group"] else ""
        rows.append(f"| `{f.name}` | `{f.default!r}` | {choices} | {per_group} | {f.metadata['help']} |")
    rows += ["", "Presets (`preset=` / `--demo_preset`; settings given by name win over the preset's):", ""]
    rows += ["| preset | settings |", "|---|---|"]
    for name, values in PRESETS.items():
        rows.append(f"| `{name}` | {', '.join(f'`{k}={v!r}`' for k, v in values.items()) or 'the defaults'} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m hf_demo.settings > docs/reference/settings.md
    print(
        "# DeMo settings\n\nGenerated from `hf_demo.settings.DeMoSettings` (`python -m hf_demo.settings > "
        "docs/reference/settings.md`). Each is a keyword of `hf_demo.DeMo`, a `--demo_<name>` field of "
        "`DeMoTrainingArguments` and a key of `--optim_args`; `lr` and `weight_decay` come from Trainer.\n"
    )
    print(markdown_table())
    print("\nRetired settings: each is refused with this error, naming what replaces it.\n")
    print("| setting | error |\n|---|---|")
    print("\n".join(f"| `{name}` | {message} |" for name, message in sorted(RETIRED.items())))
