"""What a recipe measured, the same on every rank: results.json's layout and the summary printed at the end.

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

import hashlib

import torch

from recipelib.arguments import optim_name


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


def loss_curve(log_history: list[dict]) -> list[list[float]]:
    """``[[step, training loss], ...]`` as Trainer logged it (every step with the recipes' ``logging_steps=1``)."""
    return [[r["step"], r["loss"]] for r in log_history if "loss" in r and "step" in r]
