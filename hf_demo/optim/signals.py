"""What enters DeMo's momentum in a tier of local steps, and how the averaged result becomes the new parameters.

- every-step DeMo (a tier's ``sync_every`` 1): the gradient goes in, scaled by the learning rate, into a momentum
  that decays by ``compression_decay``; the update rule turns the averaged update into a step. The phases do it
  themselves (:func:`hf_demo.optim.phases.signal`, ``momentum``, ``update``).
- :class:`LocalSignal` (``sync_every = H > 1``, :mod:`hf_demo.optim.local_steps`): every rank takes local steps
  on its own; every H-th step the change since the last synchronisation goes in, into an error feedback that
  decays with what top-k sends, and the mean change times the outer learning rate moves every rank's anchor (and
  parameters) alike.

Chosen per step by the tier's ``sync_every`` (the budget policy's tiers switch between both).
"""

from __future__ import annotations

from hf_demo import compression as F
from hf_demo.guards import any_nonfinite
from hf_demo.optim import local_steps
from hf_demo.optim.records import Chosen, Signalled, Step, StepPlan
from hf_demo.topology.dtensor import local


class LocalSignal:
    name = "local"

    def select(self, step: Step, plan: StepPlan, chosen: Chosen) -> Signalled:
        """The inner step of every item on copies; at a synchronisation the pseudo-gradient goes on."""
        view, params = step.view, chosen.params
        anchors = []
        for p in params:
            anchor = view.state[p].get("anchor")
            if anchor is None:  # the parameters at the last synchronisation: here, the first local step
                anchor = local(p).detach().clone()
                step.tx.set(view.state[p], "anchor", anchor)
            anchors.append(anchor)
        groups = chosen.groups
        inner = local_steps.inner_steps(
            [local(p) for p in params],
            chosen.grads,
            [view.state[p] for p in params],
            [view.inner_rule(g) for g in groups],
            [g["lr"] for g in groups],
            [g["weight_decay"] for g in groups],
            plan.generator,
            view.topology.matrices(params, view.whole_matrix_params(view.inner_rule), step.transport),
        )
        if local_steps.is_sync_step(plan.tier.sync_every, step.transport.step):
            pseudo = [local_steps.pseudo_gradient(a, after) for a, (after, _, _) in zip(anchors, inner)]
            return Signalled(True, pseudo, anchors, anchors=anchors, inner=inner)
        # a local step: every rank on its own until the next synchronisation
        skip = any_nonfinite([after for after, _, _ in inner])
        skip = bool(view.topology.agree(step.transport, chosen.device, int(skip), "node_flags"))  # every shard alike
        if not skip:
            for p, (after, m_in, rule_state) in zip(params, inner):
                state = view.state[p]
                step.tx.stage(
                    lambda p=p, s=state, a=after, m=m_in, r=rule_state: local_steps.commit_inner(local(p), s, a, m, r)
                )
        return Signalled(True, [], anchors, communicates=False, anchors=anchors, inner=inner, skip=skip)

    @staticmethod
    def decay_and_scale(settings, group, layout) -> tuple[float, float]:
        # the pseudo-gradient, into an error feedback that fades as fast as top-k drains it
        return local_steps.feedback_decay(settings.sync_decay, layout), 1.0

    @staticmethod
    def entering(step: Step, param, group, signal):
        """The pseudo-gradient enters as it is (the local steps ran the inner rule already)."""
        return signal

    def update(self, step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, working, updates) -> None:
        """Every rank sets ``param = anchor - outer_lr * mean change`` and the anchor moves there (the factor from
        the settings and the number of ranks averaged over, :func:`local_steps.outer_factor`)."""
        view, s = step.view, step.settings
        factor = local_steps.outer_factor(s.outer_lr, s.outer_lr_scaling, step.transport.world)
        changes = F.decode_many(updates, chosen.layouts, view.transform, view.workspace)
        for p, m, change, inner in zip(chosen.params, working, changes, signal.inner):
            step.tx.set(view.state[p], "momentum", m)
            step.tx.stage(
                lambda p=p, c=change, i=inner: local_steps.commit_sync(local(p), view.state[p], c, factor, *i[1:])
            )


SIGNALS = {cls.name: cls for cls in (LocalSignal,)}
