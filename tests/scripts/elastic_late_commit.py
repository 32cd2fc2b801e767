"""``examples/elastic.py``, where shard rank 1 of HSDP replica group 0 asks torchft's ``should_commit`` (its first
one) only once shard rank 0 of its group has exited: the order a loaded machine can give when every process of the
group raises the same error after ``should_commit``. Shard rank 0 hosts the group's torchft manager server (and
leads the group's Unix process group, ``benchlib.elastic_groups``); leaving first, it takes the server with it, and
the late shard rank's call fails with torchft's raw error. Run by tests/test_elastic_faults.py in place of the
example."""

import os
import runpy
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic.py"


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def _late_on_group_0_shard_1() -> None:
    if os.environ.get("RANK") != "1" or sys.argv[sys.argv.index("--replica-id") + 1] != "0":
        return
    from torchft.manager import Manager

    real = Manager.should_commit

    def late(self, *args, **kwargs):
        Manager.should_commit = real  # the first call only
        leader, deadline = os.getpgrp(), time.monotonic() + 120  # the group's shard rank 0 leads its process group
        while not _gone(leader) and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(self, *args, **kwargs)

    Manager.should_commit = late


_late_on_group_0_shard_1()
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
