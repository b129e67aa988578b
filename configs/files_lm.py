"""The CPU decoder (llama-cpu) pretrained on your corpus: JSONL/Parquet/Arrow records with a
text field, or plain-text files (a document a file, or a paragraph a document), of any size.

    jaxaccel data prepare --config configs/files_lm.py --set data.train_files="corpus/*.jsonl"
    jaxaccel data show --config configs/files_lm.py --set data.train_files="corpus/*.jsonl"
    jaxaccel train --config configs/files_lm.py --set data.train_files="corpus/*.jsonl"
    jaxaccel generate --checkpoint runs/files_lm "Once upon a time"

``data prepare`` tokenizes the corpus once, in a process per CPU, into the token cache
(``data.cache_dir``) that training then streams rows from (bench/README.md: preparation time
and memory against Hugging Face's run_clm recipe, the trainer's memory at 10 MB to 1 GB of
text). Without ``model.tokenizer`` the corpus's own byte-level BPE of ``data.tokenizer_vocab``
tokens is trained on it first. 5% of the documents are held out for evaluation
(``data.holdout``). The recipe is configs/canterbury_lm.py's.
"""

from canterbury_lm import get_config as canterbury


def get_config():
    return {
        **canterbury(),
        "name": "files_lm",
        "data.name": "files",
        "data.train_files": "corpus/*.jsonl",
        "data.holdout": 0.05,
        "data.eval_split": "test",
    }
