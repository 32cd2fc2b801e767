"""The Hugging Face integration: Trainer, training arguments, Accelerate, DDP, checkpoints, launch and exit."""
