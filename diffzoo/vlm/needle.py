"""`python -m diffzoo.vlm.needle`, kept: MMNeedle lives in `diffzoo.eval.needle` (python -m diffzoo.eval.needle)."""
import runpy

if __name__ == '__main__':
    runpy.run_module('diffzoo.eval.needle', run_name='__main__', alter_sys=True)
