"""The encoder of the bfsong MAE run (configs/bfsong_mae.py) fine-tuned to classify the 11
syllable types of the Bengalese finch song subset, on a CPU.

    jaxaccel train --config configs/bfsong_mae.py          # first: the pretraining run
    jaxaccel train --config configs/bfsong_finetune.py \
        [--set model.init_from=/path/to/runs/bfsong_mae]   # another workdir's run folder

``model.init_from`` takes the MAE run's newest checkpoint: the patch embedding, the encoder
layers and the final layer norm (the decoder is left behind), and a fresh classifier on the
mean of the patch tokens (Audio-MAE's fine-tuning pooling). The same run without
``model.init_from`` is the from-scratch baseline of the same budget (configs/bfsong_scratch.py);
both are in docs/reports/bfsong.md.
"""

from bfsong_mae import get_config as pretraining


def get_config():
    return {
        **pretraining(),
        "name": "bfsong_finetune",
        "model.task": "classification",
        "model.num_labels": 11,
        "model.pooling": "mean",
        "model.init_from": "runs/bfsong_mae",
        "train.epochs": 30,
        "train.learning_rate": 5e-4,
        "train.log_every": 20,
    }
