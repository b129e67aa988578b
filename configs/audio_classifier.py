"""A small ViT (vit-audio-cpu) classifying your recordings, a sub-folder a class, on a CPU
(data.name=audio).

    jaxaccel train --config configs/audio_classifier.py \
        --set data.train_files=calls/train --set data.eval_files=calls/test
    jaxaccel predict --checkpoint runs/audio_classifier calls/new/0001.wav

``calls/train/<class>/*.wav``: WAV files (16-bit PCM or float), resampled to
``data.sample_rate``; each becomes a log-mel spectrogram of the model's input (64 frames of
10 ms x 64 mel bands: 0.64 s; longer clips are cut, shorter padded with silence), normalised by
the training clips' mean and deviation. Without ``data.eval_files``, ``data.holdout`` of the
clips. Batches of 8 clips, so that a first folder of a few dozen clips trains (the refusal of a
batch larger than the training split says what to set); raise train.batch_size with more
clips. To start from MAE pretraining on unlabelled clips (configs/audio_mae.py), add
``--set model.init_from=runs/audio_mae``. The recipe is configs/bfsong_scratch.py's.
"""

from bfsong_scratch import get_config as bfsong


def get_config():
    return {
        **bfsong(),
        "name": "audio_classifier",
        "data.name": "audio",
        "data.train_files": "calls/train",
        "data.eval_files": "calls/test",
        "data.sample_rate": 16000,
        "model.num_labels": 2,
        "train.batch_size": 8,
    }
