"""A ViT classifier of the mean of its patch tokens after the final layer norm (the CLS token
left out), as the jaxaccel run this folder was exported from (``model.pooling=mean``,
Audio-MAE's fine-tuning); transformers' ``ViTForImageClassification`` classifies the CLS token
instead.

    model = AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True)

The head is ``mean_pooling_classifier`` (not ``classifier``) and the config's model_type
``vit_mean_pooling``, so that the folder never loads silently as transformers' own class.
"""
from torch import nn
from transformers import ViTConfig
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.models.vit.modeling_vit import ViTModel, ViTPreTrainedModel


class ViTMeanPoolingConfig(ViTConfig):
    model_type = "vit_mean_pooling"


class ViTMeanPoolingForImageClassification(ViTPreTrainedModel):
    """logits = mean_pooling_classifier(mean of the last hidden states of the patches); the
    loss of ``labels`` (class ids) is the cross-entropy."""

    config_class = ViTMeanPoolingConfig

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = ViTModel(config, add_pooling_layer=False)
        self.mean_pooling_classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, pixel_values=None, labels=None, interpolate_pos_encoding=None, **kwargs):
        outputs = self.vit(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding,
                           **kwargs)
        logits = self.mean_pooling_classifier(outputs.last_hidden_state[:, 1:].mean(dim=1))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return ImageClassifierOutput(loss=loss, logits=logits,
                                     hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)
