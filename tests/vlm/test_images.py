"""The image files a VLM reads (`diffzoo.vlm.images`): a path that is not an image file says what it is, through the
conversation loader; an image between 1× and 2× PIL's pixel limit is decoded at a scale under it (a JPEG) or
refused and named (any other format) in the collator's batches, and a real JPEG of 100 million pixels (PIL's limit:
89,478,485) decodes in a process whose address space could not hold it whole."""
import json
import os
import subprocess
import sys

import pytest
from PIL import Image
from torchvision import transforms

from diffzoo.vlm.conversations import ConversationCollator, load_conversations
from tests.factory import python_env
from tests.vlm.test_conversations import _tokenizer


def _record(i, image):
    return {'id': i, 'image': image, 'conversations': [{'from': 'human', 'value': '<image>\nwhat color is it?'},
                                                       {'from': 'gpt', 'value': 'red'}]}


def test_a_directory_a_symlink_loop_and_a_dangling_symlink_are_named_as_what_they_are(tmp_path):
    """Before: each was "image file missing"."""
    images = tmp_path / 'images'
    (images / 'a_folder.jpg').mkdir(parents=True)
    os.symlink('loop_b.jpg', images / 'loop_a.jpg')
    os.symlink('loop_a.jpg', images / 'loop_b.jpg')
    os.symlink('gone.jpg', images / 'dangling.jpg')
    Image.new('RGB', (8, 8), 'red').save(images / 'red.jpg')
    names = ['red.jpg', 'a_folder.jpg', 'loop_a.jpg', 'dangling.jpg', 'absent.jpg']
    (tmp_path / 'data.json').write_text(json.dumps([_record(n, name) for n, name in enumerate(names)]))
    kept, problems = load_conversations(tmp_path / 'data.json', images)
    assert [c.id for c in kept] == ['0']
    assert dict(problems.left_out) == {'image path a directory': 1, 'image path a symlink loop': 1,
                                       'image path a symlink to a missing file': 1, 'image file missing': 1}
    assert problems.examples['image path a symlink loop'] == ['2']


def test_an_image_between_one_and_two_pixel_limits_is_decoded_under_it_or_refused_and_named(tmp_path, monkeypatch,
                                                                                           capsys):
    """At a limit of 10,000 pixels, a 150 × 100 JPEG (15,000: PIL only warns) is decoded at half its size, never
    whole, and trains; a PNG of that size cannot be decoded smaller and is left out, with why. Before: both were
    decoded whole (150 × 100)."""
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 10_000)
    Image.new('RGB', (150, 100), 'red').save(tmp_path / 'big.jpg')
    Image.new('RGB', (150, 100), 'red').save(tmp_path / 'big.png')
    Image.new('RGB', (100, 100), 'red').save(tmp_path / 'fits.png')  # at the limit: decoded as it is
    (tmp_path / 'data.json').write_text(json.dumps([_record(n, name) for n, name in
                                                    enumerate(['big.jpg', 'big.png', 'fits.png'])]))
    kept, _ = load_conversations(tmp_path / 'data.json', tmp_path)
    assert kept[0].load_image().size == (75, 50)
    assert kept[2].load_image().size == (100, 100)
    with pytest.raises(Image.DecompressionBombError, match='150×100 = 15,000 pixels, over PIL\'s '
                                                           'Image.MAX_IMAGE_PIXELS \\(10,000\\), and a PNG image'):
        kept[1].load_image()
    tok = _tokenizer()
    collator = ConversationCollator(tok, transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()]),
                                    'vicuna_v1', image_aspect='crop')
    batch = collator(kept)
    assert batch['input_ids'].shape[0] == 2 and batch['skipped_images']['sources'] == [kept[1].image]
    assert batch['skipped_images']['why'][kept[1].image].startswith('DecompressionBombError: 150×100 = 15,000 pixels')


DECODE = '''
import os, resource, sys
from diffzoo.eval.lmm.records import Sample
mapped = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')  # what the imports mapped
limit = mapped + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print(Sample('1', sys.argv[1], 'q').load_image().size)
'''


@pytest.mark.slow  # real processes
def test_a_jpeg_over_pils_limit_decodes_in_a_process_that_could_not_hold_it_whole(tmp_path):
    """10,000 × 10,000 grey pixels: 100 MB decoded, 300 MB in RGB, 1.2 MB as a file. A process allowed 250 MB of
    address space beyond what its imports mapped decodes it at 1/2 per side; PIL's own decode runs out of memory
    there (before: the benchmark runner's and the collators' loader)."""
    Image.new('L', (10_000, 10_000), 128).save(tmp_path / 'big.jpg', quality=50)
    limit = str(250 * 2 ** 20)
    done = subprocess.run([sys.executable, '-c', DECODE, tmp_path / 'big.jpg', limit], capture_output=True,
                          text=True, env=python_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == '(5000, 5000)'
    whole = subprocess.run([sys.executable, '-c', DECODE.replace("Sample('1', sys.argv[1], 'q').load_image()",
                                                                 "__import__('PIL.Image').Image.open(sys.argv[1])"
                                                                 ".convert('RGB')"),
                            tmp_path / 'big.jpg', limit], capture_output=True, text=True, env=python_env(), timeout=120)
    assert whole.returncode != 0 and 'MemoryError' in whole.stderr
