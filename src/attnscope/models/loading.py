"""Load a model offline, with attnscope's attention function, and find its attention sites.

A model argument is, in this order: a built-in alias (``attnscope models``), a local folder
with a ``config.json``, a local ``.gguf`` file, or a repository id already in the local
Hugging Face cache. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from ..progress import say_slow_step
from .adapters import HOW_TO_ADD, Adapter, AttentionSite, find_sites
from .architectures import adapter_for
from .registry import ALIASES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_HELP = '"cpu", "cuda", "cuda:N", "mps" or "auto" (spread over every GPU, then the CPU)'


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for capture: the module, its tokenizer and the attention sites found in it."""

    name: str
    source: Path
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    adapter: Adapter
    sites: Mapping[nn.Module, AttentionSite]
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def input_device(self) -> torch.device:
        """Where the model takes its inputs: the input embeddings' device (the first of several with ``auto``)."""
        return cast(torch.Tensor, self.model.get_input_embeddings().weight).device

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(getattr(self.config, "is_encoder_decoder", False))

    @property
    def decoder_start_id(self) -> int:
        """The token an encoder-decoder's decoder starts from: the config's ``decoder_start_token_id``, else
        the generation config's, else the pad token (T5's convention), else the first token; refused when
        none is set (transformers 5's T5Config, for one, has no such attribute)."""
        generation = getattr(self.model, "generation_config", None)
        candidates = (getattr(self.config, "decoder_start_token_id", None),
                      getattr(generation, "decoder_start_token_id", None),
                      getattr(self.config, "pad_token_id", None), getattr(self.config, "bos_token_id", None))
        start = next((token for token in candidates if isinstance(token, int)), None)
        if start is None:
            raise AttnscopeError(
                f"model {self.name!r} (type {self.config.model_type!r}) names no token its decoder starts from "
                "(no decoder_start_token_id, pad_token_id or bos_token_id in its config or generation config); "
                "add decoder_start_token_id to its config.json")
        return start

    @property
    def causal(self) -> bool:
        """True when the input side attends only backwards (decoder-only models)."""
        main = "encoder" if self.is_encoder_decoder else "self"
        return any(site.causal for site in self.sites.values() if site.kind == main)

    @property
    def max_length(self) -> int:
        """Longest input in tokens: the tokenizer's limit, or the position table's size."""
        limits = [getattr(self.tokenizer, "model_max_length", None)]
        for attribute in ("max_position_embeddings", "n_positions"):
            limits.append(getattr(self.config, attribute, None))
        sane = [int(v) for v in limits if isinstance(v, int) and 0 < v < 1_000_000]
        return min(sane) if sane else 512

    def check_length(self, n_tokens: int, what: str = "the text") -> None:
        """Refuse an input of ``n_tokens`` tokens past :attr:`max_length` (commands that cut texts say so instead)."""
        if n_tokens > self.max_length:
            raise AttnscopeError(f"{what} is {n_tokens} tokens, more than {self.name}'s limit of {self.max_length} "
                                 "tokens; give a shorter text")

    def __repr__(self) -> str:
        return (f"LoadedModel({self.name!r}, type={self.config.model_type!r}, sites={len(self.sites)}, "
                f"dtype={self.dtype}, device={self.device})")


def cache_dir() -> Path:
    """Where attnscope keeps converted weights: ``$ATTNSCOPE_CACHE`` or ``~/.cache/attnscope``."""
    return Path(os.environ.get("ATTNSCOPE_CACHE", Path.home() / ".cache" / "attnscope"))


def publish_folder(folder: Path, build: Callable[[Path], object]) -> Path:
    """``folder``, built by ``build(staging)`` into a private staging folder beside it, then renamed into place.

    Two processes may build the same cache folder at once (a test run and a command, two workers):
    each writes its own staging folder, the first rename wins, and the other keeps the winner's folder."""
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
    try:
        build(staging)
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():  # not a lost race: a real failure to write
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _go_offline() -> None:
    # Read by huggingface_hub at call time in recent versions; local_files_only below is the real guard.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def resolve_source(name: str) -> Path:
    """The local path behind a model argument, or an :class:`AttnscopeError` saying how to get it."""
    if name in ALIASES:
        alias = ALIASES[name]
        path = alias.locate()
        if path is None and alias.buildable:
            say_slow_step(f"building model {name!r} once, on first use ({alias.build_time}); later loads read it "
                          f"from {cache_dir()}")
            path = alias.build()
        if path is None:
            raise AttnscopeError(f"model alias {name!r} is not installed; install it with: {alias.install}")
        return path
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise AttnscopeError(f"folder {path} has no config.json, so it is not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return path
    cached = _from_hf_cache(name)
    if cached is not None:
        return cached
    raise AttnscopeError(
        f"unknown model {name!r}: not an alias ({', '.join(ALIASES)}), a local folder, a .gguf file or a model in "
        "the local Hugging Face cache; download it on a machine with internet (huggingface-cli download) and pass "
        "its folder"
    )


def _from_hf_cache(repo_id: str) -> Path | None:
    if repo_id.count("/") > 1 or not repo_id.strip():
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the cache"
        return None
    return folder if (folder / "config.json").exists() else None


def _auto_class(config: Any) -> Any:
    import transformers

    architectures = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if "CausalLM" in architectures or "LMHead" in architectures:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _gguf_cache_folder(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def _check_gguf_magic(gguf_path: Path) -> None:
    try:
        with gguf_path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise AttnscopeError(f"cannot read {gguf_path}: {error.strerror or error}") from None
    if magic != b"GGUF":
        raise AttnscopeError(f"cannot read {gguf_path} as a GGUF model: it does not start with the GGUF magic bytes, "
                             "so it is not a GGUF file")


def convert_gguf(gguf_path: Path, folder: Path | None = None, dtype: str = "float32") -> Path:
    """Dequantize a GGUF file once into a safetensors folder of ``dtype`` weights (``folder``, or one in the cache
    named after the file); later loads read that folder (~1 s, not ~20 s)."""
    folder = folder or _gguf_cache_folder(gguf_path)
    if (folder / "model.safetensors").exists():
        return folder
    import transformers

    _check_gguf_magic(gguf_path)  # a file that is no GGUF at all is refused before the slow step is announced
    say_slow_step(f"converting {gguf_path.name} to {dtype} safetensors once (about 20 s for a 135M model, a minute "
                  f"for 270M, a few for 1.5B); later loads read {folder} in seconds")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=DTYPES[dtype]
        )
    except ImportError as error:
        raise AttnscopeError(f"reading GGUF needs extra packages: {error}; pip install gguf accelerate") from None
    except Exception as error:  # noqa: BLE001 - a damaged or foreign file fails in many ways inside transformers/gguf
        raise AttnscopeError(f"cannot read {gguf_path} as a GGUF model: {_first_line(error)}") from None
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we write are plain floats
    config["architectures"] = [type(model).__name__]

    def write(staging: Path) -> None:
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save_pretrained(staging)
        _save_untied(model, staging / "model.safetensors")

    return publish_folder(folder, write)


def _save_untied(model: nn.Module, path: Path) -> None:
    """Save each tensor once; a tied output head is dropped (``tie_word_embeddings`` restores it on load)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in sorted(model.state_dict().items(), key=lambda item: item[0].startswith("lm_head")):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def load_weights(name: str, *, dtype: str, device: str, attn_implementation: str,
                 eager_types: frozenset[str] = frozenset()) -> tuple[Path, Any, Any]:
    """The checkpoint of ``name`` (an alias, a local folder or a GGUF file), offline: its source,
    the model (eval mode) with ``attn_implementation`` (``"eager"`` for the model types in ``eager_types``,
    which cannot be built with another) and its tokenizer. ``dtype``/``device``: see
    :func:`attnscope.load_model` (which wires the model to attnscope's attention function)."""
    if dtype not in DTYPES:
        raise AttnscopeError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    check_device(device)
    _go_offline()
    source = resolve_source(name)
    folder = convert_gguf(source) if source.suffix == ".gguf" else source
    model, tokenizer = _load_pretrained(name, folder, DTYPES[dtype], attn_implementation, device, eager_types)
    return source, model, tokenizer


def with_sites(name: str, source: Path, model: Any, tokenizer: Any, dtype: str, device: str) -> LoadedModel:
    """``model`` with its attention sites found (by the adapters table) and marked, so the attention
    function knows where it runs; a model with none is refused."""
    adapter = adapter_for(model.config.model_type, bool(getattr(model.config, "is_encoder_decoder", False)))
    sites = find_sites(model, adapter)
    check_sites(model.config.model_type, adapter, sites)
    for module, site in sites.items():
        module.attnscope_site = site  # type: ignore[assignment]  # how the attention function finds its site
    for module in model.modules():  # attention over something other than tokens: computed, never recorded
        if type(module).__name__ in adapter.not_tokens:
            module.attnscope_not_tokens = True  # type: ignore[assignment]
    _prepare_tokenizer(tokenizer)
    return LoadedModel(name, source, model, tokenizer, adapter, sites, dtype, device)


def check_sites(model_type: str, adapter: Adapter, sites: Mapping[nn.Module, AttentionSite]) -> None:
    """Refuse a model in which ``adapter`` found no attention, or (read from the model) not every kind it needs."""
    found = {site.kind for site in sites.values()}
    if not sites:
        known = "is not in attnscope's adapters table" if adapter.generic else f"(adapter {adapter.family!r})"
        raise AttnscopeError(
            f"model type {model_type!r} {known} and has no attention module where attnscope looks for one "
            f"({' or '.join(rule.pattern for rule in adapter.rules)}); it needs an adapter row, or a bridge if it "
            f"computes attention inside its own forward ({HOW_TO_ADD})")
    missing = [kind for kind in dict.fromkeys(rule.kind for rule in adapter.rules) if kind not in found]
    if adapter.generic and missing:
        raise AttnscopeError(
            f"model type {model_type!r} is not in attnscope's adapters table and attnscope found no {missing[0]} "
            f"attention module in it; it needs an adapter row ({HOW_TO_ADD})")


def check_device(device: str) -> None:
    """Refuse, before anything loads, a device that is misspelt or that this machine does not have."""
    kind, _, number = device.partition(":")
    if kind not in ("cpu", "cuda", "mps", "auto") or (number and not (kind == "cuda" and number.isdigit())):
        raise AttnscopeError(f"unknown device {device!r}; choose {DEVICE_HELP}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise AttnscopeError(f"device {device!r} asked for, but this machine has no CUDA GPU that torch "
                             f"{torch.__version__} can use; use --device cpu (or auto)")
    if kind == "cuda" and number and int(number) >= torch.cuda.device_count():
        raise AttnscopeError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA "
                             f"GPU(s), numbered from 0")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise AttnscopeError("device 'mps' asked for, but this machine has no Apple GPU that torch can use; "
                             "use --device cpu (or auto)")
    if kind == "auto" and importlib.util.find_spec("accelerate") is None:
        raise AttnscopeError("device 'auto' spreads a model over devices with accelerate; pip install accelerate")


def _load_pretrained(name: str, folder: Path, torch_dtype: torch.dtype, implementation: str,
                     device: str = "cpu", eager_types: frozenset[str] = frozenset()) -> tuple[Any, Any]:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a ~1 s load needs no bar
    config = None
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        auto_class = _auto_class(config)
        implementation = "eager" if config.model_type in eager_types else implementation
        with warnings.catch_warnings(), _quiet_transformers():
            warnings.simplefilter("ignore")
            model, loading_info = auto_class.from_pretrained(
                folder, local_files_only=True, dtype=torch_dtype, attn_implementation=implementation,
                output_loading_info=True, device_map=None if device == "cpu" else device,
            )
    except Exception as error:  # noqa: BLE001 - damaged weights, configs or tokenizers fail in many ways
        if config is not None and _names_implementation(error, implementation):
            raise AttnscopeError(
                f"model type {config.model_type!r} computes attention inside its own modules, not through "
                f"transformers' AttentionInterface (loading it with attn_implementation={implementation!r} fails: "
                f"{_first_line(error)}); attnscope needs a bridge for it ({HOW_TO_ADD})") from None
        raise AttnscopeError(f"cannot load model {name!r} with attnscope's capture function: "
                             f"{_first_line(error)}") from None
    if loading_info.get("missing_keys"):
        missing = sorted(loading_info["missing_keys"])
        warnings.warn(f"model {name!r}: {len(missing)} weights missing from the checkpoint were initialised at "
                      f"random (e.g. {missing[0]}); its attention may not be the trained model's", stacklevel=3)
    return model.eval(), tokenizer


def _names_implementation(error: BaseException, implementation: str) -> bool:
    """Whether loading failed on the attention implementation's name (Falcon picks its attention class by
    name: ``KeyError('attnscope')``), not on a path that happens to contain it."""
    text = str(error)
    return f"'{implementation}'" in text or f'"{implementation}"' in text


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _quiet_transformers:
    """Silence transformers' load-report chatter (unused pooler weights etc.) during one load."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("transformers")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)


def _prepare_tokenizer(tokenizer: Any) -> None:
    """Right padding everywhere (positions of real tokens then match an unbatched run), and a pad token."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
