"""DeMoTrainer on a tiny random Llama with a Prometheus endpoint per rank; rank 0 scrapes both during training.

At step ``--scrape_step`` rank 0 reads ``http://127.0.0.1:<port + r>/metrics`` of every rank r over loopback
and writes the texts to ``<record_dir>/scrape-rank<r>.txt``. Used by tests/test_ops_launch.py.
"""

import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_llama import stdlib_blocks  # noqa: E402

import hf_demo  # noqa: E402
from hf_demo.ops import HealthSettings, OpsSettings  # noqa: E402


@dataclass
class ScriptArgs:
    record_dir: str = field(default="")
    prometheus_port: int = field(default=0)
    scrape_step: int = field(default=4)
    slow_step: int = field(default=0)  # rank 1 sleeps slow_s before this step (0: never)
    slow_until: int = field(default=0)  # ... and before every step up to this one (0: slow_step alone)
    slow_s: float = field(default=1.0)


class SlowRank(TrainerCallback):
    """Rank 1 is late for a step or a run of steps (a stall before each: data, the host), the others wait for it."""

    def __init__(self, script):
        self.script = script

    def on_step_begin(self, args, state, control, **kwargs):
        step, first = state.global_step + 1, self.script.slow_step
        if args.process_index == 1 and first and first <= step <= max(first, self.script.slow_until):
            time.sleep(self.script.slow_s)


class Scraper(TrainerCallback):
    def __init__(self, script):
        self.script = script

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.script.scrape_step or args.process_index != 0:
            return
        for rank in range(args.world_size):
            url = f"http://127.0.0.1:{self.script.prometheus_port + rank}/metrics"
            text = urllib.request.urlopen(url, timeout=30).read().decode()
            Path(self.script.record_dir, f"scrape-rank{rank}.txt").write_text(text)


def main():
    script, args = HfArgumentParser((ScriptArgs, hf_demo.DeMoTrainingArguments)).parse_args_into_dataclasses()
    os.makedirs(script.record_dir, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    health = HealthSettings(warmup_steps=2, min_baseline=3, min_excess_s=0.3)
    ops = OpsSettings(
        run="launch-test", prometheus_port=script.prometheus_port, table_log="csv", prometheus_linger_s=1.0,
        health=health,
    )  # fmt: skip
    trainer = hf_demo.DeMoTrainer(
        model=LlamaForCausalLM(config), args=args, train_dataset=stdlib_blocks(64, 32),
        callbacks=[SlowRank(script), Scraper(script)], demo_ops=ops,
    )  # fmt: skip
    trainer.train()


if __name__ == "__main__":
    main()
