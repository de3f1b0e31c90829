"""Helpers of the layer tests."""
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
