"""Does ``torch.compile`` speed up DeMo's per-bucket math on this machine? One bucket of SmolLM2-135M's size class
(4096 blocks of 64x64, top-32), one thread: the exchange's local part (top-k, the Elias-Fano records, bf16
values, error feedback) and the receiver's Elias-Fano decoding, eager against compiled (inductor, static shapes).
Prints the compile time and the fastest of 5 runs each; the compiled decoding is checked bitwise against eager.

    python benchmarks/compile_bucket.py
    python benchmarks/compile_bucket.py --rows 1024   # a smaller bucket: quicker
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_demo import compression as F
from hf_demo.wire import codec

EF = codec.index_coding("elias_fano")


def prepare(m: torch.Tensor, bsize: int, k: int):
    """What ``AllGatherExchange.prepare`` does to one bucket: top-k, records, bf16 values, error feedback."""
    idx, values = F.select(m, k)
    records = EF.pack(idx, bsize, k)
    sent = values.to(torch.bfloat16)
    F.feedback(m, idx, sent.float())
    return records, sent


def fastest(fn, *args, runs: int = 5) -> float:
    fn(*args)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096, help="blocks in the bucket")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bsize, k = 4096, 32
    m = torch.randn(args.rows, bsize, generator=torch.Generator().manual_seed(0))
    records = torch.stack([prepare(m.clone(), bsize, k)[0]] * 2)  # two senders

    def decode(r):
        return EF.unpack_rows(r.flatten(1), r.shape[1], bsize, k)

    eager = (fastest(lambda: prepare(m.clone(), bsize, k)), fastest(decode, records))
    t0 = time.perf_counter()
    compiled_prepare = torch.compile(prepare, dynamic=False)
    compiled_decode = torch.compile(decode, dynamic=False)
    compiled_prepare(m.clone(), bsize, k)
    compiled_decode(records)
    compile_s = time.perf_counter() - t0
    compiled = (fastest(lambda: compiled_prepare(m.clone(), bsize, k)), fastest(compiled_decode, records))
    same = torch.equal(compiled_decode(records), decode(records))
    print(f"torch {torch.__version__}, bucket {args.rows} x {bsize}, top-{k}, {args.threads} thread(s)")
    print(f"compile (both functions, first call): {compile_s:.1f} s")
    print("| part | eager ms | compiled ms | compiled / eager |\n|---|---:|---:|---:|")
    for part, e, c in zip(("prepare (top-k, records, values, feedback)", "Elias-Fano decoding"), eager, compiled):
        print(f"| {part} | {e * 1000:.1f} | {c * 1000:.1f} | {c / e:.2f} |")
    print(f"compiled decoding bitwise equal to eager: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
