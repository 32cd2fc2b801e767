"""How the averaged, decoded update becomes a parameter step (after decoupled weight decay).

Every rank holds the same averaged update, so every rule runs identically on every rank: the replicas stay
bitwise identical and no rule costs communication. The rule is a per-group setting (``update_rule`` of a
parameter group; :mod:`hf_demo.optim.param_groups` makes Muon-style groups). A rule is a small object (a
:class:`Rule`): ``signal(grad, state)`` returns what of this rank's gradient enters DeMo's momentum (the gradient
as it is, but for ``orthogonal_signal`` and ``muon_signal``) and the rank's own state entries it changes
(:data:`SIGNAL_KEYS`, committed with the step); ``direction(param, update, state)`` returns the step direction
(``param <- param - lr * direction``, applied by :func:`hf_demo.compression.apply_step`); its
per-parameter state (if any) lives in the optimizer's ``state[param]`` and is saved and resumed with it. Add a
rule by writing one class here, with its :class:`RuleFacts`, and listing it in :data:`RULES`: what the rest of
hf_demo knows of a rule (its state keys, which rules are Muon-style, which may be inner rules, which cannot step
shards, the planner's memory and Newton-Schulz runs, the state a sharded checkpoint places like the parameter) is
derived from the facts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_demo.errors import lookup


def sign_step(update: torch.Tensor) -> torch.Tensor:
    """The paper's rule: ``sign(update)`` (in place)."""
    return update.sign_()


# The largest second moment kept: fp32's maximum. An update element above about 1.8e19 squares past fp32's range;
# its second moment saturates here instead of holding Inf for good (which would freeze that element, every later
# direction u / Inf being 0) and carrying Inf into checkpoints. Finite moments are untouched (the same bits), the
# direction stays finite (the update is bounded: codec.UPDATE_BOUND), and the moment decays from there as Adam's.
MOMENT_BOUND = torch.finfo(torch.float32).max


def second_moment_denominator(
    update: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta2: float, eps: float
) -> torch.Tensor:
    """``sqrt(v / (1 - beta2**t)) + eps`` after ``v <- min(beta2*v + (1-beta2)*u^2, MOMENT_BOUND)`` (``exp_avg_sq``
    in place)."""
    exp_avg_sq.mul_(beta2).addcmul_(update, update, value=1.0 - beta2).clamp_(max=MOMENT_BOUND)
    return (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(eps)


def adam_step(update: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta2: float, eps: float) -> torch.Tensor:
    """Second-moment normalisation of the averaged update: ``u / (sqrt(v / (1 - beta2**t)) + eps)``.

    ``exp_avg_sq`` (fp32, the parameter's shape) is updated in place; ``step`` counts from 1.
    """
    return update.div_(second_moment_denominator(update, exp_avg_sq, step, beta2, eps))


def adamw_step(
    update: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
) -> torch.Tensor:
    """Adam's two moments of the averaged update: ``m_hat / (sqrt(v_hat) + eps)``.

    ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape) are updated in place; ``step`` counts from 1.
    """
    exp_avg.mul_(beta1).add_(update, alpha=1.0 - beta1)
    denom = second_moment_denominator(update, exp_avg_sq, step, beta2, eps)
    return (exp_avg / (1.0 - beta1**step)).div_(denom)


def next_step(state: dict, param: torch.Tensor, *moments: str) -> int:
    """Create the rule's fp32 moment buffers the first time, count this step (a host counter: no device sync)."""
    for key in moments:
        if key not in state:
            state[key] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    if "rule_step" not in state:
        state["rule_step"] = torch.zeros((), dtype=torch.int64, device="cpu")
    state["rule_step"] += 1
    return int(state["rule_step"])


def next_steps(params: list, states: list[dict], *moments: str) -> tuple[list[int], list[dict]]:
    """:func:`next_step` for many parameters at once, on new state: (each one's step, each one's new state with
    its moments, fresh zeros the first time, and its counter; the moments are the current tensors: the rule's
    ``torch._foreach_*`` ops that are not in place make the new ones). The counters stay on the host."""
    new = []
    for p, state in zip(params, states):
        fresh = {
            k: state[k] if k in state else torch.zeros(p.shape, dtype=torch.float32, device=p.device) for k in moments
        }
        new.append(fresh)
    counters = [
        s["rule_step"] if "rule_step" in s else torch.zeros((), dtype=torch.int64, device="cpu") for s in states
    ]
    counters = torch._foreach_add(counters, 1)
    for fresh, counter in zip(new, counters):
        fresh["rule_step"] = counter
    return torch.stack(counters).tolist() if counters else [], new


def _by_step(steps: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        groups.setdefault(step, []).append(i)
    return groups


def adam_directions(updates: list, states: list[dict], steps: list[int], beta2: float, eps: float) -> list:
    """:func:`adam_step` of many parameters with ``torch._foreach_*`` (bitwise the same): ``updates`` become
    the directions (in place) and each state's ``exp_avg_sq`` its new one."""
    for step, members in _by_step(steps).items():
        u = [updates[i] for i in members]
        v = _second_moments(u, [states[i] for i in members], beta2)
        torch._foreach_div_(u, _denominators(v, step, beta2, eps))
    return updates


def adamw_directions(updates: list, states: list[dict], steps: list[int], beta1: float, beta2: float, eps: float):
    """:func:`adamw_step` of many parameters with ``torch._foreach_*`` (bitwise the same); each state's
    ``exp_avg`` and ``exp_avg_sq`` become the new ones."""
    directions: list = [None] * len(updates)
    for step, members in _by_step(steps).items():
        u = [updates[i] for i in members]
        m = torch._foreach_mul([states[i]["exp_avg"] for i in members], beta1)
        torch._foreach_add_(m, u, alpha=1.0 - beta1)
        v = _second_moments(u, [states[i] for i in members], beta2)
        d = torch._foreach_div(m, 1.0 - beta1**step)
        torch._foreach_div_(d, _denominators(v, step, beta2, eps))
        for i, exp_avg, direction in zip(members, m, d):
            states[i]["exp_avg"], directions[i] = exp_avg, direction
    return directions


def _second_moments(u: list, states: list[dict], beta2: float) -> list:
    v = torch._foreach_mul([s["exp_avg_sq"] for s in states], beta2)
    torch._foreach_addcmul_(v, u, u, value=1.0 - beta2)
    torch._foreach_clamp_max_(v, MOMENT_BOUND)  # an update above ~1.8e19 saturates its moment (MOMENT_BOUND)
    for state, value in zip(states, v):
        state["exp_avg_sq"] = value
    return v


def _denominators(v: list, step: int, beta2: float, eps: float) -> list:
    denom = torch._foreach_div(v, 1.0 - beta2**step)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    return denom


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic iteration (Keller Jordan), as torch.optim.Muon's
NS_EPS = 1e-7


def newton_schulz(
    matrix: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration: ``U S' V^T`` for ``matrix = U S V^T``, ``S'`` roughly in [0.7, 1.2].

    A new 2-D tensor in ``dtype`` (fp32 by default: torch's bf16 matmul is ~20x slower on a CPU). The matrix is
    scaled to Frobenius norm 1 first (its spectral norm is then at most 1); the iteration runs on the wide
    orientation (rows <= columns), so its Gram matrices are the small side squared. A zero matrix stays zero.
    """
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def matrix_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor of 2 or more dimensions as the matrix (first dimension) x (the others), as Muon flattens one."""
    return t.reshape(t.shape[0], -1)


def rms_matching_scale(rows: int, cols: int, rms: float) -> float:
    """The factor that gives an orthogonal ``rows x cols`` matrix (all singular values 1) an RMS of ``rms``:
    its RMS is ``1/sqrt(max(rows, cols))`` (Moonlight's ``0.2 sqrt(max(A, B))`` at ``rms=0.2``, AdamW's typical
    update RMS, so AdamW's learning rate and weight decay carry over)."""
    return rms * math.sqrt(max(rows, cols))


def orthogonal_step(update: torch.Tensor, rms: float, steps: int, measured: bool = False) -> torch.Tensor:
    """``update`` (2 or more dimensions) orthogonalised as a matrix and scaled to ``rms``; fp32, its shape.

    ``measured=False``: by :func:`rms_matching_scale` (the RMS of a full-rank orthogonal matrix); ``True``: by
    the result's own RMS (an update of low rank, which Newton-Schulz leaves of low rank, still gets ``rms``)."""
    matrix = matrix_view(update)
    ortho = newton_schulz(matrix, steps)
    if measured:
        return ortho.mul_(rms * math.sqrt(ortho.numel()) / ortho.norm().clamp(min=NS_EPS)).reshape(update.shape)
    return ortho.mul_(rms_matching_scale(*matrix.shape, rms)).reshape(update.shape)


@dataclass(frozen=True)
class StateEntry:
    """One entry a rule keeps in a parameter's state."""

    key: str
    bytes_per_param: int  # fp32 bytes per element of the parameter; 0: a scalar per parameter (a step counter)
    agreed: bool  # the same on every rank (computed from the averaged update); False: this rank's own
    whole_matrix: bool = False  # kept for matrices only, and read whole (a rank holding a shard cannot keep it)


@dataclass(frozen=True)
class RuleFacts:
    """What a rule declares about itself; every table about rules derives from these."""

    state: tuple[StateEntry, ...] = ()
    ns_update: int = 0  # Newton-Schulz runs per matrix and step on the averaged update (0: not Muon-style)
    ns_signal: int = 0  # Newton-Schulz runs per matrix and step on each rank's own gradient (Rule.signal)
    may_be_inner: bool = True  # whether it may be inner_rule (it needs only a local momentum)

    @property
    def ns_runs(self) -> int:
        return self.ns_update + self.ns_signal

    @property
    def needs_whole_own(self) -> bool:
        """Whether it needs the whole matrix of a rank's own gradient or of a matrix-shaped state at every step
        (so it cannot step FSDP2 shards; the averaged update of a Muon-style rule is gathered instead)."""
        return self.ns_signal > 0 or any(e.whole_matrix for e in self.state)

    def state_bytes(self, shapes) -> int:
        """Bytes of this rule's state for parameters of ``shapes``."""
        return sum(
            e.bytes_per_param * math.prod(s) for e in self.state for s in shapes if not e.whole_matrix or len(s) >= 2
        )


_STEP = StateEntry("rule_step", 0, agreed=True)


class Rule:
    """What every rule has: ``directions`` of many parameters at once, here one :meth:`direction` after another
    on copies of each one's state; the rules that can batch (``torch._foreach_*``) override it. The gradient
    enters DeMo's momentum as it is (:meth:`signal`), unless a rule says otherwise. ``whole_matrix``: the
    direction of a matrix depends on all of it, not element by element: where the model is sharded, the topology
    runs the rule on each whole matrix on one rank of the shard group and hands every rank its rows of the result
    (``matrices`` of a topology, :class:`~hf_demo.topology.sharded.ShardedMatrices`)."""

    whole_matrix = False
    facts = RuleFacts()

    def signal(self, grad: torch.Tensor | None, state: dict) -> tuple[torch.Tensor | None, dict]:
        """(what of ``grad`` enters DeMo's momentum, the new :data:`SIGNAL_KEYS` entries of ``state``); ``state``
        is left as it is."""
        return grad, {}

    def directions(self, params: list, updates: list, states: list[dict]) -> tuple[list, list[dict]]:
        """(each parameter's direction, its new rule state) for the decoded ``updates`` (fp32, the parameters'
        shapes: they may be overwritten); ``states`` are the parameters' current states, left as they are."""
        new = [{k: v.clone() for k, v in state.items() if k in STATE_KEYS} for state in states]
        return [self.direction(p, u, s) for p, u, s in zip(params, updates, new)], new


class SignRule(Rule):
    name = "sign"

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        return sign_step(update)

    def directions(self, params, updates, states):
        if updates:
            torch._foreach_sign_(updates)
        return updates, [{} for _ in updates]


class RawRule(Rule):
    name = "raw"

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        return update

    def directions(self, params, updates, states):
        return updates, [{} for _ in updates]


class AdamRule(Rule):
    """Adam-style normalisation of the averaged update (state ``exp_avg_sq``: 4 bytes per parameter)."""

    name = "adam"
    facts = RuleFacts(state=(StateEntry("exp_avg_sq", 4, agreed=True), _STEP))
    beta2 = 0.999
    eps = 1e-8

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        step = next_step(state, param, "exp_avg_sq")
        return adam_step(update.float(), state["exp_avg_sq"], step, self.beta2, self.eps)

    def directions(self, params, updates, states):
        steps, new = next_steps(params, states, "exp_avg_sq")
        return adam_directions([u.float() for u in updates], new, steps, self.beta2, self.eps), new


class AdamWRule(Rule):
    """AdamW's moments on the averaged update (DeToNATION's DeToAdamW idea): a first moment smooths the
    fast components DeMo sends, the second normalises them (state ``exp_avg`` + ``exp_avg_sq``: 8 bytes per
    parameter). The betas are AdamW's of the benchmarks' baseline."""

    name = "adamw"
    facts = RuleFacts(state=(StateEntry("exp_avg", 4, agreed=True), StateEntry("exp_avg_sq", 4, agreed=True), _STEP))
    beta1 = 0.9
    beta2 = 0.95
    eps = 1e-8

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        step = next_step(state, param, "exp_avg", "exp_avg_sq")
        return adamw_step(update.float(), state["exp_avg"], state["exp_avg_sq"], step, self.beta1, self.beta2, self.eps)

    def directions(self, params, updates, states):
        steps, new = next_steps(params, states, "exp_avg", "exp_avg_sq")
        u = [u.float() for u in updates]
        return adamw_directions(u, new, steps, self.beta1, self.beta2, self.eps), new


class OrthogonalRule(Rule):
    """Muon's step on DeMo's averaged update: each matrix (a tensor of 2 or more dimensions, seen as
    first dimension x the others) orthogonalised by :func:`newton_schulz` (5 steps, fp32) and scaled by
    Moonlight's :func:`rms_matching_scale` (AdamW's update RMS for a full-rank matrix). DeMo's averaged update
    is of low rank (top-k coefficients per block), so its step is smaller than that and the best learning rate
    is higher than AdamW's (16x on the benchmark's 0.46M Llama). ``measured_rms=True`` scales by the step's
    own RMS instead. Tensors of one dimension (biases, norms) take ``sign`` steps. Embeddings and the output
    head are matrices too: as Muon users do, give them another rule in their own parameter group
    (:func:`hf_demo.optim.param_groups.muon_style_groups`). No state."""

    name = "orthogonal"
    facts = RuleFacts(ns_update=1)
    rms = 0.2
    ns_steps = 5
    measured_rms = False
    whole_matrix = True  # its direction of a matrix needs the whole matrix (made whole where the model is sharded)

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        if update.dim() < 2:
            return sign_step(update)
        return orthogonal_step(update, self.rms, self.ns_steps, self.measured_rms)


def nesterov_momentum(update: torch.Tensor, exp_avg: torch.Tensor, beta: float) -> torch.Tensor:
    """Muon's Nesterov momentum (as ``torch.optim.Muon``'s): ``m <- beta*m + (1-beta)*u`` (``exp_avg`` in place),
    then ``(1-beta)*u + beta*m`` (a new fp32 tensor)."""
    exp_avg.lerp_(update, 1.0 - beta)
    return update.float().lerp(exp_avg, beta)


class OrthogonalMomentumRule(OrthogonalRule):
    """:class:`OrthogonalRule` on a Nesterov momentum of the averaged update (``beta`` 0.95, Muon's), not on the
    update itself. Each step's averaged update is a sparse sum of top-k DCT components and, through the error
    feedback, a delayed share of the gradients; its momentum gathers the components of the last ~1/(1-beta)
    steps, a matrix of much higher rank than one step's, which Newton-Schulz then orthogonalises as Muon does
    its momentum of dense gradients. Every rank holds the same update, so the state (``exp_avg``: 4 bytes per
    parameter) stays the same on every rank. Tensors of one dimension take ``sign`` steps (no state). On the
    benchmark's 0.46M Llama it trains worse than :class:`OrthogonalRule` at every lr tried: DeMo's error
    feedback already delays each component until it is sent, and this momentum delays it again."""

    name = "orthogonal_momentum"
    facts = RuleFacts(
        state=(StateEntry("exp_avg", 4, agreed=True, whole_matrix=True),), ns_update=1, may_be_inner=False
    )
    beta = 0.95

    def direction(self, param: torch.Tensor, update: torch.Tensor, state: dict) -> torch.Tensor:
        if update.dim() < 2:
            return sign_step(update)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        smoothed = nesterov_momentum(update, state["exp_avg"], self.beta)
        return orthogonal_step(smoothed, self.rms, self.ns_steps, self.measured_rms)


def orthogonalised_signal(grad: torch.Tensor | None, steps: int) -> torch.Tensor | None:
    """A gradient of 2 or more dimensions orthogonalised as a matrix (:func:`newton_schulz`, unscaled: singular
    values about 1), in its dtype and shape; a vector (or no gradient) as it is."""
    if grad is None or grad.dim() < 2:
        return grad
    return newton_schulz(matrix_view(grad), steps).to(grad.dtype).reshape(grad.shape)


class OrthogonalSignalRule(OrthogonalRule):
    """:class:`OrthogonalRule`, and each rank's gradient of a matrix is orthogonalised too before it enters DeMo's
    momentum (:func:`orthogonalised_signal`): top-k then selects from a momentum of orthogonalised gradients, in
    which every direction of a gradient weighs alike (a raw gradient's few large singular directions would take
    most of the coefficients). The averaged update is orthogonalised again and scaled as :class:`OrthogonalRule`
    does. One more Newton-Schulz iteration per matrix and step, on each rank; no state, no traffic."""

    name = "orthogonal_signal"
    facts = RuleFacts(ns_update=1, ns_signal=1, may_be_inner=False)

    def signal(self, grad: torch.Tensor | None, state: dict) -> tuple[torch.Tensor | None, dict]:
        return orthogonalised_signal(grad, self.ns_steps), {}


def muon_direction(grad: torch.Tensor, momentum: torch.Tensor | None, beta: float, steps: int):
    """Muon's direction of one rank's gradient of a matrix: (the Newton-Schulz iterate of the Nesterov momentum
    ``(1-beta)*grad + beta*m'``, unscaled, in ``grad``'s dtype and shape; ``m' = beta*m + (1-beta)*grad``, fp32,
    a new tensor). ``momentum`` None is zero (the first step)."""
    g = grad.float()
    m = g * (1.0 - beta) if momentum is None else momentum.lerp(g, 1.0 - beta)
    return newton_schulz(matrix_view(g.lerp(m, beta)), steps).to(grad.dtype).reshape(grad.shape), m


class MuonSignalRule(OrthogonalRule):
    """:class:`OrthogonalRule`, and what of each rank's gradient of a matrix enters DeMo's momentum is Muon's own
    direction (:func:`muon_direction`): the Newton-Schulz iterate of a Nesterov momentum (``beta`` 0.95,
    ``torch.optim.Muon``'s) of the rank's gradients. Top-k then selects from a decayed sum of the ranks'
    would-be Muon steps; the averaged update is orthogonalised again and scaled as :class:`OrthogonalRule` does.
    DeMo's own momentum is then an error feedback of what was not sent yet, and trains best with a faster decay
    than with a raw gradient (``compression_decay=0.9``). State: this rank's
    ``signal_momentum`` (fp32, 4 bytes per parameter of a matrix; its own, like DeMo's momentum). One
    Newton-Schulz iteration more per matrix and step, on each rank; no traffic."""

    name = "muon_signal"
    facts = RuleFacts(
        state=(StateEntry("signal_momentum", 4, agreed=False, whole_matrix=True),),
        ns_update=1,
        ns_signal=1,
        may_be_inner=False,
    )
    beta = 0.95

    def signal(self, grad: torch.Tensor | None, state: dict) -> tuple[torch.Tensor | None, dict]:
        if grad is None or grad.dim() < 2:
            return grad, {}
        direction, momentum = muon_direction(grad, state.get("signal_momentum"), self.beta, self.ns_steps)
        return direction, {"signal_momentum": momentum}


RULES = {
    rule.name: rule
    for rule in (
        SignRule,
        RawRule,
        AdamRule,
        AdamWRule,
        OrthogonalRule,
        OrthogonalMomentumRule,
        OrthogonalSignalRule,
        MuonSignalRule,
    )
}
UPDATE_RULES = tuple(RULES)
# the rules whose Rule.signal changes what of a rank's gradient enters DeMo's momentum (the others let it in as it is)
OWN_SIGNAL = tuple(name for name, rule in RULES.items() if rule.signal is not Rule.signal)
FACTS = {name: rule.facts for name, rule in RULES.items()}
# every key a rule keeps in the optimizer's per-parameter state, the same on every rank
STATE_KEYS = tuple(sorted({e.key for f in FACTS.values() for e in f.state if e.agreed}))
# a rule's state of this rank's own gradients (Rule.signal), like DeMo's momentum
SIGNAL_KEYS = tuple(sorted({e.key for f in FACTS.values() for e in f.state if not e.agreed}))
ORTHOGONAL = tuple(n for n, f in FACTS.items() if f.ns_update)  # Muon-style groups
NOT_INNER = tuple(n for n, f in FACTS.items() if not f.may_be_inner)  # need DeMo's momentum or averaged updates
# orthogonalise each rank's gradient (signal) or keep a matrix state: not on FSDP2 shards (orthogonal gathers)
WHOLE_STATE = tuple(n for n, f in FACTS.items() if f.needs_whole_own)


def get(name: str):
    """A new rule of ``name`` (a ValueError naming every rule for an unknown one)."""
    rule = RULES.get(name) if isinstance(name, str) else None
    return (rule or lookup(RULES, "update rule", name))()
