"""What encrypting DeMo's traffic costs a rank per step, on this CPU, against the payload size.

    python benchmarks/transit_cost.py [--worlds 2 8] [--repeats 20] [--out benchmarks/results/transit_cost.md]

For each payload size and world size W, one rank's work per step on what crosses the link, three ways, with the
library's own functions (no collective: the time is the CPU's, not the network's):

- ``clear``: the payload CRC32 in the header, and every received row's CRC32 checked (``codec.sign`` and
  ``codec.verify_rows`` without a secret: the default);
- ``hmac``: the same with ``HF_DEMO_SECRET``: two HMAC-SHA256 tags per header, every header's and row's checked;
- ``aes-gcm``: ``HF_DEMO_ENCRYPT=1``: this rank's header and payload sealed (AES-256-GCM), the W headers and W
  payload rows opened (:mod:`hf_demo.wire.sealing`), and the CRC32s.

The sizes are powers of 4 from 1 KiB to 16 MiB, and the payload DeMo sends per step for SmolLM2-135M's shapes at
the default settings (top-32 of 64x64 blocks, bf16 values, Elias-Fano positions), computed from the shapes (no
model is built).
Prints a Markdown table (milliseconds per step, median of ``--repeats``) and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

SMOLLM2 = dict(vocab=49152, hidden=576, intermediate=1536, layers=30, kv=192)  # tied embeddings


def smollm2_payload_bytes(chunk: int = 64, topk: int = 32, fmt: str = "bf16", coding: str = "elias_fano") -> int:
    """The bytes of DeMo's payload per step for SmolLM2-135M's parameter shapes (from the shapes alone)."""
    from hf_demo.compression import plan
    from hf_demo.wire import codec

    h, i, kv = SMOLLM2["hidden"], SMOLLM2["intermediate"], SMOLLM2["kv"]
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    shapes = [(SMOLLM2["vocab"], h)] + layer * SMOLLM2["layers"] + [(h,)]
    return codec.PayloadCodec([plan(s, chunk, topk) for s in shapes], fmt, coding).nbytes


def _median_ms(fn, repeats: int) -> float:
    times = []
    for rep in range(repeats):
        times.append(fn(rep))
    return 1000.0 * statistics.median(times)


def _clear_or_hmac(payload: torch.Tensor, world: int, secret, repeats: int) -> float:
    from hf_demo.wire import codec

    rows = payload.expand(world, -1)

    def once(rep: int) -> float:
        header = codec.Header(rep, 1, 2, 0, world, payload.numel())
        started = time.perf_counter()
        signed = codec.sign(header, payload, secret)
        _, refusal = codec.receive_headers(signed.to_bytes().repeat(world, 1), signed, secret, 0, rep)
        assert refusal is None
        codec.verify_rows([signed] * world, rows, secret, 0, rep)
        return time.perf_counter() - started

    return _median_ms(once, repeats)


def _sealed(payload: torch.Tensor, world: int, repeats: int) -> float:
    """One rank (rank 0) seals its header and payload and opens everyone's; the other senders' sealing is
    done beforehand (their own CPUs' work), outside the clock."""
    from hf_demo.wire import codec, sealing

    sealers = [sealing.Sealer(b"a benchmark's secret") for _ in range(world)]

    def once(rep: int) -> float:
        header = codec.sign(codec.Header(rep, 1, 2, 0, world, payload.numel()), payload, None)
        others = [(s.seal_header(header, rep, r), s.seal(payload, rep, "payload")) for r, s in enumerate(sealers)][1:]
        started = time.perf_counter()
        mine = (sealers[0].seal_header(header, rep, 0), sealers[0].seal(payload, rep, "payload"))
        sealed = time.perf_counter() - started
        headers, rows = (torch.stack(part) for part in zip(mine, *others))  # what the all-gathers return
        started = time.perf_counter()
        opened = sealers[0].open_headers(headers, rep, list(range(world)), 0)
        codec.verify_rows(opened, sealers[0].open_rows(rows, rep, "payload", 0), None, 0, rep)
        return sealed + time.perf_counter() - started

    return _median_ms(once, repeats)


def measure(sizes: list[int], worlds: list[int], repeats: int) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    for nbytes in sizes:
        payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        for world in worlds:
            clear = _clear_or_hmac(payload, world, None, repeats)
            hmac = _clear_or_hmac(payload, world, b"a benchmark's secret", repeats)
            gcm = _sealed(payload, world, repeats)
            out.append(dict(nbytes=nbytes, world=world, clear=clear, hmac=hmac, gcm=gcm))
    return out


def table(rows: list[dict], smollm2: int) -> str:
    lines = [
        "| payload | W | clear (CRC32) ms | HMAC-SHA256 ms | AES-256-GCM ms | AES-GCM - HMAC ms | AES-GCM MB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"{r['nbytes'] / 2**20:.3f} MiB" + (" (SmolLM2-135M)" if r["nbytes"] == smollm2 else "")
        rate = (r["world"] + 1) * r["nbytes"] / 2**20 / (r["gcm"] / 1000.0)  # bytes sealed + opened per second
        lines.append(
            f"| {name} | {r['world']} | {r['clear']:.2f} | {r['hmac']:.2f} | {r['gcm']:.2f} | "
            f"{r['gcm'] - r['hmac']:+.2f} | {rate:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8], help="world sizes (rows opened per step)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="payload bytes (default: see above)")
    parser.add_argument("--repeats", type=int, default=20, help="steps timed per cell (the median is shown)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(w < 1 for w in args.worlds) or any(s < 0 for s in args.sizes or []):
        parser.error("--repeats and --worlds must be >= 1, --sizes >= 0")
    smollm2 = smollm2_payload_bytes()
    sizes = args.sizes or sorted({4**k * 1024 for k in (0, 2, 4, 6, 7)} | {smollm2})
    torch.set_num_threads(1)
    text = (
        f"Transit cost per step and rank on {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, 1 thread, median of {args.repeats}:\n\n"
        + table(measure(sizes, args.worlds, args.repeats), smollm2)
    )
    print(text)
    if args.out is not None:
        args.out.write_text(f"# Transit cost\n\n`python benchmarks/transit_cost.py`\n\n{text}\n")
    return text


if __name__ == "__main__":
    main()
