"""A small Llama-style decoder pretrained on the Canterbury corpus on a CPU (causal LM).

    jaxaccel train --config configs/canterbury_lm.py
    jaxaccel generate --checkpoint runs/canterbury_lm "Alice was beginning"

The ``llama-cpu`` preset (4 layers, d=256, 4 query / 2 key-value heads, SwiGLU 768, tied
8,192-token embedding: 5.2M matmul weights) from random initialisation; the corpus's 2,410
training paragraphs tokenized by a byte-level BPE of 8,192 tokens trained on them (built once
into the TFDS folder) and packed into rows of 128 tokens; 200 steps of 8 rows (204,800 tokens,
0.79 epoch), AdamW lr 1e-3 (b2 0.95, weight decay 0.1), cosine decay after 5% warm-up.
Measured (2-core AMD EPYC CPU, jax 0.10.2, fresh clone, idle): validation perplexity 697.9 over
41,234 next-token targets in 1 min 27 s wall time including building the corpus and the BPE,
compilation and the evaluation. Other settings and the fp16/fp8 policies: README.md (measured on
a draft build of the corpus, so comparable with each other only).
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
        "train.max_steps": 200,          # 204,800 tokens: 0.79 of an epoch (254 steps)
        "train.batch_size": 8,
        "train.eval_batch_size": 64,
        "train.learning_rate": 1e-3,
        "train.b2": 0.95,
        "train.warmup_ratio": 0.05,
        "train.schedule": "cosine",
        "train.weight_decay": 0.1,
        "train.log_every": 10,
    }
