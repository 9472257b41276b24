"""Randomly initialised Hugging Face BERT and GPT-2 from small configs (no downloads), exported
with their loss inside; gradients of every parameter against torch autograd."""

import pytest
import torch

from .torch_models import compare_with_torch, tiny_bert, tiny_gpt2


class WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def bert():
    return tiny_bert(vocab=64, positions=16, labels=3, intermediate=48)


def gpt2():
    return tiny_gpt2(vocab=64, positions=16)


# the dynamo export takes seconds (first use in a process more): slow; torchscript is the fast lane's
EXPORTERS = [pytest.param(False, 17, id="torchscript-17"), pytest.param(True, 18, id="dynamo-18", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_bert_sequence_classification(dynamo, opset):
    torch.manual_seed(0)
    m = WithLoss(bert()).train()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 6:] = 0
    compare_with_torch(m, (ids, mask, torch.tensor([0, 2])), ["input_ids", "attention_mask", "labels"],
                       dynamo=dynamo, opset=opset)


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_gpt2_lm_head_tied_embeddings(dynamo, opset):
    torch.manual_seed(0)
    m = WithLoss(gpt2()).train()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    compare_with_torch(m, (ids, mask, ids.clone()), ["input_ids", "attention_mask", "labels"],
                       dynamo=dynamo, opset=opset)
