"""Which parameters and gradients each rank handles, and who exchanges with whom: the ``hierarchy`` setting.

A topology is a pipeline part (:mod:`hf_demo.optim.pipeline`) with ``select(ctx)`` (this rank's items and
gradients), ``share(ctx)`` (new values to the ranks that did not compute them), ``needs_values``, the
``transport`` DeMo exchanges over, and ``identity()`` (the rank a saved state belongs to). :data:`TOPOLOGIES`
lists them by the setting's values.
"""

from hf_demo.topology.flat import FlatTopology
from hf_demo.topology.node import NodeTopology

TOPOLOGIES = {cls.name: cls for cls in (FlatTopology, NodeTopology)}
