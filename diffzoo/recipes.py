"""Recipes: YAML files (shipped in the wheel, or your own) for CLIP training and VLM fine-tuning.

One loader for both kinds:

- `base: OTHER` extends another recipe (a shipped name or a path relative to this file); mappings
  merge key by key, later files win. A mapping with a `type` key (a VLM's `model`) is replaced,
  not merged, when the type changes, so a recipe picks another model by naming its type.
- `${VAR}` in any string is read from the environment; an unset variable is named with the key.
- Overrides (`--key value`, dotted keys reach nested mappings: `--data.fraction 0.1`) apply on top.
- `validate(recipe, schema)` refuses unknown keys, listing the valid ones (with close matches),
  checks each value's type, fills defaults and names missing required keys.

A schema is a `Section` of `Key`s and nested `Section`s; `Typed` chooses a section by the mapping's
`type` key. The CLIP recipe keys are open_clip_train's flags (`diffzoo.train.recipe`), the VLM ones
`diffzoo.vlm.recipe.VLM_RECIPE`. Hand-written rather than OmegaConf: OmegaConf reads `${…}` as
interpolation of its own keys, where recipes mean environment variables, and has no `base:` chain.
"""
import difflib
import json
import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from diffzoo.flags import FlagError, YamlLoader, parse_pairs

RECIPE_DIRS = {'clip': ('recipes',), 'vlm': ('recipes', 'vlm')}
_ENV_RE = re.compile(r'\$\{([A-Za-z_][A-Za-z0-9_]*)\}')
REQUIRED = object()  # a Key default: the key must be given


class RecipeError(ValueError):
    """A recipe or override that cannot be turned into a run; the message names the fix."""


def recipe_names(kind: str = 'clip') -> List[str]:
    folder = resources.files('diffzoo').joinpath(*RECIPE_DIRS[kind])
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith('.yaml') and not p.name.startswith('_'))


def _shipped(name: str, kind: str) -> Path:
    return Path(str(resources.files('diffzoo').joinpath(*RECIPE_DIRS[kind], f'{name}.yaml')))


def find_recipe(name_or_path: str, relative_to: Optional[Path] = None, kind: str = 'clip') -> Path:
    candidates = [Path(name_or_path)]
    if relative_to is not None:
        candidates.insert(0, relative_to / name_or_path)
    candidates.append(_shipped(Path(name_or_path).stem if name_or_path.endswith('.yaml') else name_or_path, kind))
    for path in candidates:
        if path.is_file():
            return path
    raise RecipeError(f'no recipe {name_or_path!r}: not a file, and not a shipped {kind} recipe '
                      f'({", ".join(recipe_names(kind))})')


def merge(base: Mapping, top: Mapping) -> Dict:
    """`top` over `base`, mappings merged key by key; a mapping whose `type` changes is replaced."""
    out = dict(base)
    for k, v in top.items():
        below = out.get(k)
        if isinstance(v, Mapping) and isinstance(below, Mapping) and v.get('type', below.get('type')) == below.get('type'):
            out[k] = merge(below, v)
        else:
            out[k] = v
    return out


def load_recipe(name_or_path: str, relative_to: Optional[Path] = None, kind: str = 'clip', _seen=()) -> Dict:
    """The recipe's keys with its `base` chain merged underneath (later files win)."""
    path = find_recipe(name_or_path, relative_to, kind).resolve()
    if path in _seen:
        raise RecipeError(f'recipe {path} extends itself through `base`')
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=YamlLoader) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f'recipe {path} is not valid YAML: {str(exc).splitlines()[0]}') from None
    if not isinstance(data, dict):
        raise RecipeError(f'recipe {path} is not a mapping of keys to values')
    base = data.pop('base', None)
    return merge(load_recipe(base, path.parent, kind, _seen + (path,)) if base else {}, data)


def parse_overrides(tokens: List[str]) -> Dict:
    """['--lr', '1e-3', '--data.fraction=0.1', '--grad-checkpointing'] -> {'lr': 0.001, 'data.fraction': 0.1, …}."""
    try:
        return parse_pairs(tokens)
    except FlagError as exc:
        raise RecipeError(f'overrides are --key value pairs; got {exc.token!r}') from None


def apply_overrides(recipe: Mapping, overrides: Mapping) -> Dict:
    """Overrides onto a copy of the recipe; dotted keys reach nested mappings."""
    recipe = json.loads(json.dumps(recipe))
    for key, value in overrides.items():
        node, parts = recipe, key.split('.')
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return recipe


def expand_env(recipe: Mapping) -> Dict:
    """`${VAR}` in every string value read from the environment."""
    def expand(key, value):
        if isinstance(value, str):
            def sub(m):
                if m.group(1) not in os.environ:
                    raise RecipeError(f'recipe key {key} uses ${{{m.group(1)}}}, which is not set; '
                                      f'export {m.group(1)}=… or pass --{key} …')
                return os.environ[m.group(1)]
            return _ENV_RE.sub(sub, value)
        if isinstance(value, list):
            return [expand(key, v) for v in value]
        if isinstance(value, dict):
            return {k: expand(f'{key}.{k}', v) for k, v in value.items()}
        return value
    return {k: expand(k, v) for k, v in recipe.items()}


def unknown_keys_error(unknown: Sequence[str], valid: Mapping[str, str], where: str = '',
                       also: Sequence[str] = ()) -> RecipeError:
    """The error for keys a recipe does not know: each with close matches (among `valid` and `also`, keys
    valid but not listed, e.g. open_clip_train's flags), then the valid keys."""
    lines = []
    for key in unknown:
        close = [where + c for c in difflib.get_close_matches(key, sorted(set(valid) | set(also)), n=3)]
        lines.append(f'  {where}{key}' + (f' (did you mean {", ".join(close)}?)' if close else ''))
    listed = '\n'.join(f'  {where}{k:<20} {doc}' for k, doc in valid.items())
    return RecipeError('unknown recipe keys:\n' + '\n'.join(lines) + f'\nvalid keys are:\n{listed}')


TYPE_NAMES = {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string', list: 'a list'}


@dataclass
class Key:
    """One recipe value: its types, default (REQUIRED: must be given), allowed values and one line
    saying what it is; null is allowed when the default is None or `nullable`. An integer is taken
    where a number is asked for."""
    types: Tuple[type, ...]
    default: Any
    doc: str
    choices: Optional[Sequence] = None
    nullable: bool = False

    def check(self, value, where: str):
        if value is None and (self.default is None or self.nullable):
            return None
        if isinstance(value, int) and not isinstance(value, bool) and float in self.types and int not in self.types:
            value = float(value)
        if not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types):
            wanted = ' or '.join(TYPE_NAMES.get(t, t.__name__) for t in self.types)
            bare = (f'; on the command line --{where} takes a value: --{where} VALUE'
                    if value is True else '')  # a flag given alone parses as true
            raise RecipeError(f'recipe key {where}: {value!r} is not {wanted} ({self.doc}){bare}')
        if self.choices is not None and value not in self.choices:
            raise RecipeError(f'recipe key {where}: {value!r} is not one of {", ".join(map(str, self.choices))} '
                              f'({self.doc})')
        return value


@dataclass
class Section:
    """A mapping of named `Key`s, `Section`s and `Typed`s. `optional`: absent or null means None
    (e.g. no differential settings); otherwise an absent section takes its defaults."""
    keys: Dict[str, Any]
    doc: str = ''
    optional: bool = False

    def check(self, value, where: str):
        if value is None:
            if self.optional:
                return None
            value = {}
        if not isinstance(value, Mapping):
            raise RecipeError(f'recipe key {where}: {value!r} is not a mapping ({self.doc})')
        prefix = f'{where}.' if where else ''
        unknown = [k for k in value if k not in self.keys]
        if unknown:
            raise unknown_keys_error(unknown, {k: v.doc for k, v in self.keys.items()}, prefix)
        out = {}
        for name, spec in self.keys.items():
            path = prefix + name
            if name in value:
                out[name] = spec.check(value[name], path)
            elif isinstance(spec, Key) and spec.default is REQUIRED:
                raise RecipeError(f'recipe key {path} is missing: {spec.doc}')
            elif isinstance(spec, Key):
                out[name] = spec.default
            else:
                out[name] = spec.check(None if spec.optional else {}, path)
        return out


@dataclass
class Typed:
    """A mapping whose `type` key chooses its section (every section has a `type` Key)."""
    sections: Dict[str, Section]
    doc: str = ''
    optional: bool = False

    def check(self, value, where: str):
        if value is None and self.optional:
            return None
        kind = value.get('type') if isinstance(value, Mapping) else None
        if kind not in self.sections:
            raise RecipeError(f'recipe key {where}.type: {kind!r}; choose one of {", ".join(self.sections)} '
                              f'({self.doc})')
        return self.sections[kind].check(value, where)


def validate(recipe: Mapping, schema: Section) -> Dict:
    """The recipe checked against `schema` and completed with its defaults (module docstring)."""
    return schema.check(recipe, '')
