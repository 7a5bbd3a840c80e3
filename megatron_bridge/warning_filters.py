"""Warning filters for the entry points (`mbridge`, `pretrain()`, `finetune()`).

Importing `megatron_bridge` leaves the process's warning filters alone; a program that trains
through our entry points gets these, which silence third-party warnings that are expected here
and carry no information for the user.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

_INSTALLED = False


def quiet_known_warnings() -> None:
    """Ignore warnings that are expected on every run (installed once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    # megatron-core warns that it falls back to torch implementations when neither
    # TransformerEngine nor Apex is installed: expected on CPU, and said once by our setup log.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    warnings.filterwarnings("ignore", message="Apex is not installed. Falling back to Torch Norm", category=UserWarning)
    # Finalizing any TransformerConfig warns about its own default cuda_graph_scope.
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    # torch.cuda warns about the pynvml package on every import.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)


@contextlib.contextmanager
def checkpoint_loading() -> Iterator[None]:
    """Around megatron-core's `dist_checkpointing.load`: it calls torch APIs that torch has
    deprecated (`load_state_dict`, ShardedTensor), which warn on every load with nothing a user can
    change. Only while loading: the process's filters stay as they were."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield
