"""diffzoo's VLMs as an lmms-eval model: `lmms-eval --model diffzoo --model_args recipe=R[,stage=RUN][,adapter=DIR]
[,device=cuda][,batch_size=8] --tasks pope,mme,…` (with the `lmms` extra: pip install 'diffzoo[lmms]'); lmms-eval's
own --batch_size and --device work too, and --model_args wins over them (lmms-eval always passes its --batch_size,
1 by default, which would otherwise clash with the one in --model_args).

lmms-eval finds it through the entry point group `lmms_eval.models` (pyproject.toml), as a simple model: each
request brings its prompt (lmms-eval's, from the task's YAML), its generation settings and the document's
images; `generate_until` answers greedily in batches through the model's own prompt format
(`diffzoo.vlm.factory.vlm_from_recipe`), cut at the task's `until` strings. Log-likelihood requests (multiple
choice by likelihood) and multi-round generation are refused by name. A document that brings no image or more than
one (diffzoo's VLMs read one) gets an empty reply, which its task scores as wrong: the first of each task is named
in a warning, and each batch of requests ends with a line counting them (`skipped_documents` holds their ids). A
prompt longer than the model's `max_length` positions (its image's and text's) is cut to them as LLaVA's model cuts
it, then answered, as `python -m diffzoo.eval.lmm` answers it: counted the same way (`cut_documents`, with each
one's positions) and named in the batch's closing line.

lmms-eval catches any error of a run, logs it and exits 0 (unless --verbosity DEBUG), so a model that cannot be
built (a wrong recipe, stage or batch size) ends the process here instead: the error on stderr, exit status 2.
"""
import sys
from typing import Dict, List, Tuple

from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest
from lmms_eval.utils import simple_parse_args_string
from tqdm import tqdm


def _cut(text: str, until) -> str:
    """The reply up to the first of the task's stop strings."""
    for stop in ([until] if isinstance(until, str) else until or []):
        if stop:
            text = text.split(stop)[0]
    return text


class DiffzooLMM(lmms):
    """A VLM recipe's model (`recipe=`, with `stage=` or `adapter=`) answering lmms-eval's requests."""

    is_simple = True

    def __init__(self, recipe: str, stage: str = None, adapter: str = None, device: str = 'cpu', batch_size=8,
                 **_):
        super().__init__()
        self.skipped_documents: Dict[str, List] = {}  # task → ids of its documents without exactly one image
        self.cut_documents: Dict[str, List[Tuple]] = {}  # task → (id, positions) of its prompts cut to max_length
        # torch, transformers: when lmms-eval builds this model, not whenever it loads the plugins' entry points
        from diffzoo.vlm.factory import vlm_from_recipe
        try:
            if not str(batch_size).isdigit():
                raise ValueError(f'--batch_size {batch_size}: diffzoo takes a number of questions per batch')
            self.batch_size_per_gpu = int(batch_size)
            self.vlm = vlm_from_recipe(recipe, adapter, device or 'cpu', stage=stage)
        except Exception as exc:  # lmms-eval would log it and exit 0 (module docstring)
            print(f'error: lmms-eval --model diffzoo: {type(exc).__name__}: {exc}', file=sys.stderr, flush=True)
            raise SystemExit(2) from exc

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict = None) -> 'DiffzooLMM':
        """lmms-eval's, with batch_size and device in --model_args taking precedence over its flags."""
        args = simple_parse_args_string(arg_string)
        return cls(**args, **{k: v for k, v in (additional_config or {}).items() if v is not None and k not in args})

    def _skip(self, task: str, doc_id, images: int) -> None:
        """Count a document without exactly one image; warn at the first of its task."""
        if task not in self.skipped_documents:
            print(f'warning: lmms-eval --model diffzoo: {task} document {doc_id} brings {images} images, and '
                  f'diffzoo\'s VLMs read one; it gets an empty reply (scored as wrong), as will any other such '
                  f'document of {task} (counted)', file=sys.stderr, flush=True)
        self.skipped_documents.setdefault(task, []).append(doc_id)

    def generate_until(self, requests: List[Instance]) -> List[str]:
        replies, before = [], {task: len(ids) for task, ids in self.skipped_documents.items()}
        cut_before = {task: len(cut) for task, cut in self.cut_documents.items()}
        for i in tqdm(range(0, len(requests), self.batch_size_per_gpu), desc='diffzoo', disable=not requests):
            chunk = requests[i:i + self.batch_size_per_gpu]
            prompts, images, settings = [], [], []  # settings: None for a document left unanswered
            for request in chunk:
                context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
                visuals = doc_to_visual(self.task_dict[task][split][doc_id]) or []
                if len(visuals) != 1:
                    self._skip(task, doc_id, len(visuals))
                    settings.append(None)
                    continue
                limit = self.vlm.max_length  # None: a language model that states no maximum
                if limit is not None and (positions := self.vlm.prompt_positions(context)) > limit:
                    self.cut_documents.setdefault(task, []).append((doc_id, positions))
                prompts.append(context)
                images.append(visuals[0].convert('RGB'))
                settings.append(gen_kwargs)
            asked = [s for s in settings if s is not None]
            answers = iter(self.vlm.answer(images, prompts, max(int(s.get('max_new_tokens', 16)) for s in asked))
                           if asked else [])
            replies += ['' if s is None else _cut(next(answers), s.get('until')) for s in settings]
        for task, ids in self.skipped_documents.items():
            if len(ids) > before.get(task, 0):
                print(f'diffzoo: {len(ids) - before.get(task, 0)} {task} document(s) without exactly one image got an '
                      f'empty reply (the first: document {ids[before.get(task, 0)]})', file=sys.stderr, flush=True)
        for task, cut in self.cut_documents.items():
            if len(cut) > cut_before.get(task, 0):
                doc_id, positions = cut[cut_before.get(task, 0)]
                print(f'diffzoo: {len(cut) - cut_before.get(task, 0)} {task} prompt(s) longer than the model\'s '
                      f'{self.vlm.max_length:,} positions, cut to them as LLaVA\'s model cuts a prompt, then answered '
                      f'(the first: document {doc_id}, {positions:,} positions)', file=sys.stderr, flush=True)
        return replies

    def loglikelihood(self, requests):
        raise NotImplementedError('diffzoo answers generation tasks (generate_until); choose a task that generates')

    def generate_until_multi_round(self, requests):
        raise NotImplementedError('diffzoo answers one round per request (generate_until)')


MANIFEST = ModelManifest(model_id='diffzoo', simple_class_path='diffzoo.eval.lmm.lmms_eval_model.DiffzooLMM')
