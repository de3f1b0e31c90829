"""The LoRA adapter holds λ and the sub-norm: plain `PeftModel.from_pretrained` restores the whole
fine-tune; adapters written with the older side file still load."""
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from diffzoo.vlm.differential import _suffix, differential_state_dict, differentialize
from diffzoo.vlm.lora import (ADAPTER_WEIGHTS, EXTRA_CONFIG, EXTRA_WEIGHTS, add_lora, load_adapter, load_adapter_weights,
                              save_adapter)
from diffzoo.vlm.parts import differential_parameters
from tests.vlm.models import tiny_lm

VOCAB = 64
SETTINGS = {'llama': {'variant': 'split', 'lambda_init': 'depth', 'layers': [0, 2], 'mlp': 'original'},
            'qwen2': {'variant': 'duplicate', 'lambda_init': 0.5, 'layers': [0, 1, 2], 'mlp': 'swiglu'}}


def _base(family: str):
    """The same pretrained weights every call (seed 3), made differential (λ drawn at its init)."""
    return differentialize(tiny_lm(family, vocab=VOCAB, seed=3), **SETTINGS[family])


def _fine_tuned(family: str, steps: int = 3):
    """A few AdamW steps of add_lora's fine-tune on random tokens; (peft model, λ/sub-norm at init)."""
    model = add_lora(_base(family), r=4, alpha=8)
    init = [p.detach().clone() for p in differential_parameters(model)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    ids = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), init


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('family', ['llama', 'qwen2'])
def test_plain_peft_from_pretrained_restores_lora_lambda_and_sub_norm(tmp_path, family):
    model, init = _fine_tuned(family)
    trained = [p.detach().clone() for p in differential_parameters(model)]
    assert all(not torch.equal(t, i) for t, i in zip(trained, init))  # training moved every one
    ids = _ids()
    expected = model(input_ids=ids).logits
    save_adapter(model, tmp_path)
    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS))
    assert set(differential_state_dict(model)) <= set(saved)
    assert load_file(str(tmp_path / EXTRA_WEIGHTS)) == {}  # nothing outside the language model here

    settings = json.loads((tmp_path / EXTRA_CONFIG).read_text())['differential']
    loaded = PeftModel.from_pretrained(differentialize(tiny_lm(family, vocab=VOCAB, seed=3), **settings),
                                       str(tmp_path)).eval()
    for got, want, start in zip(differential_parameters(loaded), trained, init):
        assert torch.equal(got, want) and not torch.equal(got, start)
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


def test_load_adapter_restores_and_can_keep_training(tmp_path):
    model, _ = _fine_tuned('llama')
    ids = _ids()
    expected = model(input_ids=ids).logits
    save_adapter(model, tmp_path)
    resumed = load_adapter(tiny_lm('llama', vocab=VOCAB, seed=3), tmp_path, trainable=True)
    assert all(p.requires_grad for p in differential_parameters(resumed))
    torch.testing.assert_close(resumed.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)
    frozen = load_adapter(tiny_lm('llama', vocab=VOCAB, seed=3), tmp_path)
    assert not any(p.requires_grad for p in frozen.parameters())


def _write_older_adapter(model, directory):
    """An adapter as save_adapter wrote it before: LoRA weights only in peft's file, the differential
    parameters by layer (`layers.i.self_attn.lambda_q1`, …) in diffzoo_extra.safetensors."""
    model.save_pretrained(directory)
    weights = load_file(str(directory / ADAPTER_WEIGHTS))
    assert not any('lambda' in k or 'sub_norm' in k for k in weights)  # peft alone does not save them
    save_file({_suffix(k): v.contiguous() for k, v in differential_state_dict(model).items()},
              str(directory / EXTRA_WEIGHTS))
    settings = model.get_base_model().config.diffzoo_differential
    (directory / EXTRA_CONFIG).write_text(json.dumps({'differential': settings}))


def test_older_adapters_with_the_side_file_still_load(tmp_path):
    model, init = _fine_tuned('llama')
    ids = _ids()
    expected = model(input_ids=ids).logits
    _write_older_adapter(model, tmp_path)

    loaded = load_adapter(tiny_lm('llama', vocab=VOCAB, seed=3), tmp_path)
    torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)
    resumed = add_lora(_base('llama'), r=4, alpha=8)  # resuming a checkpoint: prepared as the recipe does
    assert all(torch.equal(p, i) for p, i in zip(differential_parameters(resumed), init))
    load_adapter_weights(resumed, tmp_path)
    torch.testing.assert_close(resumed.eval()(input_ids=ids).logits, expected, rtol=0, atol=0)
