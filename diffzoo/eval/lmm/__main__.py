import sys

from diffzoo.eval.lmm.cli import main

sys.exit(main())
