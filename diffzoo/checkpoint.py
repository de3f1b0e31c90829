"""Reading checkpoints safely, the preprocessing a checkpoint was trained with, and the official
DiffCLIP layout as a pure state-dict conversion.

Preprocessing record (`preprocess_record(path)`), open_clip's keys (mean, std, interpolation,
resize_mode), looked up in this order:
- a `.safetensors` file's metadata `preprocess_cfg` (JSON; `python -m diffzoo.convert` writes it);
- a training run's settings, for `RUN/checkpoints/epoch_K.pt`: `RUN/diffzoo-run.json` (written by
  `python -m diffzoo.train`), else open_clip_train's `RUN/params.txt` (image_mean, image_std,
  image_interpolation, image_resize_mode).

Official DiffCLIP files (`hammh0a/DiffCLIP_ViTB16_CC3M`, `…_CC12M`, `checkpoint_best.pt`) are
SLIP-style pickles: {'state_dict': {'module.<key>': tensor}, 'args': argparse.Namespace with
pathlib paths, numpy scalars, optimizer state, …}. They are read with `weights_only=True` and
exactly the extra globals such files hold (`SAFE_GLOBALS`); any other global is refused by name.
"""
import argparse
import ast
import json
import pathlib
import pickle
import re
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

StateDict = Dict[str, torch.Tensor]

_np_core = getattr(np, '_core', None) or np.core
RUN_CONFIG = 'diffzoo-run.json'  # the settings a CLIP training run records in its directory (train.launch)
PARAMS_TXT = 'params.txt'  # open_clip_train's record of its arguments
PREPROCESS_METADATA = 'preprocess_cfg'  # the safetensors metadata key holding open_clip's preprocess cfg (JSON)
RUN_PREPROCESS = {'image_mean': 'mean', 'image_std': 'std', 'image_interpolation': 'interpolation',
                  'image_resize_mode': 'resize_mode'}  # open_clip_train flag → open_clip preprocess key
SAFE_GLOBALS = [
    argparse.Namespace,
    pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
    np.dtype,
    _np_core.multiarray.scalar,
    (_np_core.multiarray.scalar, 'numpy.core.multiarray.scalar'),
    (_np_core.multiarray._reconstruct, 'numpy.core.multiarray._reconstruct'),
    _np_core.multiarray._reconstruct,
    np.ndarray,
    *[getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith('DType')],
]


class CheckpointError(ValueError):
    """A file that cannot be used as the checkpoint asked for; the message names the file and the fix,
    `reason` says what is wrong with it in a few words."""

    def __init__(self, message: str, reason: Optional[str] = None):
        super().__init__(message)
        self.reason = reason or message


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose pickle names globals outside `SAFE_GLOBALS` (code it would run when unpickled)."""


def run_settings(run_dir) -> Dict:
    """A training run's open_clip_train arguments: diffzoo-run.json, else params.txt ('key: value' lines);
    {} when it has neither. A diffzoo-run.json that is not a JSON object is a CheckpointError naming it."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / RUN_CONFIG
    if path.is_file():
        fix = 'the object of run settings python -m diffzoo.train writes; delete it to read the run\'s params.txt'
        try:
            settings = json.loads(path.read_bytes())
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f'{path}: not JSON ({exc}), not {fix}') from None
        if not isinstance(settings, dict):
            raise CheckpointError(f'{path}: a JSON {type(settings).__name__}, not {fix}')
        return settings
    settings = {}
    if (run_dir / PARAMS_TXT).is_file():
        for line in (run_dir / PARAMS_TXT).read_text().splitlines():
            key, sep, value = line.partition(': ')
            if sep:
                try:
                    settings[key] = ast.literal_eval(value)
                except (ValueError, SyntaxError):
                    settings[key] = value
    return settings


def preprocess_record(path) -> Optional[Dict]:
    """The preprocessing `path` was trained with, in open_clip's preprocess-cfg keys (module
    docstring); None when neither the file nor its run records it."""
    path = pathlib.Path(path)
    if path.suffix == '.safetensors':
        from safetensors import safe_open
        with safe_open(str(path), framework='pt') as f:
            recorded = (f.metadata() or {}).get(PREPROCESS_METADATA)
        if recorded:
            return json.loads(recorded)
    if path.parent.name == 'checkpoints':
        settings = run_settings(path.parent.parent)
        record = {key: settings[flag] for flag, key in RUN_PREPROCESS.items() if settings.get(flag) is not None}
        if record:
            return {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
    return None


def read_checkpoint(path) -> object:
    """`torch.load(path, weights_only=True)` with `SAFE_GLOBALS` allowed and readable errors."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f'{path}: no such checkpoint file', reason='no such file')
    if path.suffix == '.safetensors':
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path), device='cpu')
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f'{path}: not a readable safetensors file ({e}); the file may be truncated, '
                                  f'download or convert it again') from None
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path)
        if unsafe:
            raise UnsafeCheckpointError(
                f'{path}: refused to unpickle global(s) {", ".join(unsafe)}; a DiffCLIP or open_clip '
                f'checkpoint holds only tensors and {len(SAFE_GLOBALS)} known argument types. If you trust '
                f'this file, re-save its state_dict with tensors only',
                reason=f'refused global(s) {", ".join(unsafe)}') from None
        raise CheckpointError(f'{path}: not a PyTorch checkpoint (its contents do not unpickle); pass a '
                              f'.pt/.pth/.bin or .safetensors model checkpoint',
                              reason='its contents do not unpickle') from None
    except Exception as e:  # torch's zip and pickle readers fail in many ways on a cut file
        reason = f'{type(e).__name__}: {_first_line(e)}'
        raise CheckpointError(
            f'{path}: not a readable PyTorch checkpoint ({reason}); the file may be truncated (download it '
            f'again) or not a checkpoint at all', reason=reason) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].split('. ')[0] if text else type(e).__name__


def _unsafe_globals(path) -> List[str]:
    allowed = {name for name in (_global_name(g) for g in SAFE_GLOBALS)}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return []
    return [g for g in found if g not in allowed]


def _global_name(g) -> str:
    if isinstance(g, tuple):
        return g[1]
    return f'{g.__module__}.{g.__qualname__}'


def model_state_dict(ckpt, where='checkpoint') -> StateDict:
    """The model weights in a loaded checkpoint: unwraps {'state_dict': …} and DDP's 'module.' prefix."""
    state_dict = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state_dict, dict) or not state_dict or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()):
        raise CheckpointError(f'{where}: holds no state_dict of tensors (found {type(ckpt).__name__}); '
                              f'pass a model checkpoint')
    if all(k.startswith('module.') for k in state_dict):
        state_dict = {k[len('module.'):]: v for k, v in state_dict.items()}
    return state_dict


def read_state_dict(path) -> StateDict:
    """The model weights in the checkpoint file at `path` (`model_state_dict`)."""
    return model_state_dict(read_checkpoint(path), str(path))


def is_official_diffclip(state_dict: StateDict) -> bool:
    """True for the official DiffCLIP / SLIP CLIP layout (`image_projection`, `visual.blocks.*`)."""
    return 'image_projection' in state_dict and any(k.startswith('visual.blocks.') for k in state_dict)


# official key → open_clip key, applied in order; q/k/v projections are fused separately
_OFFICIAL_TO_OPEN_CLIP: List[Tuple[str, str]] = [
    (r'^visual\.(cls_token|pos_embed|patch_embed\..*|norm\..*|blocks\..*)$', r'visual.trunk.\1'),
    (r'\.attn\.out_proj\.', '.attn.proj.'),
    (r'\.attn\.diff_norm\.', '.attn.sub_norm.'),
]
_QKV = re.compile(r'^(.*\.attn)\.q_proj\.(weight|bias)$')


def official_diffclip_to_open_clip(state_dict: StateDict) -> StateDict:
    """Official DiffCLIP (or its SLIP CLIP baseline) state dict → diffzoo's open_clip model keys.

    Separate q/k/v projections become timm's fused `qkv` (rows [q; k; v], each head pair's q/k
    halves already contiguous), `out_proj` → `proj`, `diff_norm` → `sub_norm`, the vision trunk
    moves under `visual.trunk`, and `image_projection` (768, 512) becomes the bias-free
    `visual.head.proj.weight` (512, 768). Text-tower names are open_clip's already.
    """
    out: StateDict = {}
    for key, value in state_dict.items():
        if re.search(r'\.attn\.[kv]_proj\.', key):
            continue
        m = _QKV.match(key)
        if m:
            prefix, kind = m.groups()
            missing = [f'{prefix}.{p}_proj.{kind}' for p in 'kv' if f'{prefix}.{p}_proj.{kind}' not in state_dict]
            if missing:
                raise CheckpointError(f'no {", ".join(missing)} beside {key}: not a whole official DiffCLIP state '
                                      f'dict; download the checkpoint again')
            parts = [state_dict[f'{prefix}.{p}_proj.{kind}'] for p in 'qkv']
            key, value = f'{prefix}.qkv.{kind}', torch.cat(parts, dim=0)
        elif key == 'image_projection':
            key, value = 'visual.head.proj.weight', value.t().contiguous()
        for pattern, repl in _OFFICIAL_TO_OPEN_CLIP:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def first_keys(keys: Iterable[str], n: int = 5) -> str:
    keys = sorted(keys)
    more = f', … ({len(keys)} in all)' if len(keys) > n else ''
    return ', '.join(keys[:n]) + more
