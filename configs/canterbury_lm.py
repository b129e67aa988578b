"""A small Llama-style decoder pretrained on the Canterbury corpus on a CPU (causal LM).

    jaxaccel train --config configs/canterbury_lm.py
    jaxaccel generate --checkpoint runs/canterbury_lm "Alice was beginning"

The ``llama-cpu`` preset (4 layers, d=128, 4 query / 2 key-value heads, SwiGLU 384, tied
2,048-token embedding: 0.79M block matmul weights, 1.05M with the logits) from random
initialisation; the corpus's 2,410 training paragraphs tokenized by a byte-level BPE of 2,048
tokens trained on them (built once into the TFDS folder) and packed into rows of 128 tokens;
2,000 steps of 16 rows (4.1M tokens, 12.3 epochs of 333,420 tokens), AdamW lr 3e-3 (b2 0.95,
weight decay 0.1), cosine decay after 5% warm-up. The recipe was chosen on the validation
split, within ten minutes of a 2-core CPU; the search, the n-gram baselines
(``bench/ngram.py``) and the measured runs are in docs/reports/canterbury-lm.md.
"""


def get_config():
    return {
        "name": "canterbury_lm",
        "model.name": "llama-cpu",
        "data.name": "canterbury",
        "data.eval_split": "validation",
        "data.max_len": 128,
        "data.tokenizer_vocab": 2048,
        "train.epochs": 13,
        "train.max_steps": 2000,         # 4.1M tokens: 12.3 epochs (162 steps each)
        "train.batch_size": 16,
        "train.eval_batch_size": 64,
        "train.learning_rate": 3e-3,
        "train.b2": 0.95,
        "train.warmup_ratio": 0.05,
        "train.schedule": "cosine",
        "train.weight_decay": 0.1,
        "train.log_every": 50,
    }
