"""The published DiffCLIP checkpoints: strict loading, exact outputs, offline tags, refusal of
unsafe or broken files. Checkpoints are generated in the official format; nothing is downloaded."""
import os
from typing import NamedTuple

import open_clip
import pytest
import torch

from diffzoo.checkpoint import CheckpointError, official_diffclip_to_open_clip, read_state_dict
from diffzoo.clip.hub import check_fit
from diffzoo.convert import main as convert
from diffzoo.layers import set_split_kernel
from tests.clip import official_reference as ref
from tests.factory import call


class Expected(NamedTuple):
    images: torch.Tensor
    text: torch.Tensor
    image_features: torch.Tensor  # the official implementation's outputs (tests/clip/official_reference.py)
    text_features: torch.Tensor
    logit_scale: torch.Tensor


@pytest.fixture(scope='module')
def expected(official) -> Expected:
    """Two images and two captions, with what the official model computes for them from `official`'s weights."""
    g = torch.Generator().manual_seed(3)
    images = torch.randn(2, 3, 224, 224, generator=g)
    text = open_clip.get_tokenizer('diffclip-b16')(['a photo of a mug on a desk', 'a dog chasing a ball'])
    state_dict = official.state_dict
    with torch.no_grad():
        return Expected(images, text, ref.encode_image(state_dict, images), ref.encode_text(state_dict, text),
                        state_dict['logit_scale'])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _assert_matches_official(model, expected: Expected):
    model.eval()
    with torch.no_grad():
        assert _rel(model.encode_image(expected.images, normalize=False), expected.image_features) < 1e-5
        assert _rel(model.encode_text(expected.text, normalize=False), expected.text_features) < 1e-5
        torch.testing.assert_close(model.logit_scale, expected.logit_scale)


@pytest.mark.slow
def test_official_file_loads_strictly_and_matches_official_outputs(official, expected):
    path = official.path
    model, _, preprocess = open_clip.create_model_and_transforms('diffclip-b16', pretrained=str(path))
    _assert_matches_official(model, expected)


def test_converter_is_a_complete_key_map(official):
    _, state_dict = official
    converted = official_diffclip_to_open_clip(state_dict)
    with torch.device('meta'):  # keys and shapes only
        expected = open_clip.create_model('diffclip-b16', device='meta').state_dict()
    assert converted.keys() == expected.keys()
    assert all(converted[k].shape == expected[k].shape for k in expected)
    q, k, v = (state_dict[f'visual.blocks.3.attn.{p}_proj.weight'] for p in 'qkv')
    torch.testing.assert_close(converted['visual.trunk.blocks.3.attn.qkv.weight'], torch.cat([q, k, v]))


def test_a_checkpoint_that_does_not_convert_into_diffclip_b16_is_refused_by_its_keys(official, tmp_path):
    """A tensor missing, one not the model's, one of another shape, or a q projection without its k and v: each
    named before anything is written (a width-512 file would otherwise convert, be labelled diffclip-b16 and fail
    only when loaded)."""
    _, state_dict = official
    converted = official_diffclip_to_open_clip(state_dict)
    check_fit(converted, 'diffclip-b16', tmp_path / 'in.pt')  # the whole file fits
    key = 'visual.trunk.blocks.0.attn.qkv.bias'
    broken = {k: v for k, v in converted.items() if k != key}
    broken.update({'foo.bar': torch.zeros(1), 'logit_scale': torch.zeros(2)})
    with pytest.raises(CheckpointError) as refused:
        check_fit(broken, 'diffclip-b16', tmp_path / 'in.pt')
    assert str(refused.value) == (
        f"{tmp_path / 'in.pt'}: converted, its tensors do not fit diffclip-b16: 1 missing ({key}); 1 not "
        f"diffclip-b16's (foo.bar); 1 of another shape (logit_scale); e.g. logit_scale: (2,) here, () in "
        f"diffclip-b16; convert takes the published DiffCLIP ViT-B/16 checkpoint, whole")
    no_k = {k: v for k, v in state_dict.items() if k != 'visual.blocks.0.attn.k_proj.bias'}
    with pytest.raises(CheckpointError, match=r'^no visual\.blocks\.0\.attn\.k_proj\.bias beside '
                                              r'visual\.blocks\.0\.attn\.q_proj\.bias'):
        official_diffclip_to_open_clip(no_k)
    assert list(tmp_path.iterdir()) == []


def _assert_diffclip_preprocessing(preprocess):
    """ImageNet mean/std and a bilinear resize, as DiffCLIP trained (not open_clip's OpenAI defaults)."""
    resize, norm = preprocess.transforms[0], preprocess.transforms[-1]
    assert tuple(norm.mean) == (0.485, 0.456, 0.406) and tuple(norm.std) == (0.229, 0.224, 0.225), norm
    assert resize.interpolation.value == 'bilinear', resize


@pytest.mark.slow
def test_convert_cli_writes_safetensors_open_clip_loads(official, expected, tmp_path, recwarn):
    path = official.path
    out = tmp_path / 'diffclip_b16_cc12m.safetensors'
    proc = call(convert, ['official-diffclip', path, out], cwd=tmp_path)  # the process: tests/test_cli.py
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '149,629,185 parameters' in proc.stdout and 'mean (0.485, 0.456, 0.406)' in proc.stdout
    model, _, preprocess = open_clip.create_model_and_transforms('diffclip-b16', pretrained=str(out))
    _assert_matches_official(model, expected)
    _assert_diffclip_preprocessing(preprocess)  # from the file's own metadata
    assert not [w for w in recwarn if 'no record of the preprocessing' in str(w.message)]


@pytest.fixture(scope='module')
def converted(official, tmp_path_factory):
    """`official` converted into a folder, open_clip's hub layout (`diffzoo.convert official-diffclip IN.pt DIR`);
    read-only."""
    out = tmp_path_factory.mktemp('converted') / 'diffclip-b16-cc12m'
    result = call(convert, ['official-diffclip', official.path, out], cwd=out.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_convert_cli_writes_open_clips_hub_layout_local_dir_and_hf_hub_load(converted, expected, offline_hub):
    out = converted
    assert {p.name for p in out.iterdir()} == {'open_clip_config.json', 'open_clip_model.safetensors'}
    model, _, preprocess = open_clip.create_model_and_transforms(f'local-dir:{out}')
    _assert_matches_official(model, expected)
    _assert_diffclip_preprocessing(preprocess)
    # the same folder served by the hub: a snapshot in an offline Hugging Face cache
    offline_hub('me/diffclip-b16-cc12m', out)
    model, _, preprocess = open_clip.create_model_and_transforms('hf-hub:me/diffclip-b16-cc12m')
    _assert_matches_official(model, expected)
    _assert_diffclip_preprocessing(preprocess)


def test_publish_refuses_a_folder_without_the_hub_layout(tmp_path, capsys):
    from diffzoo.convert import main
    assert main(['publish', str(tmp_path), '--repo', 'me/x']) == 2
    assert 'no open_clip_config.json, open_clip_model.safetensors' in capsys.readouterr().err


@pytest.mark.slow
def test_publish_to_a_local_dir_writes_what_the_upload_sends_and_open_clip_loads_it(converted, expected, tmp_path,
                                                                                     capsys):
    """A converted folder published offline with --local-dir: only open_clip's two files (not a stray
    file beside them), loading with the official outputs and DiffCLIP's preprocessing."""
    from diffzoo.convert import main
    folder, out = tmp_path / 'converted', tmp_path / 'published'
    folder.mkdir()
    for f in converted.iterdir():  # `converted`'s files, beside a file of this folder's own
        (folder / f.name).hardlink_to(f)
    (folder / 'notes.txt').write_text('training notes, not for the hub\n')
    capsys.readouterr()
    assert main(['publish', str(folder), '--repo', 'me/diffclip-b16', '--local-dir', str(out)]) == 0
    assert capsys.readouterr().out == (
        f'wrote open_clip_config.json, open_clip_model.safetensors to {out} (not uploaded to me/diffclip-b16); '
        f"load with: open_clip.create_model_and_transforms('local-dir:{out}') (after import diffzoo)\n")
    assert sorted(p.name for p in out.iterdir()) == ['open_clip_config.json', 'open_clip_model.safetensors']
    for name in ('open_clip_config.json', 'open_clip_model.safetensors'):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    model, _, preprocess = open_clip.create_model_and_transforms(f'local-dir:{out}')
    _assert_matches_official(model, expected)
    _assert_diffclip_preprocessing(preprocess)


@pytest.mark.parametrize('config, lacking', [
    ({'model_cfg': {'embed_dim': 512}}, 'preprocess_cfg.mean, preprocess_cfg.std'),
    ({'model_cfg': {'embed_dim': 512}, 'preprocess_cfg': {'mean': [0.5] * 3}}, 'preprocess_cfg.std'),
    ({'preprocess_cfg': {'mean': [0.5] * 3, 'std': [0.5] * 3}}, 'model_cfg'),
])
def test_publish_refuses_a_config_without_the_model_or_its_preprocessing(tmp_path, capsys, config, lacking):
    """open_clip would load such a folder with OpenAI's mean/std: neither uploaded nor written."""
    import json
    from diffzoo.convert import main
    folder = tmp_path / 'converted'
    folder.mkdir()
    (folder / 'open_clip_config.json').write_text(json.dumps(config))
    (folder / 'open_clip_model.safetensors').write_bytes(b'')
    assert main(['publish', str(folder), '--local-dir', str(tmp_path / 'out')]) == 2
    assert capsys.readouterr().err == (
        f'error: {folder / "open_clip_config.json"}: no {lacking}; write the folder again with '
        f'python -m diffzoo.convert official-diffclip IN.pt {folder}\n')
    assert not (tmp_path / 'out').exists()


def test_publish_needs_a_repo_or_a_local_dir(tmp_path, capsys):
    from diffzoo.convert import main
    with pytest.raises(SystemExit) as exit_:
        main(['publish', str(tmp_path)])
    assert exit_.value.code == 2
    assert 'publish: pass --repo USER/NAME to upload, or --local-dir DIR to write the files instead' in \
        capsys.readouterr().err


def test_convert_cli_refuses_other_files(tmp_path):
    bad = tmp_path / 'notes.pt'
    bad.write_text('# a text file, not a checkpoint\n')
    proc = call(convert, ['official-diffclip', bad, tmp_path / 'o.safetensors'], cwd=tmp_path)
    assert proc.returncode == 2 and 'not a PyTorch checkpoint' in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize('tag, repo', [('cc3m', 'hammh0a/DiffCLIP_ViTB16_CC3M'),
                                       ('cc12m', 'hammh0a/DiffCLIP_ViTB16_CC12M')])
def test_pretrained_tags_and_the_official_hub_ids_resolve_through_the_hub_cache_offline(official, expected, offline_hub,
                                                                                      tag, repo):
    """`pretrained='cc3m'` and `hf-hub:hammh0a/DiffCLIP_ViTB16_CC3M` (whose repo holds only the
    official checkpoint_best.pt) give the same model, with DiffCLIP's preprocessing."""
    path = official.path
    offline_hub(repo, path)
    for name, pretrained in (('diffclip-b16', tag), (f'hf-hub:{repo}', None)):
        model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained)
        _assert_matches_official(model, expected)
        _assert_diffclip_preprocessing(preprocess)
    assert tag in open_clip.list_pretrained_tags_by_model('diffclip-b16')


def test_unsafe_global_is_refused_by_name(tmp_path):
    path = tmp_path / 'evil.pt'
    torch.save({'state_dict': {'w': torch.zeros(1)}, 'callback': os.system}, path)
    with pytest.raises(CheckpointError, match=r'refused to unpickle global\(s\) posix\.system'):
        read_state_dict(path)
    with pytest.raises(CheckpointError, match='posix.system'):
        open_clip.create_model('diffclip-tiny', pretrained=str(path))


def test_truncated_and_non_checkpoint_files_are_named(official, tmp_path):
    path, _ = official
    truncated = tmp_path / 'checkpoint_best.pt'
    truncated.write_bytes(path.read_bytes()[: 50_000_000])
    with pytest.raises(CheckpointError, match='truncated'):
        open_clip.create_model('diffclip-b16', pretrained=str(truncated))
    text = tmp_path / 'readme.pt'
    text.write_text('hello')
    with pytest.raises(CheckpointError, match='not a (readable )?PyTorch checkpoint'):
        read_state_dict(text)
    empty = tmp_path / 'empty.pt'
    torch.save({'epoch': 3}, empty)
    with pytest.raises(CheckpointError, match='no state_dict of tensors'):
        read_state_dict(empty)


def test_no_unrestricted_torch_load_anywhere():
    import diffzoo
    root = os.path.dirname(diffzoo.__file__)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith('.py'):
                src = open(os.path.join(dirpath, f)).read()
                assert 'weights_only=False' not in src, f


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
def test_official_outputs_on_cuda_in_fp32_and_with_the_triton_kernel_in_bf16(official, expected):
    """On CUDA the fp32 model (SDPA kernels, TF32 off) equals the official outputs as on CPU; in bf16 the
    Triton split kernel is off them by at most twice what the two_calls SDPA kernel is."""
    model, _, _ = open_clip.create_model_and_transforms('diffclip-b16', pretrained=str(official.path))
    model = model.cuda().eval()
    images, text = expected.images.cuda(), expected.text.cuda()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            assert _rel(model.encode_image(images, normalize=False).cpu(), expected.image_features) < 1e-5
            assert _rel(model.encode_text(text, normalize=False).cpu(), expected.text_features) < 1e-5
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    errors = {}
    for kernel in ('triton', 'two_calls'):
        set_split_kernel(model, kernel)
        with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
            errors[kernel] = (_rel(model.encode_image(images, normalize=False).float().cpu(), expected.image_features),
                              _rel(model.encode_text(text, normalize=False).float().cpu(), expected.text_features))
    for ours, sdpa in zip(errors['triton'], errors['two_calls']):
        assert ours <= 2 * sdpa + 1e-4, errors
