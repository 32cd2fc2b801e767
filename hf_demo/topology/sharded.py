"""FSDP2-sharded parameters: DeMo on each rank's local shard, exchanged across the replicate dimension only.

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) turns every parameter into a ``DTensor`` whose local
part is this rank's shard. Sharded on the ``shard`` dimension of a (replicate, shard) device mesh (HSDP,
:func:`hf_demo.fsdp.shard_model`), its backward reduce-scatters each gradient inside the shard group (the fast
link), so ``.grad`` holds the shard group's mean gradient for this rank's shard, and nothing crosses the
replicate dimension. DeMo then does what the replicate all-reduce of HSDP would have done, at a fraction of its
bytes:

- momentum, DCT blocks and top-k work on the local shard; the ranks of a replicate group hold the same shard (the
  same local shape, hence the same block layout), so their exchange is exact, as between DDP replicas;
- DeMo exchanges over the replicate group of its shard (``device_mesh["replicate"]``, or ``process_group``);
  with pure FSDP (a mesh of one dimension over every rank) there is no other replica and nothing to exchange;
- what decides a step for the whole model (skip for NaN/Inf, a refused payload, an exchange refused while in
  flight) is agreed over the shard group as well, on the fast link (a signed header per exchanging step, an
  8-byte all-gather for a vote or a drift check), so every shard takes the same step.

The DTensors themselves are read and built only in :mod:`hf_demo.topology.dtensor`; the checkpoints of a sharded
state are :mod:`hf_demo.optim.sharded_checkpoint`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_demo.errors import DeMoPayloadError
from hf_demo.exchange import collectives
from hf_demo.exchange.collectives import SHARDS, CollectiveSpec
from hf_demo.exchange.transport import Transport
from hf_demo.optim import update_rules
from hf_demo.optim.records import Chosen
from hf_demo.refusals import refuse
from hf_demo.topology import owners
from hf_demo.topology.dtensor import is_shard, is_sharded, local, mesh_of, placements_of, shard_rows
from hf_demo.topology.flat import chosen
from hf_demo.wire import codec
from hf_demo.wire.agreement import VOTE_BYTES, pack_words, unpack_words


@dataclass(frozen=True)
class ShardSpec:
    """The layout shared by every sharded parameter of one optimizer: its mesh and that mesh's ranks."""

    mesh: object  # the parameters' DeviceMesh (one dimension: the shard group)
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> ShardSpec | None:
        """None when no parameter is a DTensor; raises naming the fix for layouts DeMo cannot step."""
        sharded = [p for p in params if is_sharded(p)]
        if not sharded:
            return None
        if len(sharded) != len(params):
            refuse("sharded_and_plain", sharded=len(sharded), plain=len(params) - len(sharded))
        meshes = {id(mesh_of(p)): mesh_of(p) for p in sharded}
        if len(meshes) > 1:
            refuse("several_meshes")
        mesh = next(iter(meshes.values()))
        if mesh.ndim != 1:
            refuse("fsdp_own_hsdp", ndim=mesh.ndim, names=tuple(mesh.mesh_dim_names or ()))
        placements = {placements_of(p) for p in sharded}
        if any(not is_shard(pl) for pls in placements for pl in pls):
            refuse("not_shard_placement", placements=placements)
        return cls(mesh, tuple(int(r) for r in mesh.mesh.flatten().tolist()))


def exchange_group(group, mesh, spec: ShardSpec):
    """The group DeMo exchanges over, checked to hold one rank per shard: the optimizer's ``process_group``
    (``group``), else the replicate dimension of its ``device_mesh`` (``mesh``), else (pure FSDP over every rank)
    none: a world of one."""
    if group is None and mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(
                f"device_mesh must be the 2-D (replicate, shard) mesh the model was sharded on; got {mesh.ndim}-D"
            )
        group = mesh.get_group(0)
    if group is None:
        if len(spec.ranks) == dist.get_world_size():
            return None  # pure FSDP: every rank holds another shard, no replica to exchange with
        raise ValueError(
            f"DeMo's parameters are sharded over ranks {list(spec.ranks)}, not over every rank: the other ranks hold "
            "replicas of these shards, and DeMo needs to know which. Pass DeMo(..., device_mesh=mesh), the 2-D "
            "(replicate, shard) mesh the model was sharded on (hf_demo.fsdp.hsdp_mesh)"
        )
    peers = set(dist.get_process_group_ranks(group))
    overlap = sorted(peers & set(spec.ranks))
    if overlap != [dist.get_rank()]:
        raise ValueError(
            f"DeMo exchanges over ranks {sorted(peers)}, but ranks {overlap} of them hold different shards of the "
            f"same parameters (the shard group is {list(spec.ranks)}): pass the replicate group, "
            "device_mesh=mesh for a (replicate, shard) mesh"
        )
    return group


def refuse_unshardable(param_groups) -> None:
    """What cannot step a shard of a model on its own, in an optimizer's ``param_groups``: a rule that needs the
    whole matrix of a state or of each rank's gradient (``update_rules.WHOLE_STATE``; ``orthogonal`` gathers its
    averaged update)."""
    for group in param_groups:
        rules = {group["update_rule"], group["inner_rule"]} & set(update_rules.WHOLE_STATE)
        if rules and any(p.dim() >= 2 and p.requires_grad for p in group["params"]):
            refuse("unshardable_rule", rule=min(rules))


class ShardedTopology:
    """The topology for FSDP2 DTensor parameters (chosen by DeMo when its parameters are DTensors)."""

    name = "sharded"
    sharded = True  # every parameter is a DTensor: the step computes on its local shard
    # what it runs over the shard group (hf_demo.exchange.collectives): agree_step, agree_refusal, agree (named by
    # its callers: the drift check's and the local steps' verdicts), ShardedMatrices.gather, agree_figures
    COLLECTIVES = (
        CollectiveSpec("node_header", "all_gather", SHARDS, codec.HEADER_BYTES),
        CollectiveSpec("node_vote", "all_gather", SHARDS, VOTE_BYTES),
        CollectiveSpec("node_drift", "all_gather", SHARDS, VOTE_BYTES, collectives.CHECK),
        CollectiveSpec("node_flags", "all_gather", SHARDS, VOTE_BYTES, collectives.LOCAL_STEP),
        CollectiveSpec("node_matrices", "all_to_all", SHARDS, "matrices", collectives.WHOLE_MATRIX_STEP),
        CollectiveSpec("node_matrix_rows", "all_to_all", SHARDS, "matrices", collectives.WHOLE_MATRIX_STEP),
        CollectiveSpec("node_figures", "all_gather", SHARDS, "figures", collectives.BUDGET),
    )

    def __init__(self, transport: Transport, shards: Transport, spec: ShardSpec):
        self.transport, self.shards, self.spec = transport, shards, spec
        self._world_mesh = None

    def world_mesh(self):
        """A 1-D mesh over every rank (the default group, no new one): where each rank's own state is placed."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._world_mesh is None:
            self._world_mesh = DeviceMesh.from_group(dist.group.WORLD, self.spec.mesh.device_type)
        return self._world_mesh

    @classmethod
    def build(cls, param_groups, process_group, device_mesh, initialised: bool, timeout: float):
        """Over the optimizer's parameters' shard group and its replicate group (:func:`exchange_group`)."""
        params = [p for g in param_groups for p in g["params"] if p.requires_grad]
        spec = ShardSpec.of(params)
        if not initialised:
            raise ValueError("DeMo got FSDP2-sharded parameters but torch.distributed is not initialised")
        refuse_unshardable(param_groups)
        group = exchange_group(process_group, device_mesh, spec)
        replicas = Transport(group, timeout) if group is not None else Transport.alone()
        return cls(replicas, Transport(spec.mesh.get_group(), timeout), spec)

    def select(self, items: list) -> Chosen:
        """This rank steps its shard of every item (``plan.items``) with the shard group's mean gradient."""
        return chosen(items, [local(p.grad) for p, _, _ in items], [local(p) for p, _, _ in items])

    def identity(self) -> tuple[int, int, str]:
        """(rank, world size, scope): a sharded state is placed by its DTensors' meshes, not by a rank number."""
        return 0, dist.get_world_size(), f"mesh {self.transport.world}x{self.shards.world}"

    def mean_over_ranks(self, params, transport, name: str) -> dict:
        from hf_demo.topology.flat import dense_mean

        views = [local(p) for p in params]
        means = dense_mean(views, transport, name)
        return {p: means[v] for p, v in zip(params, views)}

    matrix_scheme = "owner"  # how whole matrices are made (ShardedMatrices; benchmarks/fsdp_memory.py compares both)

    def matrices(self, params: list, every: list, stepping) -> ShardedMatrices:
        """Whole matrices of the sharded parameters for the rules that need them (:class:`ShardedMatrices`: its
        collectives over the shard group at ``stepping``'s step, counted apart in that step's ``intra`` traffic)."""
        return ShardedMatrices(
            params, every, self.shards.at(stepping.step, stepping.traffic.within()), self.matrix_scheme
        )

    # ------------------------------------------------------------ what every shard of the model agrees on
    def agree_step(self, transport, settings_ck: int, bits: int, secret, device) -> tuple[int, Exception | None]:
        """Once per exchanging step, over the shard group (the fast link): the ranks holding the other shards of
        this replica are at the same step with the same settings and secret (the replicate group's headers
        compare one shard's ranks only), and ``bits`` (the flags that decide the whole model's step: skip,
        resync, refused in flight) OR-ed over them, with this rank's refusal of a shard's header (voted with the
        step: ``agree_refusal``). One signed 144-byte header per rank; raises
        :class:`~hf_demo.errors.DeMoSyncError` on every rank of the shard group alike, but for settings that differ:
        those are flagged (``codec.FLAG_SETTINGS_APART``) into this replica's headers, so that every rank of every
        replica names them after the replicate group's headers (:func:`hf_demo.wire.agreement.gather_headers`)."""
        from hf_demo.errors import DeMoSyncError

        if self.shards.world == 1:
            return bits, None
        shards = self.shards.at(transport.step, transport.traffic.within())
        header = codec.Header(transport.step, 0, settings_ck, bits, shards.world, 0)
        header = codec.sign(header, torch.empty(0, dtype=torch.uint8), secret)
        rows = shards.all_gather(header.to_bytes().to(device), "node_header").cpu()
        try:
            headers, refusal = codec.receive_headers(rows, header, secret, self.shards.rank, header.step)
            apart = refusal is None and codec.settings_only(headers)
            if not apart:
                codec.check_headers(headers, self.shards.rank)
        except DeMoSyncError as exc:
            members = [self.shards.global_rank(r) for r in range(self.shards.world)]
            raise DeMoSyncError(f"{exc}\n(ranks are the shard group {members}: the shards of one replica)") from None
        out = codec.FLAG_SETTINGS_APART if apart else 0  # named on every rank of every replica, with the headers
        for h in headers:
            out |= h.flags
        return out, refusal

    def node_settings(self, transport, mine: dict[str, str]) -> list:
        """Every rank of this replica's shard group's settings, each labelled with its global rank (an elastic run:
        its replica group and shard rank), for a settings error to name on every rank of every replica."""
        from hf_demo.wire.agreement import gather_objects, rank_label

        group = getattr(getattr(transport, "transport", transport), "replica_name", None)
        me = f"rank {dist.get_rank()}" if group is None else f"{rank_label(transport)} shard rank {self.shards.rank}"
        if self.shards.world == 1:
            return [[me, mine]]
        return gather_objects(self.shards.at(transport.step), [me, mine], "node_settings")

    def agree(self, transport, device, bits: int, name: str) -> int:
        """``bits`` OR-ed over the shards of this replica: what decides the whole model's step (skip, resync, an
        exchange refused in flight) is then the same for every shard."""
        out = 0
        for theirs in self._gather(transport, device, bits, name):
            out |= theirs
        return out

    def agree_figures(self, transport, device, exchange_ms: float, elapsed_ms: float, tier_bytes: list[float]):
        """The budget policy's figures for the whole model, the same on every rank: the slowest exchange and step
        of any shard's replicate group, and each tier's bytes summed over the shards (one small all-gather over the
        shard group). Every rank then takes the same decision: one tier for the whole model."""
        if self.shards.world == 1:
            return exchange_ms, elapsed_ms, tier_bytes
        mine = torch.tensor([exchange_ms, elapsed_ms, *tier_bytes], dtype=torch.float64)
        rows = self.shards.at(transport.step, transport.traffic.within()).all_gather(
            mine.view(torch.uint8).to(device), "node_figures"
        )
        every = rows.cpu().contiguous().view(torch.float64)  # (shards, 2 + tiers)
        return float(every[:, 0].max()), float(every[:, 1].max()), every[:, 2:].sum(dim=0).tolist()

    def agree_refusal(self, transport, device, refusal: DeMoPayloadError | None) -> DeMoPayloadError | None:
        """A payload refused for any shard of the model: every rank gets an error to raise, none commits."""
        verdicts = self._gather(transport, device, int(refusal is not None), "node_vote")
        if refusal is not None:
            return refusal
        refusing = [self.shards.global_rank(r) for r, v in enumerate(verdicts) if v]
        if refusing:
            return DeMoPayloadError(
                f"rank {dist.get_rank()}: optimizer step {transport.step} was refused for another shard of the "
                f"model (rank(s) {refusing} found what they received corrupted): nothing was applied on any rank, "
                "the replicas are still identical and the step can be run again"
            )
        return None

    def _gather(self, transport, device, value: int, name: str) -> list[int]:
        if self.shards.world == 1:
            return [value]
        rows = self.shards.at(transport.step, transport.traffic.within()).all_gather(
            pack_words([value]).to(device), name
        )
        return [word for (word,) in unpack_words(rows, 1)]


SCHEMES = ("owner", "everywhere")


class ShardedMatrices:
    """Whole matrices for the rules that need them (Newton-Schulz orthogonalises the whole matrix). ``params``:
    the parameters this rank steps (a parameter whose shard is empty here is not among them); ``every``: every
    parameter, in the optimizer's order on every rank, whose rule needs its whole matrix; of these, the sharded
    ones of 2 or more dimensions are made whole over the shard group (the fast link inside a node; nothing crosses
    ``replicate``), by one of two schemes (``scheme``), bitwise the same directions on every rank:

    - ``"owner"`` (the default): each matrix has one owner rank of the shard group (:func:`~hf_demo.topology.owners.
      owners`: the Newton-Schulz work balanced over the group, the same assignment on every replica); one uneven
      all-to-all brings each rank's rows of a matrix to its owner (``node_matrices``), the owner runs the rule on
      the whole matrix, a second all-to-all sends each rank its rows of the result (``node_matrix_rows``). Each
      rank orthogonalises about ``1/shards`` of the model's matrices;
    - ``"everywhere"``: one all-gather of every rank's rows, padded to the largest shard's (``node_matrices``), and
      every rank runs the rule on every whole matrix it holds rows of, then keeps its rows: ``shards`` times the
      Newton-Schulz work, in one collective.

    Vectors and unsharded parameters are elementwise for every rule: they stay as they are. The rules that reach
    here keep no state of a whole matrix (``update_rules.WHOLE_STATE`` is refused on shards)."""

    def __init__(self, params: list, every: list, shards, scheme: str = "owner"):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown whole-matrix scheme {scheme!r}: choose from {', '.join(SCHEMES)}")
        self.params, self.shards, self.scheme = params, shards, scheme  # shards: the shard group's step transport
        self.every = [p for p in every if is_sharded(p) and p.dim() >= 2] if shards.world > 1 else []
        self._whole = {id(p) for p in self.every}
        self.rows = [shard_rows(p.shape[0], shards.world) for p in self.every]
        self.owners = owners.owners([tuple(p.shape) for p in self.every], shards.world)

    def directions(self, rule, members: list[int], params: list, tensors: list, states: list) -> tuple[list, list]:
        """``rule.directions(params, tensors, states)`` for the parameters at positions ``members`` of ``params``
        (``params``: what the rule is given, this rank's views of them), each sharded matrix of ``every`` on its
        whole matrix: (this rank's rows of each direction, each one's new rule state)."""
        whole = [j for j, i in enumerate(members) if rule.whole_matrix and id(self.params[i]) in self._whole]
        if not whole:
            return rule.directions(params, tensors, states)
        rest = [j for j in range(len(members)) if j not in set(whole)]
        out, new = [None] * len(members), [None] * len(members)
        found, fresh = rule.directions([params[j] for j in rest], [tensors[j] for j in rest], [states[j] for j in rest])
        for j, direction, state in zip(rest, found, fresh):
            out[j], new[j] = direction, state
        mine = [self._rows_of(p, {id(self.params[members[j]]): tensors[j] for j in whole}) for p in self.every]
        rows = self._by_owner(rule, mine) if self.scheme == "owner" else self._everywhere(rule, mine)
        by_id = {id(p): r.reshape(-1, *p.shape[1:]) for p, r in zip(self.every, rows)}
        for j in whole:
            out[j], new[j] = by_id[id(self.params[members[j]])], {}
        return out, new

    def _rows_of(self, p, mine: dict) -> torch.Tensor:
        """This rank's rows of ``p`` as a flat fp32 matrix (rows x the other dimensions); none where its shard is
        empty. Raises where a rank holds other rows than FSDP2's ``Shard(0)`` gives it."""
        t, expected = mine.get(id(p)), shard_rows(p.shape[0], self.shards.world)[self.shards.rank]
        held = 0 if t is None else t.shape[0]
        if held != expected:
            raise ValueError(
                f"DeMo: a parameter of shape {tuple(p.shape)} holds {held} rows on this rank where FSDP2's Shard(0) "
                f"would hold {expected}: shard the model with fully_shard (hf_demo.fsdp.shard_model)"
            )
        cols = math.prod(p.shape[1:])
        if t is None:
            return torch.zeros(0, cols, dtype=torch.float32, device=local(p).device)
        return t.detach().float().reshape(held, cols)

    def _whole_directions(self, rule, ps: list, wholes: list) -> list:
        """The rule's direction of each whole matrix (fp32, flattened to rows x the others)."""
        found, fresh = rule.directions(ps, [w.reshape(p.shape) for p, w in zip(ps, wholes)], [{} for _ in ps])
        if any(fresh):
            raise ValueError(
                f"DeMo: update rule {rule.name!r} keeps state of a whole matrix, which no rank of a shard group "
                "holds: it cannot step FSDP2-sharded parameters (list it in update_rules.WHOLE_STATE)"
            )
        return [d.float().reshape(d.shape[0], -1) for d in found]

    def _by_owner(self, rule, mine: list) -> list:
        """The owner scheme: each rank's rows to the matrix's owner, the rule on the owner, each rank's rows back."""
        world, me = self.shards.world, self.shards.rank
        owned = [k for k, o in enumerate(self.owners) if o == me]
        cols = [m.shape[1] for m in mine]
        send = [sum(mine[k].numel() for k in range(len(mine)) if self.owners[k] == o) * 4 for o in range(world)]
        receive = [sum(self.rows[k][s] * cols[k] for k in owned) * 4 for s in range(world)]
        parts = [mine[k].reshape(-1) for o in range(world) for k in range(len(mine)) if self.owners[k] == o]
        got = self.shards.all_to_all(_bytes(parts, mine), send, receive, "node_matrices").view(torch.float32)
        pieces = _split(got, [self.rows[k][s] * cols[k] for s in range(world) for k in owned])
        wholes = [
            torch.cat([pieces[s * len(owned) + n].reshape(-1, cols[k]) for s in range(world)])
            for n, k in enumerate(owned)
        ]
        results = self._whole_directions(rule, [self.every[k] for k in owned], wholes)
        starts = [[sum(self.rows[k][:s]) for s in range(world + 1)] for k in owned]
        back = [r[st[s] : st[s + 1]].reshape(-1) for s in range(world) for r, st in zip(results, starts)]
        got = self.shards.all_to_all(_bytes(back, mine), receive, send, "node_matrix_rows").view(torch.float32)
        order = [k for o in range(world) for k in range(len(mine)) if self.owners[k] == o]
        rows = _split(got, [mine[k].numel() for k in order])
        out = [None] * len(mine)
        for k, r in zip(order, rows):
            out[k] = r
        return out

    def _everywhere(self, rule, mine: list) -> list:
        """The everywhere scheme: every rank's rows, padded to the largest shard's, all-gathered; the rule on every
        whole matrix this rank holds rows of; this rank's rows kept."""
        world, me = self.shards.world, self.shards.rank
        padded = []
        for m, rows in zip(mine, self.rows):
            flat = torch.zeros(rows[0], m.shape[1], dtype=torch.float32, device=m.device)
            flat[: m.shape[0]] = m
            padded.append(flat.reshape(-1))
        every = self.shards.all_gather(_bytes(padded, mine), "node_matrices").view(torch.float32)
        held = [k for k, m in enumerate(mine) if m.shape[0]]
        wholes, start = {}, 0
        for k, flat in enumerate(padded):
            piece = every[:, start : start + flat.numel()].reshape(world, self.rows[k][0], -1)
            wholes[k] = torch.cat([piece[r, : self.rows[k][r]] for r in range(world)])
            start += flat.numel()
        results = self._whole_directions(rule, [self.every[k] for k in held], [wholes[k] for k in held])
        out = list(mine)
        for k, r in zip(held, results):
            begin = sum(self.rows[k][:me])
            out[k] = r[begin : begin + self.rows[k][me]]
        return out


def _bytes(parts: list, like: list) -> torch.Tensor:
    """``parts`` (fp32) end to end as one uint8 buffer (empty, on ``like``'s device, when there are none)."""
    if parts:
        return torch.cat(parts).view(torch.uint8)
    device = like[0].device if like else torch.device("cpu")
    return torch.zeros(0, dtype=torch.uint8, device=device)


def _split(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(flat.split(sizes)) if sizes else []
