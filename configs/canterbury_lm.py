"""A small Llama-style decoder pretrained on the Canterbury corpus on a CPU (causal LM).

    jaxaccel train --config configs/canterbury_lm.py
    jaxaccel generate --checkpoint runs/canterbury_lm "Alice was beginning"

The ``llama-cpu`` preset (4 layers, d=256, 4 query / 2 key-value heads, SwiGLU 768, tied
8,192-token embedding: 5.2M matmul weights) from random initialisation; the corpus's 2,410
training paragraphs tokenized by a byte-level BPE of 8,192 tokens trained on them (built once
into the TFDS folder) and packed into rows of 128 tokens; AdamW at 2e-3, cosine decay after
10% warm-up.
Measured: MEASURED
"""


def get_config():
    return {
        "name": "canterbury_lm",
        "model.name": "llama-cpu",
        "data.name": "canterbury",
        "data.eval_split": "validation",
        "data.max_len": 128,
        "data.tokenizer_vocab": 8192,
        "train.epochs": 1,
        "train.batch_size": 16,
        "train.eval_batch_size": 64,
        "train.learning_rate": 2e-3,
        "train.schedule": "cosine",
        "train.weight_decay": 0.1,
        "train.log_every": 10,
    }
