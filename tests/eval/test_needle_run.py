"""MMNeedle through a real model: the `run` subcommand and `model_answer_fn` on a tiny build_vlm model."""
import json

import pytest
import yaml

from diffzoo.eval.needle import HaystackConfig, build, evaluate, read_captions, write
from diffzoo.eval.needle.cli import main, model_answer_fn
from tests.eval.test_needle import _corpus
from tests.factory import call


@pytest.fixture(scope='module')
def haystacks(tmp_path_factory, language_model_dir):
    root = tmp_path_factory.mktemp('needle_run')
    images, _ = _corpus(root / 'corpus')
    samples = build(images, read_captions(root / 'corpus' / 'captions.json'),
                    HaystackConfig(m=1, n=2, size=32, samples=4, seed=0))
    write(samples, root / 'set', {'source': str(images), 'm': 1, 'n': 2, 'size': 32, 'seed': 0}, log=None)
    recipe = {'model': {'type': 'build_vlm', 'vision': 'diffclip-tiny', 'language_model': str(language_model_dir)},
              'attention': {'type': 'differential', 'variant': 'split', 'lambda_init': 0.8}}
    (root / 'recipe.yaml').write_text(yaml.safe_dump(recipe))
    return root, samples


def test_two_step_protocol_asks_a_differential_vlm_and_scores_every_sample(haystacks):
    root, samples = haystacks
    answer = model_answer_fn(str(root / 'recipe.yaml'), max_new_tokens=3)
    result = evaluate(samples, answer, 'two_step')
    assert len(result['records']) == 4
    for record in result['records']:
        assert record['queries'] and all(isinstance(q['answer'], str) for q in record['queries'])
    assert result['counts']['samples'] == 4
    with pytest.raises(ValueError, match='--m 1'):
        answer([samples[0].images()[0]] * 2, 'which?')


@pytest.mark.slow
def test_run_subcommand_writes_answers_results_and_heatmap(haystacks, tmp_path):
    root, _ = haystacks
    done = call(main, ['run', '--haystacks', root / 'set', '--recipe', root / 'recipe.yaml', '--protocol', 'mmneedle',
                       '--max-new-tokens', '4', '--out', tmp_path / 'out'], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    answers = [json.loads(line) for line in (tmp_path / 'out' / 'answers.jsonl').read_text().splitlines()]
    assert len(answers) == 4 and all(a['query'] == 'mmneedle' for a in answers)
    results = json.loads((tmp_path / 'out' / 'needle_results.json').read_text())
    assert results['counts']['samples'] == 4
    assert (tmp_path / 'out' / 'needle_heatmap.png').stat().st_size > 0


@pytest.mark.slow
def test_a_stopped_run_is_resumed_and_another_run_in_its_folder_refused(haystacks, tmp_path):
    """What a stopped `run` leaves (its answers so far, appended one by one, the last cut short) is reused by the
    same command; the same folder with other settings is refused, not mixed in."""
    root, _ = haystacks
    argv = ['run', '--haystacks', root / 'set', '--recipe', root / 'recipe.yaml', '--protocol', 'mmneedle',
            '--max-new-tokens', '4', '--out', tmp_path / 'out']
    assert call(main, argv, tmp_path).returncode == 0
    path = tmp_path / 'out' / 'answers.jsonl'
    whole = path.read_text().splitlines()
    path.write_text(''.join(line + '\n' for line in whole[:2]) + whole[2][:15])  # as a stop mid-answer leaves it
    done = call(main, argv, tmp_path)
    assert done.returncode == 0 and 'run: 2 answers of a stopped run' in done.stdout, done.stderr[-2000:]
    assert path.read_text().splitlines() == whole  # two reused, two asked again: the same greedy answers
    other = call(main, [*argv[:-3], '5', '--out', tmp_path / 'out'], tmp_path)
    assert other.returncode == 2 and 'holds the answers of another run (max_new_tokens: 4 -> 5)' in other.stderr
