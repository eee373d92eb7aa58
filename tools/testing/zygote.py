"""A warm interpreter that forks the test suite's run workers (a test aid, not shipped).

Most of a short test run is its worker's start-up: a new interpreter imports torch and
transformers (about 8 CPU s on the CI machine class) before its first stage, and the
chaos tests start 18 of them per case. This server imports those packages once and forks
a worker for each request. It imports the rftpipe modules every run imports too
(`PRELOAD_OWN`, from the checkout the tests run, the files a new interpreter would read,
another 0.5 CPU s a run), but not the worker's module: the fork runs `rftpipe.run.worker`
as `__main__`, as `python -m` does.

    python -m tools.testing.zygote serve SOCKET       # tests/conftest.py: one a pytest
    python -m tools.testing.zygote serve SOCKET vllm  # ...importing vLLM's engine too
    python -m tools.testing.zygote MODULE ARGS...     # the stand-in for `python -m MODULE`
    python -m tools.testing.zygote SCRIPT ARGS...     # ...for `python SCRIPT` (a *_worker.py)

(`EXTRAS` names what `serve SOCKET NAME` imports besides `PRELOAD`.)

`jobs.submit --cluster local` starts each rank through the stand-in when
RFTPIPE_WORKER_VIA=tools.testing.zygote (tests/conftest.py sets it), and so does
`tests/helpers.launch_ranks` its rank scripts. The stand-in asks the server
named by RFTPIPE_ZYGOTE for a fork and then is that process for its launcher: it passes
its stdin, stdout and stderr, forwards the signals it gets, and exits as the worker did
(the same code, or killed by the same signal); a worker whose stand-in dies (the launcher
killed its process group) SIGKILLs itself. The server forks only a request whose
environment and directory equal its own but for the per-launch variables of
`PER_LAUNCH` (and an OMP_NUM_THREADS the server was started without, which the fork sets
with `torch.set_num_threads`): any other difference could change what the imports did (a
PYTHONPATH that shadows a package, ATen's kernel choice), and the stand-in then execs the
module in a new interpreter, as without it. So does a stand-in that finds no server.

What differs from a new interpreter: the worker's process title is the server's, its
Python hash seed is the server's (shared by every worker it forks), and the processes it
leaves behind are the server's to reap and kill (the worker's session is killed when it
exits), not the launcher's. Tests of those are run without it (RFTPIPE_WORKER_VIA="").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

ENV = "RFTPIPE_ZYGOTE"
#: Variables a launch sets for each rank, or a test for one run, that nothing the server
#: imports reads at import time: they may differ from the server's environment.
PER_LAUNCH = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTEST_CURRENT_TEST",
        "COLUMNS",  # the terminal's size, read when something formats for it
        "LINES",
        # Set by `import deepspeed` in a test's own process; torch reads it when asked
        # whether CUDA is available, not at import.
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        # Read when a request is made (the reward tests' local servers bypass any proxy).
        "NO_PROXY",
        "no_proxy",
    }
)
#: rftpipe's own variables (the rendezvous file, a fault point, a reward server's token) may
#: differ too: rftpipe reads none at import (tests/test_zygote.py checks), so what the
#: server imported of it does not depend on them.
OWN_PREFIX = "RFTPIPE_"
#: A variable named with one of these prefixes may differ while the server has not imported
#: the package that reads it: vLLM's, outside the vLLM lane.
UNIMPORTED_PREFIXES = {"VLLM_": "vllm"}
#: What a run worker imports that costs seconds before its first stage, or tenths of one
#: later, in every run (CPU s after the rest, 2026-11-29): TensorBoard's writer (0.1) at
#: its start, aiohttp (0.2) with the agents stage's endpoint, and DeepSpeed (0.45) at the
#: export, where transformers' `save_pretrained` asks accelerate whether the model is
#: wrapped in a DeepSpeed engine.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "pyarrow",
    "pyarrow.parquet",
    "pyarrow.dataset",
    "pandas",
    "numpy",
    "yaml",
    "safetensors.torch",
    "torch.utils.tensorboard",
    "aiohttp",
    "deepspeed",
)
#: The rftpipe modules a run worker imports (`rftpipe.run.worker`'s lazy imports, and
#: through them the stages, the engines' base and the storage).
PRELOAD_OWN = (
    "rftpipe.checkpoint.folder",
    "rftpipe.config.loader",
    "rftpipe.dist",
    "rftpipe.events",
    "rftpipe.run.generator",
    "rftpipe.run.handoff",
    "rftpipe.run.loop",
    "rftpipe.run.placement",
    "rftpipe.run.preemption",
    "rftpipe.storage.fresh_start",
)
#: What `serve SOCKET NAME` imports besides `PRELOAD`, by NAME. vLLM's package imports
#: little: `vllm.LLM`'s first use imports 1850 more modules (4.1 CPU s on the machine of
#: 2026-11-29) and the engine's start 713 (its CPU worker, model runner, attention backend
#: and the Llama model), so the lane's runs would still import them each.
EXTRAS = {
    "vllm": (
        "vllm",
        "vllm.entrypoints.llm",
        "vllm.v1.worker.cpu_worker",
        "vllm.v1.worker.cpu_model_runner",
        "vllm.v1.attention.backends.cpu_attn",
        "vllm.model_executor.models.llama",
    ),
}
#: The variables the worker sets, if unset, before it imports transformers
#: (`rftpipe.run.worker.setup_logging`), which transformers and huggingface_hub read at
#: import: the server sets them before its imports (tests/test_zygote.py checks the two
#: lists agree).
WORKER_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
#: What the server forks by module: a run's ranks, and the launcher that starts them
#: (`tests/helpers.submit`), which imports none of the packages it preloads but for the
#: 0.3 CPU s of its own modules a new interpreter compiles and imports.
_MODULES = frozenset({"rftpipe.run.worker", "jobs.submit"})
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_MAX = 1 << 20


def _entries(pythonpath: str | None) -> list[str]:
    return [os.path.abspath(p) for p in (pythonpath or "").split(os.pathsep) if p]


def _shadows(entry: str) -> str | None:
    """A module already imported here that `entry`, put on the path, could replace."""
    try:
        names = os.listdir(entry)
    except OSError:
        return None
    for name in names:
        top = name.split(".", 1)[0]
        if top in sys.modules:
            return os.path.join(entry, name)
    return None


def _may_differ(key: str) -> bool:
    """Whether a launch's `key` may differ from the server's: nothing the server imported
    read it (PYTHONPATH is checked apart, entry by entry)."""
    if key in PER_LAUNCH or key == "PYTHONPATH" or key.startswith(OWN_PREFIX):
        return True
    return any(key.startswith(p) and m not in sys.modules for p, m in UNIMPORTED_PREFIXES.items())


def _refusal(req: dict, env: dict[str, str], added: dict[str, str], cwd: str) -> str | None:
    """Why `req` cannot be forked from this server (started in `cwd` with `env`, to which
    its imports `added` variables), or None."""
    if "script" in req:
        script = os.path.realpath(req["script"])
        if not (script.startswith(os.path.join(cwd, "")) and script.endswith("_worker.py")):
            return f"script {req['script']!r} is not a rank script of this checkout"
    elif req.get("module") not in _MODULES:
        return f"module {req.get('module')!r}"
    if req.get("cwd") != cwd:
        return "another working directory"
    theirs = req.get("env", {})
    differ = {k for k in set(theirs) | set(env) if theirs.get(k) != env.get(k)}
    # ...where a variable the imports set here has the value they set (the client's own
    # process imported the same packages) or is absent (the fork inherits it).
    differ = {k for k in differ if k not in added or theirs[k] != added[k]}
    differ = {k for k in differ if not _may_differ(k)}
    # A thread count the server did not start with is set in the fork (`_child`).
    if "OMP_NUM_THREADS" not in env and theirs.get("OMP_NUM_THREADS", "x").isdigit():
        differ.discard("OMP_NUM_THREADS")
    if differ:
        return f"environment differs in {sorted(differ)}"
    # A PYTHONPATH of its own (a test's reward functions, environments) is taken when no
    # entry holds a module the server imported: a shadow package stands in for a missing one.
    ours = {cwd, *_entries(env.get("PYTHONPATH"))}
    for entry in set(_entries(theirs.get("PYTHONPATH"))) - ours:
        if shadow := _shadows(entry):
            return f"PYTHONPATH entry {shadow} shadows an imported module"
    return None


def _sys_path(first: str, pythonpath: str | None, base: list[str]) -> list[str]:
    """The `sys.path` of a new interpreter with this PYTHONPATH: `first` (the directory for
    `python -m`, the script's own for `python SCRIPT`), the entries, then the interpreter's
    own (`base`, the server's without its directory and PYTHONPATH entries)."""
    return [first, *_entries(pythonpath), *base]


def _child(
    conn: socket.socket, others: list[socket.socket], fds: list[int], req: dict, rng: object
) -> None:
    """In the fork: become the process `python -m MODULE ARGS` (or `python SCRIPT ARGS`)
    would have been."""
    import random
    import runpy
    import threading

    code: object = 1
    try:
        for other in others:  # the listener and the other workers' connections
            other.close()
        os.setsid()  # its own session: what it leaves behind is killed with it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(req["env"])
        script = req.get("script")
        first = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
        sys.path[:] = _sys_path(first, req["env"].get("PYTHONPATH"), req["base_path"])
        # A new interpreter's generators: Python's and NumPy's seeded from the OS, torch's
        # default one as it was right after `import torch`.
        random.seed()
        import numpy
        import torch

        numpy.random.seed()
        torch.set_rng_state(rng)
        if "OMP_NUM_THREADS" in req["env"]:  # read by OpenMP and torch when torch loads
            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))

        def die_with_stand_in() -> None:
            while True:
                try:
                    if not conn.recv(16):
                        break
                except InterruptedError:
                    continue
                except OSError:
                    break
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die_with_stand_in, daemon=True).start()
        if script:
            sys.argv = [script, *req["args"]]
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = [req["module"], *req["args"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)
            code = 1
        os._exit(code)


def _kill_session(sid: int) -> None:
    """SIGKILL what a finished worker left in its session (it was the session's leader)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat, the session id
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def start_server(
    path: str, extras: Sequence[str] = (), *, wait_s: float, **popen: Any
) -> subprocess.Popen[bytes]:
    """Start `serve` on `path` from this checkout and wait until it accepts, it has died, or
    `wait_s` has passed (a launch before then starts a new interpreter)."""
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "tools.testing.zygote", "serve", path, *extras]
    server = subprocess.Popen(cmd, cwd=root, **popen)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return server


@dataclass(frozen=True)
class _Warm:
    """What the server's forks start from: the environment and directory it was started
    with, what its imports `added` to that environment, the `sys.path` entries a new
    interpreter has of its own (`base_path`), and torch's generator state right after
    `import torch`."""

    env: dict[str, str]
    cwd: str
    added: dict[str, str]
    base_path: list[str]
    rng: Any


def _warm_up(extras: Sequence[str]) -> _Warm:
    """Import `PRELOAD`, `EXTRAS[name]` for each name of `extras` and `PRELOAD_OWN` (with
    `WORKER_ENV` set first), and become the subreaper of what the forks leave behind."""
    import importlib

    env, cwd = dict(os.environ), os.getcwd()
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    import torch

    rng = torch.get_rng_state()
    for name in (*PRELOAD, *(m for extra in extras for m in EXTRAS[extra]), *PRELOAD_OWN):
        importlib.import_module(name)
    transformers = sys.modules["transformers"]
    for attr in ("AutoModelForCausalLM", "AutoTokenizer", "DynamicCache", "GenerationConfig"):
        getattr(transformers, attr)  # lazy attributes: import the modules behind them now
    # A process's first `from_pretrained` builds transformers' table of checkpoint renamings
    # (about 670 regular expressions, 0.09 CPU s), the same for every process and kept for
    # its life: built here, every fork has it.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # What the imports put in the environment (DeepSpeed's TORCHINDUCTOR_CACHE_DIR) a new
    # interpreter's imports would put there too.
    added = {k: v for k, v in os.environ.items() if k not in env}
    # sys.path less what `python -m` put first: the directory, then PYTHONPATH's entries.
    own = {cwd, *_entries(env.get("PYTHONPATH"))}
    base_path = [p for p in sys.path if os.path.abspath(p) not in own]
    return _Warm(env=env, cwd=cwd, added=added, base_path=base_path, rng=rng)


def _answer(
    conn: socket.socket,
    listener: socket.socket,
    live: dict[int, socket.socket],
    warm: _Warm,
    log: TextIO,
) -> None:
    """Answer one request on `conn`: refuse it (and close `conn`), or fork its worker and
    keep `conn` in `live` under the worker's pid until it has ended."""
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX, 3)
        req = json.loads(data)
        why = _refusal(req, warm.env, warm.added, warm.cwd) if len(fds) == 3 else "no stdio"
        if why:
            conn.send(json.dumps({"refused": why}).encode())
            what = req.get("module") or req.get("script")
            print(f"refused {what}: {why}", file=log)
            conn.close()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                req["env"] = {**warm.added, **req["env"]}
                req["base_path"] = warm.base_path
                _child(conn, [listener, *live.values()], fds, req, warm.rng)
            live[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())
            print(f"forked {pid}", file=log)
    except (OSError, ValueError) as exc:
        print(f"failed request: {exc!r}", file=log)
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def _reap(live: dict[int, socket.socket]) -> None:
    """Reap the workers that have ended (killing what each left in its session, and sending
    its stand-in its status) and the orphans this subreaper adopted."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = live.pop(pid, None)
        if conn is not None:
            _kill_session(pid)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"status": status}).encode())
            conn.close()


def serve(path: str, extras: Sequence[str] = ()) -> None:
    """Serve forks on the socket `path`, having imported `PRELOAD` and `EXTRAS[name]` for
    each name of `extras`, until the process that started the server has ended."""
    import select

    parent = os.getppid()
    warm = _warm_up(extras)
    with open(f"{path}.log", "a", buffering=1) as log:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(f"{path}.tmp")
        listener.listen(64)
        os.rename(f"{path}.tmp", path)  # clients see the socket once it accepts
        live: dict[int, socket.socket] = {}
        while os.getppid() == parent:
            ready, _, _ = select.select([listener], [], [], 0.05)
            if ready:
                _answer(listener.accept()[0], listener, live, warm, log)
            _reap(live)
        for pid in live:  # the test session ended: so do its workers
            _kill_session(pid)


def stand_in(target: str, args: list[str]) -> None:
    """Be `python -m target args` (or `python target args`, a script's path) through the
    server, or exec it where the server says no."""
    script = target.endswith(".py")
    req = {"script" if script else "module": target, "args": args}
    req |= {"env": dict(os.environ), "cwd": os.getcwd()}
    reply: dict = {"refused": "no server"}
    path = os.environ.get(ENV)
    if path:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
            reply = json.loads(conn.recv(_MAX) or b'{"refused": "server closed"}')
        except OSError:
            pass
    if "pid" not in reply:
        os.execv(sys.executable, [sys.executable, *([] if script else ["-m"]), target, *args])
    pid = reply["pid"]

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    data = conn.recv(_MAX)
    if not data:  # the server died under its worker
        os.kill(pid, signal.SIGKILL)
        os._exit(1)
    status = json.loads(data)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    usage = (
        "usage: python -m tools.testing.zygote "
        f"serve SOCKET [{'|'.join(EXTRAS)}] | MODULE|SCRIPT ARGS..."
    )
    if argv[:1] == ["serve"]:
        # An unknown extra is the caller's typo, not a module to run as a worker.
        if len(argv) < 2 or not set(argv[2:]) <= set(EXTRAS):
            raise SystemExit(usage)
        serve(argv[1], argv[2:])
    elif argv:
        stand_in(argv[0], argv[1:])
    else:
        raise SystemExit(usage)


if __name__ == "__main__":
    main(sys.argv[1:])
