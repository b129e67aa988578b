"""The thesis workload: BERT-base fine-tuned on IMDb reviews for 3 epochs.

    jaxaccel train --config configs/bert_base_imdb.py \
        --set model.checkpoint=/path/to/bert-base-uncased --set data.manual_dir=/path/to/dir

``model.checkpoint`` is a Hugging Face bert-base-uncased directory (config.json +
model.safetensors); without it the BERT-base shapes are initialised randomly (benchmarks).
``data.manual_dir`` holds the genuine aclImdb_v1.tar.gz. Batch 16 per device, lr 1e-4, 512
tokens, the thesis's Adan hyperparameters are in configs/bert_base_imdb_adan.py.
Expected runtime: not measured yet on a GPU/TPU node (no accelerator in CI).
"""
from jaxaccel.config import device_count


def get_config():
    return {
        "name": "bert_base_imdb",
        "model.name": "bert-base",
        "data.name": "imdb_reviews",
        "data.max_len": 512,
        "data.pad_multiple": 64,
        "train.epochs": 3,
        "train.batch_size": 16 * device_count(),
        "train.eval_batch_size": 64 * device_count(),
        "train.learning_rate": 1e-4,
        "train.optimizer": "adamw",
        "train.log_every": 50,
        "train.checkpoint_every": 1000,
    }
