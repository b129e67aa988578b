"""A classifier's evaluation beyond accuracy: the confusion matrix's counts (exact: counted on
the devices from every eval batch's predictions and labels, padding rows excluded, summed over
the whole split), the per-class precision, recall, F1 and support read from them, macro-F1,
and the matrix drawn (a PNG in the run folder, an image in TensorBoard).

With ``C[i, j]`` the examples of true class ``i`` predicted as ``j``: ``precision_j = C[j, j] /
sum_i C[i, j]``, ``recall_i = C[i, i] / sum_j C[i, j]``, ``f1 = 2 p r / (p + r)``, each 0
where its denominator is (no example predicted, or none of the class: scikit-learn's
``zero_division=0``); ``macro_f1`` is the unweighted mean of the classes' F1 over the classes
with support or predictions (those absent from the split and never predicted say nothing)."""
from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np

PNG_NAME = "confusion_matrix.png"
"""The run folder's picture of its latest evaluation's confusion matrix."""

ANNOTATE_UP_TO = 30
"""Classes up to which each cell's count is written in the picture (and each class named)."""


def counts(predicted, labels, weights, num_labels: int):
    """The [num_labels, num_labels] int32 confusion counts of one batch (rows: true class,
    columns: predicted), rows of weight 0 (padding) left out."""
    real = (weights > 0).astype(jnp.int32)
    return jnp.zeros((num_labels, num_labels), jnp.int32).at[labels, predicted].add(real)


def _ratio(num, den):
    return np.divide(num, den, out=np.zeros(len(num)), where=den > 0)


def report(matrix) -> dict:
    """Per-class ``precision``, ``recall``, ``f1`` and ``support`` (lists in label order),
    ``macro_f1`` and the ``confusion_matrix`` (a list of rows) of the summed counts."""
    m = np.asarray(matrix, np.int64)
    hits, support, predicted = np.diag(m), m.sum(1), m.sum(0)
    precision, recall = _ratio(hits, predicted), _ratio(hits, support)
    f1 = _ratio(2 * precision * recall, precision + recall)
    present = (support + predicted) > 0
    return {"macro_f1": float(f1[present].mean()) if present.any() else 0.0,
            "precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist(),
            "support": support.tolist(), "confusion_matrix": m.tolist()}


def figure(matrix, label_names, title: str):
    """The matrix as a matplotlib ``Figure`` (no pyplot: safe beside the trainer's threads):
    counts shaded by each true class's share, written in each cell up to
    ``ANNOTATE_UP_TO`` classes."""
    from matplotlib.figure import Figure
    m = np.asarray(matrix, np.int64)
    n = len(m)
    share = m / np.maximum(m.sum(1, keepdims=True), 1)
    side = min(3 + 0.45 * n, 16)
    fig = Figure(figsize=(side + 1.5, side), dpi=80)
    ax = fig.add_subplot()
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label="share of the true class")
    ax.set(xlabel="predicted", ylabel="true", title=title)
    if n <= ANNOTATE_UP_TO:
        names = [str(x) for x in label_names]
        ax.set_xticks(range(n), names, rotation=90 if max(map(len, names)) > 3 else 0)
        ax.set_yticks(range(n), names)
        for (i, j), c in np.ndenumerate(m):
            ax.text(j, i, str(c), ha="center", va="center",
                    color="white" if share[i, j] > 0.5 else "black")
    fig.tight_layout()
    return fig


def png(fig) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def rgb(fig) -> np.ndarray:
    """The figure's pixels, uint8 [height, width, 3] (TensorBoard's ``add_image``, HWC)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
