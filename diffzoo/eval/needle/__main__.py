import sys

from diffzoo.eval.needle.cli import main

sys.exit(main())
