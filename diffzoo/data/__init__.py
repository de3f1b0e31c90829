"""Image–text data for training: img2dataset downloads driven by dataset cards, and shard tools.

`python -m diffzoo.data download|sizes|check|retry` (see `__main__`); the functions live in
`diffzoo.data.download` and `diffzoo.data.shards`.
"""
from .download import DatasetCard, card_names, download, load_card
from .shards import DataError, check_dataset, list_shards, read_sizes, write_retry, write_sizes
