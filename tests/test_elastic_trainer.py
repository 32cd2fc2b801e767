"""Elastic DeMo under Trainer (issue 40, item 6): DeMoTrainer and a ``with_demo`` trainer, each replica group one
``torchrun --nproc_per_node 1`` around a torchft Lighthouse on loopback (tests/scripts/elastic_trainer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dist_utils import free_port
from launch_utils import ROOT

pytest.importorskip("torchft")
SCRIPT = ROOT / "tests" / "scripts" / "elastic_trainer.py"


class Replica:
    """One replica group: ``torchrun --nproc_per_node 1`` of the script; its JSON lines collected as they come."""

    def __init__(self, rid: int, lighthouse: str, out: Path, *args: str, restarts: int = 0):
        env = {**os.environ, "REPLICA_GROUP_ID": str(rid), "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": lighthouse,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}  # fmt: skip
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--max-restarts",
               str(restarts), "--master_port", str(free_port()), str(SCRIPT), "--out", str(out), *args]  # fmt: skip
        self.log = open(out / f"replica{rid}.log", "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT)
        self.lines: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass

    def seen(self, test, timeout: float, after: int = 0) -> dict:
        """The first line from the ``after``-th on for which ``test`` holds (its index: ``line["at"]``); raises after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in enumerate(list(self.lines)[after:], after):
                if test(line):
                    return {**line, "at": at}
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"not seen in {timeout:.0f}s (exit {self.proc.poll()}): {self.lines[-5:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture
def lighthouse():
    from hf_demo.elastic import lighthouse as start

    server = start(min_replicas=1, join_timeout_ms=30_000)
    yield server.address()
    server.shutdown()


def _start_together(replicas: list[Replica], out: Path) -> None:
    """Every replica's Manager up (its train_begin line) before any takes a step: none trains ahead alone."""
    for r in replicas:
        r.seen(lambda x: "train_begin" in x, 240)
    (out / "start").write_text("go")


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"replica{rid}.json").read_text()) for rid in (0, 1)]


@pytest.mark.launch
@pytest.mark.slow
def test_demo_trainer_and_a_with_demo_trainer_train_as_two_replica_groups(tmp_path, lighthouse):
    """Fault-free: one replica group runs DeMoTrainer, the other with_demo(Trainer, TrainingArguments); from their
    own initial weights and their own shards of the data, they end bitwise identical, every step committed by a
    quorum of both, with the same learning-rate schedule."""
    start = ["--steps", "6", "--start-file", str(tmp_path / "start")]
    replicas = [Replica(0, lighthouse, tmp_path, *start, "--trainer", "demo"),
                Replica(1, lighthouse, tmp_path, *start, "--trainer", "with_demo")]  # fmt: skip
    _start_together(replicas, tmp_path)
    codes = [r.wait(300) for r in replicas]
    assert codes == [0, 0], [(tmp_path / f"replica{i}.log").read_text()[-3000:] for i in (0, 1)]
    a, b = _results(tmp_path)
    assert a["digest"] == b["digest"]
    assert a["global_step"] == b["global_step"] == a["committed"] == b["committed"] == 6
    assert [s["quorum"] for s in a["steps"]] == [2] * 6 and all(s["committed"] for s in a["steps"] + b["steps"])
    assert [s["lr"] for s in a["steps"]] == [s["lr"] for s in b["steps"]]
    assert a["recoveries"] + b["recoveries"] == 1  # the first quorum gave one replica the other's weights


@pytest.mark.launch
@pytest.mark.slow
def test_a_killed_replica_group_costs_the_survivor_one_step_under_trainer(tmp_path, lighthouse):
    """Replica group 1's worker SIGKILLs itself inside step 5 (after its backward pass, before its optimizer step):
    group 0, in that step's collectives, refuses it (nothing applied), trains on alone without reloading anything,
    and ends at max_steps with every counted step committed."""
    steps = ["--steps", "16", "--step-seconds", "0.1", "--start-file", str(tmp_path / "start")]
    survivor = Replica(0, lighthouse, tmp_path, *steps)
    lost = Replica(1, lighthouse, tmp_path, *steps, "--trainer", "with_demo", "--die-at", "5")
    _start_together([survivor, lost], tmp_path)
    assert survivor.wait(300) == 0, (tmp_path / "replica0.log").read_text()[-3000:]
    assert lost.wait(60) != 0
    [a] = [json.loads((tmp_path / "replica0.json").read_text())]
    assert a["global_step"] == a["committed"] == 16 and a["refused_steps"] == 1, a
    verdicts = [(s["quorum"], s["committed"]) for s in a["steps"]]
    assert verdicts[:4] == [(2, True)] * 4 and verdicts[4] == (2, False), verdicts  # step 5: the step in flight
    assert verdicts[5:] == [(1, True)] * 12, verdicts  # then alone, steps 5 to 16 again counted once each
    assert [s["step"] for s in a["steps"] if s["committed"]] == list(range(1, 17))


@pytest.mark.launch
@pytest.mark.slow
def test_a_killed_replica_group_comes_back_under_trainer(tmp_path, lighthouse):
    """Replica group 1's worker SIGKILLs itself inside step 5; torchrun restarts it (--max-restarts); the restarted
    worker receives the agreed state from group 0 and continues at group 0's step with the same learning rate.
    Both stop 5 steps after they train together again, bitwise identical."""
    stop = tmp_path / "stop"
    steps = ["--steps", "1000", "--step-seconds", "0.2", "--start-file", str(tmp_path / "start"), "--stop-file",
             str(stop)]  # fmt: skip
    survivor = Replica(0, lighthouse, tmp_path, *steps)
    # restarted, it waits 10 s: past the Lighthouse's heartbeat timeout, so the survivor trains alone meanwhile
    # (one that is back at once may join the survivor's next quorum directly: test_elastic.py covers that recovery)
    lost = Replica(1, lighthouse, tmp_path, *steps, "--trainer", "with_demo", "--die-at", "5", "--restart-delay",
                   "10", restarts=2)  # fmt: skip
    _start_together([survivor, lost], tmp_path)
    first = lost.seen(lambda x: "train_begin" in x, 240)["train_begin"]
    alone = survivor.seen(lambda x: x.get("quorum") == 1, 240)["step"]
    restarted = lost.seen(lambda x: x.get("train_begin") not in (None, first), 240)["at"]  # torchrun's restart
    back = lost.seen(lambda x: x.get("quorum") == 2 and x.get("committed"), 240, after=restarted)["step"]
    stop.write_text(str(back + 5))
    codes = [survivor.wait(300), lost.wait(300)]
    assert codes == [0, 0], [(tmp_path / f"replica{i}.log").read_text()[-3000:] for i in (0, 1)]
    a, b = _results(tmp_path)
    assert a["digest"] == b["digest"] and a["global_step"] == b["global_step"] == a["committed"] == back + 5
    assert a["refused_steps"] == 1 and alone < back  # the step in flight refused, then alone, then together
    assert b["recoveries"] >= 1 and b["steps"][0]["step"] > alone  # the restarted worker began at the quorum's step
    lr_a = {s["step"]: s["lr"] for s in a["steps"] if s["committed"]}
    assert all(lr_a[s["step"]] == s["lr"] for s in b["steps"] if s["committed"])
    # data: the restarted worker read its shard on from torchft's committed step (not from the epoch's start); the
    # survivor read its own shard in order, the refused step's batch included (Trainer's loader does not read it
    # again: samples_lost); the survivor counted the restarted one's shard at the steps it was away
    committed = [s for s in b["steps"] if s["committed"]]
    assert [s["samples"] for s in committed] == [_shard_batch(1, s["step"] - 1) for s in committed]
    assert [s["samples"] for s in a["steps"]] == [_shard_batch(0, i) for i in range(len(a["steps"]))]
    assert a["samples_lost"] == 2 * 4  # the refused step: both replicas' batches
    away = sum(1 for s in a["steps"] if s["committed"] and s["quorum"] == 1)
    assert away >= 1 and a["samples_unread"] == 4 * away and b["samples_unread"] == 0, (a, b)
    # the same figures as the survivor's ops metrics (the monitor's totals and the last log row)
    ops = a["ops"]
    assert (ops["samples_unread"], ops["samples_lost"], ops["losses"]) == (4 * away, 2 * 4, 1), ops
    assert (ops["logged_unread"], ops["logged_lost"]) == (4.0 * away, 8.0), ops


def _shard_batch(rid: int, step: int, batch: int = 4, size: int = 512, seed: int = 42) -> list[int]:
    """The samples replica ``rid`` of 2 reads at committed step ``step`` (0-based) when each step reads the next batch
    of its shard's stream (the epochs one after another, DistributedSampler's shard of each epoch's permutation)."""
    from torch.utils.data.distributed import DistributedSampler

    shard = DistributedSampler(range(size), num_replicas=2, rank=rid, shuffle=True, seed=seed)
    epoch, offset = divmod(step * batch, len(shard))
    shard.set_epoch(epoch)
    return list(shard)[offset : offset + batch]


# ---------------------------------------------------------------- the parts, in one process
def test_demo_elastic_takes_true_or_elastics_arguments_and_names_the_data_shard(monkeypatch):
    from hf_demo.errors import DeMoSetupError
    from hf_demo.hf import elastic

    assert elastic.options(None) is None and elastic.options(False) is None and elastic.options(True) == {}
    assert elastic.options({"min_replicas": 2}) == {"min_replicas": 2}
    with pytest.raises(TypeError, match="demo_elastic must be True, False or a dict"):
        elastic.options("yes")
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    assert elastic.data_shard({}) == (2, 3) and elastic.data_shard({"replica_id": 0, "replicas": 4}) == (0, 4)
    with pytest.raises(DeMoSetupError, match="replica_id 3 is not one of the 3 replica groups"):
        elastic.data_shard({"replica_id": 3})
    monkeypatch.delenv("NUM_REPLICA_GROUPS")
    with pytest.raises(DeMoSetupError, match="NUM_REPLICA_GROUPS"):
        elastic.data_shard({})


def test_the_schedule_is_set_to_torchfts_committed_step():
    import torch

    from hf_demo.hf.elastic import set_schedule

    def schedule():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    stepped, jumped = schedule(), schedule()
    for _ in range(7):
        stepped.optimizer.step()
        stepped.step()
    set_schedule(jumped, 7)  # a replica that recovered at step 7
    assert jumped.last_epoch == 7 and jumped.get_last_lr() == stepped.get_last_lr() == [1.0 / 8]
    set_schedule(jumped, 5)  # the survivors after refused steps: back to the committed step
    assert jumped.optimizer.param_groups[0]["lr"] == 1.0 / 6


class _FakeManager:
    def __init__(self):
        self.step = 0

    def current_step(self):
        return self.step


class _FakeElastic:
    """What ElasticCallback reads of hf_demo.elastic.Elastic: start_step, the manager's step, the verdict."""

    def __init__(self):
        self.manager, self.last_committed, self.world, self.batch_size, self.unread_samples = (
            _FakeManager(),
            True,
            2,
            4,
            0,
        )

    def start_step(self):
        pass

    def unread(self, samples):
        self.unread_samples += samples


def test_a_refused_step_does_not_count_and_max_steps_is_reached_by_committed_steps():
    from transformers import TrainerControl, TrainerState

    from hf_demo.hf.elastic import ElasticCallback

    options = {"replica_id": 0, "replicas": 3}
    trainer = type("T", (), {"demo_elastic": _FakeElastic(), "lr_scheduler": None, "_elastic_options": options})()
    callback = ElasticCallback(trainer)
    state, control = TrainerState(max_steps=3), TrainerControl()
    for verdict in (True, False, True, True):  # step 2 is refused: it takes four steps to commit three
        callback.on_step_begin(None, state, control)
        trainer.demo_elastic.last_committed = verdict
        trainer.demo_elastic.manager.step += verdict
        state.global_step += 1  # what Trainer does after the optimizer step
        control.should_training_stop = state.global_step >= state.max_steps  # Trainer's flow callback
        control.should_log = True
        callback.on_step_end(None, state, control)
        assert state.global_step == trainer.demo_elastic.manager.step
        assert control.should_log == verdict  # a refused step logs nothing
    assert state.global_step == 3 and control.should_training_stop
    assert trainer.demo_elastic.unread_samples == 3 * 4  # a third replica missing from each committed step


def test_demo_elastic_refuses_a_trainer_without_demo(tmp_path):
    import torch
    from datasets import Dataset

    import hf_demo
    from hf_demo.errors import DeMoSetupError

    data = Dataset.from_dict({"x": [[0.0] * 8] * 8, "labels": [0.0] * 8})
    model = torch.nn.Linear(8, 1)
    args = hf_demo.DeMoTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", use_cpu=True, report_to=[])
    with pytest.raises(DeMoSetupError, match="demo_elastic trains DeMo elastically: give --optim demo"):
        hf_demo.DeMoTrainer(model=model, args=args, train_dataset=data, demo_elastic=True)


def test_a_shard_stream_reads_on_from_its_position_across_epochs():
    """ShardStream: DistributedSampler's shard of each epoch's permutation, one epoch after another; a replica that
    sets its position (a restarted one, at torchft's committed step) reads on from there, and the next iteration
    starts the next epoch."""
    from torch.utils.data.distributed import DistributedSampler

    from hf_demo.hf.elastic import ShardStream

    reference = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3)
    epochs = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        epochs += list(reference)
    stream = ShardStream(range(20), rank=1, replicas=2, seed=3)
    assert len(stream) == 10
    whole = list(stream) + list(stream) + list(stream)  # epochs 0, 1, 2 of the shard
    assert whole == epochs and whole[:10] != whole[10:20]
    stream.position = 14  # epoch 1, its fifth sample
    assert list(stream) == whole[14:20] and list(stream) == whole[20:30]
    stream.set_epoch(0)  # Trainer's epoch counter does not move the stream
    assert stream.position == 30


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("setting", ["compression_topk", "lr"])
def test_replica_groups_whose_settings_differ_stop_under_trainer_naming_the_setting(tmp_path, lighthouse, setting):
    """Replica group 1's top-k (or learning rate) differs from group 0's, both under DeMoTrainer with the ops
    callbacks on. Every step was refused and retried, with a warning each time that "a replica left torchft's
    quorum" though none did, and the cause never printed. Both replica groups now stop at their first step whose
    headers differ with DeMoSettingsError naming the setting and each group's value, and no alert blames a lost
    replica."""
    other = ["--topk", "2"] if setting == "compression_topk" else ["--lr", "0.02"]
    start = ["--steps", "40", "--start-file", str(tmp_path / "start")]
    replicas = [Replica(0, lighthouse, tmp_path, *start), Replica(1, lighthouse, tmp_path, *start, *other)]
    _start_together(replicas, tmp_path)
    codes = [r.wait(240) for r in replicas]
    logs = [(tmp_path / f"replica{rid}.log").read_text() for rid in (0, 1)]
    name = "compression_topk" if setting == "compression_topk" else "param_groups[0].lr"
    values = ("4", "2") if setting == "compression_topk" else ()  # (the lr's: the warm-up's at that step)
    for rid, (code, log, replica) in enumerate(zip(codes, logs, replicas)):
        assert code != 0 and "DeMoSettingsError" in log, (rid, code, log[-3000:])
        assert name in log and "replica group 0 (rank 0 of the quorum)" in log, log[-3000:]
        assert "replica group 1 (rank 1 of the quorum)" in log and all(v in log for v in values), log[-3000:]
        assert "a replica left torchft's quorum" not in log, log[-3000:]
        assert not any(x.get("committed") for x in replica.lines if "step" in x and x["step"] > 2), replica.lines
