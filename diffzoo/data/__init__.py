"""Image–text data for training: img2dataset downloads driven by dataset cards, and shard tools.

`python -m diffzoo.data download|sizes|check|retry` (see `__main__`); the functions live in
`diffzoo.data.download`, `diffzoo.data.shards` (listing, sizes), `diffzoo.data.check` and `diffzoo.data.retry`.
"""
from .check import check_dataset
from .download import DatasetCard, card_names, download, load_card
from .retry import write_retry
from .shards import DataError, list_shards, read_sizes, write_sizes
