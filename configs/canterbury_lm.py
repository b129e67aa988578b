"""A small Llama-style decoder pretrained on the Canterbury corpus on a CPU (causal LM).

    jaxaccel train --config configs/canterbury_lm.py
    jaxaccel generate --checkpoint runs/canterbury_lm "Alice was beginning"

The ``llama-cpu`` preset (4 layers, d=256, 4 query / 2 key-value heads, SwiGLU 768, tied
8,192-token embedding: 5.2M matmul weights) from random initialisation; the corpus's 2,410
training paragraphs tokenized by a byte-level BPE of 8,192 tokens trained on them (built once
into the TFDS folder) and packed into rows of 128 tokens; 200 steps of 8 rows (204,800 tokens,
0.79 epoch), AdamW lr 1e-3 (b2 0.95, weight decay 0.1), cosine decay after 5% warm-up.
Measured (2-core AMD EPYC CPU, jax 0.10.2, dataset and BPE cached): validation perplexity
674.6 (loss 6.514 over 38,503 next-token targets, token accuracy 12.3%) in 7 min 30 s wall time
including start-up, compilation and the evaluation, on a CPU shared with other jobs (load
average 15-18 on its 2 cores; the run got 2 min 29 s of CPU time), so the time is an upper
bound; ~550 tokens/s there. A unigram model of the train split scores 1,050 on the same
targets, an interpolated bigram 276: the model is still early in training (lr 2e-3 at batch
16 for one epoch: 762 in 14.5 min; lr 3e-3 at batch 8: 746). precision.policy=fp16: 675.1,
fp8: 672.3 (within 2% of fp32, as tests/test_lm_data.py's slow test asks).
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
