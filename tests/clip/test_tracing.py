"""diffzoo's CLIP models through TorchScript, torch.compile(fullgraph=True), torch.export and ONNX (fp32, CPU).

TorchScript takes whole models, as open_clip scripts them (`create_model(..., jit=True)`, which open_clip_train's
`--torchscript` calls, logs a failure and hands back the eager model): every tiny config against eager, gradients
included, every other config on the meta device, a scripted model saved and run in a process without diffzoo, a
training with `--torchscript`, and diffclip-b16's layers. TorchScript and the other tracers take diffclip-b16 with
each tower cut to its first two blocks, at batch 1: the differential layers of the real geometry (6 vision heads of
q/k 64 and v 128 over 197 tokens, the causal text tower of 4 differential heads over 77) are what these paths must
take, one block feeding the next; a tower's blocks are one module repeated (λ_init 0.8 in each: tests/clip/
test_models.py and tests/models/test_vit_diff.py), so the other ten of each take the same path."""
import json
import logging
import re
import sys
from importlib import resources

import numpy as np
import onnxruntime as ort
import open_clip
import pytest
import torch

from diffzoo.layers import DifferentialAttention
from diffzoo.train.launch import main as train_main
from tests.factory import call, run, write_shards

CONFIGS = resources.files('diffzoo') / 'model_configs'
NAMES = sorted(p.name[:-5] for p in CONFIGS.iterdir() if p.name.endswith('.json'))  # the registered configs
TINY = [n for n in NAMES if '-tiny' in n]
CAPTIONS = ['a red circle', 'two blue squares left of a small green triangle', 'a photo of a dog']


def _scripted(name, caplog, **kwargs):
    """`open_clip.create_model(name, jit=True, …)`, checked to be scripted: open_clip logs a failure and carries on."""
    with caplog.at_level(logging.INFO):
        model = open_clip.create_model(name, jit=True, **kwargs)
    assert 'JIT scripting failed' not in caplog.text
    assert isinstance(model, torch.jit.ScriptModule), caplog.text[-2000:]
    return model


def _eager_twin(name, scripted, **kwargs):
    """The eager model of `name` with `scripted`'s weights. A scripted state_dict also holds the non-persistent
    buffers (TorchScript keeps no persistent=False): open_clip's causal `attn_mask`, the same in both."""
    model = open_clip.create_model(name, **kwargs)
    result = model.load_state_dict(scripted.state_dict(), strict=False)
    assert not result.missing_keys and all(k.endswith('attn_mask') for k in result.unexpected_keys)
    return model


def _step(model, images, text):
    """Features, logit scale, loss and parameter gradients of one CLIP loss step of `model`."""
    model.zero_grad(set_to_none=True)
    image_features, text_features, logit_scale = model(images, text)
    loss = open_clip.ClipLoss()(image_features, text_features, logit_scale)
    loss.backward()
    outputs = [image_features.detach(), text_features.detach(), logit_scale.detach(), loss.detach()]
    return outputs, [p.grad for p in model.parameters()]


@pytest.mark.parametrize('name, force_custom_text', [(n, False) for n in TINY] + [('diffclip-tiny', True)],
                         ids=lambda v: {True: 'custom_text', False: 'clip'}.get(v, v))
def test_create_model_jit_scripts_the_whole_model_equal_to_eager(name, force_custom_text, caplog):
    """The scripted model's encode_image, encode_text, forward and gradients equal eager's (fp32, same weights)."""
    scripted = _scripted(name, caplog, force_custom_text=force_custom_text)
    model = _eager_twin(name, scripted, force_custom_text=force_custom_text)
    images = torch.randn(len(CAPTIONS), 3, *model.visual.image_size)
    text = open_clip.get_tokenizer(name)(CAPTIONS)  # three lengths: EOT pooling at three positions
    with torch.no_grad():
        torch.testing.assert_close(scripted.encode_image(images), model.encode_image(images), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(scripted.encode_text(text), model.encode_text(text), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(scripted.encode_text(text, normalize=True), model.encode_text(text, normalize=True),
                                   rtol=1e-5, atol=1e-6)
    outputs, grads = _step(scripted, images, text)
    eager_outputs, eager_grads = _step(model, images, text)
    for a, b in zip(outputs, eager_outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):  # scripted, the sub-norm runs under ordinary autograd: fp32 rounding apart
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_checkpoint_of_a_scripted_model_loads_into_the_eager_model(tmp_path, caplog):
    """open_clip_train saves a scripted model's state_dict, non-persistent `attn_mask` included; it loads strictly."""
    scripted = _scripted('diffclip-tiny', caplog)
    path = tmp_path / 'epoch_1.pt'
    torch.save({'epoch': 1, 'name': 'run', 'state_dict': {f'module.{k}': v for k, v in scripted.state_dict().items()}},
               path)
    loaded = open_clip.create_model('diffclip-tiny', pretrained=str(path))
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, scripted.state_dict()[k], rtol=0, atol=0, msg=k)


# The L/14 and B/32 configs differ from their B/16 ones only in widths, heads and the timm tower's name (a tower of
# the same class at another size): TorchScript compiles by module type and constant, so they script as B/16 does
# (`test_only_sizes_set_the_larger_configs_apart` holds that premise)
SIZE_ONLY = {'embed_dim', 'text_cfg.width', 'text_cfg.heads', 'vision_cfg.width', 'vision_cfg.layers',
             'vision_cfg.patch_size', 'vision_cfg.image_size', 'vision_cfg.head_width', 'vision_cfg.timm_model_name'}
SCRIPTED_ON_META = [n for n in NAMES if n not in TINY and '-l14' not in n and '-b32' not in n]


def _flat(cfg, prefix=''):
    return {k: v for key, value in cfg.items()
            for k, v in (_flat(value, f'{prefix}{key}.') if isinstance(value, dict) else {prefix + key: value}).items()}


def test_only_sizes_set_the_larger_configs_apart():
    for name in NAMES:
        if '-l14' in name or '-b32' in name:
            larger, b16 = (_flat(open_clip.get_model_config(n)) for n in (name, re.sub('l14|b32', 'b16', name)))
            assert {k for k in larger.keys() | b16.keys() if larger.get(k) != b16.get(k)} <= SIZE_ONLY, name


@pytest.mark.parametrize('name', SCRIPTED_ON_META)
def test_create_model_jit_scripts_every_other_model_on_the_meta_device(name, caplog):
    """The full-size configs script as the tiny ones do; on the meta device (no weights) the scripted forward gives
    the shapes (diffclip-b16's layers are compared with eager below)."""
    with torch.device('meta'):
        scripted = _scripted(name, caplog, device='meta')
    cfg = open_clip.get_model_config(name)
    image_size = cfg['vision_cfg']['image_size']
    images = torch.empty(2, 3, image_size, image_size, device='meta')
    text = torch.zeros(2, cfg['text_cfg']['context_length'], dtype=torch.long, device='meta')
    image_features, text_features, logit_scale = scripted(images, text)
    assert image_features.shape == text_features.shape == (2, cfg['embed_dim']) and image_features.is_meta


def test_scripted_text_stack_applies_masks_as_eager():
    """Scripted, the causal text stack checks its mask's values at every call (eager mode: once per mask): the exact
    causal mask becomes is_causal, a banded one (each token sees the last 3) reaches the blocks as given."""
    model = open_clip.create_model('diffclip-tiny')
    stack = model.transformer
    scripted = torch.jit.script(stack)
    L = model.context_length
    x = torch.randn(2, L, stack.width)
    causal = torch.full((L, L), float('-inf')).triu_(1)  # (L, L), open_clip's additive causal mask
    banded = causal.clone()
    banded[torch.ones(L, L, dtype=torch.bool).tril_(-3)] = float('-inf')
    causal_bool = torch.ones(L, L, dtype=torch.bool).tril_()  # (L, L), True where attended
    masks = {'none': None, 'causal': causal, 'causal_bool': causal_bool, 'banded': banded}
    with torch.no_grad():
        out = {k: scripted(x, attn_mask=mask) for k, mask in masks.items()}
        for k, mask in masks.items():
            torch.testing.assert_close(out[k], stack(x, attn_mask=mask), rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(out['causal'], out['causal_bool'])
    assert not torch.allclose(out['banded'], out['causal'], atol=1e-3)  # the band took effect


@pytest.mark.slow  # a process that loads torch
def test_saved_scripted_model_runs_in_a_process_without_diffzoo(tmp_path, caplog):
    """`torch.jit.save` of `create_model('diffclip-tiny', jit=True)`: `torch.jit.load` in a process that imports
    neither diffzoo nor open_clip runs it to eager's features."""
    scripted = _scripted('diffclip-tiny', caplog)
    model = _eager_twin('diffclip-tiny', scripted)
    images = torch.randn(len(CAPTIONS), 3, 64, 64)
    text = open_clip.get_tokenizer('diffclip-tiny')(CAPTIONS)
    torch.jit.save(scripted, str(tmp_path / 'diffclip-tiny.pt'))
    with torch.no_grad():
        torch.save({'images': images, 'text': text, 'features': model(images, text)[:2]}, tmp_path / 'expected.pt')
    script = (
        'import sys, torch\n'
        'model = torch.jit.load("diffclip-tiny.pt").eval()\n'
        'expected = torch.load("expected.pt")\n'
        'with torch.no_grad():\n'
        '    image_features, text_features, _ = model(expected["images"], expected["text"])\n'
        'torch.testing.assert_close(image_features, expected["features"][0], rtol=1e-5, atol=1e-6)\n'
        'torch.testing.assert_close(text_features, expected["features"][1], rtol=1e-5, atol=1e-6)\n'
        'print(sorted(m for m in ("diffzoo", "open_clip", "timm") if m in sys.modules), "equal")\n')
    result = run([sys.executable, '-c', script], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == '[] equal'


@pytest.mark.slow  # a training
def test_train_with_torchscript_trains_the_scripted_model(tmp_path):
    """`python -m diffzoo.train --recipe diffclip-tiny … -- --torchscript`: open_clip_train scripts the model (its log
    says so; it would carry on unscripted after a failure), trains it, and saves a checkpoint the eager model loads."""
    write_shards(tmp_path / 'shards', 2, 8)
    result = call(train_main, ['--recipe', 'diffclip-tiny', '--train_data', 'shards', '--epochs', '1',
                               '--global_batch_size', '8', '--', '--torchscript'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / 'runs' / 'diffclip-tiny'
    log = (run_dir / 'out.log').read_text()
    assert 'torchscript: True' in log and 'JIT scripting successful' in log and 'JIT scripting failed' not in log
    assert 'Train Epoch: 0 [16/16 (100%)]' in log
    eager = open_clip.create_model('diffclip-tiny')
    layers = [n for n, m in eager.named_modules() if isinstance(m, DifferentialAttention)]
    records = [json.loads(line) for line in (run_dir / 'lambda.jsonl').read_text().splitlines()]
    assert records and all(sorted(r['lambda']) == sorted(layers) for r in records)  # λ of every scripted layer
    checkpoint = run_dir / 'checkpoints' / 'epoch_1.pt'
    trained = open_clip.create_model('diffclip-tiny', pretrained=str(checkpoint))  # strict: every key
    assert not torch.equal(trained.logit_scale, open_clip.create_model('diffclip-tiny').logit_scale)


class TextTower(torch.nn.Module):
    """`encode_text` as a module, the form the tracers take."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, text):
        return self.clip.encode_text(text)


BLOCKS = 2  # of each diffclip-b16 tower (the module docstring)


@pytest.fixture(scope='module')
def towers():
    model = open_clip.create_model('diffclip-b16').eval()
    model.visual.trunk.blocks = model.visual.trunk.blocks[:BLOCKS]
    model.transformer.resblocks = model.transformer.resblocks[:BLOCKS]
    model.transformer.layers = BLOCKS
    image = torch.randn(1, 3, 224, 224)
    text = open_clip.get_tokenizer('diffclip-b16')(['a photo of a differential cat'])
    return {'vision': (model.visual, image), 'text': (TextTower(model), text), 'model': (model, (image, text))}


@pytest.mark.slow  # a B/16-wide model scripted
def test_torchscript_of_diffclip_b16_matches_eager(towers):
    model, (image, text) = towers['model']
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted.encode_image(image), model.encode_image(image), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scripted.encode_text(text), model.encode_text(text), rtol=1e-5, atol=1e-5)
        for a, b in zip(scripted(image, text), model(image, text)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # B/16-wide towers through dynamo
@pytest.mark.parametrize('tower', ['vision', 'text'])
def test_compile_fullgraph_has_no_graph_break(towers, tower):
    module, x = towers[tower]
    with torch.no_grad():
        eager = module(x)
        compiled = torch.compile(module, fullgraph=True, backend='eager')(x)  # fullgraph: a break raises
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # B/16-wide towers through export
@pytest.mark.parametrize('tower', ['vision', 'text'])
def test_exported_program_runs_equal_to_eager(towers, tower):
    module, x = towers[tower]
    program = torch.export.export(module, (x,))
    with torch.no_grad():
        assert torch.equal(program.module()(x), module(x))


@pytest.mark.slow  # a B/16-wide tower through ONNX and onnxruntime
def test_vision_tower_onnx_in_onnxruntime_matches_eager(towers, tmp_path):
    module, x = towers['vision']
    path = tmp_path / 'diffclip-b16-visual.onnx'
    torch.onnx.export(module, (x,), dynamo=True, verbose=False).save(str(path))
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        eager = module(x).numpy()
    assert np.abs(out - eager).max() <= 1e-4
