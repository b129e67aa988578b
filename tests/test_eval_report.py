"""A classifier's evaluation beyond accuracy (jaxaccel.train.confusion): per-class precision,
recall and F1, macro-F1 and the confusion matrix from exact counts, padding rows left out, and
the matrix drawn. End to end through the CLI (eval JSON, metrics.jsonl, the PNG, TensorBoard,
predict --top-k): test_user_data.py's files classifier; two processes' shares gathered:
test_distributed.py."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccel.train import confusion
from jaxaccel.train.tasks import TASKS


def test_the_report_reads_precision_recall_and_f1_from_the_counts():
    # True class 0: 5 right, 1 taken for class 1; class 1: 3 right, 2 taken for 0; class 2
    # never in the split, predicted once (a class 1 example); class 3 absent and never predicted.
    m = [[5, 1, 0, 0], [2, 3, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    r = confusion.report(m)
    assert r["support"] == [6, 6, 0, 0] and r["confusion_matrix"] == m
    np.testing.assert_allclose(r["precision"], [5 / 7, 3 / 4, 0, 0])
    np.testing.assert_allclose(r["recall"], [5 / 6, 3 / 6, 0, 0])
    f1 = [2 * (5 / 7) * (5 / 6) / (5 / 7 + 5 / 6), 2 * 0.75 * 0.5 / 1.25, 0.0]
    np.testing.assert_allclose(r["f1"][:3], f1)
    assert r["macro_f1"] == pytest.approx(np.mean(f1))      # class 3 says nothing


def test_the_counts_take_the_accuracy_s_predictions_and_leave_padding_rows_out():
    logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [9.0, 0.0, 0.0]])
    batch = {"labels": jnp.array([0, 2, 2, 1]), "weights": jnp.array([1.0, 1.0, 1.0, 0.0])}
    task = TASKS["classification"]
    m = np.asarray(task.tallies(logits, batch)["confusion"])
    assert m.tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 1]]      # the padding row (1 -> 0) not
    _, correct, count = task.sums(logits, batch)
    assert np.trace(m) == float(correct) and m.sum() == float(count)


def test_the_matrix_is_drawn_as_a_png_and_as_pixels():
    fig = confusion.figure([[3, 1], [0, 4]], ["neg", "pos"], "step 2")
    assert confusion.png(fig).startswith(b"\x89PNG\r\n\x1a\n")
    pixels = confusion.rgb(fig)
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    many = confusion.figure(np.eye(40, dtype=int), [f"c{i}" for i in range(40)], "40 classes")
    assert confusion.png(many).startswith(b"\x89PNG")          # no counts written: too many
