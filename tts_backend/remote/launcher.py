"""`voxgate worker --gpus 0,1,2,3` (or `all`): one worker process per GPU on one host.

Each child is the same `voxgate worker` command without `--gpus`, with CUDA_VISIBLE_DEVICES set to its GPU
(so inside it the GPU is `cuda:0`), and with the ports counted up from the given ones: `--listen
tcp://0.0.0.0:7100 --health-port 9400` makes GPU i listen on 7100+i with its health port on 9400+i (its
--advertise and --reachable-at ports are counted up alike). Its worker id gets `-gpuI` (default ids already
differ by port). A Unix socket gets `.I` after its path.

SIGTERM and SIGINT are passed to every child, so each drains as it would alone; the launcher exits when
all have, with the worst exit status. A child that dies is not restarted here: that is the job of what
runs the launcher (systemd, Kubernetes), and the pools of the gateways move its sessions meanwhile. A
launcher that dies without passing a signal on (SIGKILL, an OOM kill) takes its children with it: on Linux
each asks the kernel for SIGTERM when its parent ends (PR_SET_PDEATHSIG), and drains as on any SIGTERM,
instead of serving on unsupervised with its GPU and ports held.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys

from .connection import WorkerAddress, default_worker_id, listen_address

log = logging.getLogger(__name__)

LAUNCHER_PID = "VOXGATE_WORKER_LAUNCHER_PID"  # set in each child's environment: the launcher's process id
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_launcher() -> None:
    """In a child of the launcher: be sent SIGTERM when the launcher ends. Outside Linux this is a no-op
    (logged once)."""
    launcher = os.environ.pop(LAUNCHER_PID, None)
    if launcher is None:
        return
    if not sys.platform.startswith("linux"):
        log.warning("this platform cannot tie a worker to its launcher: the workers outlive a killed launcher")
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker outlives a killed launcher",
                    ctypes.get_errno())
    # The launcher may have died before the call above, when nothing would tell us any more.
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)


def gpu_list(spec: str) -> list[str]:
    """'all' (every GPU nvidia-smi lists) or a comma-separated list of indices."""
    if spec.strip() == "all":
        try:
            listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise SystemExit(f"voxgate worker --gpus all: cannot list the GPUs with nvidia-smi ({exc})") from None
        gpus = [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]
        if not gpus:
            raise SystemExit("voxgate worker --gpus all: nvidia-smi lists no GPU")
        return gpus
    gpus = [part.strip() for part in spec.split(",") if part.strip()]
    if not gpus or any(not g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise SystemExit(f"voxgate worker --gpus: give 'all' or distinct GPU indices like 0,1,2 (got {spec!r})")
    return gpus


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv with each of `flags` and its value removed (as `--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def child_commands(args: argparse.Namespace, argv: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    listen = listen_address(args.listen, args.socket)
    base = _without(argv, "--gpus", "--listen", "--socket", "--worker-id", "--health-port", "--advertise",
                    "--reachable-at")
    advertise = WorkerAddress.parse(args.advertise) if args.advertise else None
    reachable_at = [WorkerAddress.parse(item.strip()) for value in args.reachable_at for item in value.split(",")
                    if item.strip()]
    commands = []
    for i, gpu in enumerate(gpu_list(args.gpus)):
        if listen.scheme == "unix":
            own = WorkerAddress("unix", path=f"{listen.path}.{i}")
        else:
            if listen.port == 0:
                raise SystemExit("voxgate worker --gpus: give --listen a fixed port (GPU i takes PORT+i)")
            own = listen.with_port(listen.port + i)
        command = [sys.executable, "-m", "tts_backend.remote.worker", *base, "--listen", str(own),
                   "--worker-id", f"{args.worker_id or default_worker_id(listen)}-gpu{gpu}"]
        if advertise is not None:
            command += ["--advertise", str(advertise.with_port(advertise.port + i) if advertise.is_network else advertise)]
        for address in reachable_at:  # counted up as the listen addresses are
            nth = address.with_port(address.port + i) if address.is_network else WorkerAddress(
                "unix", path=f"{address.path}.{i}")
            command += ["--reachable-at", str(nth)]
        if args.health_port:
            command += ["--health-port", str(args.health_port + i)]
        commands.append((command, {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, LAUNCHER_PID: str(os.getpid()),
                                   "VOXGATE_WORKER_REACHABLE_AT": ""}))  # given per GPU above
    return commands


def run_per_gpu(args: argparse.Namespace, argv: list[str]) -> int:
    children = [subprocess.Popen(command, env=env) for command, env in child_commands(args, argv or sys.argv[1:])]

    def forward(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(abs(child.wait()) for child in children)
