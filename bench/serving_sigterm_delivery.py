"""How often a process-directed SIGTERM (kill(2), what ServerProcess.terminate and process
managers send) fails to wake a main thread that sleeps the way the old server did.

Each trial starts a child whose main thread waits for SIGTERM while another thread keeps
starting threads (as TF's and gRPC's pools do). "old": a Python handler sets a
threading.Event that the main thread waits on (the old server.main). "new": the C-level
handler writes to a wakeup fd (signal.set_wakeup_fd) that the main thread select()s on (the
current server.main). A trial counts as missed if the child has not exited 2 s after the
signal. The kernel may hand the signal to any thread that does not block it (a thread
that unblocks signals, as a starting thread does, takes a pending one); CPython then runs
the Python handler only when the main thread next runs Python code, and a main thread
asleep in a lock does not.

    .venv/bin/python bench/serving_sigterm_delivery.py [trials per mode, default 30]
"""
import os
import select
import signal
import subprocess
import sys
import threading
import time


def _keep_starting_threads():
    while True:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()


def child(mode):
    if mode == "old":
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        wait = lambda: stop.wait(30)  # noqa: E731
    else:
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        wait = lambda: bool(select.select([read], [], [], 30)[0])  # noqa: E731
    threading.Thread(target=_keep_starting_threads, daemon=True).start()
    print("ready", flush=True)
    wait()


def trials(mode, n):
    missed = 0
    for _ in range(n):
        p = subprocess.Popen([sys.executable, __file__, "--child", mode], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(2)
        except subprocess.TimeoutExpired:
            missed += 1
            p.kill()
            p.wait()
    return missed


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
        for mode in ("old", "new"):
            print(f"{mode}: {trials(mode, n)}/{n} process-directed SIGTERMs missed by the main thread",
                  flush=True)
