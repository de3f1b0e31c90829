import open_clip
import pytest
import torch

from diffzoo.data.synthetic import COLOURS, SHAPES, CorpusConfig, write_corpus
from diffzoo.eval.synthetic import evaluate, prompts, recall_at_k


def test_recall_counts_any_image_with_the_caption_and_the_images_own_caption():
    # 3 images, 2 distinct captions; images 0 and 1 have caption 0, image 2 has caption 1
    similarity = torch.tensor([[0.9, 0.1],
                               [0.2, 0.8],
                               [0.7, 0.3]])
    own = torch.tensor([0, 0, 1])
    r = recall_at_k(similarity, own, ks=(1, 2))
    assert r['image_to_text_R@1'] == pytest.approx(100 / 3)  # only image 0 ranks its caption first
    assert r['image_to_text_R@2'] == 100.0
    # caption 0 ranks image 0 first (a hit); caption 1 ranks image 1 first (not its image), image 2 second
    assert r['text_to_image_R@1'] == 50.0 and r['text_to_image_R@2'] == 100.0


def test_prompts_name_one_class_over_every_other_attribute():
    shape = prompts('shape')
    assert list(shape) == list(SHAPES) and len(shape['circle']) == 2 * len(COLOURS)
    assert all('circle' in p and not any(s in p for s in SHAPES if s != 'circle') for p in shape['circle'])
    assert list(prompts('colour')) == list(COLOURS)
    with pytest.raises(ValueError, match='shape and colour'):
        prompts('size')


@pytest.mark.parametrize('name', ['diffclip-tiny', 'clip-tiny-baseline'])
def test_every_metric_for_a_real_model(tmp_path, name):
    write_corpus(tmp_path, CorpusConfig(train=1, val=40, per_shard=40, image_size=64), progress=None)
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(name)
    metrics = evaluate(model, preprocess, open_clip.get_tokenizer(name), tmp_path / 'val')
    assert set(metrics) == {'zero_shot_shape', 'zero_shot_colour'} | {
        f'{d}_R@{k}' for d in ('image_to_text', 'text_to_image') for k in (1, 5, 10)}
    assert all(0 <= v <= 100 for v in metrics.values())
    for direction in ('image_to_text', 'text_to_image'):
        assert metrics[f'{direction}_R@1'] <= metrics[f'{direction}_R@5'] <= metrics[f'{direction}_R@10']
    assert evaluate(model, preprocess, open_clip.get_tokenizer(name), tmp_path / 'val') == metrics
