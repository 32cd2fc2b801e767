"""The optimizer's own state as types: the counters, the exchange in flight, and the ``"demo"`` entry of
``state_dict()`` with its one versioned serialisation (:class:`SavedState`).

Format 3 is what this release writes and reads. A state missing any of its fields comes from a pre-release build:
it is refused with the version and the missing field named (start the optimizer afresh, or resume with the
build that wrote it, flush and save again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import astuple, dataclass, field

import torch

from hf_demo.compression import BlockLayout, Workspace
from hf_demo.errors import DeMoStateError
from hf_demo.exchange.transport import InFlight, Traffic
from hf_demo.optim.policy import BudgetPolicy, Clock

STATE_VERSION = 3


@dataclass(frozen=True)
class RunState:
    """What a :class:`hf_demo.DeMo` keeps between steps besides its settings, its parameters' state and its traffic
    totals: one frozen record, replaced whole by DeMo's transitions (the step's commit, the load, ``reset_peers``,
    ``settled``, ``run_by``, ...) and by nothing else (``tests/test_state_ownership.py``). A tentative commit's undo
    puts the record it replaced back."""

    policy: BudgetPolicy  # the communication tier and its moves (hf_demo.optim.policy)
    counters: Counters = field(default_factory=lambda: Counters())
    clock: Clock = field(default_factory=Clock)  # the policy's figures of the last exchange
    context: str = "loop"  # where DeMo runs, for the fixes its errors name: "trainer" (DeMoTrainer) or "loop"
    pending: PendingExchange | None = None  # overlap: the exchange started by the last step
    saved_world: tuple | None = None  # (rank, world, scope) of a loaded state, until checked against this run's
    run_id: str | None = None  # this run's identity, saved with the state (checkpointing.agreed_run_id)
    saved_identity: tuple = (None, None, None)  # (run, optimizer step, parameter fingerprint) of a loaded state
    first_checked: bool = False  # this process's first exchange compared the replicas and the gradients
    unsettled: object = None  # the last step, its verdict not read yet (hf_demo.optim.settle.Unsettled)
    undo_spare: dict = field(default_factory=dict)  # the copies of the last undo log no longer needed, for the next
    wire_agreed: dict = field(default_factory=dict)  # {(world, tier): payload bytes} of the last exchange there
    ddp_checked: bool = False  # the first-step DDP guard ran (again if False)
    ddp_wrappers: list = field(default_factory=list)  # weak references to live DDP wrappers (guards.watched)
    topology: object = None  # the topology built over the process group (DeMo.topology)
    peers: object = None  # the topology a wrapper gave (DeMo.reset_peers: an elastic quorum's), which then steps DeMo
    workspace: Workspace = field(default_factory=Workspace, compare=False)  # the step's scratch buffers (not state)


def forgotten_peers() -> dict:
    """What :meth:`hf_demo.DeMo.reset_peers` replaces when the peers change: what DeMo learnt of the last ones goes."""
    return dict(
        clock=Clock(),  # every rank decides its next tier from the same (no) figures
        first_checked=False,  # the first exchange compares every rank again (a joiner's recovered state)
        ddp_checked=False,  # the first-step DDP guard runs again
        wire_agreed={},  # no payload rides with the headers until the new peers agreed its size
        pending=None,  # overlap: the exchange in flight ran over the last group; nobody applies it
    )


@dataclass(frozen=True)
class Counters:
    """Optimizer steps taken in lockstep (skipped ones included) and what happened to them."""

    steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    resyncs: int = 0
    unsynced: bool = False  # a local step since the last committed synchronisation (the same on every rank)

    def skipped(self) -> Counters:
        skips = self.consecutive_skips + 1
        return dataclasses.replace(
            self, steps=self.steps + 1, skipped_steps=self.skipped_steps + 1, consecutive_skips=skips
        )


@dataclass
class PendingExchange:
    """Overlap: the exchange a step started, with what it takes to apply it one step later (whatever the
    settings or the trainable parameters are by then): the coding it was sent with, each update's learning rate
    and weight decay, and the positions, among all of the optimizer's parameters, of those it updates."""

    in_flight: InFlight
    exchange: str
    reduce_positions: str
    index_coding: str
    value_format: str
    layouts: list[BlockLayout]
    lr: list[tuple[float, float]]
    params: list[int]
    counted: bool = False  # its arrival is in comm_stats already (a step that waited for it failed)

    @property
    def step(self) -> int:
        return self.in_flight.step

    def to_state(self, traffic: Traffic) -> dict:
        return {
            **self.in_flight.to_state(traffic),
            "step": self.step,
            "exchange": self.exchange,
            "reduce_positions": self.reduce_positions,
            "lr": [list(x) for x in self.lr],
            "index_coding": self.index_coding,
            "layouts": [list(astuple(x)) for x in self.layouts],
            "value_format": self.value_format,
            "params": list(self.params),
        }

    @classmethod
    def from_state(cls, saved: dict, rank: int, world: int, device) -> PendingExchange:
        keys = ("rows", "step", "lr", "index_coding", "headers", "layouts", "value_format", "params")
        _require(saved, keys, "pending")
        return cls(
            InFlight.from_state(saved, int(saved["step"]), rank, world, device),
            saved.get("exchange", "all_gather"),  # written by overlap's first release: all_gather only
            saved.get("reduce_positions", "union"),
            saved["index_coding"],
            saved["value_format"],
            [_layout(x) for x in saved["layouts"]],
            [tuple(x) for x in saved["lr"]],
            [int(i) for i in saved["params"]],
        )


@dataclass
class SavedState:
    """The ``"demo"`` entry of the optimizer's ``state_dict()``."""

    counters: Counters
    rank: int
    world_size: int
    rank_scope: str  # "group": the rank in the optimizer's group; "mesh RxS": FSDP2 shards, placed by their DTensors
    settings: dict
    policy: dict  # BudgetPolicy.state_dict() and the tier's (value_format, topk_divisor, sync_every)
    comm: dict
    pending: dict | None = None
    local_params: dict = field(default_factory=dict)  # inside a local phase: this rank's own parameters
    shards: str | None = None
    run_id: str | None = None  # the run that saved it (inherited on resume): every rank's file must share it
    params_print: int | None = None  # this rank's parameters when saved (guards.fingerprint): the model's
    shapes: dict | None = None  # {state-dict id: the parameter's shape} (not FSDP2): the pieces' shapes when saved

    FIELDS = ("steps", "skipped_steps", "consecutive_skips", "resyncs", "unsynced", "rank", "world_size")
    FIELDS += ("rank_scope", "settings", "policy", "pending", "comm", "local_params")

    def to_dict(self) -> dict:
        out = {"format_version": STATE_VERSION, **dataclasses.asdict(self.counters)}
        out.update({k: getattr(self, k) for k in self.FIELDS if not hasattr(self.counters, k)})
        for key in OPTIONAL:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, saved: dict | None) -> SavedState:
        if saved is None:
            raise DeMoStateError("this optimizer state was not saved by hf_demo.DeMo (no 'demo' entry)")
        if not isinstance(saved, dict):
            raise DeMoStateError(_malformed("demo", saved, "a dict"))
        if saved.get("format_version") != STATE_VERSION:
            raise DeMoStateError(
                f"optimizer state has format version {saved.get('format_version')}, this hf_demo reads "
                f"{STATE_VERSION}: start the optimizer afresh, or resume with the hf_demo that wrote it"
            )
        _require(saved, cls.FIELDS, "demo")
        _check_types(saved)
        counters = Counters(*(type(getattr(Counters(), k))(saved[k]) for k in dataclasses.asdict(Counters())))
        rest = {k: saved[k] for k in cls.FIELDS if not hasattr(counters, k)}
        identity = {k: saved.get(k) for k in OPTIONAL}  # absent in older states
        return cls(counters=counters, **identity, **rest)

    @property
    def tier_spec(self) -> tuple:
        spec = self.policy["tier_spec"]
        return spec[0], int(spec[1]), int(spec[2])


def _require(saved: dict, keys, where: str) -> None:
    missing = [k for k in keys if k not in saved]
    if missing:
        raise DeMoStateError(
            f"optimizer state format {STATE_VERSION} without {', '.join(missing)} in '{where}': written by a "
            "pre-release hf_demo. Start the optimizer afresh, or resume with the build that wrote it"
        )


INT, NUMBER = (int,), (int, float)
TYPES = {"steps": INT, "skipped_steps": INT, "consecutive_skips": INT, "resyncs": INT, "unsynced": (bool, int),
         "rank": INT, "world_size": INT, "rank_scope": (str,), "settings": (dict,), "policy": (dict,),
         "pending": (dict, type(None)), "comm": (dict,), "local_params": (dict,), "shards": (str, type(None)),
         "run_id": (str, type(None)), "params_print": (int, type(None)), "shapes": (dict, type(None))}  # fmt: skip
OPTIONAL = ("shards", "run_id", "params_print", "shapes")  # "demo" entries an older hf_demo did not write


def _malformed(where: str, value, expected: str) -> str:
    return (
        f"optimizer state has a malformed '{where}' entry ({type(value).__name__} {str(value)[:60]!r}, expected "
        f"{expected}): the file was not written by hf_demo.DeMo or was altered. Resume from another checkpoint "
        "(or start the optimizer afresh)"
    )


def _check_types(saved: dict) -> None:
    """Raise :class:`DeMoStateError` naming the first entry of the ``"demo"`` state whose type is not the one
    :meth:`SavedState.to_dict` writes, before anything is loaded."""
    for key, types in TYPES.items():
        if key in saved and not isinstance(saved[key], types):
            raise DeMoStateError(_malformed(f"demo.{key}", saved[key], " or ".join(t.__name__ for t in types)))
    _require(saved["policy"], ("tier_spec",), "demo.policy")
    policy, spec = saved["policy"], saved["policy"]["tier_spec"]
    fit = isinstance(spec, (list, tuple)) and len(spec) == 3 and isinstance(spec[0], str)
    if not fit or not all(isinstance(x, int) for x in spec[1:]):
        raise DeMoStateError(_malformed("demo.policy.tier_spec", spec, "[value_format, topk_divisor, sync_every]"))
    for where, entries in (("demo.policy", policy), ("demo.comm", saved["comm"])):
        for k, v in entries.items():
            if k != "tier_spec" and not isinstance(v, NUMBER):
                raise DeMoStateError(_malformed(f"{where}.{k}", v, "a number"))
    for k, v in saved["local_params"].items():
        if not isinstance(k, int) or not torch.is_tensor(v):
            raise DeMoStateError(_malformed(f"demo.local_params[{k!r}]", v, "a tensor under a parameter id"))


def _layout(saved) -> BlockLayout:
    """A :class:`BlockLayout` from its saved fields (shape, rows, cols, b0, b1, k)."""
    shape, *rest = saved
    return BlockLayout(tuple(int(x) for x in shape), *(int(x) for x in rest))


def saved_tensors(state_dict: dict) -> dict:
    """{saved id: {key: tensor}}: torch casts floating state to the parameter's dtype when it loads (and integer
    state too: a bf16 step counter stops at 256), so the optimizer restores its own tensors from these."""
    return {pid: {k: v for k, v in s.items() if torch.is_tensor(v)} for pid, s in state_dict.get("state", {}).items()}
