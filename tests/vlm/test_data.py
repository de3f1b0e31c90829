"""VQAv2 loading and batching with damaged inputs: truncated annotation files, images that do not decode."""
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from accelerate import skip_first_batches
from PIL import Image

from diffzoo.vlm.data import PaliGemmaCollator, SkippedImages, VLMCollator, VQASample, load_images, load_vqav2
from tests.vlm.models import write_vqav2_split


def corrupt(image: Path, how: str) -> None:
    """A JPEG cut off mid-scan (PIL opens it, decoding fails) or not an image at all."""
    if how == 'truncated':
        image.write_bytes(image.read_bytes()[:300])
    else:
        image.write_bytes(b'<html>404 Not Found</html>\n' * 8)


def write_bomb(path: Path) -> None:
    """A PNG of a few tens of KB with more pixels than PIL decodes (twice Image.MAX_IMAGE_PIXELS): one bit each."""
    side = math.isqrt(2 * Image.MAX_IMAGE_PIXELS) + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new('1', (side, side)).save(path)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp('vqa-data')
    write_vqav2_split(root / 'vqav2', 'train', 6, seed=0)
    samples = load_vqav2(root / 'vqav2', 'train')  # 2 questions per image, in image order
    corrupt(Path(samples[2].image), 'truncated')
    corrupt(Path(samples[4].image), 'not an image')
    return samples


@pytest.mark.parametrize('name', ['questions', 'annotations'])
def test_truncated_annotation_json_is_named(tmp_path, name):
    write_vqav2_split(tmp_path, 'val', 2, seed=0)
    path = next(tmp_path.glob(f'*_{name}.json'))
    path.write_bytes(path.read_bytes()[:41])  # a download cut short
    with pytest.raises(ValueError, match=rf'{re.escape(str(path))}: not valid JSON .* 41 bytes.*download it again'):
        load_vqav2(tmp_path, 'val')


def test_unreadable_images_are_dropped_and_named(data, language_model_dir):
    samples = data
    with pytest.raises(OSError):
        samples[2].load_image()
    with pytest.raises(OSError):
        samples[4].load_image()
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    collate = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64))
    batch = collate(samples[:6])  # images 0, 1 (truncated), 2 (not an image): 2 good questions of 6
    assert batch['pixel_values'].shape[0] == batch['input_ids'].shape[0] == 2
    why = batch['skipped_images'].pop('why')
    assert batch['skipped_images'] == {'sources': [samples[2].image, samples[3].image, samples[4].image,
                                                   samples[5].image], 'kept': [0, 1], 'placeholder': False}
    assert why[samples[2].image].startswith('OSError: ')  # the truncated file
    assert why[samples[4].image].startswith('UnidentifiedImageError: cannot identify image file')
    assert (batch['labels'] != -100).sum(1).tolist() == [2, 2]  # answer + EOS of each kept question
    assert 'skipped_images' not in collate(samples[:2])  # a good batch is the model's input, unchanged
    batch = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64), train=False)(samples[1:4])  # evaluation
    assert batch['input_ids'].shape[0] == 1 and 'labels' not in batch
    assert {k: v for k, v in batch['skipped_images'].items() if k != 'why'} == {
        'sources': [samples[2].image, samples[3].image], 'kept': [0], 'placeholder': False}


def test_a_batch_of_unreadable_images_becomes_one_unscored_row(data, language_model_dir, paligemma_dir):
    samples = data
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    batch = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64))(samples[2:6])
    assert batch['input_ids'].shape[0] == 1 and (batch['labels'] == -100).all()
    assert {k: v for k, v in batch['skipped_images'].items() if k != 'why'} == {
        'sources': [s.image for s in samples[2:6]], 'kept': [], 'placeholder': True}
    processor = transformers.AutoProcessor.from_pretrained(paligemma_dir)
    batch = PaliGemmaCollator(processor)(samples[1:4])
    assert batch['input_ids'].shape[0] == 1 and (batch['labels'] != -100).any()
    assert batch['skipped_images']['sources'] == [samples[2].image, samples[3].image]
    batch = PaliGemmaCollator(processor)(samples[2:4])
    assert batch['input_ids'].shape[0] == 1 and (batch['labels'] == -100).all()


def test_skipped_images_count_each_file_once(data, language_model_dir, capsys):
    samples = data
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    collate = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64))
    ranks = [SkippedImages(), SkippedImages()]
    for rank, batch in [(0, samples[0:3]), (0, samples[3:6]), (1, samples[2:4]), (1, samples[6:12])]:
        ranks[rank].update(collate(batch))
    out = capsys.readouterr().out
    assert out.count(f'left out): {samples[2].image}') == 2  # named once by each process that met it
    assert out.count(f'left out): {samples[4].image}') == 1
    total = ranks[0].merge(ranks[1:])
    assert total.record() == {'count': 2, 'files': [samples[2].image, samples[4].image],
                              'samples_skipped': 6, 'samples_trained': 2 + 0 + 6}
    assert '2 unreadable image file(s) left out (6 samples)' in total.summary()


def test_resume_skips_trained_batches_without_decoding_them(data, language_model_dir):
    """Trainer resumes through accelerate's `skip_first_batches`: for a map-style dataset the batch sampler
    skips, so a corrupt image in an already-trained batch is not decoded (nor reported) again."""
    samples = data
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    decoded = []

    def transform(image: Image.Image) -> torch.Tensor:
        decoded.append(image)
        return torch.zeros(3, 64, 64)

    collate = VLMCollator(tokenizer, transform)
    loader = torch.utils.data.DataLoader(samples, batch_size=6, collate_fn=collate)  # batch 0 holds both bad images
    seen = SkippedImages()
    for batch in skip_first_batches(loader, 1):
        seen.update(batch)
    assert len(decoded) == 6 and seen.record() == {'count': 0, 'files': [], 'samples_skipped': 0,
                                                   'samples_trained': 6}


def test_evaluation_answers_the_readable_questions_and_names_each_unreadable_file_once(data, language_model_dir,
                                                                                          capsys):
    """answer_questions over batches with unreadable images: the readable questions get the answers they get
    without the unreadable ones beside them; the others none, each file named once; a batch of unreadable
    images only answers nothing."""
    from diffzoo.eval.vqa import answer_questions, left_out
    from diffzoo.vlm import load_vlm
    samples = data  # images of samples 2, 3 (truncated) and 4, 5 (not an image) do not decode
    vlm = load_vlm({'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir)})
    vlm.model.eval()
    readable = [samples[0], samples[1], samples[6], samples[7]]
    expected = answer_questions(vlm, readable[:2], batch_size=4) + answer_questions(vlm, readable[2:], batch_size=4)
    capsys.readouterr()
    # batches: (0, 1, 2, 3) keeps 0, 1; (4, 5, 6, 7) keeps 6, 7; (2, 3) keeps nothing
    answers = answer_questions(vlm, samples[0:8] + samples[2:4], batch_size=4)
    assert answers == expected
    out = capsys.readouterr().out
    for source in (samples[2].image, samples[4].image):
        assert out.count(f'skipped an unreadable image (its questions are not answered): {source}') == 1
    assert left_out(answers, samples[0:8]) == 4


def test_an_image_over_pils_decompression_bomb_limit_is_dropped_and_named(tmp_path, data, language_model_dir):
    """Image.DecompressionBombError is not an OSError: such an image is unreadable like any other, in training
    batches and for the benchmark runner (`load_images`), and PIL's limit stays as it was."""
    limit = Image.MAX_IMAGE_PIXELS
    write_bomb(tmp_path / 'bomb.png')
    assert (tmp_path / 'bomb.png').stat().st_size < 100_000
    bomb = VQASample(question_id=99, question='what is it?', answer='white', answers=['white'],
                     image=str(tmp_path / 'bomb.png'))
    with pytest.raises(Image.DecompressionBombError):
        bomb.load_image()
    kept, images, skipped = load_images([data[0], bomb, data[1]])
    assert kept == [0, 2] and len(images) == 2 and skipped == [bomb.image]
    tokenizer = transformers.AutoTokenizer.from_pretrained(language_model_dir)
    batch = VLMCollator(tokenizer, lambda im: torch.zeros(3, 64, 64))([data[0], bomb])
    assert batch['input_ids'].shape[0] == 1
    assert {k: v for k, v in batch['skipped_images'].items() if k != 'why'} == {
        'sources': [bomb.image], 'kept': [0], 'placeholder': False}
    assert Image.MAX_IMAGE_PIXELS == limit
