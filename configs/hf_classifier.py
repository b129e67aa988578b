"""MiniLM-L6 fine-tuned on a Hugging Face dataset saved with save_to_disk (data.name=hf).

    pip install 'jaxaccel[hf]'          # the datasets library, an optional extra
    python -c "import datasets; datasets.load_dataset('imdb').save_to_disk('imdb_saved')"
    jaxaccel train --config configs/hf_classifier.py --set data.dataset=imdb_saved

A ``DatasetDict`` folder's splits are read by name (``data.eval_split``); a lone ``Dataset`` is
the training split, ``data.holdout`` of it the eval split. A ``ClassLabel`` label feature names
the classes. (A dataset's Parquet or Arrow files without the folder: configs/files_classifier.py.)
The recipe is the main job's (configs/minilm_rt.py).
"""

from minilm_rt import get_config as main_job


def get_config():
    return {
        **main_job(),
        "name": "hf_classifier",
        "data.name": "hf",
        "data.dataset": "imdb_saved",
        "data.text_field": "text",
        "data.label_field": "label",
        "train.max_steps": 0,
    }
