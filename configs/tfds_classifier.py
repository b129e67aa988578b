"""BERT-base fine-tuned on a TFDS dataset you prepared (data.name=tfds), read by name from its
data dir through ArrayRecord, without TensorFlow.

    tfds build imdb_reviews --data_dir ~/tensorflow_datasets --file_format=array_record
    jaxaccel train --config configs/tfds_classifier.py \
        --set data.dataset=imdb_reviews --set data.data_dir=~/tensorflow_datasets

``data.dataset`` is the catalogue name (``name``, ``name/config``, ``name:1.0.0``); the
prepared folder's own metadata is enough, the builder's code need not be installed. The
features read are ``data.text_field`` and ``data.label_field`` (a ``ClassLabel`` names the
classes); the splits are the dataset's (``data.eval_split``). The recipe is
configs/bert_base_imdb.py's.
"""

from bert_base_imdb import get_config as imdb


def get_config():
    return {
        **imdb(),
        "name": "tfds_classifier",
        "data.name": "tfds",
        "data.dataset": "imdb_reviews",
        "data.text_field": "text",
        "data.label_field": "label",
    }
