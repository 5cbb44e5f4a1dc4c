"""The image packages the rehearsal's stand-in installs at PyPI's versions (bench/gpu_image_rehearsal.sh): those the
payload's wheels require and the image holds at no recorded version (gpu_pack's resolved.json), and the suite's own
requirements (pyproject.toml) that the image holds. Stdlib only (the stand-in's Python 3.12).

    python bench/gpu_image_rehearsal_needs.py WHEELS/resolved.json      # -> names, one line
"""

import json
import os
import re
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(resolved: str) -> str:
    image, recorded = set(), set()
    with open(os.path.join(REPO, "bench", "gpu_image.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name = normalise(line.split("==", 1)[0])
                (recorded if "==" in line else image).add(name)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        needs = tomllib.load(f)["project"]["dependencies"]
    suite = {normalise(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]) for d in needs}
    with open(resolved) as f:
        assumed = set(json.load(f)["assumed_on_the_image"])
    return " ".join(sorted((assumed | (suite & image)) - recorded))


if __name__ == "__main__":
    print(main(sys.argv[1]))
