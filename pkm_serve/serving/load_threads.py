"""--num_load_threads and --num_unload_threads: TF Serving's AspiredVersionsManager loads
(unloads) servables on a thread pool of that size when it is above 0, instead of one
after another in its manager loop, so one servable's slow load, or its waits between load
retries, does not hold back another's."""
import concurrent.futures
import contextlib
import threading


class KeyedThreads:
    """A pool of `threads` threads running at most one task per key at a time (a model's
    poll, a version's unload); a key whose task still runs is skipped, not queued twice."""

    def __init__(self, threads, name):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lock = threading.RLock()   # a done callback may run at once, in submit's thread
        self._running = {}

    def submit(self, key, fn, *args):
        """fn(*args) on the pool; None (nothing submitted) if key's task still runs."""
        with self._lock:
            if key in self._running:
                return None
            future = self._pool.submit(fn, *args)
            self._running[key] = future
        future.add_done_callback(lambda _f: self._forget(key, future))
        return future

    def _forget(self, key, future):
        with self._lock:
            if self._running.get(key) is future:
                del self._running[key]

    def is_running(self, key) -> bool:
        with self._lock:
            return key in self._running

    def wait_all(self, timeout) -> bool:
        """Waits up to `timeout` seconds for every task running now; False if some still run."""
        with self._lock:
            running = list(self._running.values())
        return not concurrent.futures.wait(running, timeout).not_done

    def shutdown(self, cancel_queued=True):
        """Takes no more tasks; the queued ones are cancelled (polls: a stopped manager polls no
        more) or, with cancel_queued False, still run (unloads: each frees what it holds)."""
        self._pool.shutdown(wait=False, cancel_futures=cancel_queued)


def submit_all(threads, calls, wait):
    """Submits every (key, fn, arg) of `calls` to the KeyedThreads `threads` and, if `wait`,
    waits for them. Once stop() has shut the pool down nothing is submitted (the poll ends),
    and a task it cancelled ends the wait for it: concurrent.futures.wait never returns for a
    future cancelled by the pool's shutdown, so the poll held the poll lock for good."""
    try:
        submitted = [threads.submit(key, fn, arg) for key, fn, arg in calls]
    except RuntimeError:   # "cannot schedule new futures after shutdown"
        return
    for future in submitted if wait else ():
        if future is not None:
            with contextlib.suppress(concurrent.futures.CancelledError):
                future.result()


def run_all(threads, calls):
    """Runs every call of `calls` [(key, fn, *args)] and returns once they have all ended: in
    turn in this thread if `threads` is None, else on the free threads of the KeyedThreads
    `threads` and in this thread, which runs the first call and then each one no thread has
    taken yet (so a task of `threads` waiting here cannot deadlock the pool, and the calls
    running at once stay within its size). A call whose key runs already is skipped."""
    if threads is None or len(calls) < 2:
        for _key, fn, *args in calls:
            fn(*args)
        return
    submitted = []
    for key, fn, *args in calls[1:]:
        try:
            future = threads.submit(key, fn, *args)
        except RuntimeError:   # the pool was shut down (stop()): run it here
            submitted.append((None, fn, args))
            continue
        if future is not None:
            submitted.append((future, fn, args))
    first_key, first_fn, *first_args = calls[0]
    if not threads.is_running(first_key):
        first_fn(*first_args)
    running = []
    for future, fn, args in submitted:
        if future is None or future.cancel():   # (wait() would wait for a cancelled one to be dequeued)
            fn(*args)
        else:
            running.append(future)
    concurrent.futures.wait(running)
