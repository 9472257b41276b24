"""transformers' Trainer training an ORTModule-wrapped BERT classifier (random weights, a tiny
config, no downloads) gives the plain model's losses and weights, and save_pretrained /
from_pretrained round-trip through the wrapper."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gradbuilder.ortmodule import ORTModule

from .torch_models import tiny_bert

pytest.importorskip("accelerate")  # the Trainer's own dependency (in the test extras)


def _data(n: int = 16, length: int = 8):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 64, (length,), generator=g),
             "attention_mask": (torch.arange(length) < 5 + i % 4).long(),
             "labels": torch.randint(0, 3, (), generator=g)} for i in range(n)]


def _lm_data(n: int = 16, length: int = 8):
    """Causal-LM samples: ids, a right-padded attention mask, the ids as labels (-100 on padding)."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(n):
        ids = torch.randint(3, 96, (length,), generator=g)
        mask = (torch.arange(length) < 5 + i % 4).long()
        samples.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                        "labels": ids.masked_fill(mask == 0, -100)})
    return samples


def _train(model, directory, data=None) -> list[float]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(directory), per_device_train_batch_size=4, num_train_epochs=2,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data if data is not None else _data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_the_wrapped_model_as_the_plain_one(tmp_path):
    torch.manual_seed(0)
    bert = tiny_bert(vocab=64, positions=16, labels=3, intermediate=48)
    plain, wrapped = copy.deepcopy(bert), ORTModule(copy.deepcopy(bert))
    want = _train(plain, tmp_path / "plain")
    got = _train(wrapped, tmp_path / "wrapped")
    assert len(want) == 8 and len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert want[0] != want[-1]  # it trained
    for (name, p), q in zip(plain.state_dict().items(), wrapped.module.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("architecture", ["qwen3", "mixtral"])
def test_trainer_trains_a_wrapped_llm_as_the_plain_one(tmp_path, architecture):
    """A dense and a mixture-of-experts causal LM (transformers' own classes, default
    attention) under the Trainer: the wrapped model's losses and weights are the plain one's."""
    from .llm_models import causal_lm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = causal_lm(architecture)
    plain, wrapped = copy.deepcopy(model), ORTModule(copy.deepcopy(model))
    want = _train(plain, tmp_path / "plain", _lm_data())
    got = _train(wrapped, tmp_path / "wrapped", _lm_data())
    assert len(want) == 8 and len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert want[0] != want[-1]  # it trained
    for (name, p), q in zip(plain.state_dict().items(), wrapped.module.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_save_pretrained_and_from_pretrained_round_trip_through_the_wrapper(tmp_path):
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    wrapped = ORTModule(tiny_bert(vocab=64, positions=16, labels=3, intermediate=48))
    batch = {k: torch.stack([d[k] for d in _data(4)]) for k in ("input_ids", "attention_mask", "labels")}
    wrapped(**batch).loss.backward()  # compiled and used before saving
    wrapped.save_pretrained(tmp_path / "saved")
    loaded = ORTModule(BertForSequenceClassification.from_pretrained(tmp_path / "saved"))
    for (name, p), q in zip(wrapped.module.state_dict().items(), loaded.module.state_dict().values()):
        torch.testing.assert_close(q, p, msg=name)
    wrapped.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, wrapped(**batch).logits)


def test_trainer_save_model_writes_a_checkpoint_from_pretrained_loads(tmp_path):
    """Trainer.save_model saves with save_pretrained only for a PreTrainedModel (or what
    accelerate unwraps to one); the wrapper of one counts as its model's class, so the directory
    has config.json and loads with from_pretrained, with the trained weights."""
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    wrapped = ORTModule(tiny_bert(vocab=64, positions=16, labels=3, intermediate=48))
    _train(wrapped, tmp_path / "run")
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    Trainer(model=wrapped, args=args).save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").is_file()
    loaded = BertForSequenceClassification.from_pretrained(tmp_path / "saved")
    for (name, p), q in zip(wrapped.module.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(q, p, msg=name)
    assert isinstance(wrapped, ORTModule) and isinstance(wrapped, BertForSequenceClassification)
    assert type(copy.deepcopy(wrapped)) is ORTModule
