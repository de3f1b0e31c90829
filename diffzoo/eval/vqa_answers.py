"""VQA-style answers as each reference scorer processes them, and the accuracy of one reply under each.

Three ways to prepare a reply and the human answers before they are compared, each named after where it is used:

    vqaeval    VQAv2's official vqaEval.py (github.com/GT-Vision-Lab/VQA, master a013f00) on the reply as given:
               tabs and newlines to spaces, stripped (`clean`); then, only if the human answers still differ among
               themselves, the reply and every human answer normalised (`normalize_answer`). When all humans agree
               the comparison is exact, case included (per the maintainer, GT-Vision-Lab/VQA#14, so that answers
               reading text in the image stay raw): "Yes" against ten "yes" scores 0.
    llava      VQAv2 as LLaVA-1.5 reports it: its scripts/convert_vqav2_for_submission.py passes every reply
               through EvalAI's answer processor (`evalai_answer`) before the server runs vqaEval.py on it, so
               the reply is processed and the human answers are handled as vqaEval does.
    lmms_eval  lmms-eval's vqav2_process_results: the reply and every human answer cleaned, then always through
               the punctuation and word steps of EvalAI's processor (`normalize_answer`, its comma rule taking a
               run of commas between digits).

TextVQA and OK-VQA (LLaVA's eval_textvqa.py with m4c_evaluator's TextVQAAccuracyEvaluator, lmms-eval's
textvqa_process_results and ok_vqa_process_results) pass the reply and every human answer through EvalAI's
processor: `evalai_accuracy`.

Accuracy of a reply against human answers a_1..a_n (10 in VQAv2, TextVQA and OK-VQA), leaving each out in turn:

    acc = 1/n · Σ_i min(1, #{j ≠ i : a_j = reply} / 3)

so of 10 humans, 4 or more matching give 1, 3 give 0.9, 2 give 0.6 and 1 gives 0.3. vqaEval and lmms-eval leave
out an answer dict (the dicts differ by answer_id), TextVQAAccuracyEvaluator an (index, answer) pair; here answer i
is left out by position, which is the same.

`normalize_answer`, vqaEval's processPunctuation then processDigitArticle:
1. Punctuation: each mark of `PUNCTUATION` is deleted if the text has that mark next to a space, or
   has a comma between two digits anywhere ("1,000"); otherwise it becomes a space ("a/b" → "a b").
   Both tests look at the text before any mark was replaced. The apostrophe, colon and period are not
   in the list: a period is deleted unless a digit follows ("yes." → "yes", "3.5" stays).
2. Words: lower-case, split on whitespace, number words to digits (`NUMBER_WORDS`, "none" → "0"),
   articles dropped (`ARTICLES`), then the words of `CONTRACTIONS` restored ("dont" → "don't"),
   joined by single spaces.

`evalai_answer`, EvalAI's answer processor (LLaVA's llava/eval/m4c_evaluator.py EvalAIAnswerProcessor, copied from
MMF; lmms-eval's _task_utils/vqa_eval_metric.py holds the same class, with the same tables as vqaEval.py): first
lower-case, delete every comma and question mark and write "'s" as " 's" ("the dog's" → "the dog 's"), strip; then
`clean` and `normalize_answer` (whose digit-comma rule can no longer apply): "Nokia" → "nokia", "Two." → "2".
"""
import re
from typing import Callable, Dict, Sequence

# vqaEval.py's tables, as data (EvalAI's processor holds the same). The keys "Id've", "I'dve", "Im", "Ive" hold
# capitals and so never match the lower-cased words; "somebody'd" maps to "somebodyd". Both are kept as published.
CONTRACTIONS: Dict[str, str] = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at", "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's",
    "shouldve": "should've", "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", "somethingll": "something'll",
    "thats": "that's", "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    "therere": "there're", "theres": "there's", "theyd": "they'd", "theyd've": "they'd've",
    "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas",
    "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't",
    "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's",
    "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}
NUMBER_WORDS: Dict[str, str] = {
    'none': '0', 'zero': '0', 'one': '1', 'two': '2', 'three': '3', 'four': '4', 'five': '5', 'six': '6',
    'seven': '7', 'eight': '8', 'nine': '9', 'ten': '10',
}
ARTICLES = ('a', 'an', 'the')
PUNCTUATION = (';', '/', '[', ']', '"', '{', '}', '(', ')', '=', '+', '\\', '_', '-', '>', '<', '@', '`', ',', '?',
               '!')

_DIGIT_COMMA_DIGIT = re.compile(r'\d,\d')  # vqaEval's commaStrip
_DIGIT_COMMAS_DIGIT = re.compile(r'\d,+\d')  # EvalAI's COMMA_STRIP: a run of commas between digits
# The script's pattern is "(?!<=\d)(\.)(?!\d)": its "(?!<=\d)" is a lookahead for the text "<=digit",
# never true in front of a period, so it is a period not followed by a digit. The script passes
# re.UNICODE (= 32) where re.sub takes `count`, so at most 32 periods go.
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r'\.(?!\d)')
_PERIOD_LIMIT = int(re.UNICODE)
_MATCHES_FOR_FULL_CREDIT = 3


def clean(text: str) -> str:
    """Tabs and newlines to spaces, then strip: all vqaEval.py does to an answer before comparing."""
    return text.replace('\n', ' ').replace('\t', ' ').strip()


def strip_punctuation(text: str, digit_commas: re.Pattern = _DIGIT_COMMA_DIGIT) -> str:
    """vqaEval's processPunctuation (step 1 of the module docstring); EvalAI's with `_DIGIT_COMMAS_DIGIT`."""
    delete_marks = digit_commas.search(text) is not None
    out = text
    for mark in PUNCTUATION:
        next_to_space = mark + ' ' in text or ' ' + mark in text
        out = out.replace(mark, '' if delete_marks or next_to_space else ' ')
    return _PERIOD_NOT_BEFORE_DIGIT.sub('', out, count=_PERIOD_LIMIT)


def normalize_words(text: str) -> str:
    """vqaEval's processDigitArticle (step 2 of the module docstring)."""
    words = [NUMBER_WORDS.get(word, word) for word in text.lower().split()]
    return ' '.join(CONTRACTIONS.get(word, word) for word in words if word not in ARTICLES)


def normalize_answer(text: str) -> str:
    """An answer as vqaEval.py compares it when the human answers differ: "Two dogs." → "2 dogs"."""
    return normalize_words(strip_punctuation(clean(text)))



def evalai_answer(text: str) -> str:
    """A reply or human answer as EvalAI's answer processor leaves it (module docstring): "Nokia." → "nokia"."""
    text = text.lower().replace(',', '').replace('?', '').replace("'s", " 's").strip()
    return normalize_words(strip_punctuation(clean(text), _DIGIT_COMMAS_DIGIT))


def _leave_one_out(prediction: str, answers: Sequence[str]) -> float:
    """The accuracy formula of the module docstring on answers already processed as the reply was."""
    matches = sum(a == prediction for a in answers)
    held_out = [min(1, (matches - (a == prediction)) / _MATCHES_FOR_FULL_CREDIT) for a in answers]  # (n,)
    return sum(held_out) / len(held_out)


def _vqaeval(prediction: str, answers: Sequence[str]) -> float:
    answers = [clean(a) for a in answers]
    prediction = clean(prediction)
    if len(set(answers)) > 1:
        answers = [normalize_answer(a) for a in answers]
        prediction = normalize_answer(prediction)
    return _leave_one_out(prediction, answers)


def _lmms_eval_vqav2(prediction: str, answers: Sequence[str]) -> float:
    def process(text: str) -> str:
        return normalize_words(strip_punctuation(clean(text), _DIGIT_COMMAS_DIGIT))
    return _leave_one_out(process(prediction), [process(a) for a in answers])


VQA_SCORING: Dict[str, Callable[[str, Sequence[str]], float]] = {
    'llava': lambda prediction, answers: _vqaeval(evalai_answer(prediction), answers),
    'lmms_eval': _lmms_eval_vqav2,
    'vqaeval': _vqaeval,
}


def vqa_accuracy(prediction: str, answers: Sequence[str], scoring: str = 'llava') -> float:
    """VQAv2 accuracy in [0, 1] of one reply against the human answers of one question (10 in VQAv2), the reply
    and answers prepared as `scoring` names (module docstring): 'llava' (the default: EvalAI's processor on the
    reply, then vqaEval.py), 'lmms_eval', or 'vqaeval' (the official script on the reply as given).

    Leave-one-out over however many answers are given: with n answers and m of them matching,
    leaving out a match scores min(1, (m-1)/3) and leaving out another min(1, m/3).
    """
    if isinstance(answers, str):
        raise TypeError(f'answers must be a list of the human answers, not the string {answers!r}')
    if len(answers) < 2:
        raise ValueError(f'vqa_accuracy needs at least 2 human answers to leave one out, got {len(answers)} '
                         f'({list(answers)!r}); for a single reference answer compare normalize_answer() outputs')
    if scoring not in VQA_SCORING:
        raise ValueError(f'scoring={scoring!r}: one of {", ".join(VQA_SCORING)}')
    return VQA_SCORING[scoring](prediction, answers)


def evalai_accuracy(prediction: str, answers: Sequence[str]) -> float:
    """TextVQA's and OK-VQA's accuracy of one reply: the reply and every human answer through `evalai_answer`,
    then leave-one-out (LLaVA's TextVQAAccuracyEvaluator, which asserts ten answers; lmms-eval's
    textvqa_process_results and ok_vqa_process_results, which take any number). No answers score 0, as in
    ok_vqa_process_results."""
    if isinstance(answers, str):
        raise TypeError(f'answers must be a list of the human answers, not the string {answers!r}')
    if not answers:
        return 0.0
    return _leave_one_out(evalai_answer(prediction), [evalai_answer(a) for a in answers])
