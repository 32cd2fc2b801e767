"""Parameter and momentum hashes after 30 steps for every mode x value format x 1/2/4 ranks (gloo, CPU).

    python scripts/step_hashes.py > tests/data/step_hashes.json              # an AVX512 CPU not made by AMD
    python scripts/step_hashes.py > tests/data/step_hashes_avx2.json         # an AMD AVX2 CPU
    python scripts/step_hashes.py > tests/data/step_hashes_amd_avx512.json   # an AMD AVX512 CPU

The file is the record that a change of the step's code changes nothing a user can see: ``tests/test_step_hashes.py``
runs the same cases and compares with the file made on a CPU with the same kernels: the same vendor
(``/proc/cpuinfo``'s ``vendor_id``) and vector width (``torch.backends.cpu.get_cpu_capability()``). The vendor
matters: the math libraries take other code paths on AMD's and Intel's AVX512 CPUs, and their bits differ.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # benchlib: the gloo launcher

import hf_demo  # noqa: E402
from dist_utils import expect_ok, run_ranks  # noqa: E402
from models import loss_and_backward, tiny_mlp  # noqa: E402

STEPS = 30


def cpu_vendor() -> str:
    """The CPU's maker as Linux names it (``AuthenticAMD``, ``GenuineIntel``), or ``unknown``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "unknown")
    except OSError:
        return "unknown"


def made_here(record: dict) -> bool:
    """Whether ``record`` was made on this kind of CPU: the same vector width and torch, and the same maker (a
    record without one was made on an AVX512 CPU not AMD's: AMD's give other bits)."""
    if (record["cpu"], record["torch"]) != (torch.backends.cpu.get_cpu_capability(), torch.__version__):
        return False
    return record["vendor"] == cpu_vendor() if "vendor" in record else cpu_vendor() != "AuthenticAMD"


MODES = {
    "all_gather": {},
    "all_gather+raw": {"update_rule": "raw"},
    "all_gather+adam": {"update_rule": "adam"},
    "all_gather+adamw": {"update_rule": "adamw"},
    "all_reduce": {"exchange": "all_reduce"},
    "all_reduce+leader": {"exchange": "all_reduce", "reduce_positions": "leader"},
    "sync_every": {"sync_every": 4},
    "overlap": {"overlap": True},
    "full_sync_every": {"full_sync_every": 5},
}
FORMATS = ("bf16", "fp32", "sign")
WORLDS = (1, 2, 4)


def cases():
    for mode, kw in MODES.items():
        for fmt in FORMATS:
            if fmt == "sign" and kw.get("exchange") == "all_reduce":
                continue  # refused: all_reduce sums values
            for world in WORLDS:
                yield f"{mode}/{fmt}/{world}", {**kw, "value_format": fmt}, world


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _train(rank, world, kw):
    model = tiny_mlp()
    opt = hf_demo.DeMo(model.parameters(), lr=3e-3, compression_topk=4, compression_chunk=8, **kw)
    for step in range(STEPS):
        loss_and_backward(model, rank, step)
        opt.step()
    opt.flush()
    params = list(model.parameters())
    momenta = [opt.state[p]["momentum"] for p in params if "momentum" in opt.state[p]]
    return {"params": digest(params), "momentum": digest(momenta)}


def run_case(kw, world) -> list[dict]:
    return expect_ok(run_ranks(_train, world, kw, timeout=300))


def main() -> None:
    out = {"cpu": torch.backends.cpu.get_cpu_capability(), "vendor": cpu_vendor(), "torch": torch.__version__}
    out["cases"] = {}
    for name, kw, world in cases():
        out["cases"][name] = run_case(kw, world)
        print(name, out["cases"][name][0], file=sys.stderr)
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
