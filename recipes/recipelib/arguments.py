"""The recipes' command line: model and data arguments, the defaults every recipe shares, logging.

A recipe parses ``(ModelArguments, DataTrainingArguments, hf_demo.DeMoTrainingArguments)`` (or TRL's config)
with :func:`parse_args`, from the command line or from a single .json/.yaml file.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers
from transformers import HfArgumentParser

logger = logging.getLogger("recipes")

FILE_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv"}
TEXT_CANDIDATES = ("text", "sentence", "content", "review", "document")
# Every recipe trains with DeMo unless --optim says otherwise, and evaluates at the start of train() (Trainer's
# own way; an evaluate() before train() works too with DeMoTrainer, which still wraps the model in DDP).
RECIPE_DEFAULTS = {"optim": "demo", "eval_on_start": True}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A hub model id or a local folder saved with save_pretrained. Default: the recipe's offline model "
            "(see above)."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer, if not the model's own."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where hub models and data sets are cached."})
    # PEFT LoRA (apply_lora below): the base weights stay frozen, DeMo trains and exchanges only the adapters
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 (default): fine-tune every weight, no LoRA."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (the update is alpha/r * BA)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch's input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={
            "help": "Modules that get adapters: 'all-linear' (every nn.Linear but the output head: q/k/v/o and the "
            "MLP of Llama, the attention and FFN layers of BERT) or names such as q_proj v_proj."
        },
    )


@dataclass
class CausalLMModelArguments(ModelArguments):
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside model_name_or_path, if any."})


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A data set on the hub (datasets)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration name."})
    train_file: str | None = field(default=None, metadata={"help": f"Training data: {', '.join(FILE_FORMATS)}."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data, same formats."})
    text_column: str | None = field(
        default=None, metadata={"help": f"Column with the text. Default: the first of {', '.join(TEXT_CANDIDATES)}."}
    )
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "Percent of the training data held out when there is no validation set."}
    )
    split_seed: int = field(default=42, metadata={"help": "Seed of the train/validation split and sub-sampling."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many evaluation examples."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for datasets.map."})


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(dataclass_types, argv: list[str] | None = None, *, description: str | None = None, **defaults):
    """Parse the command line, or a single .json/.yaml file, into the dataclasses.

    Defaults: ``RECIPE_DEFAULTS`` (DeMo, evaluation at the start of training), then the recipe's ``defaults``,
    then what the user gives. ``description`` (the recipe's docstring) heads ``--help``.
    """
    parser = HfArgumentParser(dataclass_types, description=description, formatter_class=_HelpFormatter)
    defaults = {**RECIPE_DEFAULTS, **defaults}
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        text = Path(argv[0]).read_text()
        if argv[0].endswith(".json"):
            config = json.loads(text)
        else:
            import yaml

            config = yaml.safe_load(text)
        return parser.parse_dict({**defaults, **config})
    parser.set_defaults(**defaults)
    return parser.parse_args_into_dataclasses(args=argv)


def setup_logging(training_args) -> None:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)


def optim_name(training_args) -> str:
    return str(getattr(training_args.optim, "value", training_args.optim))
