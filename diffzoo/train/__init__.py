"""Training through open_clip_train's own loop: recipes, launcher seams, λ logging.

`python -m diffzoo.train` (see `diffzoo.train.launch`); recipes in `diffzoo/recipes/`.
"""
