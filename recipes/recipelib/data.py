"""The recipes' data: the hub, local files (.txt, .json, .jsonl, .csv, .tsv) or the recipe's offline default,
checked early and split into train and validation."""

from __future__ import annotations

from pathlib import Path

import datasets
from datasets import Dataset, DatasetDict

from hf_demo.stdlib_corpus import stdlib_files
from recipelib.arguments import FILE_FORMATS, TEXT_CANDIDATES, DataTrainingArguments


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
