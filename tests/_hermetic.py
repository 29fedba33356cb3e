"""A test session that leaves the user's files alone, and a Ctrl-C that stops it (issue 38, item 4).

* :func:`isolate_caches` (:func:`cache_env`): the environment variables that move every cache a test could
  write (portrl's models, data and kernels; Hugging Face, torch, Triton, Inductor, vLLM and matplotlib caches;
  Ray's default token file, which a new local Ray writes to ``~/.ray/auth_token``) into one temporary folder.
  tests/conftest.py sets them before anything is imported, so no test reads or writes the user's caches.
* :func:`outputs_state` / :func:`outputs_changes`: the guard on ``outputs/`` of the repository root and of the
  current directory (the default ``trainer.output_dir`` is ``outputs/run``: a test that runs a command without
  its own output folder would meet, or change, the user's run there). tests/conftest.py compares them before
  and after the session and fails the session on a difference.
* :class:`SigintWatch`: a Ctrl-C that lands while a test runs ``portrl`` in the pytest process is taken by the
  run's own handler (finish the step, save, return 130: portrl.trainer.interrupts); the watch notes it, and
  tests/conftest.py raises KeyboardInterrupt after that test, so the session stops instead of going on.
* :func:`end_child_sessions`: a Ctrl-C reaches only the terminal's process group; a test's run started in a
  session of its own is ended by tests/conftest.py when pytest is interrupted.
"""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

#: variable -> folder under the session's cache folder (a variable that names a file is handled in cache_env)
CACHE_DIRS = {
    "XDG_CACHE_HOME": "xdg",  # the default of every cache below that is not named, pip's and platformdirs' ones
    "HF_HOME": "huggingface",  # transformers / huggingface_hub: hub downloads, dynamic modules, tokens
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # torch.utils.cpp_extension builds
    "TORCHINDUCTOR_CACHE_DIR": "inductor",  # torch.compile's code (default /tmp/torchinductor_$USER)
    "TRITON_CACHE_DIR": "triton",  # Triton's compiled kernels (default ~/.triton/cache)
    "VLLM_CACHE_ROOT": "vllm",  # vLLM's torch.compile cache and model info (default ~/.cache/vllm)
    "MPLCONFIGDIR": "matplotlib",  # matplotlib's font cache and config (default ~/.config/matplotlib, ~/.cache)
}

#: set by a user, these would point a library at the user's cache in spite of HF_HOME / XDG_CACHE_HOME above
SHADOWING = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE",
             "HF_ASSETS_CACHE", "HF_XET_CACHE", "TRITON_HOME")


def isolate_caches(environ, base: str, worker: str) -> None:
    """Point ``environ`` (``os.environ``) at the session's caches: :func:`cache_env`'s values set, and the
    variables that would override them (:data:`SHADOWING`) removed."""
    for var in SHADOWING:
        environ.pop(var, None)
    environ.update(cache_env(base, worker))


def cache_env(base: str, worker: str) -> dict[str, str]:
    """The variables that put every cache of a test session under ``base``: ``PORTRL_CACHE`` per xdist
    ``worker`` (two processes that write the same cached tiny model at once rename it away under each other's
    reader: portrl.user_files.replace_dir), the rest shared. ``RAY_AUTH_TOKEN_PATH`` names a token file written
    here once, so that a local Ray finds a token and does not write one to ``~/.ray`` (unless the user gave
    Ray a token already: ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` are then left as they are)."""
    env = {"PORTRL_CACHE": f"{base}-{worker}" if worker else base,
           # the native kernels (backends/cpu/native_build.py) are built once for the session and shared by every
           # worker and every test that moves PORTRL_CACHE to a folder of its own (a build is renamed into place)
           "PORTRL_KERNEL_CACHE": os.path.join(base, "kernels")}
    env.update({var: os.path.join(base, sub) for var, sub in CACHE_DIRS.items()})
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        token = Path(base) / "ray" / "auth_token"
        if not token.is_file():
            token.parent.mkdir(parents=True, exist_ok=True)
            tmp = token.with_name(f"auth_token.{os.getpid()}")
            tmp.write_text(secrets.token_hex(32))
            os.replace(tmp, token)  # two xdist workers may write it at once: each writes a whole file
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    return env


def outputs_state(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder/outputs`` (relative to ``folder``) with its size and modification time in ns;
    empty when there is no such folder. Two states that differ mean something was created, changed or removed."""
    root = Path(folder) / "outputs"
    state: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return state
    state["outputs"] = (0, root.stat().st_mtime_ns)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:  # removed while walking
                continue
            state[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return state


def outputs_changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What differs between two :func:`outputs_state` results, one ``"created|changed|removed PATH"`` each."""
    return ([f"created {p}" for p in sorted(after.keys() - before.keys())]
            + [f"changed {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
            + [f"removed {p}" for p in sorted(before.keys() - after.keys())])


class SigintWatch:
    """Counts the SIGINTs that portrl's run handler (portrl.trainer.interrupts.StopSignals) receives in this
    process: :meth:`install` wraps the handler once for the session; :meth:`take` returns whether one arrived
    since the last call, and clears it."""

    def __init__(self) -> None:
        self.count = 0
        self._seen = 0

    def install(self) -> None:
        from portrl.trainer import interrupts

        original = interrupts.StopSignals._handle
        if getattr(original, "_sigint_watch", None) is not None:
            return
        watch = self

        def _handle(stop, signum, frame):  # the same signature and behaviour, after counting
            if signum == signal.SIGINT:
                watch.count += 1
            return original(stop, signum, frame)

        _handle._sigint_watch = watch  # type: ignore[attr-defined]
        interrupts.StopSignals._handle = _handle  # type: ignore[method-assign]

    def take(self) -> bool:
        arrived, self._seen = self.count > self._seen, self.count
        return arrived


def end_child_sessions() -> list[int]:
    """SIGKILL the process group of every child of this process that leads a group other than this process's (a
    test's run started with ``start_new_session=True``, which a Ctrl-C in the terminal does not reach). Returns
    the groups ended. Linux only (it reads /proc); elsewhere it ends nothing."""
    me, mine, ended = os.getpid(), os.getpgrp(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        pid, ppid, pgrp = int(stat.parent.name), int(fields[1]), int(fields[2])
        if ppid == me and pgrp == pid and pgrp != mine:
            try:
                os.killpg(pgrp, signal.SIGKILL)
                ended.append(pgrp)
            except OSError:
                pass
    return ended
