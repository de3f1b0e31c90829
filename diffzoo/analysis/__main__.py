import sys

from diffzoo.analysis.cli import main

sys.exit(main())
