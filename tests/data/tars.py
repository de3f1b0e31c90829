"""Shards as tests.factory.write_shards writes them, altered member by member the way broken or hostile tools
would write them."""
import io
import tarfile
from pathlib import Path
from typing import Dict, Iterable


def rename_samples(shard: Path, names: Dict[str, str], drop: Iterable[str] = ()) -> None:
    """Write `shard` again, in the same member order, with the members of sample KEY named NAME.ext
    (`names` {KEY: NAME}; NAME may be another sample's key, or a path such as '../x' or '/abs/x') and the
    members named in `drop` left out."""
    with tarfile.open(shard) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    with tarfile.open(shard, 'w') as tar:
        for info, data in members:
            if info.name in drop:
                continue
            key, _, ext = info.name.partition('.')
            info.name = f'{names.get(key, key)}.{ext}'
            tar.addfile(info, io.BytesIO(data))
