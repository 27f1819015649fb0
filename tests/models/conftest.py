import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct GGUF), loaded once through ``load_model(None)``."""
    from mimw.models.checkpoint import load_model

    return load_model(None, progress=False)
