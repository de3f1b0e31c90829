"""`lmms-eval --model diffzoo` on documents that do not bring exactly one image: each gets an empty reply (its task
scores it as wrong), the first of each task is named in a warning and every one is counted, and the other documents
are answered as before. Under lmms-eval an exception here would end the whole run, which lmms-eval exits with 0."""
import pytest
from PIL import Image

lmms_eval = pytest.importorskip('lmms_eval')  # the lmms extra, which `make test` installs

from lmms_eval.api.instance import Instance  # noqa: E402

from diffzoo.eval.lmm.lmms_eval_model import DiffzooLMM  # noqa: E402
from tests.eval.test_lmm import tiny_recipe  # noqa: E402


def _visual(doc):
    return doc['images']


def test_a_document_without_exactly_one_image_gets_an_empty_reply_named_once_and_counted(tmp_path, capsys):
    """Before: generate_until raised ValueError at a two-image document, which ended the whole lmms-eval run."""
    model = DiffzooLMM.create_from_arg_string(f'recipe={tiny_recipe(tmp_path)},batch_size=2')
    one = [Image.new('RGB', (48, 32), c) for c in ('red', 'blue', 'green')]
    docs = {'mmmu': [{'images': one[:2]}, {'images': [one[0]]}, {'images': []}, {'images': one}],
            'pope': [{'images': [one[1]]}, {'images': one[1:]}]}
    model.task_dict = {task: {'test': d} for task, d in docs.items()}
    gen_kwargs = {'max_new_tokens': 3, 'temperature': 0, 'do_sample': False, 'until': ['\n\n']}
    requests = [Instance('generate_until', (f'Question {task} {i}?', gen_kwargs, _visual, i, task, 'test'), idx=0,
                         metadata={'task': task, 'doc_id': i, 'repeats': 1})
                for task, d in docs.items() for i in range(len(d))]
    replies = model.generate_until(requests)
    answered = [model.vlm.answer([image], [prompt], 3)[0]  # each asked alone in its batch, as above
                for image, prompt in ((one[0], 'Question mmmu 1?'), (one[1], 'Question pope 0?'))]
    assert replies == ['', answered[0], '', '', answered[1], '']
    assert model.skipped_documents == {'mmmu': [0, 2, 3], 'pope': [1]}
    err = capsys.readouterr().err
    assert err.count('warning: lmms-eval --model diffzoo:') == 2  # once per task, at its first such document
    assert 'mmmu document 0 brings 2 images' in err and 'pope document 1 brings 2 images' in err
    assert 'diffzoo: 3 mmmu document(s) without exactly one image got an empty reply (the first: document 0)' in err
    assert 'diffzoo: 1 pope document(s) without exactly one image' in err
    model.generate_until(requests[2:3])  # a later batch of requests: counted again, not warned again
    err = capsys.readouterr().err
    assert 'warning' not in err and 'diffzoo: 1 mmmu document(s) without exactly one image got an empty reply ' \
        '(the first: document 2)' in err
    assert model.skipped_documents['mmmu'] == [0, 2, 3, 2]
