"""What `ConfigContainer.env_vars` may set.

A config is data, and config files are shared: nothing in one may make a process load code.
Environment variables that make Python, the dynamic linker, a shell or another program started
by the run (git, a JVM, Node) load or run code from a place they name are therefore refused in
`env_vars`, each with the reason. To set one on purpose, set it in the environment that launches
the run (`PYTHONPATH=... mbridge pretrain ...`, the sbatch script, the container); that
environment is the user's own, and a variable it already has wins over `env_vars` anyway.

Values are also bounded: Linux passes one environment string (`NAME=value` and its terminator)
of at most `MAX_ARG_STRLEN` bytes to a new process, so a longer one would make every process
the run starts (checkpoint writers, tracker, data workers) fail with E2BIG.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.config.errors import Problems, show
from megatron_bridge.config.secrets import REDACTED

MAX_ARG_STRLEN = 131072
"""Longest environment string Linux passes to a new process, in bytes (32 pages of 4 KiB),
counting `NAME=`, the value and the terminating NUL."""

CODE_LOADING: dict[str, str] = {
    # Python: where modules, startup files and compiled bytecode come from.
    "PYTHONPATH": "Python imports modules from it (a sitecustomize.py there runs in every Python process)",
    "PYTHONHOME": "Python takes its standard library from it",
    "PYTHONSTARTUP": "Python runs this file at interactive start",
    "PYTHONUSERBASE": "Python imports its user site-packages (and runs their .pth files) from it",
    "PYTHONPLATLIBDIR": "Python looks for its library directory under this name",
    "PYTHONPYCACHEPREFIX": "Python reads compiled bytecode from this tree",
    "PYTHONBREAKPOINT": "breakpoint() imports and calls the function it names",
    "PYTHONWARNINGS": "Python imports the module of each warning category it names",
    "PYTHONINSPECT": "Python opens an interactive prompt when the program ends",
    "PYTHONEXECUTABLE": "Python reports it as its own executable (programs start it)",
    # Compiled code loaded by the libraries training uses.
    "TORCHINDUCTOR_CACHE_DIR": "torch.compile loads generated code from this cache",
    "TRITON_CACHE_DIR": "Triton loads compiled kernels from this cache",
    "TORCH_EXTENSIONS_DIR": "torch loads compiled extensions from this directory",
    "CUDA_INJECTION64_PATH": "CUDA loads this library into the process",
    "OMP_TOOL_LIBRARIES": "the OpenMP runtime loads these libraries",
    "NCCL_NET_PLUGIN": "NCCL loads this network plugin library",
    "NCCL_TUNER_PLUGIN": "NCCL loads this tuner plugin library",
    "NCCL_PROFILER_PLUGIN": "NCCL loads this profiler plugin library",
    "GCONV_PATH": "the C library loads character-set converters (shared libraries) from it",
    "PATH": "programs the run starts (git, compilers, launchers) are looked up in it",
    # Shells and other interpreters a run or its tools may start.
    "BASH_ENV": "bash runs this file when it starts a script",
    "ENV": "sh runs this file when it starts",
    "PROMPT_COMMAND": "bash runs it before each prompt",
    "PERL5LIB": "Perl imports modules from it",
    "PERLLIB": "Perl imports modules from it",
    "PERL5OPT": "Perl takes command-line options (e.g. modules to load) from it",
    "RUBYLIB": "Ruby loads libraries from it",
    "RUBYOPT": "Ruby takes command-line options (e.g. libraries to load) from it",
    "NODE_OPTIONS": "Node.js takes options (e.g. --require a file) from it",
    "NODE_PATH": "Node.js loads modules from it",
    "JAVA_TOOL_OPTIONS": "every JVM takes options (e.g. -javaagent) from it",
    "_JAVA_OPTIONS": "every JVM takes options (e.g. -javaagent) from it",
    "JDK_JAVA_OPTIONS": "the java launcher takes options (e.g. -javaagent) from it",
    # git, which trackers and version reporting run.
    "GIT_SSH": "git runs this program",
    "GIT_SSH_COMMAND": "git runs this command",
    "GIT_ASKPASS": "git runs this program",
    "SSH_ASKPASS": "ssh runs this program",
    "GIT_EXEC_PATH": "git runs its subcommands from this directory",
    "GIT_EXTERNAL_DIFF": "git runs this program",
    "GIT_PAGER": "git runs this program",
    "GIT_EDITOR": "git runs this program",
    "GIT_PROXY_COMMAND": "git runs this command",
    "GIT_CONFIG_PARAMETERS": "git takes settings (some run programs, e.g. core.fsmonitor) from it",
    "GIT_CONFIG_COUNT": "git takes settings (some run programs, e.g. core.fsmonitor) from GIT_CONFIG_KEY_n",
    "GIT_CONFIG_GLOBAL": "git reads settings (some run programs) from this file",
    "GIT_CONFIG_SYSTEM": "git reads settings (some run programs) from this file",
}
"""Variables refused in `env_vars`, with what they make a process load or run."""

CODE_LOADING_PREFIXES: tuple[tuple[str, str], ...] = (
    ("LD_", "the dynamic linker's settings (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, ...) choose the "
            "shared libraries every process loads"),
    ("DYLD_", "the macOS dynamic linker's settings choose the libraries every process loads"),
    ("BASH_FUNC_", "bash defines (and runs) the shell function it holds"),
    ("GIT_CONFIG_KEY_", "git takes settings (some run programs, e.g. core.fsmonitor) from it"),
    ("GIT_CONFIG_VALUE_", "git takes settings (some run programs, e.g. core.fsmonitor) from it"),
)  # fmt: skip
"""Families of variables refused in `env_vars`, by prefix."""

HOW_TO_SET = "set it in the environment that launches the run, not in the config"


def check(env_vars: Any, problems: Problems) -> None:
    """Report each entry of `env_vars` that cannot or may not be set (`problems` is at `env_vars`)."""
    if not isinstance(env_vars, dict):
        problems.add("", f"must be a mapping of names to values, got {type(env_vars).__name__}", "use {NAME: value}")
        return
    for name, value in env_vars.items():
        if not isinstance(name, str) or not name.strip() or "=" in name or "\0" in name:
            problems.add(show(name), "is not a valid environment variable name", "use a non-empty name without '='")
            continue
        upper = name.upper()  # Windows reads names case-insensitively
        reason = CODE_LOADING.get(upper) or next((w for pre, w in CODE_LOADING_PREFIXES if upper.startswith(pre)), None)
        if reason is not None:
            problems.add(name, f"may not be set from a config: {reason}", HOW_TO_SET)
            continue
        if not isinstance(value, (str, int, float, bool)):
            problems.add(name, f"value {show(value)} is not a string or number", "give a scalar value")
            continue
        text = str(value)
        if text == REDACTED:
            problems.add(name, f"is {REDACTED!r}: the config was written without this credential",
                         "give the value again, e.g. from the environment: ${oc.env:VAR}")
            continue
        if "\0" in text:
            problems.add(name, "the value holds a NUL character, which an environment cannot", "remove it")
            continue
        size = len(name.encode()) + len(text.encode(errors="surrogateescape")) + 2  # '=' and the terminator
        if size > MAX_ARG_STRLEN:
            problems.add(
                name,
                f"NAME=value is {size:,} bytes, over the {MAX_ARG_STRLEN:,} bytes the operating system passes "
                "per environment variable (MAX_ARG_STRLEN): every process the run starts would fail",
                "keep large data in a file and put its path in the variable",
            )
