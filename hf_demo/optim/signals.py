"""What enters DeMo's momentum, and how the averaged result becomes the new parameters: the ``signal`` part.

- :class:`GradientSignal` (every-step DeMo): the gradient goes in, scaled by the learning rate, into a momentum
  that decays by ``compression_decay``; the update rule turns the averaged update into a step.
- :class:`LocalSignal` (``sync_every = H > 1``, :mod:`hf_demo.optim.local_steps`): every rank takes local steps
  on its own; every H-th step the change since the last synchronisation goes in, into an error feedback that
  decays with what top-k sends, and the mean change moves every rank's anchor (and parameters) alike.

Chosen per step by the tier's ``sync_every`` (the budget policy's tiers switch between both).
"""

from __future__ import annotations

from hf_demo.compression import functional as F
from hf_demo.guards.checks import any_nonfinite
from hf_demo.optim import local_steps
from hf_demo.topology.dtensor import local


class GradientSignal:
    name = "gradient"

    def select(self, ctx) -> None:
        ctx.local = False
        for p in ctx.params:  # a tier without local steps: a later local phase starts afresh
            if any(k in ctx.opt.state[p] for k in local_steps.LOCAL_KEYS):
                ctx.tx.stage(lambda state=ctx.opt.state[p]: local_steps.forget(state))
        ctx.signals, ctx.replicas = list(ctx.grads), [local(p) for p in ctx.params]

    @staticmethod
    def decay_and_scale(ctx, group, layout) -> tuple[float, float]:
        return group["compression_decay"], group["lr"]

    @staticmethod
    def entering(ctx, param, group, signal):
        """What of the gradient enters the momentum: the group's update rule says (``signal``); the rule's state of
        this rank's gradients (``update_rules.SIGNAL_KEYS``) is staged to commit with the step."""
        state = ctx.opt.state[param]
        entered, changed = ctx.opt.rule(group).signal(signal, state)
        if changed:
            ctx.tx.update(state, changed)
        return entered

    def update(self, ctx) -> None:
        """The rule's direction for every item, computed now on copies of its state (so the commit cannot fail
        in a rule), once per bucket and rule; the step is staged in place."""
        opt = ctx.opt
        params = ctx.params
        for p, m in zip(params, ctx.working):
            ctx.tx.set(opt.state[p], "momentum", m)
        groups = [g for _, g, _ in ctx.items]
        matrices = opt.topology.matrices(params, whole_matrix_params(opt, opt.rule), ctx.transport)
        directions, rule_states = rule_directions(opt, params, groups, ctx.updates, ctx.layouts, matrices)
        for p, rule_state in zip(params, rule_states):
            ctx.tx.update(opt.state[p], rule_state)
        lrs, wds = [g["lr"] for g in groups], [g["weight_decay"] for g in groups]
        views = [local(p) for p in params]
        ctx.tx.stage(lambda: F.apply_steps(views, directions, lrs, wds, ctx.generator))


def whole_matrix_params(opt, rule_of) -> list:
    """Every trainable parameter, in the optimizer's order (the same on every rank), whose rule (``rule_of`` its
    group: ``opt.rule`` or ``opt.inner_rule``) needs the whole matrix."""
    return [p for g in opt.param_groups if rule_of(g).whole_matrix for p in g["params"] if p.requires_grad]


def rule_directions(opt, params, groups, updates, layouts, matrices):
    """(each parameter's direction for its decoded update, its rule's new state), nothing written: the inverse
    transform once per bucket, each rule once for all the parameters it steps (on whole matrices where the rule
    needs them: ``matrices``, the topology's view of ``params``)."""
    decoded = F.decode_many(updates, layouts, opt.transform)
    by_rule: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_rule.setdefault(g["update_rule"], []).append(i)
    directions: list = [None] * len(params)
    states: list = [None] * len(params)
    for members in by_rule.values():
        rule = opt.rule(groups[members[0]])
        ps = [params[i] for i in members]
        views, states_of = [local(p) for p in ps], [opt.state[p] for p in ps]
        found, new = matrices.directions(rule, members, views, [decoded[i] for i in members], states_of)
        for i, direction, state in zip(members, found, new):
            directions[i], states[i] = direction, state
    return directions, states


class LocalSignal:
    name = "local"

    def select(self, ctx) -> None:
        """The inner step of every item on copies; at a synchronisation the pseudo-gradient goes on."""
        opt, tier = ctx.opt, ctx.tier
        ctx.local = True
        ctx.anchors = []
        for p in ctx.params:
            anchor = opt.state[p].get("anchor")
            if anchor is None:  # the parameters at the last synchronisation: here, the first local step
                anchor = local(p).detach().clone()
                ctx.tx.set(opt.state[p], "anchor", anchor)
            ctx.anchors.append(anchor)
        groups = [g for _, g, _ in ctx.items]
        ctx.inner = local_steps.inner_steps(
            [local(p) for p in ctx.params],
            ctx.grads,
            [opt.state[p] for p in ctx.params],
            [opt.inner_rule(g) for g in groups],
            [g["lr"] for g in groups],
            [g["weight_decay"] for g in groups],
            ctx.generator,
            opt.topology.matrices(ctx.params, whole_matrix_params(opt, opt.inner_rule), ctx.transport),
        )
        ctx.replicas = ctx.anchors
        if local_steps.is_sync_step(tier.sync_every, ctx.transport.step):
            ctx.signals = [local_steps.pseudo_gradient(a, after) for a, (after, _, _) in zip(ctx.anchors, ctx.inner)]
            return
        ctx.communicates = False  # a local step: every rank on its own until the next synchronisation
        afters = [after for after, _, _ in ctx.inner]
        skip = any_nonfinite(afters)
        ctx.skip = bool(opt.topology.agree(ctx, int(skip), "node_flags"))  # every shard of the model alike
        if ctx.skip:
            return
        for (p, _, _), (after, m_in, rule_state) in zip(ctx.items, ctx.inner):
            ctx.tx.stage(
                lambda p=p, a=after, m=m_in, r=rule_state: local_steps.commit_inner(local(p), opt.state[p], a, m, r)
            )

    @staticmethod
    def decay_and_scale(ctx, group, layout) -> tuple[float, float]:
        # the pseudo-gradient, into an error feedback that fades as fast as top-k drains it
        return local_steps.feedback_decay(ctx.settings.sync_decay, layout), 1.0

    @staticmethod
    def entering(ctx, param, group, signal):
        """The pseudo-gradient enters as it is (the local steps ran the inner rule already)."""
        return signal

    def update(self, ctx) -> None:
        """Every rank sets ``param = anchor - mean change`` and the anchor moves there."""
        opt = ctx.opt
        changes = F.decode_many(ctx.updates, ctx.layouts, opt.transform)
        for (p, _, _), m, change, inner in zip(ctx.items, ctx.working, changes, ctx.inner):
            ctx.tx.set(opt.state[p], "momentum", m)
            ctx.tx.stage(lambda p=p, c=change, i=inner: local_steps.commit_sync(local(p), opt.state[p], c, *i[1:]))


SIGNALS = {cls.name: cls for cls in (GradientSignal, LocalSignal)}


def for_tier(tier):
    return SIGNALS["local" if tier.sync_every > 1 else "gradient"]()
