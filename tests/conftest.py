"""Test setup: 8 fake CPU devices (sharding tests), offline Hugging Face, shared fixtures."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def minilm_dir():
    from jaxaccel.models import packaged_minilm_dir
    return packaged_minilm_dir()
