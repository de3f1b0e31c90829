"""`python -m diffzoo.clip_benchmark eval --model diffclip-b16 --pretrained cc3m --dataset …`: CLIP_benchmark's
own command line, unchanged, with diffzoo's models registered and its NumPy 2 fault mended.

A plain `clip_benchmark` process cannot see diffzoo's models: open_clip has no plugin entry points,
so the models exist only in a process that imported diffzoo. This command imports it, installs
`diffzoo.eval.seams`, then runs `clip_benchmark.cli.main` with the same arguments.
"""
import sys

import clip_benchmark.cli

import diffzoo  # noqa: F401  registers the models with open_clip

from diffzoo.eval import seams


def main() -> int:
    seams.install()
    sys.argv[0] = 'clip_benchmark'
    clip_benchmark.cli.main()
    return 0


if __name__ == '__main__':
    sys.exit(main())
