"""Same as `spd-infer generate ...`, for a checkout without the console script: python infer/generate.py key=value ..."""

import sys

from spd.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
