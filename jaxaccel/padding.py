"""The one padding rule of batches: a batch's [b, L] length from its longest row, for training,
evaluation and prediction batches (``jaxaccel.data.pipeline``) and generation prompts
(``jaxaccel.models.generate``), which share it without importing each other."""
from __future__ import annotations


def padded_length(longest: int, multiple: int, max_len: int) -> int:
    """The [b, L] length of a batch whose longest row has ``longest`` tokens: rounded up to a
    multiple of ``multiple`` (few distinct shapes, few compiles), at most ``max_len``."""
    return min(-(-max(longest, 1) // multiple) * multiple, max_len)
