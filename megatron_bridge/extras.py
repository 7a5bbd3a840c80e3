"""Optional packages: whether they are installed, and importing them with an actionable error.

Each optional integration sits behind a pip extra of this project; the error names the extra.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
from collections.abc import Iterator, Mapping
from types import ModuleType

# module name -> (pip extra, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "mlflow": ("mlflow", "MLflow tracking"),
    "comet_ml": ("comet", "Comet tracking"),
    "wandb": ("wandb", "Weights & Biases tracking"),
    "tensorboard": ("tensorboard", "TensorBoard logging"),
    "nvidia_resiliency_ext": ("resiliency", "fault tolerance, in-process restart and NVRx straggler detection"),
    "transformer_engine": ("te", "TransformerEngine layers, FP8/FP4 and communication overlap"),
    "tokenizers": ("hf", "Hugging Face tokenizers"),
    "sentencepiece": ("sentencepiece", "SentencePiece tokenizers (.model files)"),
    "safetensors": ("hf", "reading and writing Hugging Face weights and peft adapters"),
    "datasets": ("data", "reading datasets directories"),
    "pyarrow": ("data", "reading Parquet and Arrow files"),
    "jinja2": ("data", "chat templates"),
    "matplotlib": ("plot", "plotting training curves"),
    "pynvml": ("nvml", "GPU energy logging"),
}


def is_installed(module: str) -> bool:
    """True if `module` can be imported where the config is resolved for: this machine, unless
    `assume_installed` says otherwise for the machines a dry run resolves for."""
    assumed = _ASSUMED.get().get(module)
    return installed_here(module) if assumed is None else assumed


@functools.lru_cache(maxsize=None)
def installed_here(module: str) -> bool:
    """True if `module` can be imported on this machine (checked without importing it; cached)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


is_installed.cache_clear = installed_here.cache_clear  # type: ignore[attr-defined]

_ASSUMED: contextvars.ContextVar[Mapping[str, bool]] = contextvars.ContextVar("assumed_installed", default={})


@contextlib.contextmanager
def assume_installed(**modules: bool) -> Iterator[None]:
    """Within the block, `is_installed(name)` answers `modules[name]`: resolve a config for the
    machines it will run on (a dry run on a login node, for GPUs with TransformerEngine) rather
    than for this one. Nothing is imported; `require` still needs the real package."""
    token = _ASSUMED.set({**_ASSUMED.get(), **modules})
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def install_hint(module: str) -> str:
    extra, _ = EXTRAS.get(module, (None, None))
    if extra is None:
        return f"pip install {module}"
    return f"pip install 'megatron-bridge[{extra}]'"


def missing_message(module: str, why: str | None = None) -> str:
    _, what = EXTRAS.get(module, (None, module))
    return f"{why or what} needs the '{module}' package, which is not installed ({install_hint(module)})"


def require(module: str, why: str | None = None) -> ModuleType:
    """Import an optional package, or raise ModuleNotFoundError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] != module.split(".")[0]:
            raise
        raise ModuleNotFoundError(missing_message(module.split(".")[0], why), name=module) from exc
