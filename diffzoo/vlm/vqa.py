"""`python -m diffzoo.vlm.vqa`, kept: VQA accuracy lives in `diffzoo.eval.vqa` (python -m diffzoo.eval.vqa)."""
import runpy

if __name__ == '__main__':
    runpy.run_module('diffzoo.eval.vqa', run_name='__main__', alter_sys=True)
