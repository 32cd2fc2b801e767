"""Elastic faults found from outside: replica groups whose settings differ, momentum snapshots that do not fit, a
Lighthouse lost or never named, a replica group that comes back to a run that is over, and survivors of one failure
that fail at different steps. Each gives the library's own error (or warning) naming the cause and the fix, on every
replica, in bounded time.

The replica groups are ``examples/elastic.py`` processes around a real torchft Lighthouse on loopback (real gloo,
``benchlib.elastic.Replicas``); the snapshot checks use ``Elastic`` over a stand-in Manager."""

import os
import time
from pathlib import Path

import pytest
import torch

import hf_demo
from hf_demo.errors import DeMoSettingsError, DeMoSetupError, DeMoSyncError
from test_elastic import _elastic, _Manager, _stepped

FAST = ["--timeout", "10", "--step-seconds", "0.05", "--digests"]


def _torchft():
    pytest.importorskip("torchft", reason="hf_demo.elastic needs torchft (pip install 'hf-demo[ft]')")


# ---------------------------------------------------------------- momentum snapshots checked before loading
def _joiner_loading(tmp_path, dead, path, rid="r1"):
    """A restarted replica ``rid`` receiving the agreed state of step 5 (the dead one's run): its warnings."""
    peer, _ = _elastic(_Manager())
    state = peer.agreed_state()
    state["optimizer"]["demo"]["run_id"] = dead.opt.run_id
    restarted = _Manager()
    restarted.step = 5
    joiner, model = _elastic(restarted, replica_id=rid, momentum_dir=tmp_path)
    with pytest.warns(UserWarning) as caught:
        joiner.load_agreed(state)
    messages = [str(w.message) for w in caught if "hf_demo.elastic" in str(w.message)]
    assert all("momentum" not in joiner.opt.state[p] for p in model.parameters()), "a refused snapshot was loaded"
    assert not joiner.stats.momentum_restored
    return messages


def _invert(path, data: bytes, count: int = 64) -> None:
    """``count`` bytes of ``data`` (a tensor's bytes inside the file at ``path``) inverted in place on disk."""
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    assert at >= 0, "the momentum's bytes are not stored plainly in the snapshot"
    for i in range(at, at + count):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("fault", ["nan", "torn", "another_replica"])
def test_a_snapshot_that_is_not_finite_torn_or_another_replicas_is_refused_naming_the_file(tmp_path, fault):
    """A NaN in the snapshot's momentum, 64 bytes of it inverted on disk (a torn write that still unpickles), or
    replica r0's file in replica r1's place: each is refused with a warning naming the file and why, and the
    joiner's momentum starts at zero (never loaded silently)."""
    _torchft()
    from hf_demo.own_momentum import snapshot_path

    rid = "r0" if fault == "another_replica" else "r1"
    dead, _ = _stepped(_Manager(), tmp_path) if rid == "r1" else (None, None)
    if fault == "another_replica":
        manager = _Manager()
        manager.world = 1
        dead, model = _elastic(manager, replica_id="r0", momentum_dir=tmp_path)
        dead.start_step()
        model(torch.randn(4, 8)).square().mean().backward()
        dead.step()
        os.replace(snapshot_path(tmp_path, "r0"), snapshot_path(tmp_path, "r1"))  # copied over r1's
    path = snapshot_path(tmp_path, "r1")
    if fault == "nan":
        blob = torch.load(path, weights_only=True)
        blob["own"][0]["momentum"].view(-1)[3] = float("nan")
        from hf_demo.own_momentum import checksum

        blob["sha256"] = checksum(blob)  # a whole file, written so by a replica whose momentum held a NaN
        torch.save(blob, path)
    elif fault == "torn":
        first = next(iter(dead.opt.state.values()))["momentum"]
        _invert(path, first.contiguous().view(torch.uint8).numpy().tobytes()[:64])
    messages = _joiner_loading(tmp_path, dead, path)
    why = {"nan": "NaN or Inf", "torn": "checksum", "another_replica": "replica r0's, not replica r1's"}[fault]
    assert any(str(path) in m and why in m and "starts at zero" in m for m in messages), messages


def test_a_snapshot_carries_its_replica_run_and_checksum(tmp_path):
    _torchft()
    from hf_demo.own_momentum import checksum, snapshot_path

    dead, _ = _stepped(_Manager(), tmp_path)
    blob = torch.load(snapshot_path(tmp_path, "r1"), weights_only=True)
    assert blob["replica_id"] == "r1" and blob["run_id"] == dead.opt.run_id and blob["sha256"] == checksum(blob)


# ---------------------------------------------------------------- settings, decided at once on every replica
def test_a_settings_error_is_raised_after_torchft_is_told_not_retried():
    """decide(): a DeMoSettingsError is reported to torchft (whose should_commit every replica reaches alike, so
    none waits) and then raised, where a DeMoSyncError of a lost peer only refuses the step."""
    _torchft()
    manager = _Manager()
    elastic, _ = _elastic(manager)
    elastic.start_step()
    assert not elastic.decide(DeMoSyncError("a peer died"))
    elastic.start_step()
    with pytest.raises(DeMoSettingsError, match="compression_topk"):
        elastic.decide(DeMoSettingsError("settings that differ:\n    compression_topk: rank 0 4, rank 1 2"))
    assert elastic.stats.refused_steps == 2 and manager.step == 0


TRANSPORT_ERROR = 'status: Unknown, message: "transport error", details: [], metadata: MetadataMap { headers: {} }'


def test_a_settings_error_is_raised_where_torchft_fails_after_it():
    """HSDP: shard rank 0 of a replica group hosts its torchft manager server; raising the settings error first,
    it may take the server with it while another shard rank's should_commit is still in flight (or the other's is
    late, and its own times out). The settings error, which every process holds, is raised there too (torchft's
    failure in its traceback), not torchft's raw RuntimeError; with no settings error torchft's failure is raised."""
    _torchft()
    manager = _Manager()

    def gone():
        raise RuntimeError(TRANSPORT_ERROR)

    manager.should_commit = gone
    elastic, _ = _elastic(manager)
    elastic.start_step()
    with pytest.raises(DeMoSettingsError, match="compression_topk") as caught:
        elastic.decide(DeMoSettingsError("settings that differ:\n    compression_topk: rank 0 4, rank 1 2"))
    assert TRANSPORT_ERROR in str(caught.value.__context__), caught.value.__context__
    assert elastic.stats.refused_steps == 1 and not elastic.last_committed
    for error in (None, DeMoSyncError("a peer died")):
        elastic.start_step()
        with pytest.raises(RuntimeError, match="transport error"):
            elastic.decide(error)


def test_a_joiner_keeps_its_own_learning_rate_for_the_headers_to_compare():
    """A replica whose lr differs receives a peer's agreed state (with the peer's lr): it keeps its own, so the
    first exchange names both values on every replica instead of the joiner taking the peer's silently."""
    _torchft()
    peer, _ = _elastic(_Manager())
    peer.opt.param_groups[0]["lr"] = 0.003
    state = peer.agreed_state()
    manager = _Manager()
    joiner, _ = _elastic(manager)
    joiner.opt.param_groups[0]["lr"] = 0.01
    joiner.load_agreed(state)
    assert joiner.opt.param_groups[0]["lr"] == 0.01


def test_a_refused_step_with_no_replica_lost_is_not_called_a_lost_replica():
    """A step refused while the quorum keeps its size (a corrupted header retried; under Trainer, before this fix,
    every try of a settings mismatch) alerts as elastic_step_refused naming where the reason is, not as a replica
    that "left torchft's quorum"; a quorum that shrinks still alerts replica_lost."""
    from hf_demo.ops.health import HealthRules
    from hf_demo.ops.settings import HealthSettings
    from test_elastic_ops import event, monitored

    events = {1: [event("join", 1, 2)], 3: [event("loss", 3, 2, samples_lost=8)], 5: [event("loss", 5, 1)]}
    samples, _ = monitored(6, events)
    rules = HealthRules(HealthSettings(quorum_patience=100))
    alerts = [a for s in samples for a in rules.observe(s) if a.kind in ("replica_lost", "elastic_step_refused")]
    assert [(a.kind, a.step) for a in alerts] == [("elastic_step_refused", 3), ("replica_lost", 5)], alerts
    assert "left torchft's quorum" not in alerts[0].message and "last_error" in alerts[0].message, alerts[0].message


# ---------------------------------------------------------------- the Lighthouse: not named, lost
def test_no_lighthouse_named_is_one_error_naming_the_variable_and_the_fix(monkeypatch):
    _torchft()
    from hf_demo.elastic import Elastic

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    model = torch.nn.Linear(8, 8)
    with pytest.raises(DeMoSetupError, match="TORCHFT_LIGHTHOUSE is not set") as caught:
        Elastic(hf_demo.DeMo(model.parameters()), model, replica_id="0")
    assert "torchft_lighthouse" in str(caught.value)


def test_a_quorum_that_fails_names_a_lighthouse_that_is_gone():
    _torchft()
    from dist_utils import free_port
    from hf_demo.elastic import quorum_failed

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    error = quorum_failed(TimeoutError("status: Cancelled"), address)
    assert isinstance(error, DeMoSyncError)
    message = str(error)
    assert f"the Lighthouse at {address} does not answer" in message and "restart the Lighthouse" in message
    assert "torchft said: TimeoutError: status: Cancelled" in message


def test_a_restarted_replica_alone_at_step_0_is_refused(monkeypatch):
    """torchrun restarted this replica group (TORCHELASTIC_RESTART_COUNT) and its first quorum holds only itself at
    step 0: no live replica holds the run's state, and training on alone would start the run again."""
    _torchft()
    manager = _Manager()
    manager.world = 1
    elastic, _ = _elastic(manager)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(DeMoSyncError, match="alone in torchft's quorum at step 0"):
        elastic.start_step()
    manager = _Manager()  # the same restart meeting live peers (3 replicas): it goes on
    elastic, _ = _elastic(manager)
    elastic.start_step()


def test_a_replica_back_alone_at_step_0_to_a_lighthouse_that_formed_quorums_before_is_refused(monkeypatch):
    """Without torchrun (no restart count), a replica group alone at step 0 in a quorum after the Lighthouse's first
    one comes back to a run whose state no live replica holds: refused. The run's first replica alone at step 0
    (the Lighthouse's first quorum) trains."""
    _torchft()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    manager = _Manager()
    manager.world, manager.quorum = 1, 3
    elastic, _ = _elastic(manager)
    with pytest.raises(DeMoSyncError, match="formed 2 quorum.s. before this one but is alone in torchft's quorum"):
        elastic.start_step()
    manager = _Manager()
    manager.world = 1  # the Lighthouse's first quorum: a run that starts with one replica
    elastic, _ = _elastic(manager)
    elastic.start_step()


# ---------------------------------------------------------------- replica groups on loopback (a real Lighthouse)
def _replicas(tmp_path, n, args, extra=None):
    _torchft()
    from benchlib.elastic import Replicas

    return Replicas(n, tmp_path, [*FAST, *args], extra=extra)


def _exits(reps, rids, timeout: float) -> dict:
    """{replica id: (its exit code, its error line or None, the steps it tried)} once each has exited."""
    deadline = time.monotonic() + timeout
    out = {}
    for rid in rids:
        replica = reps.live[rid]
        try:
            replica.proc.wait(max(deadline - time.monotonic(), 1))
        except Exception:  # noqa: BLE001 - a replica still running: the assertion says which
            raise AssertionError(f"replica {rid} still runs after {timeout:.0f}s: {reps.logs(rid)}") from None
        errors = [x["error"] for x in replica.lines if "error" in x and "step" not in x]
        out[rid] = (replica.proc.returncode, errors[0] if errors else None, [x for x in replica.lines if "step" in x])
    return out


@pytest.mark.launch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["compression_topk", "lr"])
def test_replica_groups_whose_settings_differ_raise_the_named_error_on_every_replica(tmp_path, setting):
    """Replica group 1's top-k (or learning rate) differs from replica group 0's, from the start. Today: every step
    refused and retried forever (top-k), or group 1 silently takes group 0's lr at the first quorum. Now: both raise
    DeMoSettingsError at their first step, naming the setting and each group's value, and exit."""
    other = ["--topk", "2"] if setting == "compression_topk" else ["--lr", "0.01"]
    reps = _replicas(tmp_path, 2, ["--steps", "50"], extra={"1": other})
    try:
        done = _exits(reps, ["0", "1"], 120)
    finally:
        reps.close()
    name = "compression_topk" if setting == "compression_topk" else "param_groups[0].lr"
    values = ("4", "2") if setting == "compression_topk" else ("0.003", "0.01")
    for rid, (code, error, tried) in done.items():
        assert code == 1 and error is not None and error.startswith("DeMoSettingsError"), (rid, code, error)
        assert name in error and f"replica group 0 (rank 0 of the quorum) {values[0]}" in error, error
        assert f"replica group 1 (rank 1 of the quorum) {values[1]}" in error, error
        assert len(tried) <= 1 and not any(x["committed"] for x in tried), tried  # no refuse-and-retry loop


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_joiner_whose_top_k_differs_stops_every_replica_with_the_named_error(tmp_path):
    """Replica group 1 dies between steps 3 and 4 and comes back with another top-k: at the first step of the new
    quorum every replica raises DeMoSettingsError naming compression_topk with both values (not 587 tries)."""
    reps = _replicas(tmp_path, 2, ["--steps", "100000"], extra={"1": ["--die-at", "3:between"]})
    try:
        reps.wait_exit("1", 120)
        reps.start("1", ["--topk", "2"])
        done = _exits(reps, ["0", "1"], 150)
    finally:
        reps.close()
    for rid, (code, error, _) in done.items():
        assert code == 1 and error is not None and "DeMoSettingsError" in error, (rid, code, error)
        assert "compression_topk" in error and "4" in error and "2" in error, error
    refused = [x for x in done["0"][2] if not x["committed"]]
    assert len(refused) <= 2, refused  # within one retry (a refused step at the loss, then the raise)


def _lighthouse_process(tmp_path):
    """A ``torchft_lighthouse`` of its own (a process that can be SIGKILLed, as a Lighthouse host fails): (the
    process, its address)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import free_port

    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    port = free_port()
    log = open(tmp_path / "lighthouse.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([binary, "--min_replicas", "1", "--bind", f"[::]:{port}", "--quorum_tick_ms", "50",
                             "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    return proc, f"http://localhost:{port}"


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_lighthouse_killed_mid_run_is_one_named_error_on_every_replica(tmp_path):
    """The Lighthouse (its own process) is SIGKILLed after step 3: every replica exits with hf_demo's error naming
    the Lighthouse and the fix (not torchft's raw TimeoutError: status: Cancelled), within the quorum timeout and a
    margin."""
    _torchft()
    lighthouse, address = _lighthouse_process(tmp_path)
    try:
        reps = _replicas(tmp_path, 2, ["--steps", "100000", "--quorum-timeout", "8", "--lighthouse", address])
        try:
            reps.wait_step("0", 3, 120)
            lighthouse.kill()
            lighthouse.wait()
            stopped = time.monotonic()
            done = _exits(reps, ["0", "1"], 90)
            seconds = time.monotonic() - stopped
        finally:
            reps.close()
    finally:
        lighthouse.kill()
        lighthouse.wait()
    for rid, (code, error, _) in done.items():
        assert code == 1 and error is not None and error.startswith("DeMoSyncError"), (rid, code, error)
        assert f"the Lighthouse at {address} does not answer" in error and "restart the Lighthouse" in error, error
    assert seconds < 60, seconds


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_replica_restarted_after_the_others_finished_refuses_to_train_alone(tmp_path):
    """Replica group 1 dies at step 2; group 0 trains on to the end and exits. torchrun restarts group 1
    (TORCHELASTIC_RESTART_COUNT=1): alone in the quorum at step 0, it raises naming why, instead of training the run
    again alone and exiting 0 with other parameters."""
    reps = _replicas(tmp_path, 2, ["--steps", "6"], extra={"1": ["--die-at", "2:between"]})
    try:
        reps.wait_exit("1", 120)
        finished = reps.finish(120)
        assert finished["0"]["steps"] == 6
        reps.start("1", env={"TORCHELASTIC_RESTART_COUNT": "1"})
        done = _exits(reps, ["1"], 120)
    finally:
        reps.close()
    code, error, tried = done["1"]
    assert code == 1 and error is not None and "alone in torchft's quorum at step 0" in error, (code, error)
    assert "last checkpoint" in error and not tried, tried


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_started_again_by_any_launcher_after_the_others_finished_refuses_to_train_alone(tmp_path):
    """The same, started again by another launcher than torchrun (a plain process: no TORCHELASTIC_RESTART_COUNT).
    It trained alone and exited 0 with other parameters; it is now refused from the Lighthouse's quorum count."""
    reps = _replicas(tmp_path, 2, ["--steps", "6"], extra={"1": ["--die-at", "2:between"]})
    try:
        reps.wait_exit("1", 120)
        finished = reps.finish(120)
        assert finished["0"]["steps"] == 6
        reps.start("1")  # no TORCHELASTIC_RESTART_COUNT (the test process runs under no launcher)
        done = _exits(reps, ["1"], 120)
    finally:
        reps.close()
    code, error, tried = done["1"]
    assert code == 1 and error is not None and "alone in torchft's quorum at step 0" in error, (code, error)
    assert "came back to a run whose Lighthouse formed" in error and not tried, (error, tried)


# ---------------------------------------------------------------- survivors of one failure, at different steps
def _probe_at(rank, world, steps):
    """Rank 2 is gone (it never answers); ranks 0 and 1 fail at different steps (rank 1 a second later) and ask the
    rendezvous store who is alive, as a failed collective does: the message each would raise."""
    import datetime

    import torch.distributed as dist

    from hf_demo.exchange.transport import Transport

    dist.barrier()  # every rank started (a loaded machine forks them seconds apart)
    if rank == 2:
        return None
    transport = Transport(None, 0)  # the default group (no timed group: rank 2 takes no part)
    transport.timeout = 10.0
    time.sleep(rank * 1.0)
    message = str(transport._failure("header", 10.0, RuntimeError("Connection closed by peer"), steps[rank]))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("test/probed", "1")
    else:  # rank 0 hosts the store: it stays until rank 1 has asked
        store.wait(["test/probed"], datetime.timedelta(seconds=60))
    return message


@pytest.mark.ranks
def test_survivors_failing_at_different_steps_name_only_the_lost_rank():
    """Today the probe's key holds the step and the count of failures, so two survivors failing at steps 5 and 6
    each name the other, alive, as a rank that 'did not answer'. Both name rank 2 only."""
    from dist_utils import expect_ok, run_ranks

    zero, one, _ = expect_ok(run_ranks(_probe_at, 3, [5, 6, None], timeout=90))
    for message in (zero, one):
        assert "rank(s) [2] did not answer" in message, message


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_an_hsdp_replica_group_with_another_lr_on_one_shard_rank_is_named_on_every_process(tmp_path):
    """Elastic HSDP, 2 replica groups x 2 shard ranks: shard rank 0 of group 1 has another lr. Every process of both
    groups raises DeMoSettingsError naming the lr of every process (its replica group and shard rank), not only the
    processes whose replicate group's headers differ."""
    _torchft()
    _lr_named_on_every_process(tmp_path)


def _lr_named_on_every_process(tmp_path):
    from benchlib.elastic_groups import ReplicaGroups

    groups = ReplicaGroups(2, 2, tmp_path, [*FAST, "--steps", "50"], extra={"1": ["--lr", "0.01"]})
    try:
        done = _exits(groups, list(groups.live), 150)
    finally:
        groups.close()
    for key, (code, error, _) in done.items():
        assert code == 1 and error is not None and error.startswith("DeMoSettingsError"), (key, code, error)
        assert "param_groups[0].lr" in error and "shard rank 0 0.01" in error, (key, error)
        assert error.count(" 0.003") == 3, (key, error)  # the three other processes' lr, each named


@pytest.mark.launch
@pytest.mark.timeout(400)
def test_an_hsdp_replica_group_with_another_lr_names_it_where_its_shard_rank_0_left_first(tmp_path, monkeypatch):
    """The same, where shard rank 1 of replica group 0 asks torchft's should_commit only once shard rank 0 of its
    group has exited (tests/scripts/elastic_late_commit.py: the order a loaded machine can give). Shard rank 0
    waited for it until torchft's timeout, then left with its group's manager server; the late shard rank's call
    met the server gone. Both raised torchft's raw error (a timeout; 'status: Unknown, message: "transport
    error"') instead of the settings error every process holds. Now every process raises DeMoSettingsError."""
    _torchft()
    from benchlib import elastic_groups

    monkeypatch.setattr(elastic_groups, "EXAMPLE", Path(__file__).parent / "scripts" / "elastic_late_commit.py")
    _lr_named_on_every_process(tmp_path)
