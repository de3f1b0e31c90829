"""Where a CLIP training's loss stands against chance, for the line a training ends on.

open_clip's contrastive loss is the cross-entropy of each image over the texts it is compared with and of each text
over the images, averaged. Every step compares the pairs of one global batch (batch_size × accum_freq × world_size:
with gradient accumulation the cached features of the other micro-batches join the logits, across processes the
features are gathered), so a model that scores every pair alike has loss ln(global batch). exp(loss) reads as the
number of candidates it still guesses among: the right caption is as likely as one in exp(loss) of the batch's.
"""
import math
from typing import Dict, List, Optional, Tuple

LAST_STEPS = 10  # the closing loss: the mean of the last logged steps (one step's loss is noisy)
AT_CHANCE = 0.9  # at chance while exp(loss) exceeds this share of the batch: under a tenth of the candidates ruled out


def global_batch(settings: Dict) -> int:
    """The pairs each step's loss compares, from a run's open_clip_train settings (`checkpoint.run_settings`)."""
    return settings['batch_size'] * settings.get('accum_freq', 1) * settings.get('world_size', 1)


def chance_loss(batch: int) -> float:
    """The contrastive loss of scoring every pair of a global batch of `batch` alike."""
    return math.log(batch)


def last_loss(records: List[Dict], steps: int = LAST_STEPS) -> Optional[Tuple[float, int]]:
    """(mean loss, steps averaged) over the last `steps` logged steps of a run's lambda.jsonl records; None before
    the first."""
    losses = [r['loss'] for r in records if r.get('loss') is not None][-steps:]
    return (sum(losses) / len(losses), len(losses)) if losses else None


def against_chance(loss: float, batch: int) -> str:
    """`loss` against ln(batch) in words: above, at or below chance, and the candidates exp(loss) it amounts to."""
    candidates = math.exp(loss)
    odds = f'the right pair is as likely as one in {candidates:.1f} of the batch\'s {batch}'
    if candidates > batch:
        return f'worse than chance ({odds}: a run that diverged, or one just started)'
    if candidates > AT_CHANCE * batch:
        return (f'at chance ({odds}: fewer than a tenth of the others ruled out): the model has learned next to '
                f'nothing yet; train longer (--epochs) or on more data')
    return f'better than chance ({odds}): the model is learning'


def closing_line(records: List[Dict], batch: int, contrastive: bool = True) -> str:
    """The line a training ends on: its last loss and, for CLIP's contrastive loss, where it stands against chance."""
    last = last_loss(records)
    if last is None:
        return 'trained: no loss was logged'
    loss, steps = last
    shown = f'trained: loss {loss:.3f} (mean of the last {steps} logged step{"s" * (steps != 1)})'
    if not contrastive:
        return shown
    return (f'{shown}; chance ln {batch} = {chance_loss(batch):.3f} (global batch {batch}): '
            f'{against_chance(loss, batch)}')
