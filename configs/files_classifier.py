"""MiniLM-L6 fine-tuned on your labelled texts: JSONL, CSV/TSV, Parquet or Arrow files, or a
folder of .txt files a sub-folder a class (data.name=files).

    jaxaccel data show --config configs/files_classifier.py \
        --set data.train_files="reviews/train-*.jsonl" --set data.eval_files=reviews/test.jsonl
    jaxaccel train --config configs/files_classifier.py \
        --set data.train_files="reviews/train-*.jsonl" --set data.eval_files=reviews/test.jsonl
    jaxaccel predict --checkpoint runs/files_classifier "a gripping, beautifully shot film"

Each record's text is ``data.text_field``, its class ``data.label_field`` (names or integers:
the names are kept with the run, so ``predict`` answers with them); without
``data.eval_files``, ``data.holdout`` of the training records is the eval split. The recipe is
the main job's (configs/minilm_rt.py): the Rotten Tomatoes snippets written out as JSONL
(``{"text": ..., "label": "neg"|"pos"}``) give its batches exactly, token for token and in the
same order (tests/test_data.py), so its 86.5% test accuracy (seed 0).
"""


def get_config():
    return {
        "name": "files_classifier",
        "model.name": "minilm-l6",
        "model.pooling": "mean",
        "data.name": "files",
        "data.train_files": "reviews/train.jsonl",
        "data.eval_files": "reviews/test.jsonl",
        "data.text_field": "text",
        "data.label_field": "label",
        "data.max_len": 128,
        "train.epochs": 2,
        "train.batch_size": 16,
        "train.learning_rate": 1e-4,
    }
