"""Environment variables of the ``vllm`` backend: the one place that reads or sets them.

vLLM takes part of its configuration from the environment (``VLLM_CPU_*`` on
CPU hosts). :func:`apply_defaults` fills in the values this project relies on
before vLLM is imported; anything the operator exported wins. Test helpers and
benchmarks that start vLLM workers as subprocesses build their environment
with :func:`subprocess_env` instead of reading ``os.environ`` themselves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

#: Defaults for vLLM's own variables; an exported value is never overridden.
VLLM_ENV_DEFAULTS: Mapping[str, str] = {
    # GiB of KV cache per CPU engine. vLLM's CPU default (4 GiB) would put two
    # engines plus the test suite beyond what a small CI machine has.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM's usage-stats reporter would try to reach the network.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Progress bars of transformers/huggingface_hub in worker logs are noise.
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_defaults(environ: dict[str, str] | None = None) -> None:
    """Set every :data:`VLLM_ENV_DEFAULTS` entry that is not already set (in ``os.environ`` by default).

    Call before importing vLLM: some of its modules read the environment at
    import time, and its engine processes inherit the parent's environment.
    """
    target = os.environ if environ is None else environ
    for key, value in VLLM_ENV_DEFAULTS.items():
        target.setdefault(key, value)


def subprocess_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process running vLLM: ours, plus the defaults, plus ``overrides``."""
    env = dict(os.environ)
    apply_defaults(env)
    if overrides:
        env.update(overrides)
    return env


#: Where vLLM creates its inter-process sockets (ZeroMQ ``ipc://`` files, one per channel).
RPC_BASE_PATH = "VLLM_RPC_BASE_PATH"
#: The longest path a Unix socket may have (``sizeof(sockaddr_un.sun_path)`` - 1 on Linux).
IPC_PATH_MAX = 107
#: The socket directories this process made (so a second engine gets its own, and only these are removed).
_OWN_RPC_DIRS: set[str] = set()


#: The prefix of a socket directory's name; ``mkdtemp`` appends 8 random characters.
_RPC_DIR_PREFIX = "slo-vllm-ipc-"
#: Characters of vLLM's socket file name inside the directory (a uuid4).
_SOCKET_NAME_CHARS = 36


def new_rpc_dir() -> str:
    """A new owner-only directory (mode 0700) for one engine's ZeroMQ sockets; the caller removes it.

    In the temporary directory, unless a socket path there would not fit ``sockaddr_un``
    (:data:`IPC_PATH_MAX` bytes: the directory, "/", a uuid), then in ``/tmp``.
    """
    base = tempfile.gettempdir()
    name_chars = len(_RPC_DIR_PREFIX) + 8  # mkdtemp's random suffix is 8 characters
    if len(base) + 1 + name_chars + 1 + _SOCKET_NAME_CHARS > IPC_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix=_RPC_DIR_PREFIX, dir=base)


def private_rpc_dir() -> Path | None:
    """A fresh owner-only directory for the next engine's sockets, exported as ``VLLM_RPC_BASE_PATH``.

    vLLM names each socket ``<VLLM_RPC_BASE_PATH>/<uuid>`` (the temporary directory by default) and
    leaves the files behind: about seven per engine start. Giving each engine a directory of its
    own lets :func:`remove_rpc_dir` take them all away when the engine stops. Returns None, and
    changes nothing, when the operator exported ``VLLM_RPC_BASE_PATH`` themselves.
    """
    current = os.environ.get(RPC_BASE_PATH)
    if current is not None and current not in _OWN_RPC_DIRS:
        return None
    path = new_rpc_dir()
    _OWN_RPC_DIRS.add(path)
    os.environ[RPC_BASE_PATH] = path
    return Path(path)


def remove_rpc_dir(path: Path | None) -> None:
    """Remove a directory :func:`private_rpc_dir` made, with the sockets in it (None: nothing)."""
    if path is not None and str(path) in _OWN_RPC_DIRS:
        shutil.rmtree(path, ignore_errors=True)
