"""A warm starter of `hetero` commands for the tests: imported once, forked for each command (tests/procs.py).

A cold `hetero run` of the tiny model spends about 6 of its 10 s importing torch, transformers and matplotlib
and tearing the interpreter down; the process tests start about a hundred of them. This server imports what
`hetero run` and `hetero worker` import, then forks one child per request. The child takes the request's
working directory, environment, argv and standard streams (passed as descriptors), shows the request's command
line in /proc/PID/cmdline (the tests find leftover processes by it), and runs ``hetero.cli.main`` as the console
script would. The server reaps each child and answers its exit code as Popen reports it (-N: killed by signal N).

    python -P tests/warm_server.py SOCKET PADDING

Protocol on the Unix socket, one connection per command: the client sends a 4-byte length, then a JSON object
``{"argv", "cwd", "env", "nofile"}`` (nofile: a soft limit on open files, or null), with its stdin, stdout and stderr descriptors attached to the first message; the
server answers ``PID\\n`` and later ``EXITCODE\\n``. The server exits when its parent does. Tests that are
about how a process starts (a folder named hetero in the working directory, another interpreter, ssh) start
the real console script instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback

PRELOAD = ("hetero.cli", "hetero.runtime.cli", "hetero.runtime.run.data",
           "hetero.runtime.stage.process", "transformers.models.llama.modeling_llama", "matplotlib.pyplot")


def preload() -> None:
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a module that moved: the child imports what it needs itself, only slower
    from transformers import AutoTokenizer  # noqa: F401 (transformers' lazy module: this imports the tokenizers)


def show_command_line(argv: list[str]) -> None:
    """Write ``argv`` over this process's own argument strings, so /proc/self/cmdline shows it (the server was
    started with room to spare: PADDING)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of proc(5))
    text = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(text.ljust(end - start, b"\0"))


def child(request: dict, fds: list[int]) -> None:
    """Become the requested command; never returns."""
    code: int = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        if request.get("nofile") is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (request["nofile"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)  # Python ignores SIGPIPE
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1, errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
        sys.argv = list(request["argv"])
        show_command_line(sys.argv)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # numpy's global generator is not reseeded on fork (random's is)
        from hetero.cli import main

        try:
            result = main(sys.argv[1:])
        except SystemExit as exc:
            result = exc.code
        if isinstance(result, int):
            code = result
        elif result is None:
            code = 0
        else:
            print(result, file=sys.stderr)
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then die of SIGINT
        traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return json.loads(data[4:]), list(fds)


def serve(path: str) -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.02)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test went away
                conn.close()


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
