"""How a part of DeMo's step describes the collectives it runs, for the traffic model and the monitor to read.

Each part that calls the :class:`~hf_demo.exchange.transport.Transport` lists its collectives next to its code:
the exchanges (``collectives`` of :mod:`hf_demo.exchange.transport`), the agreement of a step
(:data:`hf_demo.wire.agreement.COLLECTIVES`) and the sharded topology's agreement over the shard group
(``ShardedTopology.COLLECTIVES``). :mod:`hf_demo.ops.traffic` turns the descriptions into byte counts for
``hf-demo plan``; :mod:`hf_demo.ops.monitor` tells the bytes of the shard group (inside a node) from the rest by
their group. A part that adds, renames or merges a collective changes its description, and both follow.

Imports nothing of hf-demo, so every part may use it.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLICAS = "replicas"  # the exchange group: the replicas of the model (across nodes, or the replicate dimension)
SHARDS = "shards"  # the shard group of a sharded model: the ranks holding the other shards of a replica (a node)

# when a collective runs (what ops.traffic turns into "once per this many steps", or leaves out)
EXCHANGE = "exchange"  # at each exchanging step (every step; every sync_every steps with local steps)
COMMIT_VOTE = "commit_vote"  # after an exchange, unless commit_vote="off" or overlap=True (the next header votes)
FULL_SYNC = "full_sync"  # every full_sync_every steps
CHECK = "check"  # every check_every steps
LOCAL_STEP = "local_step"  # at each local step between synchronisations (sync_every > 1)
WHOLE_MATRIX_STEP = "whole_matrix_step"  # at each step whose rule needs whole matrices (orthogonal on shards)
BUDGET = "budget"  # at each exchanging step under comm_budget
WHEN = (EXCHANGE, COMMIT_VOTE, FULL_SYNC, CHECK, LOCAL_STEP, WHOLE_MATRIX_STEP, BUDGET)


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective of a step, as the part that runs it describes it.

    ``name``: what the transport records it under; ``kind``: ``all_gather``, ``all_reduce``, ``broadcast`` or
    ``reduce_scatter``; ``group``: :data:`REPLICAS` or :data:`SHARDS`; ``nbytes``: what each rank hands to one
    call, in bytes (an int), or the name of the size the traffic model computes for it (``"payload"``,
    ``"positions"``, ``"values"``: the exchange's buffers; ``"parameters"``: the trainable parameters, dense;
    ``"matrices"``: this rank's rows of each sharded matrix; ``"figures"``: the budget policy's figures);
    ``when``: one of :data:`WHEN`; ``overlaps``: with ``overlap=True`` it runs under the next step's
    computation."""

    name: str
    kind: str
    group: str
    nbytes: int | str
    when: str = EXCHANGE
    overlaps: bool = False

    def __post_init__(self):
        if self.group not in (REPLICAS, SHARDS) or self.when not in WHEN:
            raise ValueError(f"collective {self.name!r}: group {self.group!r} or when {self.when!r} is not known")
