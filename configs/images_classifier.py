"""A ViT fine-tuned on your images, a sub-folder a class (data.name=images), from a Hugging
Face ViT checkpoint folder (e.g. `huggingface-cli download google/vit-base-patch16-224-in21k
--local-dir vit-base`).

    jaxaccel data show --config configs/images_classifier.py \
        --set data.train_files=pets/train --set data.eval_files=pets/test
    jaxaccel train --config configs/images_classifier.py \
        --set model.checkpoint=vit-base --set model.num_labels=37 \
        --set data.train_files=pets/train --set data.eval_files=pets/test
    jaxaccel predict --checkpoint runs/images_classifier --top-k 3 pets/new/0001.jpg
    jaxaccel export --checkpoint runs/images_classifier --out pets-vit

``pets/train/<class>/*.jpg`` (JPEG, PNG or WebP; a class is the first folder level under the
root), or a .csv/.jsonl listing of ``path`` and ``label``; resized and normalised as the
checkpoint's ``preprocessor_config.json`` says (kept in the run folder and exported with the
model); training images randomly resized-cropped and flipped, seeded by (seed, epoch, image).
``model.num_labels`` must be the number of class folders. Without ``model.checkpoint`` the
ViT-B/16 preset starts from random weights (mean and std 0.5, as ``ViTImageProcessor``).
Not measured end to end here (a CPU steps ViT-B/16 at ~0.3 images/s: bench/README.md).
"""


def get_config():
    return {
        "name": "images_classifier",
        "model.name": "vit-b16-mae",
        "model.task": "classification",
        "model.checkpoint": "vit-base",
        "model.num_labels": 2,
        "data.name": "images",
        "data.train_files": "pets/train",
        "data.eval_files": "pets/test",
        "train.epochs": 3,
        "train.batch_size": 32,
        "train.eval_batch_size": 64,
        "train.learning_rate": 5e-5,
        "train.warmup_ratio": 0.1,
    }
