"""F1 score, as a local `evaluate` metric script (no hub needed): ``evaluate.load("recipes/metrics/f1")``."""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = """
The F1 score is the harmonic mean of precision and recall: F1 = 2 * (precision * recall) / (precision + recall).
`average="binary"` (the default) scores the class `pos_label` of a two-class task; `average="macro"` is the
unweighted mean of the per-class F1 scores (use it for more than two classes).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    labels (`list` of `int`): the labels to include when `average != "binary"`. Default None (all present).
    pos_label (`int`): the class to score when `average="binary"`. Default 1.
    average (`str`): "binary" (default), "micro", "macro", "weighted", "samples" or None (per-class scores).
    sample_weight (`list` of `float`): per-example weights. Default None.
Returns:
    f1 (`float` or `list` of `float`): the F1 score (a list, one per class, when `average=None`).
Examples:
    >>> f1 = evaluate.load("recipes/metrics/f1")
    >>> f1.compute(references=[0, 1, 0, 1, 0], predictions=[0, 0, 1, 1, 0])
    {'f1': 0.5}
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
class F1(evaluate.Metric):
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
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        score = f1_score(
            references,
            predictions,
            labels=labels,
            pos_label=pos_label,
            average=average,
            sample_weight=sample_weight,
            zero_division=0,
        )
        return {"f1": score.tolist() if getattr(score, "size", 1) > 1 else float(score)}
