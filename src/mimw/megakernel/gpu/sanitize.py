"""Small-shape megakernel run for compute-sanitizer (racecheck / synccheck / memcheck):

    compute-sanitizer --tool racecheck python3 -m mimw.megakernel.gpu.sanitize
Two small shapes on 8 SMs, two decode steps each, no CUDA graph: a tiny Qwen3 (16-row tiles, one ATTN_IN part) and
a 2-layer SmolLM2 with ATTN_IN in 2 column parts (the ticket and finisher path). Exits non-zero if logits are wrong.
"""
import dataclasses
import sys

from ...models.spec import get_preset
from .check import check_decode
from .config import KernelConfig


def main() -> int:
    ok = True
    for spec, parts in ((get_preset("tiny-qwen3"), 0), (get_preset("smollm2-135m").with_(num_layers=2), 2)):
        kcfg = dataclasses.replace(KernelConfig.for_spec(spec), qkv_parts=parts)
        r = check_decode(spec, 40, steps=2, graph=False, num_sms=8, kcfg=kcfg)
        print(r, flush=True)
        ok &= r.ok()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
