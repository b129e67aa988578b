"""Model classes an exported folder ships for transformers, where transformers has none of
the model (``save_checkpoint(..., custom_code=True)``, ``jaxaccel export --custom-code``).

Each ``modeling_*.py`` here is copied verbatim into the folder and named in its config.json's
``auto_map``, so ``AutoModelFor...from_pretrained(folder, trust_remote_code=True)`` imports it;
it needs torch and transformers only, and jaxaccel never imports it. Its config class has its
own ``model_type``, so loading the folder without ``trust_remote_code`` is refused (transformers
knows no such type) rather than building transformers' own class of other outputs; and its head
is named ``mean_pooling_classifier``, so a plain ``BertForSequenceClassification`` /
``ViTForImageClassification`` built from it directly reports that head unexpected and its own
``classifier`` missing.

* ``BERT_MEAN_POOLING``: a BERT classifier of the mean of the last hidden states over the
  attention mask (``model.pooling=mean``; transformers' classifies the pooler's CLS token).
* ``VIT_MEAN_POOLING``: a ViT classifier of the mean of the patch tokens after the final layer
  norm (Audio-MAE's fine-tuning; transformers' classifies the CLS token).
"""
from __future__ import annotations

import dataclasses
import os
import shutil

HEAD = "mean_pooling_classifier"      # the classes' head; transformers' is "classifier"


@dataclasses.dataclass(frozen=True)
class CustomClass:
    """A model class shipped as ``{module}.py``: its ``model_type``, config and model class
    names, and the Auto class that loads it."""

    module: str
    model_type: str
    config_class: str
    model_class: str
    auto_class: str

    def config_json(self) -> dict:
        """The config.json entries that name the class (updating the writer's own)."""
        return {"model_type": self.model_type, "architectures": [self.model_class],
                "auto_map": {"AutoConfig": f"{self.module}.{self.config_class}",
                             self.auto_class: f"{self.module}.{self.model_class}"}}

    def copy_to(self, folder) -> str:
        """Copy the class's file into ``folder``; its name."""
        name = f"{self.module}.py"
        shutil.copyfile(os.path.join(os.path.dirname(__file__), name),
                        os.path.join(folder, name))
        return name


BERT_MEAN_POOLING = CustomClass("modeling_bert_mean_pooling", "bert_mean_pooling",
                                "BertMeanPoolingConfig",
                                "BertMeanPoolingForSequenceClassification",
                                "AutoModelForSequenceClassification")
VIT_MEAN_POOLING = CustomClass("modeling_vit_mean_pooling", "vit_mean_pooling",
                               "ViTMeanPoolingConfig", "ViTMeanPoolingForImageClassification",
                               "AutoModelForImageClassification")


def custom_name(name: str) -> str:
    """The classes' name of the checkpoint tensor ``name`` of transformers' class (the
    writers'): its head ``classifier.*`` is ``mean_pooling_classifier.*``."""
    return HEAD + name.removeprefix("classifier") if name.startswith("classifier.") else name


def standard_name(name: str) -> str:
    """transformers' name of the checkpoint tensor ``name`` of a class here (the readers')."""
    return "classifier" + name.removeprefix(HEAD) if name.startswith(HEAD + ".") else name


__all__ = ["BERT_MEAN_POOLING", "HEAD", "VIT_MEAN_POOLING", "CustomClass", "custom_name",
           "standard_name"]
