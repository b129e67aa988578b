"""A tiny random BERT on synthetic tokens: a smoke test of the whole loop in seconds.

    jaxaccel train --config configs/tiny_synthetic.py
"""


def get_config():
    return {
        "name": "tiny_synthetic",
        "model.name": "tiny",
        "data.name": "synthetic",
        "data.synthetic_examples": 256,
        "data.synthetic_seq_len": 32,
        "train.epochs": 2,
        "train.batch_size": 16,
        "train.eval_batch_size": 32,
        "train.learning_rate": 1e-3,
        "train.log_every": 4,
    }
