"""The Python packages widellm imports that the GPU machines' image lacks, downloaded here as
wheels for ``benchmarks/gpu/check.sh`` to install there (nothing can be fetched on those
machines; their python3 is 3.12 and already holds torch, triton, transformers and the rest of
:data:`ON_IMAGE`, as the device notes list it, 2026-11-17).

Each wheel is the version installed in this environment (what CI tests), for CPython 3.12 on
manylinux x86_64, without dependencies: every dependency is in :data:`CARRIED` or on the image.

Usage: python benchmarks/gpu/wheels.py [DIR]   (default .whl; git-ignored; name it in the
device call's ``carry``)
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

# Distribution -> import name, for what the engine imports and the image does not hold.
CARRIED = {
    "msgspec": "msgspec",
    "pyzmq": "zmq",
    "xgrammar": "xgrammar",
    "apache-tvm-ffi": "tvm_ffi",  # xgrammar's
    "pydantic": "pydantic",
    "pydantic-core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "gguf": "gguf",
}
# widellm's dependencies, and the carried packages' own, that the image already holds.
ON_IMAGE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "jinja2",
            "prometheus-client", "httpx", "ninja", "pyyaml", "matplotlib", "triton",
            "typing-extensions", "requests"}
# Dependencies only the HTTP server needs; check.sh runs engines in-process, never `serve`.
SERVER_ONLY = {"fastapi", "uvicorn"}
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def pinned() -> list[str]:
    """``name==version`` of every carried distribution, as installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]


def download(folder: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
                    "-d", folder, *pinned()], check=True)


if __name__ == "__main__":
    download(sys.argv[1] if len(sys.argv) > 1 else ".whl")
