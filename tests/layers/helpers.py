"""Helpers of the layer tests."""
import contextlib
import inspect

import pytest
import torch


def saved_bytes(layer, x) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of `layer` on `x`."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(storages.values())


@contextlib.contextmanager
def interpreter_patches_language_once_per_launch():
    """Triton's interpreter patches triton.language for the interpreter at each kernel launch, and again at
    every call of a @triton.jit helper inside the kernel; within a launch the second is a repeat on the same,
    already patched modules (undone by nothing), and a third of an interpreted kernel test. While this is
    active a helper called inside a launch skips the repeat; launches, and a Triton without these internals,
    run as before."""
    import triton.language as tl
    from triton.runtime import interpreter
    patch_lang, executor = getattr(interpreter, '_patch_lang', None), getattr(interpreter, 'GridExecutor', None)
    if patch_lang is None or executor is None:
        yield
        return
    launch = executor.__call__
    launch_langs = None  # ids of the language modules the running launch patched; None between launches
    langs_of = {}  # a function's language modules, read from its globals once

    def patch_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = {id(value) for value in fn.__globals__.values()
                                    if inspect.ismodule(value) and value in (tl, tl.core)}
        if launch_langs is not None and langs <= launch_langs:
            return interpreter._LangPatchScope()  # nothing to undo
        scope = patch_lang(fn)
        if launch_langs is not None:
            launch_langs.update(langs)
        return scope

    def run_launch(self, *args, **kwargs):
        nonlocal launch_langs
        launch_langs = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            launch_langs = None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, '_patch_lang', patch_once)
        mp.setattr(executor, '__call__', run_launch)
        yield
