"""`python -m diffzoo.vlm.train`, kept: VLM fine-tuning lives in `diffzoo.train.vlm` (python -m diffzoo.train.vlm)."""
import runpy

if __name__ == '__main__':
    runpy.run_module('diffzoo.train.vlm', run_name='__main__', alter_sys=True)
