"""diffclip-b16's towers through torch.compile(fullgraph=True), torch.export and ONNX (fp32, CPU).

Full-size towers at batch 1: the differential layers of the real geometry (6 vision heads of q/k 64
and v 128, the causal text tower of 4 differential heads) are what these paths must take."""
import numpy as np
import onnxruntime as ort
import open_clip
import pytest
import torch

pytestmark = pytest.mark.slow  # full-size towers through dynamo, export and ONNX


class TextTower(torch.nn.Module):
    """`encode_text` as a module, the form the tracers take."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, text):
        return self.clip.encode_text(text)


@pytest.fixture(scope='module')
def towers():
    model = open_clip.create_model('diffclip-b16').eval()
    image = torch.randn(1, 3, 224, 224)
    text = open_clip.get_tokenizer('diffclip-b16')(['a photo of a differential cat'])
    return {'vision': (model.visual, image), 'text': (TextTower(model), text)}


@pytest.mark.parametrize('tower', ['vision', 'text'])
def test_compile_fullgraph_has_no_graph_break(towers, tower):
    module, x = towers[tower]
    with torch.no_grad():
        eager = module(x)
        compiled = torch.compile(module, fullgraph=True, backend='eager')(x)  # fullgraph: a break raises
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('tower', ['vision', 'text'])
def test_exported_program_runs_equal_to_eager(towers, tower):
    module, x = towers[tower]
    program = torch.export.export(module, (x,))
    with torch.no_grad():
        assert torch.equal(program.module()(x), module(x))


def test_vision_tower_onnx_in_onnxruntime_matches_eager(towers, tmp_path):
    module, x = towers['vision']
    path = tmp_path / 'diffclip-b16-visual.onnx'
    torch.onnx.export(module, (x,), dynamo=True, verbose=False).save(str(path))
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        eager = module(x).numpy()
    assert np.abs(out - eager).max() <= 1e-4
