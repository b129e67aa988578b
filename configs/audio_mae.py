"""A small ViT (vit-audio-cpu) pretrained as a masked autoencoder on a folder of unlabelled
recordings (data.name=audio, model.task=mae), on a CPU.

    jaxaccel train --config configs/audio_mae.py --set data.train_files="clips/**/*.wav"
    jaxaccel train --config configs/audio_classifier.py --set model.init_from=runs/audio_mae

Clips as configs/audio_classifier.py makes them (no labels needed: every clip may sit in one
folder); 5% held out to report the reconstruction loss on. The recipe is configs/bfsong_mae.py's.
"""

from bfsong_mae import get_config as bfsong


def get_config():
    return {
        **bfsong(),
        "name": "audio_mae",
        "data.name": "audio",
        "data.train_files": "clips/*.wav",
        "data.holdout": 0.05,
        "data.sample_rate": 16000,
    }
