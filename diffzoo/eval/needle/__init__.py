"""MMNeedle, the Multimodal Needle-in-a-Haystack benchmark (Wang et al., 2024), and the two-step
querying that Differential PaliGemma (Li et al., 2025) used for a short-context model.

A sample's *haystack* is M images, each an N×N stitch of sub-images resized to `size`×`size` px
(MMNeedle: M ∈ {1, 10}, N ∈ {1, 2, 4, 8}, 256 px; Differential PaliGemma: one 2×2 stitch of 224 px
COCO val2014 images). The *needle* is the caption of one sub-image. A positive sample holds it at
(index, row, column), all 1-based: index counts the M images, row and column the grid. A negative
sample's needle is the caption of an image that is in none of its stitches; its ground truth is -1
(stored as index = row = column = -1).

What follows github.com/Wang-ML-Lab/multimodal-needle-in-a-haystack (read, not copied):
- stitching (`sample_stitched_images.py`): sub-image k = row·N + column is resized to size×size and
  pasted at (column·size, row·size) on a black RGB canvas;
- samples (`sample_single_needle.py`): the first half of the samples are positives, the rest
  negatives; a positive's cell is uniform over the M·N² cells; a negative's needle comes from an
  image that is in none of its stitches;
- captions (`annotations_trainval/file_to_caption.py`): one caption per COCO image — of its five
  annotations the last in file order (a dict keyed by image id keeps the last);
- the prompt (`needle.py`, single needle): `MMNEEDLE_PROMPT`, kept word for word so that answers
  compare with the paper's, followed by a line "Caption: <needle>"; the images come first;
- scoring (`evaluate.py`): an answer other than "-1" claims the needle is there (existence); index
  accuracy compares the first field, exact accuracy the whole "index, row, column"; it prints index
  and exact accuracy for sets of positive samples, existence for both; exact accuracy per grid cell
  of the needle is its heatmap; answers that never came back (None) are left out.

Where diffzoo differs, on purpose:
- the M·N² sub-images of a sample are distinct, and no sub-image other than the needle's (positive)
  or no sub-image at all (negative) has the needle's caption (compared lower-case, without a final
  period); MMNeedle samples each stitch on its own and does not compare captions;
- sample i is drawn from its own generator seeded by (seed, i) over the file names in sorted order,
  so a set is the same on every machine (MMNeedle: one `random.seed(0)` over `os.listdir` order);
- `parse_answer` reads the integers of an answer in order, so "(2,1,2)" and "image 2, row 1,
  column 2." count; MMNeedle strips spaces, newlines and periods and compares with the string
  "2, 1, 2" (its first ", " field for the index). An index or exact match there is one here too;
  existence differs only for answers whose first number is -1 but that say more than "-1" (there:
  present, here: absent);
- stitches are written as PNG (lossless); MMNeedle writes JPEG. Cells of the heatmap with no
  positive sample are blank, not 0.

The two-step protocol (`two_step`), for models that see one image with a short context (PaliGemma-3B
at 224 px). The paper asked of a 2×2 stitch "top or bottom?", then "left or right?"; for M stitches
of N×N this asks each stitch on its own, k = 1..M, with the caption:
    row step:    which row holds the caption's sub-image, or none? N = 2: "top or bottom" (the
                 paper's question); N > 2: a row number, 1 = top … N = bottom; N = 1: "yes or no".
    column step: it is in that row (half) — which column? N = 2: "left or right"; N > 2: a column
                 number, 1 = left … N = right. Not asked for N = 1.
The first stitch whose row answer does not say "none" (or "no", "-1" …) is the predicted index, and
the row and column answers there the predicted row and column; later stitches are not asked. If
every stitch says none, the prediction is -1. As in MMNeedle, an answer that does not say the needle
is absent claims it is present: an unreadable row answer predicts this stitch with row and column
unknown (the index may be right, exact is not). So existence = "some stitch claimed it", index =
"the first stitch to claim it", at most M + 1 queries per sample.

    python -m diffzoo.eval.needle build --source val2014 --captions annotations/captions_val2014.json \\
        --out needle/2x2 --m 1 --n 2 --size 224 --samples 1000
    python -m diffzoo.eval.needle score --haystacks needle/2x2 --answers answers.jsonl --out needle/2x2/scores
    python -m diffzoo.eval.needle run --haystacks needle/2x2 --recipe paligemma-3b-vqav2-diff \\
        --adapter runs/vlm/paligemma-3b-vqav2-diff/adapter --protocol two_step --out needle/2x2/diff

`run` asks the model a VLM recipe (`diffzoo.train.vlm`) names (with its LoRA adapter, or made differential
as the recipe says) and scores it; models reading one image per prompt need --m 1.


The package: `haystack` (captions, stitches, the sample sets), `protocols` (prompts and answer
parsing of both protocols), `scoring` (accuracies from a model or from saved answers), `report`
(table, heatmap, results file), `cli` (`python -m diffzoo.eval.needle`).
"""
from .haystack import ABSENT, UNREADABLE, HaystackConfig, Location, NeedleError, Sample, build, caption_key
from .haystack import find_captions, read_captions, read_haystacks, stitch, usable_captions, write
from .protocols import PROTOCOLS, Query, column_prompt, mmneedle_prompt, parse_answer, parse_step, row_prompt
from .report import plot_cells, table, write_report
from .scoring import evaluate, read_answers, score, score_answers, summarize, write_answers
