"""Bring up a real, private Slurm cluster on this one machine (Debian, root, no systemd).

    python -m tools.cluster.slurm_local up [--nodes N] [--user-signal|--no-user-signal]
                                           [--grace-time S]
    python -m tools.cluster.slurm_local down
    python -m tools.cluster.slurm_local status
    python -m tools.cluster.slurm_local env  # prints: export SLURM_CONF=...

Everything lives in its own state directory (default /tmp/rftpipe-slurm, or $RFTPIPE_SLURM_DIR,
or --dir): slurm.conf, munge key and socket, StateSaveLocation, spool, pid files and logs.
/etc/slurm and /etc/munge are never read or written, and the daemons listen on their own ports
(slurmctld 17817, slurmd 17901..), so a system Slurm on the default 6817/6818 is left alone.

N emulated nodes (rfnode1..rfnodeN, all NodeAddr=127.0.0.1, each slurmd on its own port) share
this host; each claims every core, so a one-task-per-node job fits on every node at once. No
/etc/hosts entries are needed: clients reach nodes through NodeAddr. Partitions: `low`
(default, PriorityTier=1, preempted by requeue) and `high` (PriorityTier=10).

`up` is idempotent. Flags that are not given keep the running cluster's value (fresh default:
2 nodes, no user signal, GraceTime 0). Changing --user-signal or --grace-time on a running
cluster rewrites slurm.conf and runs `scontrol reconfigure`; changing --nodes restarts the
daemons. Missing packages are installed with apt-get (slurm-wlm, munge).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = "/tmp/rftpipe-slurm"
# Away from the default 6817/6818 so a system Slurm (or a second checkout) does not collide.
CTLD_PORT = 17817
SLURMD_PORT_BASE = 17900
NODE_PREFIX = "rfnode"
CLUSTER_NAME = "rftpipe"
DEFAULT_NODES = 2
DEFAULT_GRACE_TIME = 0
# Cap RealMemory so the config stays identical across roomy machines; slurmd drains a node
# whose RealMemory exceeds what it finds, so it is also capped by the machine's memory.
MAX_REAL_MEMORY_MB = 8000
HEALTHY_STATES = {"idle", "mixed", "allocated", "completing"}
SEARCH_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


class ClusterError(RuntimeError):
    """A one-line failure message plus optional detail (log tails) printed before it."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class Settings:
    nodes: int = DEFAULT_NODES
    user_signal: bool = False
    grace_time: int = DEFAULT_GRACE_TIME


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def settings_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def munge(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge / "munge.socket"

    @property
    def munge_pid(self) -> Path:
        return self.munge / "munged.pid"

    @property
    def ctld_pid(self) -> Path:
        return self.root / "slurmctld.pid"

    def slurmd_pid(self, node: str) -> Path:
        return self.root / f"slurmd-{node}.pid"

    def slurmd_log(self, node: str) -> Path:
        return self.log / f"slurmd-{node}.log"


def state_dir(override: str | os.PathLike[str] | None = None) -> Path:
    return Path(override or os.environ.get("RFTPIPE_SLURM_DIR") or DEFAULT_DIR).resolve()


def node_names(n: int) -> list[str]:
    return [f"{NODE_PREFIX}{i}" for i in range(1, n + 1)]


def cluster_env(directory: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """os.environ with SLURM_CONF pointing at this cluster, for running slurm commands."""
    env = {
        k: v
        for k, v in os.environ.items()
        # Inherited job variables (when this runs inside a real Slurm job) would make
        # srun/sbatch attach to that job's allocation instead of the local cluster.
        if not (k.startswith("SLURM_") or k.startswith("SBATCH_") or k.startswith("SRUN_"))
    }
    env["SLURM_CONF"] = str(state_dir(directory) / "slurm.conf")
    # Daemons and scontrol live in /usr/sbin, which a non-login PATH may lack.
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(path + [p for p in SEARCH_PATH if p not in path])
    return env


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SEARCH_PATH))


def _binary(name: str) -> str:
    path = _which(name)
    if path is None:
        raise ClusterError(f"{name} not found after install")
    return path


@contextlib.contextmanager
def _locked(layout: Layout) -> Iterator[None]:
    """Serialise up/down: parallel test workers may all call ensure_up() at once."""
    layout.root.mkdir(parents=True, exist_ok=True)
    with open(layout.root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_installed() -> None:
    needed = ("slurmctld", "slurmd", "munged", "scontrol", "sinfo", "srun", "sbatch")
    missing = [b for b in needed if _which(b) is None]
    if not missing:
        return
    apt = _which("apt-get")
    if apt is None:
        raise ClusterError(f"missing {', '.join(missing)} and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = [apt, "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
    print(f"slurm_local: missing {', '.join(missing)}; running: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        # A bare image often has no package lists yet; refresh once and retry.
        print("slurm_local: install failed; running apt-get update and retrying", flush=True)
        subprocess.run([apt, "update"], env=env, capture_output=True, text=True, check=False)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise ClusterError("apt-get install slurm-wlm munge failed", _tail_text(res.stderr))
    print(f"slurm_local: installed slurm-wlm and munge in {time.monotonic() - t0:.1f}s")


def _tail_text(text: str, n: int = 20) -> str:
    return "\n".join(text.splitlines()[-n:])


def _real_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) // 1024
                # Leave headroom: slurmd drains a node that reports less than RealMemory.
                return max(1, min(MAX_REAL_MEMORY_MB, total - 512))
    return 1000


def _hardware() -> str:
    """CPU topology for a NodeName line, as `slurmd -C` detects it on this host.

    Declaring the detected sockets/cores (not just CPUs=) keeps slurmd from logging
    "Node configuration differs from hardware"; every emulated node claims all of it.
    """
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    slurmd = _which("slurmd")
    if slurmd:
        res = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30)
        found = dict(re.findall(r"(\w+)=(\S+)", res.stdout.splitlines()[0] if res.stdout else ""))
        if res.returncode == 0 and all(k in found for k in keys):
            return " ".join(f"{k}={found[k]}" for k in keys)
    return f"CPUs={os.cpu_count() or 1}"


def render_conf(layout: Layout, settings: Settings) -> str:
    names = node_names(settings.nodes)
    hw = _hardware()
    mem = _real_memory_mb()
    host = socket.gethostname().split(".")[0]
    ctld_params = "SlurmctldParameters=preempt_send_user_signal\n" if settings.user_signal else ""
    node_lines = "".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={SLURMD_PORT_BASE + i} "
        f"{hw} RealMemory={mem} State=UNKNOWN\n"
        for i, n in enumerate(names, start=1)
    )
    nodelist = f"{NODE_PREFIX}[1-{settings.nodes}]"
    return f"""\
# Generated by tools/cluster/slurm_local.py; rewritten on every `up`. Do not edit.
ClusterName={CLUSTER_NAME}
# slurmctld only starts where gethostname() matches SlurmctldHost.
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT_BASE}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Our own munged socket; cred_expire=10 so requeued jobs become eligible again quickly.
AuthInfo=socket={layout.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={layout.state}
SlurmdSpoolDir={layout.spool}/%n
SlurmctldPidFile={layout.ctld_pid}
SlurmdPidFile={layout.root}/slurmd-%n.pid
SlurmctldLogFile={layout.log}/slurmctld.log
SlurmdLogFile={layout.log}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: track processes by parent pid, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Nodes are emulated: trust the config rather than what each slurmd detects.
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# A requeued job becomes eligible when its BeginTime passes, which no event announces: the
# periodic passes (60 s / 30 s by default) would then leave it pending for that long.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=5
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
{ctld_params}
{node_lines}
PartitionName=low Nodes={nodelist} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={settings.grace_time} MaxTime=INFINITE State=UP
PartitionName=high Nodes={nodelist} Default=NO PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
"""


def _load_settings(layout: Layout) -> Settings | None:
    try:
        raw = json.loads(layout.settings_file.read_text())
        return Settings(int(raw["nodes"]), bool(raw["user_signal"]), int(raw["grace_time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _resolve_settings(
    layout: Layout, nodes: int | None, user_signal: bool | None, grace_time: int | None
) -> Settings:
    prev = _load_settings(layout) or Settings()
    return Settings(
        nodes=prev.nodes if nodes is None else nodes,
        user_signal=prev.user_signal if user_signal is None else user_signal,
        grace_time=prev.grace_time if grace_time is None else grace_time,
    )


# ---------------------------------------------------------------- processes


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _our_pid(pidfile: Path, binary: str, marker: str) -> int | None:
    """The pid in pidfile if it is alive and is `binary` started for this state dir.

    A stale pid file may name a recycled pid; checking the binary and our own config/socket
    path on its command line keeps us from signalling an unrelated process.
    """
    pid = _read_pid(pidfile)
    if pid is None:
        return None
    args = _cmdline(pid)
    if not args or Path(args[0]).name != binary or not any(marker in a for a in args):
        return None
    return pid


def _daemons(layout: Layout, nodes: list[str]) -> list[tuple[str, Path, str, str]]:
    """(label, pidfile, binary, marker) for every daemon this cluster runs."""
    conf = str(layout.conf)
    out = [
        ("munged", layout.munge_pid, "munged", str(layout.munge_socket)),
        ("slurmctld", layout.ctld_pid, "slurmctld", conf),
    ]
    out += [(f"slurmd {n}", layout.slurmd_pid(n), "slurmd", conf) for n in nodes]
    return out


def _run(
    cmd: list[str], layout: Layout, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        cmd, env=cluster_env(layout.root), capture_output=True, text=True, timeout=timeout
    )
    if check and res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise ClusterError(
            f"{Path(cmd[0]).name} failed (rc={res.returncode}): {msg[-1] if msg else ''}",
            _log_tails(layout),
        )
    return res


def _log_tails(layout: Layout, n: int = 15) -> str:
    parts = []
    logs = [layout.munge / "munged.log", layout.log / "slurmctld.log"]
    logs += sorted(layout.log.glob("slurmd-*.log"))
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            continue
        parts.append(f"--- {path} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(parts)


# ---------------------------------------------------------------- munge


def _prepare_dirs(layout: Layout, nodes: list[str]) -> pwd.struct_passwd:
    try:
        munge_user = pwd.getpwnam("munge")
    except KeyError as e:
        raise ClusterError("no 'munge' user; is the munge package installed?") from e
    # munged runs as the munge user and must traverse every parent of its socket and key.
    for parent in layout.root.parents:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            raise ClusterError(f"munge user cannot enter {parent} (needs o+x); pick another --dir")
    for d in (layout.root, layout.state, layout.spool, layout.log):
        d.mkdir(parents=True, exist_ok=True)
        # munged refuses to run under a group/world-writable directory (no sticky bit),
        # and walks the parents of its key and socket; keep ours 0755.
        d.chmod(0o755)
    for n in nodes:
        (layout.spool / n).mkdir(exist_ok=True)
    layout.munge.mkdir(exist_ok=True)
    os.chown(layout.munge, munge_user.pw_uid, munge_user.pw_gid)
    # Clients (slurm as root, but also any user's srun) need to reach the socket.
    layout.munge.chmod(0o755)
    return munge_user


def _ensure_munge_key(layout: Layout, munge_user: pwd.struct_passwd) -> None:
    key = layout.munge_key
    if not key.exists():
        mungekey = _which("mungekey")
        if mungekey:
            subprocess.run([mungekey, "--create", "--keyfile", str(key)], check=True)
        else:
            key.write_bytes(os.urandom(1024))
        print(f"slurm_local: created munge key {key}")
    os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
    key.chmod(0o400)


def _start_munged(layout: Layout, munge_user: pwd.struct_passwd) -> None:
    cmd = [
        _binary("munged"),
        # --force: a previous munged killed hard leaves its socket behind, and munged refuses
        # to start over a stale socket without it. We only get here when ours is not alive.
        "--force",
        f"--socket={layout.munge_socket}",
        f"--key-file={layout.munge_key}",
        f"--pid-file={layout.munge_pid}",
        f"--log-file={layout.munge / 'munged.log'}",
        f"--seed-file={layout.munge / 'munged.seed'}",
    ]
    print("slurm_local: starting munged", flush=True)
    # munged daemonizes itself; run() returns once the daemon has forked and is listening.
    res = subprocess.run(
        cmd,
        user=munge_user.pw_uid,
        group=munge_user.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        cwd=layout.munge,
    )
    if res.returncode != 0:
        err = res.stderr.strip().splitlines()
        raise ClusterError(
            f"munged failed to start: {err[-1] if err else 'rc=' + str(res.returncode)}",
            _log_tails(layout),
        )
    _check_munge(layout)


def _check_munge(layout: Layout) -> None:
    sock = f"--socket={layout.munge_socket}"
    cred = subprocess.run(
        [_binary("munge"), sock, "-n"], capture_output=True, text=True, timeout=10
    )
    ok = cred.returncode == 0 and (
        subprocess.run(
            [_binary("unmunge"), sock],
            input=cred.stdout,
            capture_output=True,
            text=True,
            timeout=10,
        ).returncode
        == 0
    )
    if not ok:
        raise ClusterError(
            f"munge round trip via {layout.munge_socket} failed: {cred.stderr.strip()}",
            _log_tails(layout),
        )


# ---------------------------------------------------------------- slurm


def _start_slurmctld(layout: Layout) -> None:
    print("slurm_local: starting slurmctld", flush=True)
    # -f on the command line (besides SLURM_CONF) also tags the process as ours for `down`.
    _run([_binary("slurmctld"), "-f", str(layout.conf)], layout)


def _start_slurmd(layout: Layout, node: str) -> None:
    print(f"slurm_local: starting slurmd {node}", flush=True)
    _run([_binary("slurmd"), "-f", str(layout.conf), "-N", node], layout)


def _ping(layout: Layout) -> bool:
    res = _run(["scontrol", "ping"], layout, check=False, timeout=20)
    return res.returncode == 0 and " is UP" in res.stdout


def _node_states(layout: Layout) -> dict[str, str]:
    res = _run(["sinfo", "-h", "-N", "-o", "%N %T"], layout, check=False, timeout=20)
    if res.returncode != 0:
        return {}
    states: dict[str, str] = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            # A node in two partitions is listed twice with the same state.
            states[parts[0]] = parts[1].lower()
    return states


def _healthy(layout: Layout, nodes: list[str]) -> bool:
    if not _ping(layout):
        return False
    states = _node_states(layout)
    return all(states.get(n) in HEALTHY_STATES for n in nodes)


def _wait_ready(layout: Layout, nodes: list[str], timeout: float) -> None:
    """Poll until slurmctld answers and every node is idle (or busy with jobs)."""
    deadline = time.monotonic() + timeout
    last_resume = 0.0
    dead_since: float | None = None
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        # A daemon that died after forking (bad port, bad config) will never register: fail
        # early with its log instead of waiting out the timeout. Allow a few seconds first,
        # since a freshly forked daemon writes its pid file only after it has started.
        dead = [label for label, pid in _alive(layout, nodes).items() if pid is None]
        if not dead:
            dead_since = None
        elif dead_since is None:
            dead_since = time.monotonic()
        elif time.monotonic() - dead_since > 3:
            raise ClusterError(f"{', '.join(dead)} exited during startup", _log_tails(layout))
        if _ping(layout):
            states = _node_states(layout)
            if all(states.get(n) in HEALTHY_STATES for n in nodes):
                return
            # A node left down by a timeout while slurmd was stopped stays down until
            # resumed; '*' means it has not registered yet. A drained node is not resumed:
            # Slurm drains one whose job outlived SIGKILL, which a real cluster's admin must
            # see (the tests assert that none does).
            stuck = [
                n
                for n in nodes
                if (s := states.get(n, "")) and "*" not in s and s.startswith("down")
            ]
            drained = [n for n in nodes if states.get(n, "").startswith("drain")]
            if drained:
                raise ClusterError(
                    f"{', '.join(drained)} drained (a job outlived SIGKILL?): "
                    f"scontrol update nodename={','.join(drained)} state=resume",
                    _log_tails(layout),
                )
            if stuck and time.monotonic() - last_resume > 5:
                print(f"slurm_local: resuming {','.join(stuck)}", flush=True)
                _run(
                    ["scontrol", "update", f"nodename={','.join(stuck)}", "state=resume"],
                    layout,
                    check=False,
                )
                last_resume = time.monotonic()
        time.sleep(0.5)
    raise ClusterError(
        f"cluster not ready after {timeout:.0f}s (node states: {states or 'slurmctld not answering'})",
        _log_tails(layout),
    )


def _reconfigure(layout: Layout, settings: Settings) -> None:
    print("slurm_local: slurm.conf changed; running scontrol reconfigure", flush=True)
    _run(["scontrol", "reconfigure"], layout)
    # SlurmctldParameters are re-read on reconfigure (slurmctld rechecks them whenever the
    # config's last_update changes), so verify the controller really has the new value.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        res = _run(["scontrol", "show", "config"], layout, check=False)
        has_signal = "preempt_send_user_signal" in res.stdout
        if res.returncode == 0 and has_signal == settings.user_signal:
            return
        time.sleep(0.5)
    raise ClusterError("scontrol reconfigure did not apply SlurmctldParameters", _log_tails(layout))


def _alive(layout: Layout, nodes: list[str]) -> dict[str, int | None]:
    return {label: _our_pid(pf, b, m) for label, pf, b, m in _daemons(layout, nodes)}


def is_up(directory: str | os.PathLike[str] | None = None) -> bool:
    """True when every daemon of the cluster is alive and the nodes are usable."""
    layout = Layout(state_dir(directory))
    settings = _load_settings(layout)
    if settings is None or not layout.conf.exists():
        return False
    nodes = node_names(settings.nodes)
    return all(_alive(layout, nodes).values()) and _healthy(layout, nodes)


def up(
    directory: str | os.PathLike[str] | None = None,
    nodes: int | None = None,
    user_signal: bool | None = None,
    grace_time: int | None = None,
    timeout: float = 90,
) -> float:
    """Start (or reuse, or reconfigure) the cluster; returns the seconds it took."""
    t0 = time.monotonic()
    ensure_installed()
    layout = Layout(state_dir(directory))
    # AF_UNIX paths are limited to 108 bytes; munged's error for a longer one is cryptic.
    if len(str(layout.munge_socket)) > 100:
        raise ClusterError(f"state dir path too long for a unix socket: {layout.root}")
    with _locked(layout):
        return _up_locked(layout, t0, nodes, user_signal, grace_time, timeout)


def _up_locked(
    layout: Layout,
    t0: float,
    nodes: int | None,
    user_signal: bool | None,
    grace_time: int | None,
    timeout: float,
) -> float:
    prev = _load_settings(layout)
    settings = _resolve_settings(layout, nodes, user_signal, grace_time)
    if settings.nodes < 1:
        raise ClusterError("--nodes must be at least 1")
    names = node_names(settings.nodes)

    if (
        prev is not None
        and prev.nodes != settings.nodes
        and any(_alive(layout, node_names(prev.nodes)).values())
    ):
        # Slurm cannot add or drop nodes on reconfigure in 22.05: restart everything.
        print(f"slurm_local: node count {prev.nodes} -> {settings.nodes}; restarting", flush=True)
        _down_locked(layout)

    munge_user = _prepare_dirs(layout, names)
    text = render_conf(layout, settings)
    old = layout.conf.read_text() if layout.conf.exists() else None
    changed = old != text
    if changed:
        # Replaced whole: a job's `scontrol` reading it mid-write found it empty and failed
        # its requeue (test_preempted_four_times_at_known_stages, 2026-11-29).
        tmp = layout.conf.with_name(f".{layout.conf.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, layout.conf)
    layout.settings_file.write_text(json.dumps(settings.__dict__) + "\n")

    alive = _alive(layout, names)
    if all(alive.values()) and not changed and _healthy(layout, names):
        print(f"slurm_local: already up ({layout.conf})")
        return time.monotonic() - t0

    _ensure_munge_key(layout, munge_user)
    if not alive["munged"]:
        _start_munged(layout, munge_user)
    # Daemons that survived with the old file must be told to re-read it.
    needs_reconfigure = changed and any(v for k, v in alive.items() if k != "munged")
    if not alive["slurmctld"]:
        _start_slurmctld(layout)
    for n in names:
        if not alive[f"slurmd {n}"]:
            _start_slurmd(layout, n)
    if needs_reconfigure:
        _wait_ready(layout, names, timeout)
        _reconfigure(layout, settings)
    _wait_ready(layout, names, timeout)
    elapsed = time.monotonic() - t0
    print(
        f"slurm_local: up in {elapsed:.1f}s: {settings.nodes} nodes, "
        f"user_signal={settings.user_signal}, grace_time={settings.grace_time}; "
        f"export SLURM_CONF={layout.conf}"
    )
    return elapsed


def ensure_up(
    directory: str | os.PathLike[str] | None = None,
    nodes: int | None = None,
    user_signal: bool | None = None,
    grace_time: int | None = None,
) -> dict[str, str]:
    """For tests: make sure the cluster runs (a no-op when healthy); returns its env.

    Arguments left as None keep whatever the running cluster has, so a test that does not
    care about, say, user signals does not reconfigure a cluster another test set up.
    """
    up(directory, nodes=nodes, user_signal=user_signal, grace_time=grace_time)
    return cluster_env(directory)


def _stop(pid: int, label: str, timeout: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.2)
    print(f"slurm_local: {label} (pid {pid}) ignored SIGTERM; sending SIGKILL", flush=True)
    # Only reached for a pid we verified as ours; the daemon is wedged.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def down(directory: str | os.PathLike[str] | None = None, cancel_jobs: bool = True) -> None:
    """Stop the daemons this tool started (found via its pid files); keeps state and logs."""
    layout = Layout(state_dir(directory))
    if not layout.root.is_dir():
        print(f"slurm_local: nothing to stop in {layout.root}")
        return
    with _locked(layout):
        _down_locked(layout, cancel_jobs)


def _down_locked(layout: Layout, cancel_jobs: bool = True) -> None:
    settings = _load_settings(layout) or Settings()
    # Also look for slurmd pid files of other node counts the directory has seen.
    extra = sorted(p.name[len("slurmd-") : -len(".pid")] for p in layout.root.glob("slurmd-*.pid"))
    nodes = list(dict.fromkeys(node_names(settings.nodes) + extra))
    alive = _alive(layout, nodes)
    if cancel_jobs and alive.get("slurmctld") and alive.get("munged"):
        # Job steps run under slurmstepd, which outlives slurmd; cancel them so `down`
        # does not leave orphaned job processes behind.
        res = _run(["squeue", "-h", "-o", "%A"], layout, check=False, timeout=20)
        jobs = res.stdout.split() if res.returncode == 0 else []
        if jobs:
            print(f"slurm_local: cancelling {len(jobs)} job(s)", flush=True)
            _run(["scancel", *jobs], layout, check=False, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                res = _run(["squeue", "-h", "-t", "R,CG", "-o", "%A"], layout, check=False)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.5)
    # slurmd first (they report to slurmctld), munged last (everyone authenticates via it).
    order = [lbl for lbl in alive if lbl.startswith("slurmd")] + ["slurmctld", "munged"]
    stopped = 0
    for label in order:
        pid = alive.get(label)
        if pid:
            print(f"slurm_local: stopping {label} (pid {pid})", flush=True)
            _stop(pid, label)
            stopped += 1
    print(f"slurm_local: down ({stopped} daemon(s) stopped; logs kept in {layout.log})")


def status(directory: str | os.PathLike[str] | None = None) -> bool:
    layout = Layout(state_dir(directory))
    settings = _load_settings(layout)
    if settings is None:
        print(f"slurm_local: no cluster in {layout.root}")
        return False
    nodes = node_names(settings.nodes)
    alive = _alive(layout, nodes)
    for label, pid in alive.items():
        print(f"{label:<16} {'alive pid ' + str(pid) if pid else 'not running'}")
    print(
        f"settings: nodes={settings.nodes} user_signal={settings.user_signal} "
        f"grace_time={settings.grace_time}  SLURM_CONF={layout.conf}"
    )
    if alive["slurmctld"] and alive["munged"]:
        print(_run(["scontrol", "ping"], layout, check=False).stdout.strip())
        print(_run(["sinfo"], layout, check=False).stdout.rstrip())
    return all(alive.values()) and _healthy(layout, nodes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.cluster.slurm_local",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --dir is accepted before or after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        default=argparse.SUPPRESS,
        help=f"state directory (default $RFTPIPE_SLURM_DIR or {DEFAULT_DIR})",
    )
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True)
    pu = sub.add_parser("up", parents=[common], help="start the cluster (idempotent)")
    pu.add_argument("--nodes", type=int, default=None, help=f"emulated nodes ({DEFAULT_NODES})")
    pu.add_argument(
        "--user-signal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SlurmctldParameters=preempt_send_user_signal (default: keep current, else off)",
    )
    pu.add_argument("--grace-time", type=int, default=None, help="GraceTime of partition low")
    pu.add_argument("--timeout", type=float, default=90, help="seconds to wait for idle nodes")
    sub.add_parser(
        "down", parents=[common], help="stop the daemons this tool started; keep state and logs"
    )
    sub.add_parser("status", parents=[common], help="daemons alive and sinfo")
    sub.add_parser("env", parents=[common], help="print export SLURM_CONF=...")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            up(args.dir, args.nodes, args.user_signal, args.grace_time, args.timeout)
        elif args.cmd == "down":
            down(args.dir)
        elif args.cmd == "status":
            if not status(args.dir):
                print("slurm_local: error: cluster is not fully up", file=sys.stderr)
                return 1
        else:
            print(f"export SLURM_CONF={state_dir(args.dir) / 'slurm.conf'}")
    except ClusterError as e:
        if e.detail:
            print(e.detail, file=sys.stderr)
        print(f"slurm_local: error: {e}", file=sys.stderr)
        return 1
    except (OSError, subprocess.SubprocessError) as e:
        print(f"slurm_local: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
