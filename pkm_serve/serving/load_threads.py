"""--num_load_threads and --num_unload_threads: TF Serving's AspiredVersionsManager loads
(unloads) servables on a thread pool of that size when it is above 0, instead of one
after another in its manager loop, so one servable's slow load, or its waits between load
retries, does not hold back another's."""
import concurrent.futures
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

    def shutdown(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
