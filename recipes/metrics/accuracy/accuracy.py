"""Accuracy, as a local `evaluate` metric script (no hub needed): ``evaluate.load("recipes/metrics/accuracy")``."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:
accuracy = (TP + TN) / (TP + TN + FP + FN).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`): if False, return the number of correct predictions instead of the fraction. Default True.
    sample_weight (`list` of `float`): per-example weights. Default None.
Returns:
    accuracy (`float` or `int`): the fraction (or the count) of correct predictions.
Examples:
    >>> accuracy = evaluate.load("recipes/metrics/accuracy")
    >>> accuracy.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12}, pages={2825--2830}, year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        score = accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight)
        return {"accuracy": float(score) if normalize or sample_weight is not None else int(score)}
