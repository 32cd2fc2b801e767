"""How much code one steady DeMo step walks through: the distinct hf_demo functions and files that one
``optimizer.step()`` enters, with the default settings on 2 gloo ranks (a 4-tensor MLP), after 3 warm-up steps.

    python benchmarks/step_trace.py [--settings key=value,...] [--world 2] [--functions] [--json]

Prints a table of files (functions entered in each) and a summary line; ``--functions`` also lists every function
entered under its file; ``--json`` prints one JSON object instead: {"functions", "files", "calls", "by_file",
"names"} (names: file -> sorted function names). The design goal for a default steady step: at most 90
functions in at most 12 files (docs/DESIGN.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

from benchlib.overrides import parse_overrides
from benchlib.ranks import expect_ok, run_ranks

HIDDEN = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def _tracer(root: str, funcs: set, files: set, calls: list):
    def prof(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        rel = os.path.relpath(frame.f_code.co_filename, root)
        calls[0] += 1
        files.add(rel)
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if not name.endswith(HIDDEN):
            funcs.add(f"{rel}:{name}")

    return prof


def trace_rank(rank: int, world: int, settings: dict, warmup: int) -> dict:
    import hf_demo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    opt = hf_demo.create_optimizer(model, lr=1e-3, **settings)
    gen = torch.Generator().manual_seed(7 + rank)
    root = os.path.dirname(os.path.abspath(hf_demo.__file__))
    funcs, files, calls = set(), set(), [0]
    for step in range(warmup + 1):
        loss = model(torch.randn(16, 64, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if step == warmup:
            sys.setprofile(_tracer(root, funcs, files, calls))
        try:
            opt.step()
        finally:
            sys.setprofile(None)
    opt.flush()
    hf_demo.shutdown()
    by_file = Counter(f.split(":", 1)[0] for f in funcs)
    names = {path: sorted(f.split(":", 1)[1] for f in funcs if f.split(":", 1)[0] == path) for path in by_file}
    return {
        "functions": len(funcs),
        "files": len(files),
        "calls": calls[0],
        "by_file": dict(by_file.most_common()),
        "names": names,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="", help="DeMo settings as key=value,... (default: the defaults)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the traced one (default 3)")
    ap.add_argument("--functions", action="store_true", help="list every function entered, under its file")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    settings = parse_overrides(args.settings) if args.settings else {}
    out = expect_ok(run_ranks(trace_rank, args.world, settings, args.warmup, timeout=300))[0]
    if args.json:
        print(json.dumps(out))
        return 0
    for path, n in out["by_file"].items():
        print(f"{n:4d}  hf_demo/{path}")
        if args.functions:
            for name in out["names"][path]:
                print(f"          {name}")
    print(f"one steady step on {args.world} ranks enters {out['functions']} functions in {out['files']} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
