"""Audio-MAE pretraining of a small ViT on birdsong log-mel spectrograms (bfsong), on a CPU.

    jaxaccel train --config configs/bfsong_mae.py
    jaxaccel train --config configs/bfsong_finetune.py      # then: its encoder, classifying

The 450 training syllables of the Bengalese finch song subset shipped in the evfuncs 0.3.3
sdist (fetched from PyPI and checked against its sha256 on first use; jaxaccel/data/bfsong.py),
each a 64-frame x 64-mel-bin log-mel spectrogram normalised by the train split's mean and
standard deviation; ``vit-audio-cpu`` (an 8 x 8 grid of 8 x 8 patches, 4 layers of 192),
80% of the patches masked (Audio-MAE's ratio), normalised-patch targets and a local-window
decoder (4 x 4 patches, shifted every other layer). The eval split's masked-patch error is
reported (fixed masks). The recipe and what pretraining buys: docs/reports/bfsong.md.
"""


def get_config():
    return {
        "name": "bfsong_mae",
        "model.name": "vit-audio-cpu",
        "model.task": "mae",
        "data.name": "bfsong",
        "train.epochs": 100,
        "train.batch_size": 32,
        "train.eval_batch_size": 160,
        "train.learning_rate": 1e-3,
        "train.weight_decay": 0.05,
        "train.warmup_ratio": 0.05,
        "train.schedule": "cosine",
        "train.log_every": 50,
    }
