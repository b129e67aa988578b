"""A BERT classifier of the mean of its last hidden states, as the jaxaccel run this folder
was exported from (``model.pooling=mean``); transformers' ``BertForSequenceClassification``
classifies the pooler output (the CLS token) instead.

    model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)

The head is ``mean_pooling_classifier`` (not ``classifier``) and the config's model_type
``bert_mean_pooling``, so that the folder never loads silently as transformers' own class.
The pooler is kept (jaxaccel's model has one) but the logits do not read it.
"""
from torch import nn
from transformers import BertConfig
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.bert.modeling_bert import BertModel, BertPreTrainedModel


class BertMeanPoolingConfig(BertConfig):
    model_type = "bert_mean_pooling"


class BertMeanPoolingForSequenceClassification(BertPreTrainedModel):
    """logits = mean_pooling_classifier(dropout(mean of the last hidden states over the tokens
    of ``attention_mask``)); the loss of ``labels`` (class ids) is the cross-entropy."""

    config_class = BertMeanPoolingConfig

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.mean_pooling_classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None,
                position_ids=None, inputs_embeds=None, labels=None, **kwargs):
        outputs = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                            token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, **kwargs)
        hidden = outputs.last_hidden_state
        if attention_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        logits = self.mean_pooling_classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits,
                                        hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)
