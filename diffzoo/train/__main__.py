import sys

import diffzoo  # registers the models with open_clip before open_clip_train looks them up
from diffzoo.train.launch import main

sys.exit(main())
