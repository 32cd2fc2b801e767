"""Perplexity from per-token negative log-likelihoods (natural log): exp(mean NLL).

Unlike the hub's `perplexity` metric it does not run a model: the recipe's evaluation loop already
computed the NLL of every predicted token, so this works offline and on any model.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Perplexity exp(mean token NLL) from per-token negative log-likelihoods."
_KWARGS = """
Args:
    predictions (list of float): negative log-likelihood of each predicted token (natural log).
Returns:
    perplexity (float): exp of the mean NLL.
    mean_nll (float): the mean NLL (the usual eval loss).
    tokens (int): how many tokens were scored.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions):
        if len(predictions) == 0:
            raise ValueError("perplexity needs at least one token")
        mean = math.fsum(predictions) / len(predictions)
        return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens": len(predictions)}
