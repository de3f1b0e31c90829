import sys

from diffzoo.train.vlm.cli import main

sys.exit(main())
