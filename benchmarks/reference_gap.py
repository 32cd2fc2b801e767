"""Why hf_demo.DeMo ends worse than pytorch-optimizer's DeMo at "identical" settings (issue 10, item 0).

    python benchmarks/reference_gap.py                      # world 1, 60 steps, the default model (~2 min)
    python benchmarks/reference_gap.py --intermediate 640   # the same with an MLP width the chunk divides
    python benchmarks/reference_gap.py --train --steps 300 --seeds 0 1   # 2 gloo ranks, held-out loss

Part 1 (always): the block layouts both optimizers use for every parameter of the byte-level Llama of
``wan_worker.py`` (hidden 256, intermediate 688, 4 layers), and the coefficients each sends per step.

Part 2 (always): one process (gloo world of 1, which the peer needs), three copies of one model
(same init), the same batch every step, three optimizers:

- ``hf``      ``hf_demo.DeMo(value_format="fp32")`` as shipped (a dimension the chunk does not divide is
              zero-padded up to a multiple of the chunk);
- ``hf-div``  the same optimizer with ``hf_demo.compression.blocks.plan`` replaced, in this process only, by the peer's
              blocking rule (the largest divisor of the dimension not above the chunk): the proposed fix;
- ``peer``    ``pytorch_optimizer.DeMo`` (chunk 64, top-32, its defaults otherwise).

Per step it prints the largest parameter difference to the peer, split into MLP matrices (688 x 256 and
256 x 688) and everything else, and the number of entries whose step differs (a sign flip is a difference
of 2*lr). It also reports how much of hf's residual momentum lives in the zero-padding (rows/columns
that do not exist in the parameter).

Part 3 (``--train``): 2 gloo ranks, ``--steps`` steps, warmup + constant lr as in the measurement of the
issue, the three variants per seed (run through ``convergence.py``'s runner), final held-out loss.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import wan_worker  # noqa: E402  (model and data of the WAN benchmark, reused)


# ------------------------------------------------------------------ the proposed fix, as a patch
def divisor_split(n: int, chunk: int) -> int:
    """The peer's rule: the largest divisor of n not above chunk (n itself when n <= chunk)."""
    if n <= chunk:
        return n
    return max(d for d in range(1, chunk + 1) if n % d == 0)


def divisor_plan(shape, chunk, topk):
    """``hf_demo.compression.blocks.plan`` with the peer's blocking (no padding)."""
    from hf_demo.compression.blocks import BlockLayout

    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = shape[0], math.prod(shape[1:])
    b0, b1 = divisor_split(rows, chunk), divisor_split(cols, chunk)
    return BlockLayout(tuple(shape), rows, cols, b0, b1, min(topk, b0 * b1))


def use_divisor_blocking() -> None:
    """Make hf_demo.DeMo in this process block as the peer does (benchmark-only monkeypatch)."""
    import hf_demo
    import hf_demo.compression.blocks as hblocks

    original = hblocks.plan
    for name in dir(hf_demo):  # every hf_demo module that imported plan by name (optimizer, ...)
        mod = getattr(hf_demo, name)
        if getattr(mod, "plan", None) is original:
            mod.plan = divisor_plan


# ------------------------------------------------------------------ helpers
def init_world_of_one() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(minutes=5))


def model_args(a) -> SimpleNamespace:
    return SimpleNamespace(
        hidden=a.hidden, intermediate=a.intermediate, layers=a.layers, heads=a.heads, seq_len=a.seq_len, seed=a.seed
    )


def is_mlp(name: str) -> bool:
    return "mlp" in name


def layouts(model, chunk: int, topk: int) -> list[dict]:
    from hf_demo.compression.blocks import plan

    rows = []
    for name, p in model.named_parameters():
        a, b = plan(tuple(p.shape), chunk, topk), divisor_plan(tuple(p.shape), chunk, topk)
        rows.append(
            dict(
                name=name,
                shape=tuple(p.shape),
                numel=p.numel(),
                hf_block=(a.b0, a.b1),
                hf_blocks=a.nblocks,
                hf_coeffs=a.nblocks * a.k,
                hf_padded=a.padded,
                peer_block=(b.b0, b.b1),
                peer_blocks=b.nblocks,
                peer_coeffs=b.nblocks * b.k,
            )
        )
    return rows


def print_layouts(rows) -> dict:
    kinds = {}
    for r in rows:
        key = (r["shape"], r["hf_block"], r["peer_block"])
        k = kinds.setdefault(key, dict(count=0, **r))
        k["count"] += 1
    print(f"\n## Block layouts (chunk {ARGS.chunk}, top-k {ARGS.topk})\n")
    print("| shape | tensors | hf block | hf coeffs/step | peer block | peer coeffs/step | hf/peer |")
    print("|---|---|---|---|---|---|---|")
    for (shape, hb, pb), k in kinds.items():
        pad = " (zero-padded)" if k["hf_padded"] else ""
        print(
            f"| {shape} | {k['count']} | {hb[0]}x{hb[1]}{pad} | {k['hf_coeffs']} | {pb[0]}x{pb[1]} | "
            f"{k['peer_coeffs']} | {k['hf_coeffs'] / k['peer_coeffs']:.3f} |"
        )
    tot = {s: sum(r[s] for r in rows) for s in ("numel", "hf_coeffs", "peer_coeffs")}
    mlp = {s: sum(r[s] for r in rows if is_mlp(r["name"])) for s in ("numel", "hf_coeffs", "peer_coeffs")}
    print(
        f"\nAll {tot['numel']} parameters: hf sends {tot['hf_coeffs']} coefficients/step "
        f"({tot['hf_coeffs'] / tot['numel'] * 100:.3f}% of entries), the peer {tot['peer_coeffs']} "
        f"({tot['peer_coeffs'] / tot['numel'] * 100:.3f}%): ratio {tot['hf_coeffs'] / tot['peer_coeffs']:.3f}."
    )
    print(
        f"MLP matrices ({mlp['numel']} parameters, {mlp['numel'] / tot['numel'] * 100:.1f}% of the model): hf "
        f"{mlp['hf_coeffs']} ({mlp['hf_coeffs'] / mlp['numel'] * 100:.3f}%), peer {mlp['peer_coeffs']} "
        f"({mlp['peer_coeffs'] / mlp['numel'] * 100:.3f}%)."
    )
    return dict(total=tot, mlp=mlp)


def pad_energy(opt, model) -> tuple[float, float]:
    """hf's residual momentum (squared norm, parameter domain): (energy in the zero-padding, total)."""
    from hf_demo.compression.blocks import BlockLayout, dct_matrix, plan

    pad_e = tot_e = 0.0
    for p in model.parameters():
        m = opt.state[p].get("momentum")
        if m is None:
            continue
        lay: BlockLayout = plan(tuple(p.shape), ARGS.chunk, ARGS.topk)
        if not lay.padded:
            tot_e += float(m.double().pow(2).sum())
            continue
        blocks = m.reshape(lay.block_rows, lay.block_cols, lay.b0, lay.b1)
        x = dct_matrix(lay.b0).T @ blocks @ dct_matrix(lay.b1)
        full = x.permute(0, 2, 1, 3).reshape(lay.block_rows * lay.b0, lay.block_cols * lay.b1).double()
        e_all = float(full.pow(2).sum())
        e_in = float(full[: lay.rows, : lay.cols].pow(2).sum())
        pad_e += e_all - e_in
        tot_e += e_all
    return pad_e, tot_e


def transmitted(g: torch.Tensor, layout) -> torch.Tensor:
    """What one top-k round of a fresh momentum (= g) sends, decoded and cropped to the parameter."""
    from hf_demo.compression import functional as F
    from hf_demo.compression.blocks import decode, encode

    coeffs = encode(g, layout)
    idx, vals = F.select(coeffs, layout.k)
    return decode(F.densify(idx, vals, layout), layout)


def compression_quality(model, batch, chunk: int, topk: int) -> list[dict]:
    """Step 1 on the MLP matrices: how well one top-k round of the gradient represents it, per blocking."""
    from hf_demo.compression.blocks import plan

    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch).loss.backward()
    k_equal = round(topk * divisor_plan((688, 256), chunk, topk).nblocks / plan((688, 256), chunk, topk).nblocks)
    cases = {
        f"pad, top-{topk}": lambda s: plan(s, chunk, topk),
        f"divisor, top-{topk}": lambda s: divisor_plan(s, chunk, topk),
        f"pad, top-{k_equal} (as many coefficients as divisor)": lambda s: plan(s, chunk, k_equal),
    }
    out = []
    for label, lay in cases.items():
        coeffs = cos_num = cos_den_t = cos_den_g = agree = n = 0.0
        for name, p in model.named_parameters():
            if not is_mlp(name):
                continue
            g = p.grad.float()
            layout = lay(tuple(p.shape))
            t = transmitted(g, layout)
            coeffs += layout.nblocks * layout.k
            cos_num += float((t * g).sum())
            cos_den_t += float(t.pow(2).sum())
            cos_den_g += float(g.pow(2).sum())
            agree += float((t.sign() == g.sign()).sum())
            n += g.numel()
        out.append(
            dict(
                case=label,
                coefficients=int(coeffs),
                cosine=cos_num / math.sqrt(cos_den_t * cos_den_g),
                sign_agreement=agree / n,
            )
        )
    model.zero_grad(set_to_none=True)
    print("\n## Step 1, MLP matrices: one top-k round of the gradient vs the gradient\n")
    print("| blocking | coefficients | cosine(sent, grad) | entries with sign(sent) = sign(grad) |")
    print("|---|---|---|---|")
    for r in out:
        print(f"| {r['case']} | {r['coefficients']} | {r['cosine']:.4f} | {r['sign_agreement'] * 100:.1f}% |")
    return out


# ------------------------------------------------------------------ part 2: world of one, step by step
def step_by_step(a) -> dict:
    import pytorch_optimizer

    import hf_demo

    init_world_of_one()
    torch.manual_seed(a.seed)
    base = wan_worker.build_model(model_args(a))
    models = {k: copy.deepcopy(base) for k in ("hf", "hf-div", "peer", "peer-ulp")}
    with torch.no_grad():  # control: the peer from weights one ulp away (towards +inf) from the others
        for p in models["peer-ulp"].parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
    names = [n for n, _ in base.named_parameters()]
    common = dict(lr=a.lr, compression_decay=0.999, compression_chunk=a.chunk)
    import hf_demo.optim.optimizer as hopt

    original_plan = hopt.plan
    opts = {"hf": hf_demo.DeMo(models["hf"].parameters(), compression_topk=a.topk, value_format="fp32", **common)}
    hopt.plan = divisor_plan
    opts["hf-div"] = hf_demo.DeMo(models["hf-div"].parameters(), compression_topk=a.topk, value_format="fp32", **common)
    hopt.plan = original_plan
    opts["peer"] = pytorch_optimizer.DeMo(models["peer"].parameters(), compression_top_k=a.topk, **common)
    opts["peer-ulp"] = pytorch_optimizer.DeMo(models["peer-ulp"].parameters(), compression_top_k=a.topk, **common)
    dct_gap = {
        n: float(
            (
                opts["peer"].transform.f_dict[(n, torch.device("cpu"), torch.float32)]
                - __import__("hf_demo").blocks.dct_matrix(n).T
            )
            .abs()
            .max()
        )
        for n in sorted({key[0] for key in opts["peer"].transform.f_dict})
    }
    print(
        "\nDCT matrices, max |peer's forward matrix - hf's D.T| per size: "
        + ", ".join(f"{n}: {v:.1e}" for n, v in dct_gap.items())
    )

    data = wan_worker.Data(wan_worker.stdlib_bytes(), 0, 1, a.seq_len, a.batch_size, a.seed, 0.02, a.eval_batches)
    quality = compression_quality(copy.deepcopy(base), data.eval[0], a.chunk, a.topk)
    rows = []
    print("\n## Step by step, world of one (max |param - peer's param|; entries whose step differs)\n")
    print(
        "| step | hf−peer MLP | hf−peer rest | entries ≠ (hf) | hf-div−peer MLP | hf-div−peer rest | "
        "entries ≠ (hf-div) | entries ≠ (peer-ulp) | train loss hf / hf-div / peer | hf residual in padding |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step in range(1, a.steps + 1):
        batch = data.next_batch()
        losses = {}
        for k, m in models.items():
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            losses[k] = float(loss)
            hopt.plan = divisor_plan if k == "hf-div" else original_plan
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
        hopt.plan = original_plan
        rec = dict(step=step, loss=losses)
        params = {k: dict(m.named_parameters()) for k, m in models.items()}
        for k in ("hf", "hf-div", "peer-ulp"):
            mlp = rest = 0.0
            ndiff = 0
            for n in names:
                d = (params[k][n] - params["peer"][n]).abs()
                if is_mlp(n):
                    mlp = max(mlp, float(d.max()))
                else:
                    rest = max(rest, float(d.max()))
                ndiff += int((d > a.lr / 2).sum())
            rec[k] = dict(mlp=mlp, rest=rest, entries_differing=ndiff)
        pe, te = pad_energy(opts["hf"], models["hf"])
        rec["hf_pad_energy_share"] = pe / te if te else 0.0
        rows.append(rec)
        if step <= 10 or step % a.print_every == 0 or step == a.steps:
            print(
                f"| {step} | {rec['hf']['mlp']:.2e} | {rec['hf']['rest']:.2e} | {rec['hf']['entries_differing']} | "
                f"{rec['hf-div']['mlp']:.2e} | {rec['hf-div']['rest']:.2e} | {rec['hf-div']['entries_differing']} | "
                f"{rec['peer-ulp']['entries_differing']} | "
                f"{losses['hf']:.4f} / {losses['hf-div']:.4f} / {losses['peer']:.4f} | "
                f"{rec['hf_pad_energy_share'] * 100:.2f}% |",
                flush=True,
            )
    evals = {k: wan_worker.evaluate(m, data.eval) for k, m in models.items()}
    print(
        f"\nHeld-out loss after {a.steps} steps (world of one): " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items())
    )
    first = {
        k: next((r["step"] for r in rows if r[k]["entries_differing"] > 0), None) for k in ("hf", "hf-div", "peer-ulp")
    }
    print("First step with a differing parameter entry: " + ", ".join(f"{k} {v}" for k, v in first.items()))
    return dict(rows=rows, heldout=evals, first_divergence=first, dct_gap=dct_gap, step1_quality=quality)


# ------------------------------------------------------------------ part 3: 2 ranks, held-out loss
def train(a) -> list[dict]:
    import convergence

    variants = {
        "hf": "demo:value_format=fp32",
        "hf-k47": "demo:value_format=fp32,mlp_topk=47",
        "hf-div": "demo:value_format=fp32,blocking=divisor",
        "peer": "peer",
    }
    results = []
    for seed in a.seeds:
        for label in a.variants:
            spec = variants[label]
            method = convergence.parse_method(spec, label)
            cfg = convergence.RunConfig(
                method=method,
                lr=a.lr,
                seed=seed,
                steps=a.steps,
                warmup=5,
                schedule="constant",
                world=2,
                eval_every=a.eval_every,
                hidden=a.hidden,
                intermediate=a.intermediate,
                layers=a.layers,
                heads=a.heads,
                seq_len=a.seq_len,
                batch_size=a.batch_size,
                eval_batches=a.eval_batches,
                topk=a.topk,
                chunk=a.chunk,
            )
            r = convergence.run(cfg)
            if not r.get("ok"):
                print(f"seed {seed} {label}: FAILED {r['error']}", flush=True)
                continue
            print(
                f"seed {seed} {label:6s} final held-out {r['final_loss']:.4f}  "
                f"bytes/param/step {r['bytes_per_param_step']:.4f}  ({r['wall_s']:.0f} s)",
                flush=True,
            )
            results.append(
                dict(
                    seed=seed,
                    variant=label,
                    final_loss=r["final_loss"],
                    bytes_per_param_step=r["bytes_per_param_step"],
                    evals=r["evals"],
                )
            )
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(dict(args=vars(a), train=results), indent=1))
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="model init and data seed of part 2")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--train", action="store_true", help="part 3: 2-rank training runs instead of part 2")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["hf", "hf-div", "peer"],
        choices=["hf", "hf-div", "hf-k47", "peer"],
        help="part 3: which optimizers, run in this order per seed",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON with everything measured")
    return p.parse_args(argv)


ARGS = None


def main(argv=None):
    global ARGS
    ARGS = a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out = dict(args=vars(a))
    out["layout_summary"] = print_layouts(layouts(wan_worker.build_model(model_args(a)), a.chunk, a.topk))
    if a.train:
        out["train"] = train(a)
    else:
        out["step_by_step"] = step_by_step(a)
    if a.out and not a.train:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1, default=str))
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
