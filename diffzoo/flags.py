"""`--key value` pairs from a command line, read as YAML values (recipe overrides, img2dataset flags), and the
argparse types of a whole-number flag (`at_least`) and a torch device (`torch_device`)."""
import argparse
import re
from typing import Callable, Dict, List

import yaml


class YamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` as a string; recipes and command lines mean a number."""


YamlLoader.add_implicit_resolver(
    'tag:yaml.org,2002:float',
    re.compile(r'^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$'),
    list('-+0123456789.'))


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number, `minimum` or more (argparse names the flag in its error)."""
    def whole_number(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f'{text!r}: a whole number, {minimum} or more')
        return int(text)
    return whole_number


def torch_device(text: str) -> str:
    """An argparse type: a torch device this machine has (cpu, cuda, cuda:N, …), as given."""
    import torch
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f'{text!r}: not a torch device ({exc}); give cpu, cuda or cuda:N') from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f'{text!r}: no CUDA device here; leave --device out to run on the CPU')
    return text


def yaml_value(text: str):
    return yaml.load(text, Loader=YamlLoader)


class FlagError(ValueError):
    def __init__(self, token: str):
        super().__init__(f'not a --key: {token!r}')
        self.token = token


def parse_pairs(tokens: List[str]) -> Dict:
    """['--lr', '1e-3', '--epochs=2', '--grad-checkpointing'] -> {'lr': 0.001, 'epochs': 2, 'grad_checkpointing': True}.

    A key without a value is true; dashes in keys become underscores. FlagError names the first
    token that is not a `--key`."""
    out, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith('--') or token == '--':
            raise FlagError(token)
        if '=' in token:
            key, value = token[2:].split('=', 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith('--'):
            key, value = token[2:], tokens[i + 1]
            i += 2
        else:
            key, value = token[2:], 'true'
            i += 1
        out[key.replace('-', '_')] = yaml_value(value)
    return out
