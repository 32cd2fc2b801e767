"""What the step checks before it commits: non-finite values, replicas that drifted apart, gradients that DDP
still averages. Local findings become header flags (:mod:`hf_demo.guards.verdicts`), so every rank judges
from the same facts and takes the same decision."""
