"""The line a CLIP training ends on: its last loss against ln(global batch), the loss of scoring every pair alike."""
import math

import torch

from diffzoo.train import loss_report


def test_uniform_scores_give_the_chance_loss_of_open_clips_contrastive_loss():
    """open_clip's ClipLoss on features that score every pair alike is ln(batch): the level the verdict reads."""
    from open_clip.loss import ClipLoss
    features = torch.nn.functional.normalize(torch.ones(32, 8), dim=-1)
    loss = ClipLoss()(features, features, logit_scale=torch.tensor(14.3))
    assert loss_report.chance_loss(32) == math.log(32)
    assert abs(loss.item() - loss_report.chance_loss(32)) < 1e-6  # fp32 rounding


def test_the_quick_starts_loss_reads_at_chance_and_a_learning_run_below():
    """3.4502 after the quick start's 62 steps of a batch of 32 (chance ln 32 = 3.4657) is at chance; 2.70 and 1.64,
    the demo's two models later on, are learning; a loss over ln 32 is worse than guessing."""
    records = [{'step': 0, 'loss': None}] + [{'step': s, 'loss': 3.5 if s <= 52 else 3.4502} for s in range(1, 63)]
    line = loss_report.closing_line(records, 32)
    assert line == ('trained: loss 3.450 (mean of the last 10 logged steps); chance ln 32 = 3.466 (global batch 32): '
                    'at chance (the right pair is as likely as one in 31.5 of the batch\'s 32: fewer than a tenth of '
                    'the others ruled out): the model has learned next to nothing yet; train longer (--epochs) or on '
                    'more data')
    assert loss_report.against_chance(2.70, 32).startswith('better than chance (the right pair is as likely as one '
                                                           'in 14.9 of the batch\'s 32)')
    assert loss_report.against_chance(1.64, 32).startswith('better than chance')
    assert loss_report.against_chance(3.6, 32).startswith('worse than chance')
    edge = math.log(0.9 * 32)  # exp(loss) = 90 % of the batch: the last loss still at chance
    assert loss_report.against_chance(edge + 1e-6, 32).startswith('at chance')
    assert loss_report.against_chance(edge - 1e-3, 32).startswith('better than chance')


def test_other_losses_get_no_chance_and_a_run_without_steps_says_so():
    records = [{'step': 0, 'loss': None}, {'step': 1, 'loss': 0.5}]
    assert loss_report.closing_line(records, 32, contrastive=False) == ('trained: loss 0.500 (mean of the last 1 '
                                                                        'logged step)')
    assert loss_report.closing_line(records[:1], 32) == 'trained: no loss was logged'
    assert loss_report.global_batch({'batch_size': 8, 'accum_freq': 2, 'world_size': 4}) == 64
