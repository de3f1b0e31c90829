"""`python -m diffzoo.attention`, kept: attention maps live in `diffzoo.analysis.maps`, their command
line in `diffzoo.analysis.overlays` (python -m diffzoo.analysis.overlays)."""
import runpy

if __name__ == '__main__':
    runpy.run_module('diffzoo.analysis.overlays', run_name='__main__', alter_sys=True)
