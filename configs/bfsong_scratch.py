"""The from-scratch baseline of configs/bfsong_finetune.py: the same classifier, data and
budget from a random initialisation (no MAE pretraining).

    jaxaccel train --config configs/bfsong_scratch.py
"""

from bfsong_finetune import get_config as finetune


def get_config():
    return {**finetune(), "name": "bfsong_scratch", "model.init_from": ""}
