"""ScienceQA-IMG as LLaVA-1.5 evaluates it: from its llava_test_CQM-A.json (its prompts; the answers from
ScienceQA's problems.json when it lies beside it), or from ScienceQA's own problems.json and pid_splits.json."""
from pathlib import Path
from typing import Dict, List, Optional

from diffzoo.data import llava_qa
from diffzoo.data.shards import DataError

from .records import LeftOut, Sample, image_in, read_json, required, strict_unless

LETTER_PROMPT = "Answer with the option's letter from the given choices directly."


SCIENCEQA_LLAVA_QUESTIONS = 'llava_test_CQM-A.json'  # LLaVA-1.5's ScienceQA test questions (scripts/v1_5/eval/sqa.sh)


def _scienceqa_images(root: Path, image, left_out: LeftOut, where: str) -> Optional[Path]:
    """images/test/<image> (or test/<image>); None (left out) for a name that would leave those folders."""
    if image_in(root, image, left_out, where) is None:
        return None
    return llava_qa.first_file(root / 'images' / 'test' / image, root / 'test' / image)


def _option_count(prompt: str) -> int:
    """How many options "A. …", "B. …", … the prompt's last option list holds."""
    lines = prompt.splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith('A. ')), default=len(lines))
    count = 0
    while first + count < len(lines) and lines[first + count].startswith(f'{chr(65 + count)}. '):
        count += 1
    return count


def _problem(problems: Dict, pid: str) -> Optional[Dict]:
    """ScienceQA's problem `pid` when it holds a question, its choices and an answer among them; else None."""
    p = problems.get(pid)
    ok = (isinstance(p, dict) and isinstance(p.get('question'), str) and isinstance(p.get('choices'), list)
          and isinstance(p.get('answer'), int) and 0 <= p['answer'] < len(p['choices']))
    return p if ok else None


NOT_A_PROBLEM = 'not in problems.json with a question, choices and an answer among them'
NOT_A_LETTER = 'answer not one of its option letters (problems.json beside the file gives the answers)'


def read_scienceqa_llava(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """LLaVA-1.5's question file, a list of {id, image: "<pid>/image.png" under images/test/, conversations:
    [human, gpt]}: the human turn asked as its model_vqa_science.py --single-pred-prompt asks it ("<image>" removed,
    the text stripped, then "\\n" and the letter prompt; a text that already ends with it is asked as written); the
    answer and option count from ScienceQA's problems.json when it lies beside it (as LLaVA's eval_science_qa.py
    scores), else the gpt turn's letter and the options in the prompt. The questions with an image (ScienceQA-IMG,
    LLaVA's IMG-Accuracy)."""
    path, left_out = root / SCIENCEQA_LLAVA_QUESTIONS, strict_unless(left_out)
    problems = read_json(root / 'problems.json') if (root / 'problems.json').is_file() else None
    samples = []
    for n, q in enumerate(read_json(path)):
        turns = q.get('conversations') if isinstance(q, dict) else None
        if not (isinstance(turns, list) and len(turns) >= 2 and 'id' in q
                and all(isinstance(t, dict) and isinstance(t.get('value'), str) for t in turns[:2])):
            left_out.add(f'not {{id, image, conversations: [human, gpt]}} as LLaVA-1.5\'s {SCIENCEQA_LLAVA_QUESTIONS}',
                         f'{path} entry {n}')
            continue
        if not q.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        pid, question = str(q['id']), turns[0]['value'].replace('<image>', '').strip()
        prompt = question if question.endswith(LETTER_PROMPT) else f'{question}\n{LETTER_PROMPT}'
        where = f'{path} entry {n} (id {pid})'
        if problems is not None:
            problem = _problem(problems, pid)
            if problem is None:
                left_out.add(NOT_A_PROBLEM, where)
                continue
            answer, options = chr(65 + problem['answer']), len(problem['choices'])
        else:
            answer, options = turns[1]['value'].strip(), _option_count(prompt)
            if len(answer) != 1 or not 'A' <= answer < chr(65 + options):
                left_out.add(NOT_A_LETTER, f'{where} (answer {answer!r}, {options} options)')
                continue
        if (image := _scienceqa_images(root, q['image'], left_out, where)) is not None:
            samples.append(Sample(pid, image, prompt, {'answer': answer, 'options': options}, where))
    return samples


def read_scienceqa(root: Path, left_out: Optional[LeftOut] = None) -> List[Sample]:
    """ScienceQA-IMG from LLaVA-1.5's llava_test_CQM-A.json when it is there, else from ScienceQA's own files."""
    if (root / SCIENCEQA_LLAVA_QUESTIONS).is_file():
        return read_scienceqa_llava(root, left_out)
    if not (root / 'problems.json').is_file():
        raise DataError(f'{root}: neither ScienceQA\'s problems.json (with pid_splits.json and images/test/<pid>/) nor '
                        f'LLaVA-1.5\'s {SCIENCEQA_LLAVA_QUESTIONS} (with images/test/<pid>/image.png); put either '
                        f'there')
    problems, left_out = read_json(root / 'problems.json'), strict_unless(left_out)
    splits = read_json(required(root / 'pid_splits.json'))
    test = splits.get('test') if isinstance(splits, dict) else None
    if not isinstance(test, list) or not isinstance(problems, dict):
        raise DataError(f'{root}: problems.json is not an object of problems, or pid_splits.json has no "test" list; '
                        f'put ScienceQA\'s published files there')
    samples = []
    for pid in map(str, test):
        where = f'{root / "problems.json"} (pid {pid})'
        if (p := _problem(problems, pid)) is None:
            left_out.add(NOT_A_PROBLEM, where)
            continue
        if not p.get('image'):
            continue  # ScienceQA-IMG: the questions with an image
        options = '\n'.join(f'{chr(65 + i)}. {c}' for i, c in enumerate(p['choices']))
        context = f'Context: {p["hint"]}\n' if p.get('hint') else ''
        image = _scienceqa_images(root, f'{pid}/{p["image"]}', left_out, where)
        if image is not None:
            samples.append(Sample(pid, image, f'{context}{p["question"]}\n{options}\n{LETTER_PROMPT}',
                                  {'answer': chr(65 + p['answer']), 'options': len(p['choices'])}, where))
    return samples
