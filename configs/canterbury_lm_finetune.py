"""A Llama-format checkpoint fine-tuned on the Canterbury corpus (causal LM), e.g. TinyLlama.

    huggingface-cli download TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T \
        --local-dir llama_checkpoint          # or any Llama-family folder: config.json,
                                              # *.safetensors, the tokenizer's files
    jaxaccel train --config configs/canterbury_lm_finetune.py \
        [--set model.checkpoint=/path/to/checkpoint]

The checkpoint's weights and its own tokenizer (a Llama tokenizer adds BOS; EOS ends every
document), the corpus's paragraphs packed into rows of 512 tokens; bf16 with Pallas/cuDNN
attention where available (``auto``) and rematerialised layers, for one GPU or TPU chip (a
1.1B model does not fine-tune on a CPU in useful time). tests/test_lm_job.py runs this config
on a tiny Llama checkpoint written in the test. Not measured yet on an accelerator.
"""

from canterbury_lm import get_config as pretraining


def get_config():
    return {
        **pretraining(),
        "name": "canterbury_lm_finetune",
        "model.name": "llama-1b",        # naming only: the checkpoint's config.json decides
        "model.checkpoint": "llama_checkpoint",
        "model.attention_impl": "auto",
        "model.remat": True,
        "precision.policy": "bf16",
        "data.max_len": 512,
        "train.epochs": 1,
        "train.max_steps": 0,
        "train.batch_size": 16,
        "train.learning_rate": 2e-5,
        "train.warmup_ratio": 0.05,
        "train.weight_decay": 0.0,
    }
