"""Audio-MAE's ViT-B/16 pretraining step (Huang et al. 2022) for planning on accelerators:
1024 frames x 128 mel bins (a 64 x 8 grid of 16 x 16 patches), 80% of the patches masked,
normalised-patch targets, a local-window decoder (4 x 4 patches), batch 512, bf16.

    jaxaccel compile --config configs/audiomae_b16.py --topology h100:1x8
    jaxaccel compile --config configs/audiomae_b16.py --topology v5e-8
    jaxaccel compile --config configs/audiomae_b16.py --topology h100:1x8 \
        --set precision.policy=fp8                    # the fp8 policy of the study's A100 run

The data is synthetic arrays of the model's input shape sized as AudioSet-2M (2,000,000
clips an epoch, for the planner's epoch time and cost); a real run points data.name at an
array dataset of such spectrograms. Audio-MAE's recipe otherwise: AdamW, weight decay 0.05,
learning rate 2e-4 x batch / 256, 32 epochs. Plans (estimates): docs/reports/bfsong.md.
"""


def get_config():
    return {
        "name": "audiomae_b16",
        "model.name": "audiomae-b16",
        "model.task": "mae",
        "data.name": "synthetic",
        "data.synthetic_examples": 2_000_000,
        "precision.policy": "bf16",
        "train.epochs": 32,
        "train.batch_size": 512,
        "train.eval_batch_size": 512,
        "train.learning_rate": 4e-4,
        "train.weight_decay": 0.05,
        "train.warmup_ratio": 0.1,
        "train.schedule": "cosine",
    }
