"""Small-shape megakernel run for compute-sanitizer (racecheck / synccheck / memcheck):

    compute-sanitizer --tool racecheck python3 -m mimw.megakernel.gpu.sanitize
A tiny Qwen3-shaped model (16-row tiles) on 8 SMs, two decode steps, no CUDA graph; exits non-zero if the logits are wrong.
"""
import sys

from ...models.spec import get_preset
from .check import check_decode
from .config import KernelConfig


def main() -> int:
    spec = get_preset("tiny-qwen3")
    r = check_decode(spec, 40, steps=2, graph=False, num_sms=8, kcfg=KernelConfig.for_spec(spec))
    print(r)
    return 0 if r.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
