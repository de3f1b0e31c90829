import pytest

from diffzoo.data.synthetic import CorpusConfig, write_corpus


@pytest.fixture(scope='session')
def corpus(tmp_path_factory):
    """A tiny synthetic corpus (64 px; 32 validation scenes), written once for the eval tests."""
    root = tmp_path_factory.mktemp('corpus')
    write_corpus(root, CorpusConfig(train=1, val=32, per_shard=32, image_size=64), progress=None)
    return root
