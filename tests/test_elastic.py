"""hf_demo.elastic: the missing extra is named, and the modes it does not run are refused with the reason."""

import builtins
import dataclasses
import json

import pytest
import torch

import hf_demo
from hf_demo.errors import DeMoSetupError


def test_missing_torchft_names_the_extra(monkeypatch):
    from hf_demo import elastic

    real = builtins.__import__

    def no_torchft(name, *args, **kwargs):
        if name.startswith("torchft"):
            raise ImportError("No module named 'torchft'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchft)
    monkeypatch.setattr(elastic.importlib, "import_module", lambda n: no_torchft(n))
    with pytest.raises(ImportError, match=r"hf-demo\[ft\]"):
        elastic.require_torchft()


def test_the_modes_elastic_does_not_run_are_refused_with_the_reason():
    from hf_demo.elastic import refuse_modes

    model = torch.nn.Linear(8, 8)
    refuse_modes(hf_demo.DeMo(model.parameters()))  # every-step DeMo runs
    refuse_modes(hf_demo.DeMo(model.parameters(), comm_budget=0.01, policy_sync_every=4))  # local-step tiers run
    refuse_modes(hf_demo.DeMo(model.parameters(), sync_every=4))  # local steps run: joiners wait for a sync
    refuse_modes(hf_demo.DeMo(model.parameters(), preset="from_scratch"))
    refuse_modes(hf_demo.DeMo(model.parameters(), overlap=True))  # the exchange in flight dropped at a new quorum
    with pytest.raises(DeMoSetupError, match="device_mesh"):
        refuse_modes(hf_demo.DeMo(model.parameters(), device_mesh=object()))


class _Group:
    def getBackendName(self):  # noqa: N802 - torch's name
        return "gloo"


class _Manager:
    """torchft's Manager as Elastic sees it: a quorum (id, size, this replica's rank), a step, a commit decision."""

    def __init__(self):
        self.quorum, self.world, self.step, self.batches, self.commit, self.heal = 1, 3, 0, 0, True, None
        self._pg, self.errors = _Group(), []

    def start_quorum(self, shrink_only=False):
        self.shrink_only = shrink_only
        self._quorum_id = self.quorum
        if self.heal is not None:
            self.heal()

    def participating_rank(self):
        return 0

    def num_participants(self):
        return self.world

    def current_step(self):
        return self.step

    def batches_committed(self):
        return self.batches

    def report_error(self, e):
        self.errors.append(e)

    def should_commit(self):
        if self.commit and not self.errors:
            self.step, self.batches = self.step + 1, self.batches + self.world
            return True
        self.errors = []
        return False

    def shutdown(self, wait=False):
        pass


def _elastic(manager, **kwargs):
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from hf_demo.elastic import Elastic

    model = torch.nn.Linear(8, 8)
    return Elastic(hf_demo.DeMo(model.parameters()), model, batch_size=4, manager=manager, **kwargs), model


def _recovered(state: dict, step: int, **kwargs):
    """A replica (re)starting at ``step`` whose heal receives ``state`` from a live peer, after its first
    ``start_step``: (the replica, its model)."""
    manager = _Manager()
    manager.step = step
    joiner, model = _elastic(manager, **kwargs)
    manager.heal = lambda: joiner.load_agreed(state)
    joiner.start_step()
    return joiner, model


def test_a_loss_and_a_join_are_events_with_the_time_and_samples_lost():
    """The accounting of the quorum's changes (no processes): a refused step's samples, the loss event when the
    quorum shrinks (the seconds since the refused step began), a join, the batch each replica reads, and every
    replica of a new quorum forgetting what it learnt about the last one's peers."""
    from hf_demo.elastic import ElasticEvent
    from hf_demo.errors import DeMoSyncError

    manager = _Manager()
    elastic, _ = _elastic(manager)
    heard = []
    elastic.add_listener(heard.append)
    elastic.start_step()
    assert elastic.decide(None) and elastic.batch_index == 3  # step 1 reads the batches after step 0's three
    elastic.start_step()
    assert not elastic.decide(DeMoSyncError("a peer died")) and elastic.samples_lost == 3 * 4
    elastic.opt.run_state = dataclasses.replace(elastic.opt.run_state, first_checked=True, wire_agreed={(3, 0): 100})
    manager.quorum, manager.world = 2, 2
    elastic.start_step()
    (loss,) = elastic.events
    assert isinstance(loss, ElasticEvent) and heard == [loss]
    assert (loss.kind, loss.step, loss.quorum, loss.samples_lost) == ("loss", 1, 2, 12) and loss.seconds > 0
    assert elastic.opt.first_checked is False and elastic.opt.wire_agreed == {}
    assert elastic.decide(None) and elastic.batch_index == 3 + 2
    manager.quorum, manager.world = 3, 3
    elastic.start_step()
    assert [e.kind for e in elastic.events] == ["loss", "join"] and elastic.events[-1].quorum == 3
    assert elastic.stats.replicas_lost == 1 and elastic.stats.replicas_joined == 1
    with pytest.raises(AttributeError):
        loss.kind = "join"  # frozen


def test_a_joiner_receives_the_agreed_state_without_momentum():
    """A restarted replica receives the parameters and DeMo's agreed state from a peer, its momentum at zero; a
    replica that only lagged keeps its own momentum; the recovery is an event."""
    peer, peer_model = _elastic(_Manager())
    for p in peer_model.parameters():
        peer.opt.state[p]["momentum"] = torch.ones(8, 8)
    state = peer.agreed_state()
    assert all("momentum" not in s for s in state["optimizer"]["state"].values())
    joiner, model = _recovered(state, 7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), peer_model.parameters()))
    assert all("momentum" not in joiner.opt.state[p] for p in model.parameters())
    (recovered,) = joiner.events
    assert recovered.kind == "recovered" and recovered.step == 7
    own = torch.full((8, 8), 2.0)
    for p in model.parameters():
        joiner.opt.state[p]["momentum"] = own.clone()
    joiner.load_agreed(state)  # lagged: received the state again, its own momentum kept
    assert all(torch.equal(joiner.opt.state[p]["momentum"], own) for p in model.parameters())


def test_a_joiner_in_a_process_group_of_its_own_loads_a_peers_state_saved_in_a_larger_quorum():
    """Under Trainer each replica group is a torchrun of one process, so torch.distributed is initialised (a group of
    one) when a restarted replica receives a live peer's state. That state was saved by the peer's rank 1 of a
    quorum of 2: it is the peer's, loaded as such, not refused as a checkpoint resumed with another world (the
    restarted replica would crash again and the survivor lose the step it joined at)."""
    import torch.distributed as dist

    from dist_utils import free_port
    from hf_demo.errors import DeMoStateError

    peer, peer_model = _elastic(_Manager())
    state = peer.agreed_state()
    state["optimizer"]["demo"].update(rank=1, world_size=2)  # the peer's place in the quorum it saved in
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        resumed = hf_demo.DeMo(torch.nn.Linear(8, 8).parameters())
        with pytest.raises(DeMoStateError, match="saved with 2 process"):
            resumed.load_state_dict(state["optimizer"])  # a checkpoint's resume still checks
        joiner, model = _recovered(state, 4)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), peer_model.parameters()))
        assert joiner.stats.recoveries == 1 and joiner.opt.saved_world is None
    finally:
        dist.destroy_process_group()


def _stepped(manager, tmp_path):
    """A replica (one process, ``_Manager``) with ``momentum_dir``, after one committed step."""
    manager.world = 1  # alone: its step commits without a peer
    elastic, model = _elastic(manager, replica_id="r1", momentum_dir=tmp_path)
    elastic.start_step()
    model(torch.randn(4, 8)).square().mean().backward()
    elastic.step()
    return elastic, model


def test_a_restarted_replica_resumes_its_own_momentum_from_its_snapshot(tmp_path):
    """momentum_dir: after each committed step a replica writes its own momentum to momentum_dir/replica-<id>.pt; the
    process that takes the id back receives the agreed state from a peer and then its momentum from the file, bitwise
    the momentum the dead replica had after its last committed step; a replica that only lagged keeps its own."""
    from hf_demo.own_momentum import snapshot_path

    manager = _Manager()
    dead, dead_model = _stepped(manager, tmp_path)
    assert manager.step == 1 and snapshot_path(tmp_path, "r1").is_file()
    kept = {i: s["momentum"].clone() for i, s in enumerate(dead.opt.state.values())}
    assert all(m.abs().sum() > 0 for m in kept.values())
    peer, peer_model = _elastic(_Manager())
    state = peer.agreed_state()
    state["optimizer"]["demo"]["run_id"] = dead.opt.run_id  # the run's identity, which every replica shares
    joiner, model = _recovered(state, 3, replica_id="r1", momentum_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), peer_model.parameters()))  # the peer's weights
    got = [joiner.opt.state[p]["momentum"] for p in model.parameters()]
    assert all(torch.equal(g, kept[i]) for i, g in enumerate(got)) and joiner.stats.momentum_restored == 1


@pytest.mark.parametrize("unfit", ["another_run", "another_model", "a_later_step", "torn"])
def test_a_snapshot_that_does_not_fit_is_not_loaded_and_a_warning_says_why(tmp_path, unfit):
    from hf_demo.own_momentum import checksum, snapshot_path

    dead, _ = _stepped(_Manager(), tmp_path)
    path = snapshot_path(tmp_path, "r1")
    if unfit == "torn":
        path.write_bytes(path.read_bytes()[:50])
    elif unfit == "another_model":
        blob = torch.load(path, weights_only=True)
        blob["shapes"][0] = [4, 4]
        blob["sha256"] = checksum(blob)  # a whole snapshot, of another model
        torch.save(blob, path)
    peer, _ = _elastic(_Manager())
    state = peer.agreed_state()
    if unfit != "another_run":
        state["optimizer"]["demo"]["run_id"] = dead.opt.run_id
    restarted = _Manager()
    restarted.step = 0 if unfit == "a_later_step" else 5  # the snapshot is of step 1
    joiner, model = _elastic(restarted, replica_id="r1", momentum_dir=tmp_path)
    why = {"another_run": "another run", "another_model": "other shapes", "a_later_step": "after the agreed step 0",
           "torn": "not a momentum snapshot"}[unfit]  # fmt: skip
    with pytest.warns(UserWarning, match=why):
        joiner.load_agreed(state)
    assert all("momentum" not in joiner.opt.state[p] for p in model.parameters()) and not joiner.stats.momentum_restored


def test_momentum_dir_refuses_what_it_cannot_keep(tmp_path, monkeypatch):
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from hf_demo.elastic import Elastic

    model = torch.nn.Linear(8, 8)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(DeMoSetupError, match="give replica_id"):
        Elastic(hf_demo.DeMo(model.parameters()), model, manager=_Manager(), momentum_dir=tmp_path)
    with pytest.raises(ValueError, match="momentum_every=0"):
        Elastic(hf_demo.DeMo(model.parameters()), model, manager=_Manager(), momentum_dir=tmp_path, replica_id="a",
                momentum_every=0)  # fmt: skip


def test_a_new_quorum_gives_the_budget_policy_the_same_figures_on_every_replica():
    """comm_budget: the policy's next decision reads the last exchange's figures and the tier it ran in, which a
    survivor holds and a joiner does not (a joiner's are reset by the load). At a new quorum every replica forgets
    them, so survivor and joiner decide from the same figures; the tier itself travels with the agreed state."""
    from hf_demo.optim.policy import Clock

    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from hf_demo.elastic import Elastic

    def replica(manager):
        model = torch.nn.Linear(8, 8)
        opt = hf_demo.DeMo(model.parameters(), comm_budget=0.3, policy_sync_every=2)
        return Elastic(opt, model, manager=manager), model

    survivor, _ = replica(_Manager())
    survivor.start_step()
    survivor.decide(None)
    survivor.opt.policy.tier = 5  # moved up after an exchange in tier 4
    survivor.opt.run_state = dataclasses.replace(survivor.opt.run_state, clock=Clock(40.0, 12.5, 4))
    state = survivor.agreed_state()
    manager = _Manager()
    joiner, _ = replica(manager)
    manager.heal = lambda: joiner.load_agreed(state)
    survivor.manager.quorum = 2  # the join: a new quorum on both
    survivor.start_step()
    joiner.start_step()
    assert joiner.opt.policy.tier == survivor.opt.policy.tier == 5
    assert joiner.opt.clock == survivor.opt.clock == Clock()


def _hsdp_modes(rank, world):
    """On 2 gloo ranks sharding a model with FSDP2 (one HSDP replica group): what refuse_modes says per mode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_demo.elastic import node_shards, refuse_modes

    out = {}
    modes = {"every_step": {}, "budget": {"comm_budget": 0.1, "policy_sync_every": 1}, "overlap": {"overlap": True},
             "sync_every": {"sync_every": 2}, "budget_local": {"comm_budget": 0.1, "policy_sync_every": 4}}  # fmt: skip
    for name, kw in modes.items():
        model = torch.nn.Linear(8, 8)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        try:
            refuse_modes(hf_demo.DeMo(model.parameters(), **kw))
            out[name] = None
        except DeMoSetupError as exc:
            out[name] = str(exc)
    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    out["node"] = node_shards(hf_demo.DeMo(model.parameters()), 5.0).world
    from hf_demo.elastic import Elastic

    try:  # a momentum snapshot of whole tensors: refused before anything is set up
        Elastic(hf_demo.DeMo(model.parameters()), model, manager=_Manager(), replica_id="a", momentum_dir="unused")
        out["momentum_dir"] = None
    except DeMoSetupError as exc:
        out["momentum_dir"] = str(exc)
    return out


@pytest.mark.ranks
def test_hsdp_replica_groups_run_every_step_demo_and_refuse_what_they_do_not_run_with_the_reason():
    """A replica group of FSDP2 shard ranks (HSDP) runs every-step DeMo (with or without a budget of every-step
    tiers) elastically; an exchange in flight (overlap), local phases and momentum snapshots are refused, each
    naming why."""
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from dist_utils import expect_ok, run_ranks

    for out in expect_ok(run_ranks(_hsdp_modes, 2)):
        assert out["every_step"] is None and out["budget"] is None and out["node"] == 2, out
        assert "overlap=True on HSDP" in out["overlap"] and "no exchange in flight" in out["overlap"], out
        for name in ("sync_every", "budget_local"):
            assert "local steps" in out[name] and "parameters of a rank's own" in out[name], out
        assert "momentum_dir is not supported on HSDP" in out["momentum_dir"], out


class _Work:
    def wait(self):
        return True


class _PeerGroup:
    """torchft's group as one shard rank sees it: shard rank 0's peer replica died, shard rank 1's answered."""

    def __init__(self, dead: bool):
        self.dead = dead

    def getBackendName(self):  # noqa: N802 - torch's name
        return "gloo"

    def allgather(self, outs, ins, opts):
        if self.dead:
            raise RuntimeError("Connection closed by peer")
        for row in outs[0]:
            row.copy_(ins[0])
        return _Work()


def _lockstep(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_demo.elastic import LockstepTransport, node_shards
    from hf_demo.errors import DeMoSyncError

    model = torch.nn.Linear(8, 8)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    node = node_shards(hf_demo.DeMo(model.parameters()), 5.0)
    transport = LockstepTransport(_PeerGroup(dead=rank == 0), 0, 2, 5.0, node)
    try:
        transport.all_gather(torch.zeros(8, dtype=torch.uint8), "header", 3, None)
        raised = None
    except DeMoSyncError as exc:
        raised = str(exc)
    after = node.shards.all_gather(torch.full((8,), rank, dtype=torch.uint8), "node_header", 4, None)  # in step
    return raised, after[:, 0].tolist()


@pytest.mark.ranks
def test_a_replicate_collective_failed_on_one_shard_rank_stops_every_shard_rank_at_that_collective():
    """HSDP: the peer replica group died between two shard ranks' collectives (shard rank 0's failed, shard rank
    1's went through). Both raise at that collective, so the shard group's next collective meets in step."""
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from dist_utils import expect_ok, run_ranks

    (raised0, after0), (raised1, after1) = expect_ok(run_ranks(_lockstep, 2))
    assert "header exchange of optimizer step 3 failed" in raised0, raised0
    assert "failed on shard rank(s) [0] of this replica group" in raised1, raised1
    assert after0 == after1 == [0, 1]


# ---------------------------------------------------------------- replica groups on loopback (real gloo, a Lighthouse)
FAST = ["--timeout", "10", "--step-seconds", "0.05", "--digests"]


def _harness(tmp_path, n, args, extra=None):
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from benchlib.elastic import Replicas

    return Replicas(n, tmp_path, [*FAST, *args], extra=extra)


def _steps(replica):
    return [x for x in replica.lines if "step" in x]


def _events(replica, kind):
    return [x["event"] for x in replica.lines if "event" in x and x["event"]["kind"] == kind]


def _by_step(replicas):
    """{step: {replica id: its committed line}}: what each replica committed at each step."""
    out = {}
    for r in replicas:
        for x in _steps(r):
            if x["committed"]:
                out.setdefault(x["step"], {})[r.rid] = x
    return out


def _check_refused_apply_nothing(replica):
    """A refused step leaves the parameters as the last committed step left them."""
    last = None
    for x in _steps(replica):
        if x["committed"]:
            last = x["digest"]
        elif last is not None:
            assert x["digest"] == last, f"replica {replica.rid} changed its parameters at refused step {x['step']}"


def _check_data(replicas, committed_batches: int, slack: int):
    """Every committed step read batches no other committed step read, and none was skipped (but the batches of a
    replica that died before printing its committed line: ``slack``)."""
    read = [x["batch"] for r in replicas for x in _steps(r) if x["committed"]]
    assert len(read) == len(set(read)), "a batch was trained twice"
    assert set(read) <= set(range(committed_batches))
    assert len(read) >= committed_batches - slack


def _run_loss(tmp_path, point: str, steps: int):
    """Replica 2 of 3 lost at step 6 (SIGKILLed at ``point``, or ``frozen`` by SIGSTOP); the survivors' records and
    every incarnation's replica object."""
    import os
    import signal

    die = [] if point == "frozen" else ["--die-at", f"6:{point}"]
    reps = _harness(tmp_path, 3, ["--steps", str(steps)], extra={"2": die})
    try:
        if point == "frozen":
            reps.wait_step("2", 6, 120)
            os.kill(reps.live["2"].proc.pid, signal.SIGSTOP)
            reps.kill("2")  # stays frozen until the survivors are done, then SIGKILLed
        else:
            reps.wait_exit("2", 120)
        records = reps.finish(180)
        survivors = [reps.live["0"], reps.live["1"]]
    finally:
        reps.close()
    return records, survivors, reps.dead


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before", "inside", "after", "between", "frozen"])
def test_a_lost_replica_costs_the_survivors_a_step_not_the_run(tmp_path, point):
    """Replica 2 of 3 SIGKILLed at a point of step 6 (or frozen with SIGSTOP: the collective's timeout): both
    survivors refuse that step alike (nothing applied) or commit it alike, go on with a quorum of 2 averaging over
    the replicas present, never receive a state from a peer, end bitwise identical, and count the loss's seconds
    and samples; no batch is trained twice or skipped."""
    records, survivors, everyone = _run_loss(tmp_path, point, 16)
    assert records["0"]["digest"] == records["1"]["digest"]
    for rec in records.values():
        assert rec["steps"] == 16 and rec["quorum_size"] == 2 and rec["replicas_lost"] == 1, rec
        assert not [e for e in rec["events"] if e["kind"] == "recovered"], "a survivor reloaded a state"
        (loss,) = [e for e in rec["events"] if e["kind"] == "loss"]
        assert loss["quorum"] == 2 and 0 < loss["seconds"] < 60  # the step in flight + the detection
        assert loss["samples_lost"] == rec["samples_lost"] == 32 * 3 * rec["refused_steps"]
        if point in ("before", "inside", "frozen"):  # the exchange could not finish: the step is refused
            assert rec["refused_steps"] >= 1 and "failed" in rec["last_error"], rec["last_error"]
        else:  # the exchange was done: the survivors commit it (the dead one's batch counted)
            assert rec["refused_steps"] == 0
    assert records["0"]["refused_steps"] == records["1"]["refused_steps"]
    for r in survivors:
        _check_refused_apply_nothing(r)
    quorums = []
    for step, lines in sorted(_by_step(survivors).items()):
        assert lines["0"]["digest"] == lines["1"]["digest"], f"replicas apart after step {step}"
        quorums.append(lines["0"]["quorum"])
    lost_at = quorums.index(2)  # every step after the loss averages over the two replicas present
    assert lost_at in (6, 7) and quorums == [3] * lost_at + [2] * (16 - lost_at), quorums
    _check_data(everyone, records["0"]["batches_committed"], slack=1)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True], ids=["zero_momentum", "momentum_dir"])
def test_a_restarted_replica_rejoins_with_the_agreed_state_and_its_momentum(tmp_path, keep):
    """Replica 2 of 3 SIGKILLed inside step 5 and started again: it joins the quorum, receives the agreed state
    from a live peer (its momentum at zero, or with momentum_dir the one it had after its last committed step; the
    survivors keep theirs and reload nothing), reads the batches after those committed, and from then on the three
    replicas are bitwise identical at every step."""
    import time

    steps_file = tmp_path / "steps"
    kept = ["--momentum-dir", str(tmp_path / "momenta")] if keep else []
    reps = _harness(
        tmp_path, 3, ["--steps", "100000", "--steps-file", str(steps_file), *kept],
        extra={"2": ["--die-at", "5:inside"]},
    )  # fmt: skip
    try:
        reps.wait_exit("2", 120)
        joiner = reps.start("2")
        deadline = time.monotonic() + 180
        while len([x for x in _steps(joiner) if x["committed"]]) < 3:
            assert time.monotonic() < deadline and joiner.proc.poll() is None, reps.logs("2")
            time.sleep(0.05)
        steps_file.write_text(str(max(r.step() for r in reps.live.values()) + 8))
        records = reps.finish(180)
        live = dict(reps.live)
    finally:
        reps.close()
    assert len({rec["digest"] for rec in records.values()}) == 1
    (recovered,) = [x for x in joiner.lines if "event" in x and x["event"]["kind"] == "recovered"]
    last = [x for x in _steps(reps.dead[0]) if x["committed"]][-1]  # the killed one's last committed step
    assert recovered["momentum"] == (last["momentum"] if keep else 0.0) and last["momentum"] > 0, (recovered, last)
    assert recovered["event"]["step"] > 5 and recovered["event"]["quorum"] == 3
    for rid in ("0", "1"):
        assert [e["kind"] for e in records[rid]["events"]] == ["loss", "join"], records[rid]["events"]
        assert not [e for e in records[rid]["events"] if e["kind"] == "recovered"]
    joined = recovered["event"]["step"]
    for step, lines in _by_step(live.values()).items():
        if step >= joined:
            assert set(lines) == {"0", "1", "2"} and len({x["digest"] for x in lines.values()}) == 1, step
            assert {x["quorum"] for x in lines.values()} == {3}
    _check_data(reps.dead, records["0"]["batches_committed"], slack=0)


@pytest.mark.slow
def test_the_guards_hold_on_the_managed_group(tmp_path):
    """On torchft's group as on a plain one: a non-finite gradient on one replica makes every replica skip that step
    alike, and the replicas stay bitwise identical. (Settings that differ between replica groups raise on every
    replica: tests/test_elastic_faults.py.)"""
    reps = _harness(tmp_path / "nan", 2, ["--steps", "8"], extra={"1": ["--nan-at", "4"]})
    try:
        records = reps.finish(180)
    finally:
        reps.close()
    assert records["0"]["digest"] == records["1"]["digest"]
    for rec in records.values():
        assert rec["steps"] == 8 and rec["skipped_steps"] == 1 and rec["refused_steps"] == 0


def _refused_at(replica, step):
    """The error of ``replica``'s refused try of ``step`` (there is exactly one), and that the retry committed."""
    tries = [x for x in _steps(replica) if x["step"] == step]
    assert [x["committed"] for x in tries] == [False, True], tries
    return tries[0]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["crc32", "hmac"])
def test_the_header_payload_and_drift_guards_hold_on_the_managed_group(tmp_path, monkeypatch, secret):
    """On torchft's group as on a plain one: replica 1 receives replica 0's header with a bit flipped at step 3
    (its CRC32 fails; with HF_DEMO_SECRET, its HMAC-SHA256) and, without a secret, a payload bit flipped at step 6;
    every replica refuses that step at once, naming the header (or payload), nothing is applied, and the retry
    commits. A parameter nudged on replica 1 after step 8 is found by the drift check (check_every=5) and resynced
    on every replica alike. The replicas end bitwise identical, every step committed."""
    if secret:
        monkeypatch.setenv("HF_DEMO_SECRET", secret)
    flips = ["--flip-at", "3:header:112"] if secret else ["--flip-at", "3:header", "--flip-at", "6:payload"]
    reps = _harness(tmp_path, 2, ["--steps", "14", "--check-every", "5"], extra={"1": [*flips, "--drift-at", "8"]})
    try:
        records = reps.finish(240)
        zero, one = reps.live["0"], reps.live["1"]
    finally:
        reps.close()
    assert records["0"]["digest"] == records["1"]["digest"]
    refused = 1 if secret else 2
    for rec in records.values():
        assert rec["steps"] == 14 and rec["refused_steps"] == refused and rec["resyncs"] == 1, rec
    why = "HMAC-SHA256" if secret else "CRC32"
    mine, theirs = _refused_at(one, 3), _refused_at(zero, 3)
    assert "the header from rank 0 at optimizer step" in mine and why in mine, mine
    assert "rank 1 refused the header from rank 0" in theirs, theirs
    if not secret:
        mine, theirs = _refused_at(one, 6), _refused_at(zero, 6)
        assert "payload from rank 0" in mine and "CRC32" in mine, mine
        assert "refused" in theirs, theirs
    for r in (zero, one):
        _check_refused_apply_nothing(r)
    for step, lines in _by_step([zero, one]).items():  # apart only between the nudge and the drift check
        if not 8 <= step < 10:
            assert lines["0"]["digest"] == lines["1"]["digest"], step


@pytest.mark.launch
@pytest.mark.timeout(480)
def test_the_short_soak_survives_its_kills_with_warm_standbys_and_no_restart(tmp_path):
    """benchmarks/elastic_soak.py in small, in the default tier: 3 replica groups, 2 SIGKILLed at random steps, each
    replaced by a warm standby (imported and built beforehand) that joins the quorum with the agreed state; every
    failure survived, no full restart, both replacements in the quorum with the dead replica's momentum (kept on disk),
    the 3 replicas that finish bitwise identical, and the run within its --max-seconds bound (the bound, generous
    for a loaded machine, fails the test clearly: ``timed_out``)."""
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    import elastic_soak

    args = ["--model", "mlp", "--steps", "30", "--kills", "2", "--standbys", "1", "--step-seconds", "0.1",
            "--quiet-tail", "0.3", "--eval-batches", "2", "--no-baseline", "--max-seconds", "360",
            "--out", str(tmp_path), "--keep-momentum"]  # fmt: skip
    result = elastic_soak.main(args)
    assert not result["timed_out"], result
    assert result["failures"] == 2 and result["full_restarts"] == 0, result
    assert result["steps_committed"] >= 30 and result["replicas_identical"] and result["replicas_finished"] == 3
    assert result["rejoins"] == 2 and result["seconds_to_replace"] > 0, result  # both standbys recovered the state
    assert result["seconds_lost_per_failure"] > 0, result  # each failure's loss event, seen by the survivors
    assert result["momentum_resumed"] == 2, result  # each standby resumed the dead replica's momentum from its disk


def _rejoin(tmp_path, args, die: str, after: int = 3):
    """3 replicas; replica 2 SIGKILLed at ``die`` and started again; the run ends ``after``-odd steps once it is
    back. Returns (records, the live replicas, the joiner)."""
    import time

    steps_file = tmp_path / "steps"
    reps = _harness(tmp_path, 3, ["--steps", "100000", "--steps-file", str(steps_file), *args],
                    extra={"2": ["--die-at", die]})  # fmt: skip
    try:
        reps.wait_exit("2", 120)
        joiner = reps.start("2")
        deadline = time.monotonic() + 240
        while len([x for x in _steps(joiner) if x["committed"]]) < after:
            assert time.monotonic() < deadline and joiner.proc.poll() is None, reps.logs("2")
            time.sleep(0.05)
        last = max(r.step() for r in reps.live.values()) + 6
        steps_file.write_text(str(last + last % 2))  # an even count of steps: the run ends on a synchronisation
        records = reps.finish(180)
        live = dict(reps.live)
    finally:
        reps.close()
    return records, live, joiner


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync_every", "from_scratch"])
def test_local_steps_lose_a_replica_inside_a_phase_and_a_joiner_waits_for_a_synchronisation(tmp_path, mode):
    """sync_every=2 (and the from_scratch preset, which has it): replica 2 of 3 SIGKILLed inside a local phase;
    the survivors go on, synchronise over the two present, and the restarted replica joins only at a
    synchronisation (its recovery at an even step), after which the three agree at every synchronisation and end
    bitwise identical."""
    args = ["--sync-every", "2"] if mode == "sync_every" else ["--preset", "from_scratch"]
    records, live, joiner = _rejoin(tmp_path, args, "4:before")
    assert len({rec["digest"] for rec in records.values()}) == 1
    (recovered,) = [x["event"] for x in joiner.lines if "event" in x and x["event"]["kind"] == "recovered"]
    assert recovered["step"] % 2 == 0 and recovered["step"] > 4 and recovered["quorum"] == 3
    for rid in ("0", "1"):
        kinds = [e["kind"] for e in records[rid]["events"]]
        assert kinds == ["loss", "join"] and records[rid]["refused_steps"] == 0, records[rid]
    for step, lines in _by_step(live.values()).items():
        if step % 2 == 1 and step >= recovered["step"]:  # after each synchronisation: one state everywhere
            assert set(lines) == {"0", "1", "2"} and len({x["digest"] for x in lines.values()}) == 1, step


@pytest.mark.slow
def test_overlap_drops_the_exchange_in_flight_on_every_replica_when_the_quorum_changes(tmp_path):
    """overlap=True: replica 2 of 3 SIGKILLed while its step's exchange is in flight; every survivor drops that
    exchange alike at the new quorum (nothing of it applied anywhere), the restarted replica joins with no
    exchange in flight, and from then on the three are bitwise identical at every step."""
    records, live, joiner = _rejoin(tmp_path, ["--overlap"], "6:inside")
    assert len({rec["digest"] for rec in records.values()}) == 1
    (recovered,) = [x["event"] for x in joiner.lines if "event" in x and x["event"]["kind"] == "recovered"]
    for rid in ("0", "1"):
        assert [e["kind"] for e in records[rid]["events"]] == ["loss", "join"], records[rid]["events"]
    by_step = _by_step(live.values())
    for step, lines in by_step.items():
        assert len({x["digest"] for x in lines.values()}) == 1, step  # the survivors, then all three
        if step >= recovered["step"]:
            assert set(lines) == {"0", "1", "2"}
    lost = next(e["step"] for e in records["0"]["events"] if e["kind"] == "loss")
    assert by_step[lost]["0"]["digest"] == by_step[lost - 1]["0"]["digest"]  # the dropped exchange: nothing landed


@pytest.mark.slow
def test_the_budget_policy_moves_into_a_local_phase_loses_a_replica_there_and_a_joiner_gets_the_tier(tmp_path):
    """comm_budget with local-step tiers (policy_sync_every=2): a slow link (replica 0 waits 0.5 s before each
    collective from step 3 to 12) drives the policy into its local-step tiers; replica 2 is SIGKILLed inside a
    local phase and started again. Every replica decides the same tier at every step (the survivors forgot the
    last exchange's figures at each change of the quorum, as the joiner has none), the joiner enters only at a
    quorum after a synchronisation and receives the tier with the agreed state, and the three end bitwise
    identical."""
    import time

    steps_file = tmp_path / "steps"
    args = ["--steps", "100000", "--steps-file", str(steps_file), "--comm-budget", "0.3",
            "--policy-sync-every", "2", "--policy-patience", "1", "--step-seconds", "0.2"]  # fmt: skip
    # a step stays shorter than the Lighthouse's join window (2 s), so a joiner never makes a quorum form without a
    # live replica still finishing its step (which would then receive the state from a peer too)
    reps = _harness(tmp_path, 3, args, extra={"0": ["--slow-link", "3:12:0.5"], "2": ["--die-at", "4:local"]})
    try:
        reps.wait_exit("2", 180)
        joiner = reps.start("2")
        deadline = time.monotonic() + 240
        while len([x for x in _steps(joiner) if x["committed"]]) < 3:
            assert time.monotonic() < deadline and joiner.proc.poll() is None, reps.logs("2")
            time.sleep(0.05)
        last = max(max(r.step() for r in reps.live.values()) + 8, 24)
        steps_file.write_text(str(last + last % 2))  # an even count of steps: the run ends on a synchronisation
        records = reps.finish(240)
        live, dead = dict(reps.live), list(reps.dead)
    finally:
        reps.close()
    assert len({rec["digest"] for rec in records.values()}) == 1
    assert len({json.dumps(rec["policy"], sort_keys=True) for rec in records.values()}) == 1, records
    killed = _steps(dead[0])
    assert killed[-1]["unsynced"] and killed[-1]["local"], killed[-1]  # it died inside a local phase
    (recovered,) = [x["event"] for x in joiner.lines if "event" in x and x["event"]["kind"] == "recovered"]
    by_step = _by_step(live.values())
    assert not by_step[recovered["step"] - 1]["0"]["unsynced"]  # the joiner entered after a synchronisation
    for step, lines in by_step.items():
        assert len({x["tier"] for x in lines.values()}) == 1, (step, lines)  # one tier everywhere
        if not lines["0"]["unsynced"]:
            assert len({x["digest"] for x in lines.values()}) == 1, step
    for rid in ("0", "1"):
        assert [e["kind"] for e in records[rid]["events"]] == ["loss", "join"], records[rid]["events"]
    tiers = [lines["0"]["local"] for _, lines in sorted(by_step.items())]
    entered = tiers.index(True)
    assert False in tiers[entered:], tiers  # and moved out of it once the link was fast again


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["every_step", "comm_budget"])
def test_an_hsdp_replica_group_lost_whole_and_restarted_recovers_each_shard_from_a_live_peer(tmp_path, mode):
    """HSDP: 2 replica groups x 2 shard ranks (FSDP2 over each group's own gloo group; DeMo between the groups over
    torchft's managed group, shard rank i with shard rank i). Replica group 1 is SIGKILLed whole (both processes, as
    a node fails) inside step 6: both shard ranks of group 0 refuse that step alike, go on alone and reload nothing;
    group 1, started again, receives each shard's agreed state from the same shard rank of group 0 (momentum at
    zero), and from then on every shard rank is bitwise identical to its peer in the other group at every step.
    ``comm_budget``: the same with the budget policy's every-step tiers (its figures agreed over the shard group,
    forgotten at each new quorum), one tier everywhere."""
    import time

    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")
    from benchlib.elastic_groups import ReplicaGroups

    steps_file = tmp_path / "steps"
    args = [*FAST, "--steps", "100000", "--steps-file", str(steps_file)]
    if mode == "comm_budget":
        args += ["--comm-budget", "0.3", "--policy-sync-every", "1", "--policy-patience", "1"]
    groups = ReplicaGroups(2, 2, tmp_path, args, extra={"1": ["--die-at", "6:inside", "--die-group"]})
    try:
        groups.wait_exit("1", 180)
        joiners = groups.start("1")
        deadline = time.monotonic() + 300
        while min(len([x for x in _steps(j) if x["committed"]]) for j in joiners) < 3:
            assert time.monotonic() < deadline and all(j.proc.poll() is None for j in joiners), groups.logs("1-0")
            time.sleep(0.05)
        steps_file.write_text(str(max(r.step() for r in groups.live.values()) + 4))
        records = groups.finish(180)
        live = dict(groups.live)
    finally:
        groups.close()
    for shard in (0, 1):
        assert records[f"0-{shard}"]["digest"] == records[f"1-{shard}"]["digest"], shard
    assert records["0-0"]["digest"] != records["0-1"]["digest"]  # two shards of one model, not two copies
    survivors = [records["0-0"], records["0-1"]]
    for rec in survivors:
        assert [e["kind"] for e in rec["events"]] == ["loss", "join"], rec["events"]
        assert rec["refused_steps"] >= 1 and "failed" in rec["last_error"], rec
    assert survivors[0]["refused_steps"] == survivors[1]["refused_steps"]  # the whole replica group refused alike
    recovered = [[x for x in _events_lines(j) if x["event"]["kind"] == "recovered"] for j in joiners]
    assert all(len(r) == 1 and r[0]["momentum"] == 0.0 for r in recovered), recovered
    joined = {r[0]["event"]["step"] for r in recovered}
    assert len(joined) == 1 and min(joined) > 6  # both shard ranks joined at one step, after the loss
    lines = {key: {x["step"]: x for x in _steps(p) if x["committed"]} for key, p in live.items()}
    for step in lines["0-0"]:
        if step >= min(joined):
            for shard in (0, 1):
                a, b = lines[f"0-{shard}"][step], lines[f"1-{shard}"][step]
                assert a["digest"] == b["digest"] and a["quorum"] == b["quorum"] == 2, (step, shard)
                assert a["tier"] == b["tier"] == lines["0-0"][step]["tier"], (step, shard)


def _events_lines(process):
    return [x for x in process.lines if "event" in x]
