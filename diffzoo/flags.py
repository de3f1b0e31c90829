"""`--key value` pairs from a command line, read as YAML values (recipe overrides, img2dataset flags), and the
argparse types of a whole-number flag (`at_least`), a torch device (`torch_device`) and an output path
(`output_file`, `output_folder`)."""
import argparse
import os
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional

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


def output_problem(text: str, folder: bool) -> Optional[str]:
    """Why `text` cannot be written as an output file (or, with `folder`, a folder to write in), in words, or None:
    empty, a folder where a file goes, a file where a folder goes, under a file, in a folder not writable."""
    if not text.strip():
        return f'an empty path; give the {"folder to write in" if folder else "file to write"}'
    path = Path(text)
    if folder and path.exists() and not path.is_dir():
        return 'a file; give a folder to write in'
    if not folder and path.is_dir():
        return f'a folder; give the file to write, e.g. {path / "NAME"}'
    for above in (path / 'NAME' if folder else path).absolute().parents:  # the nearest that exists
        if above.exists():
            if not above.is_dir():
                return f'{above} is a file, so nothing can be written under it; give a path in a folder'
            if not os.access(above, os.W_OK | os.X_OK):
                return f'{above} is not writable; give a path in a folder you can write'
            return None
    return None


def output_file(text: str) -> str:
    """An argparse type: a file a command may write (`output_problem`), as given; checked before the command works,
    so a bad path does not end it after its work."""
    problem = output_problem(text, folder=False)
    if problem:
        raise argparse.ArgumentTypeError(f'{text!r}: {problem}')
    return text


def output_folder(text: str) -> str:
    """An argparse type: a folder a command may write in, made if missing (`output_problem`), as given."""
    problem = output_problem(text, folder=True)
    if problem:
        raise argparse.ArgumentTypeError(f'{text!r}: {problem}')
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
