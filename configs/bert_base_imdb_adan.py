"""The thesis workload with the thesis's optimizer: BERT-base on IMDb, 3 epochs, Adan.

    jaxaccel train --config configs/bert_base_imdb_adan.py \
        --set model.checkpoint=/path/to/bert-base-uncased --set data.manual_dir=/path/to/dir

Adan with the thesis's fine-tuning hyperparameters (b1=0.98, b2=0.92, b3=0.99, lr 1e-4,
weight decay 0.01); the fused Pallas update on GPU/TPU (``train.optimizer_impl=auto``).
Everything else is configs/bert_base_imdb.py (imported plainly: the config loader puts this
folder on the import path).
Expected runtime: not measured yet on a GPU/TPU node.
"""
import bert_base_imdb


def get_config():
    config = bert_base_imdb.get_config()
    config.update({
        "name": "bert_base_imdb_adan",
        "train.optimizer": "adan",
        "train.b1": 0.98, "train.b2": 0.92, "train.b3": 0.99,
        "train.learning_rate": 1e-4,
        "train.weight_decay": 0.01,
    })
    return config
