"""What enters DeMo's momentum, and how the averaged result becomes the new parameters: the ``signal`` phase.

- :class:`GradientSignal` (every-step DeMo): the gradient goes in, scaled by the learning rate, into a momentum
  that decays by ``compression_decay``; the update rule turns the averaged update into a step.
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
from hf_demo.optim.transaction import keep_mapping
from hf_demo.topology.dtensor import local


class GradientSignal:
    name = "gradient"

    def select(self, step: Step, plan: StepPlan, chosen: Chosen) -> Signalled:
        state = step.view.state
        for p in chosen.params:  # a tier without local steps: a later local phase starts afresh
            if any(k in state[p] for k in local_steps.LOCAL_KEYS):
                step.tx.stage(lambda state=state[p]: local_steps.forget(state), before=keep_mapping(state[p]))
        return Signalled(local=False, signals=list(chosen.grads), replicas=[local(p) for p in chosen.params])

    @staticmethod
    def decay_and_scale(settings, group, layout) -> tuple[float, float]:
        return group["compression_decay"], group["lr"]

    @staticmethod
    def entering(step: Step, param, group, signal):
        """What of the gradient enters the momentum: the group's update rule says (``signal``); the rule's state of
        this rank's gradients (``update_rules.SIGNAL_KEYS``) is staged to commit with the step."""
        state = step.view.state[param]
        entered, changed = step.view.rule(group).signal(signal, state)
        if changed:
            step.tx.update(state, changed)
        return entered

    def update(self, step: Step, plan: StepPlan, chosen: Chosen, signal: Signalled, working, updates) -> None:
        """The rule's direction for every item, computed now on copies of its state (so the commit cannot fail
        in a rule), once per bucket and rule; the step is staged in place."""
        view, tx, params = step.view, step.tx, chosen.params
        for p, m in zip(params, working):
            tx.set(view.state[p], "momentum", m)
        groups = chosen.groups
        matrices = view.topology.matrices(params, view.whole_matrix_params(view.rule), step.transport)
        directions, rule_states = rule_directions(view, params, groups, updates, chosen.layouts, matrices)
        for p, rule_state in zip(params, rule_states):
            tx.update(view.state[p], rule_state)
        lrs, wds = [g["lr"] for g in groups], [g["weight_decay"] for g in groups]
        views = [local(p) for p in params]
        generator = plan.generator
        tx.stage(lambda: F.apply_steps(views, directions, lrs, wds, generator), touches=views)


def rule_directions(view, params, groups, updates, layouts, matrices):
    """(each parameter's direction for its decoded update, its rule's new state), nothing written: the inverse
    transform once per bucket, each rule once for all the parameters it steps (on whole matrices where the rule
    needs them: ``matrices``, the topology's view of ``params``). ``view``: the optimizer's
    (:class:`~hf_demo.optim.view.OptimizerView`: its transform, rules and state)."""
    decoded = F.decode_many(updates, layouts, view.transform)
    by_rule: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_rule.setdefault(g["update_rule"], []).append(i)
    directions: list = [None] * len(params)
    states: list = [None] * len(params)
    for members in by_rule.values():
        rule = view.rule(groups[members[0]])
        ps = [params[i] for i in members]
        views, states_of = [local(p) for p in ps], [view.state[p] for p in ps]
        found, new = matrices.directions(rule, members, views, [decoded[i] for i in members], states_of)
        for i, direction, state in zip(members, found, new):
            directions[i], states[i] = direction, state
    return directions, states


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
        changes = F.decode_many(updates, chosen.layouts, view.transform)
        for p, m, change, inner in zip(chosen.params, working, changes, signal.inner):
            step.tx.set(view.state[p], "momentum", m)
            step.tx.stage(
                lambda p=p, c=change, i=inner: local_steps.commit_sync(local(p), view.state[p], c, factor, *i[1:])
            )


SIGNALS = {cls.name: cls for cls in (GradientSignal, LocalSignal)}


def for_tier(tier):
    return SIGNALS["local" if tier.sync_every > 1 else "gradient"]()
