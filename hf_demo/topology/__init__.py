"""Which parameters and gradients each rank handles, and who exchanges with whom.

A topology is what the ``topology`` phase asks (:mod:`hf_demo.optim.phases`): it has ``select(items)`` (a
:class:`~hf_demo.optim.records.Chosen`: this rank's items and gradients), the ``transport`` DeMo exchanges over,
``identity()`` (the rank a saved state belongs to) and ``mean_over_ranks(params, transport, name)`` (the ranks'
mean, which ends a local phase). :data:`TOPOLOGIES` lists them by name; :func:`choose` picks one for an optimizer:
``sharded`` when its parameters are FSDP2 DTensors (:mod:`hf_demo.topology.sharded`), ``flat`` otherwise.
"""

from hf_demo.topology.dtensor import is_sharded
from hf_demo.topology.flat import FlatTopology
from hf_demo.topology.sharded import ShardedTopology

TOPOLOGIES = {cls.name: cls for cls in (FlatTopology, ShardedTopology)}


def choose(param_groups):
    """The topology class for an optimizer's parameters (its ``param_groups``)."""
    params = (p for g in param_groups for p in g["params"] if p.requires_grad)
    return ShardedTopology if any(is_sharded(p) for p in params) else FlatTopology
