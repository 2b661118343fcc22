"""Request batching with TF Serving's BatchingParameters semantics.

Concurrent requests for the same (servable version, signature, input dtypes and
per-row shapes) are concatenated along dimension 0, run once, and the outputs
split back by row counts. A batch closes when it reaches max_batch_size, when
its oldest task has waited batch_timeout_micros, or -- with timeout 0 -- as soon
as a batch thread is free (so load alone decides the batch size). At most
max_enqueued_batches batches wait per queue; beyond that a request is refused
with UNAVAILABLE rather than queued without bound.

With enable_large_batch_splitting (SharedBatchScheduler's queue semantics),
max_batch_size bounds one request and max_execution_batch_size each run: a
request first fills what is left of the open batch, the rest goes into new
batches of max_execution_batch_size rows, and its answer is the pieces' outputs
put back together in order.
"""
import collections
import logging
import os
import threading
import time

import grpc
import numpy as np

from pkm_serve.serving.batch_padding import drop_unpaddable, merge_inputs
from pkm_serve.serving.errors import ServingError

log = logging.getLogger("pkm_serve.serving")


_LONGEST_WAIT_S = 3600.0   # a batch thread re-checks its queues at least this often


def _value(wrapper_msg, field, default):
    return getattr(wrapper_msg, field).value if wrapper_msg.HasField(field) else default


def _internal(e):
    return ServingError(grpc.StatusCode.INTERNAL, f"batched run failed: {type(e).__name__}: {e}")


def _has_batch_dimension(signature, inputs) -> bool:
    """Whether every input has the rank its signature declares (where it declares one), so
    that dimension 0 is the batch. A single bag [K] sent to a [-1, K] signature is one bag:
    merged with others, or padded, its ids would be pooled with theirs into one bag and
    each caller get a slice of that bag's vector."""
    specs = getattr(signature, "input_specs", None) or {}
    infos = getattr(getattr(signature, "signature_def", None), "inputs", {})
    for key, value in inputs.items():
        spec = specs.get(key)
        if key in infos and not infos[key].HasField("tensor_shape"):
            continue   # a hand-written TensorInfo without a shape declares no rank (not a scalar)
        if spec is not None and spec.shape.rank is not None and spec.shape.rank != value.ndim:
            return False
    return True


def _execution_limit(params, max_batch_size):
    """(split large requests?, most rows one run takes), as bundle_factory_util.h's
    GetQueueOptions reads them: without splitting a run takes max_batch_size rows."""
    if not _value(params, "enable_large_batch_splitting", False):
        if params.HasField("max_execution_batch_size"):
            log.warning("batching parameters: max_execution_batch_size is used only with "
                        "enable_large_batch_splitting { value: true }; it is ignored, as in TF Serving")
        return False, max_batch_size
    # Unset, upstream takes max_batch_size's value, 0 when that is unset too (a queue
    # that could hold nothing): refused here with the reason.
    limit = int(_value(params, "max_execution_batch_size", _value(params, "max_batch_size", 0)))
    if limit <= 0:
        raise ValueError("batching parameters: enable_large_batch_splitting needs a positive "
                         "max_execution_batch_size (unset, it is max_batch_size's value), got "
                         f"{limit}")
    if limit > max_batch_size:
        raise ValueError("batching parameters: when enable_large_batch_splitting is true, "
                         f"max_batch_size ({max_batch_size}) must be greater than or equal to "
                         f"max_execution_batch_size ({limit})")
    return True, limit


class BatchOptions:
    def __init__(self, params):
        self.max_batch_size = int(_value(params, "max_batch_size", 1000))
        self.batch_timeout_s = _value(params, "batch_timeout_micros", 0) / 1e6
        self.num_batch_threads = int(_value(params, "num_batch_threads", os.cpu_count() or 1))
        # Unset fields take TF Serving's defaults (SharedBatchScheduler::QueueOptions).
        self.max_enqueued_batches = int(_value(params, "max_enqueued_batches", 10))
        # Kept in the order given: as TF Serving's RoundToLowestAllowedBatchSize, a batch is
        # padded to the first listed entry that holds it.
        self.allowed_batch_sizes = list(params.allowed_batch_sizes)
        if self.max_batch_size <= 0 or self.num_batch_threads <= 0 or self.max_enqueued_batches <= 0:
            raise ValueError("batching parameters max_batch_size, num_batch_threads and "
                             "max_enqueued_batches must be positive")
        if self.batch_timeout_s < 0:
            raise ValueError(f"batching parameters batch_timeout_micros must be >= 0, got "
                             f"{params.batch_timeout_micros.value}")
        if self.allowed_batch_sizes and min(self.allowed_batch_sizes) <= 0:
            raise ValueError(f"batching parameters allowed_batch_sizes must be positive, got "
                             f"{list(params.allowed_batch_sizes)}")
        self.split_large_batches, self.max_execution_batch_size = _execution_limit(params, self.max_batch_size)
        self.pad_variable_length_inputs = params.pad_variable_length_inputs
        _check_allowed_batch_sizes(self.allowed_batch_sizes, self.max_batch_size)


def _check_allowed_batch_sizes(sizes, max_batch_size):
    """bundle_factory_util.cc's WrapSessionForBatching: the last entry as listed (not the
    largest) must be max_batch_size. Entries out of order are taken, as there, with a warning."""
    if not sizes:
        return
    if sizes[-1] != max_batch_size:
        raise ValueError("Last entry in allowed_batch_sizes must match max_batch_size; last entry "
                         f"was {sizes[-1]}; expected {max_batch_size}")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        log.warning("batching parameters: allowed_batch_sizes %s are not in increasing order; as in "
                    "TF Serving, a batch is padded to the first listed entry that holds it", sizes)


def _run_padded(q, tasks):
    """(outputs, rows, padded rows) of one run of the tasks' merged inputs, padded to the first
    listed allowed_batch_sizes entry that holds them (batching_session.cc)."""
    rows = sum(t.rows for t in tasks)
    padded = next((size for size in q.opts.allowed_batch_sizes if size >= rows), rows)
    return q.run_fn(merge_inputs(tasks, padded - rows, q.opts.pad_variable_length_inputs)), rows, padded


def _hand_out(tasks, outputs, padded):
    """Each task's result: its rows of the outputs, in order (the padding's dropped)."""
    for k, v in outputs.items():
        if v.ndim == 0 or v.shape[0] != padded:
            raise ServingError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"batching needs every output to have the batch as dimension 0; "
                               f"output '{k}' has shape {list(v.shape)} for a batch of {padded}")
    start = 0
    for t in tasks:
        t.result = {k: v[start:start + t.rows] for k, v in outputs.items()}
        start += t.rows


class _Task:
    __slots__ = ("inputs", "rows", "_done", "result", "error", "cancelled", "enqueued",
                 "_pieces", "_pieces_left", "_pieces_lock")

    def __init__(self, inputs, rows):
        self.inputs = inputs
        self.rows = rows
        self._pieces = None
        # A held lock that the batch thread releases when the result is in: waiting on it
        # stays in C, where threading.Event's Condition runs Python code on both sides
        # (the profile showed Event.wait/set among the top per-request costs).
        self._done = threading.Lock()
        self._done.acquire()
        self.result = None
        self.error = None
        self.cancelled = False
        self.enqueued = time.monotonic()

    def wait(self, timeout):
        return self._done.acquire(timeout=-1 if timeout is None else timeout)

    def finish(self):
        self._done.release()

    def split(self, sizes):
        """The pieces of `sizes` rows each (in order) that run in separate batches; this
        task is answered when the last of them is."""
        self._pieces, start = [], 0
        for rows in sizes:
            self._pieces.append(_Piece(self, start, rows))
            start += rows
        self._pieces_left = len(sizes)
        self._pieces_lock = threading.Lock()
        return self._pieces

    def piece_finished(self):
        with self._pieces_lock:
            self._pieces_left -= 1
            if self._pieces_left:
                return
        try:
            errors = [p.error for p in self._pieces if p.error is not None]
            if errors:
                self.error = errors[0]
            else:
                self.result = _concatenate_pieces([p.result for p in self._pieces])
        except ServingError as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - the request must be answered, never left waiting
            self.error = _internal(e)
        finally:
            self.finish()


def _concatenate_pieces(results):
    """A split request's outputs: its pieces' along dimension 0 (as SplitInputTask's
    done callback concatenates them)."""
    out = {}
    for k in results[0]:
        parts = [r[k] for r in results]
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            # With pad_variable_length_inputs each piece was padded to its own batch.
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the pieces of this split request (enable_large_batch_splitting) gave "
                               f"output '{k}' of different shapes past dimension 0 "
                               f"({sorted({tuple(p.shape[1:]) for p in parts})}), padded to the inputs "
                               f"of their batches (pad_variable_length_inputs); they cannot be "
                               f"concatenated")
        out[k] = np.concatenate(parts, axis=0)
    return out


class _Piece:
    """Rows [start, start + rows) of a split request, run as a task of its own."""
    __slots__ = ("inputs", "rows", "parent", "result", "error", "enqueued")

    def __init__(self, parent, start, rows):
        self.inputs = {k: v[start:start + rows] for k, v in parent.inputs.items()}
        self.rows = rows
        self.parent = parent
        self.result = None
        self.error = None
        self.enqueued = parent.enqueued

    @property
    def cancelled(self):
        return self.parent.cancelled

    def finish(self):
        self.parent.piece_finished()


class _Batch:
    __slots__ = ("tasks", "rows", "opened", "closed")

    def __init__(self):
        self.tasks = []
        self.rows = 0
        self.opened = time.monotonic()
        self.closed = False


class _Queue:
    def __init__(self, key, run_fn, opts):
        self.key = key
        self.run_fn = run_fn
        self.opts = opts                     # BatchOptions of the queue (its version's)
        self.batches = collections.deque()   # oldest first; only the last may be open
        self.running = 0                     # batches taken by a worker and not finished


class BatchScheduler:
    def __init__(self, params, metrics=None, stopped_message="server is shutting down"):
        self.opts = BatchOptions(params)
        self._stopped_message = stopped_message   # UNAVAILABLE to a request that comes after stop()
        self._metrics = metrics
        self._cv = threading.Condition()
        # Keyed by the servable object itself (never id(): a collected version's id can be
        # reused by the next one) and dropped as soon as it is empty and idle, so a queue
        # holds its version only while that version has requests in it.
        self._queues = {}
        self._stopping = False
        self._threads = [threading.Thread(target=self._worker, name=f"batch-{i}", daemon=True)
                         for i in range(self.opts.num_batch_threads)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _key(servable, signature, inputs, pad_variable_length_inputs):
        # Padded, requests of any sizes past dimension 0 share a batch (of one rank).
        return (servable, signature.name,
                tuple(sorted((k, v.dtype.str, v.ndim if pad_variable_length_inputs else v.shape[1:])
                             for k, v in inputs.items())))

    def run(self, servable, signature, inputs, deadline=None, model_name=""):
        """Runs signature on inputs as part of a batch; returns its outputs (dict)."""
        # A version served with --enable_per_model_batching_parameters carries the options
        # of its own batching_params.pbtxt, or None: it has none and is not batched.
        opts = getattr(servable, "batch_options", self.opts)
        rows = {v.shape[0] if v.ndim else None for v in inputs.values()}
        if opts is None or len(rows) != 1 or None in rows or rows == {0} or \
                not _has_batch_dimension(signature, inputs):
            # Not batchable (scalars, mismatched dim 0, empty, not the signature's rank): run alone.
            return signature.run(inputs)
        if next(iter(rows)) > opts.max_batch_size:
            # max_batch_size bounds what one run may take (memory): TF Serving's batch queue
            # refuses a larger request (shared_batch_scheduler.h) rather than run it alone.
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"Task size {next(iter(rows))} is larger than maximum input batch size "
                               f"{opts.max_batch_size}")
        task = _Task(inputs, next(iter(rows)))
        key = self._key(servable, signature, inputs, opts.pad_variable_length_inputs)
        with self._cv:
            if self._stopping:
                raise ServingError(grpc.StatusCode.UNAVAILABLE, self._stopped_message)
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = _Queue(key, signature.run, opts)
            if opts.split_large_batches:
                pieces = self._enqueue_split(q, task)
            else:
                self._enqueue(q, task)
                pieces = 1
            self._cv.notify(pieces)   # each piece may have closed a batch a free thread can take
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not task.wait(timeout):
            task.cancelled = True
            raise ServingError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "deadline exceeded while the request waited in the batch queue")
        if task.error is not None:
            raise task.error
        return task.result

    def _enqueue(self, q, task):
        """Called with the lock held: task into q's open batch, or into a new one."""
        last = q.batches[-1] if q.batches else None
        limit = q.opts.max_execution_batch_size
        if last is None or last.closed or last.rows + task.rows > limit:
            if last is not None and not last.closed:
                last.closed = True
            if len(q.batches) >= q.opts.max_enqueued_batches:
                raise ServingError(grpc.StatusCode.UNAVAILABLE,   # shared_batch_scheduler.h's words
                                   "The batch scheduling queue to which this task was submitted is full; "
                                   f"currently {len(q.batches)} batches enqueued and max_enqueued_batches "
                                   f"is {q.opts.max_enqueued_batches}")
            last = _Batch()
            q.batches.append(last)
        last.tasks.append(task)
        last.rows += task.rows
        if last.rows >= limit:
            last.closed = True

    def _enqueue_split(self, q, task):
        """Called with the lock held: task's rows fill the open batch, the rest go into new
        batches of max_execution_batch_size rows (shared_batch_scheduler.h's eager split);
        refused whole, before any piece is queued, when the queue cannot take them all."""
        limit = q.opts.max_execution_batch_size
        last = q.batches[-1] if q.batches else None
        is_open = last is not None and not last.closed
        room = limit - last.rows if is_open else 0
        # Upstream counts its open batch among the enqueued ones, empty or not.
        enqueued = len(q.batches) + (0 if is_open else 1)
        capacity = (q.opts.max_enqueued_batches - enqueued) * limit + (room if is_open else limit)
        if task.rows > capacity:
            raise ServingError(grpc.StatusCode.UNAVAILABLE,
                               "The batch scheduling queue to which this task was submitted is full; "
                               f"task size is {task.rows} but scheduling capacity is only {capacity} "
                               f"(num_enqueued_batches={enqueued}, max_enqueued_batches="
                               f"{q.opts.max_enqueued_batches}, open_batch_size={last.rows if is_open else 0}, "
                               f"max_execution_batch_size={limit})")
        sizes, left = [], task.rows
        if room:
            sizes.append(min(left, room))
            left -= sizes[0]
        while left:
            sizes.append(min(left, limit))
            left -= sizes[-1]
        for piece in (task.split(sizes) if len(sizes) > 1 else [task]):
            self._enqueue(q, piece)
        return len(sizes)

    # ------------------------------------------------------------ workers
    def _take_batch(self):
        """Called with the lock held: the batch to run now, or (None, seconds to wait)."""
        now = time.monotonic()
        wait = None
        best = None
        for key, q in self._queues.items():
            if not q.batches:
                continue
            b = q.batches[0]
            due = b.opened + q.opts.batch_timeout_s
            if b.closed or now >= due or self._stopping:
                if best is None or b.opened < best[1].opened:
                    best = (q, b)
            else:
                wait = due - now if wait is None else min(wait, due - now)
        if best is not None:
            q, b = best
            q.batches.popleft()
            b.closed = True
            q.running += 1
            return q, b, None
        return None, None, wait

    def _finished(self, q):
        """Called with the lock held after a batch of q ran: prunes q if nothing is left."""
        q.running -= 1
        if not q.batches and not q.running:
            del self._queues[q.key]

    def _worker(self):
        while True:
            with self._cv:
                while True:
                    q, batch, wait = self._take_batch()
                    if batch is not None:
                        break
                    if self._stopping:
                        return
                    # Clamped: a batch_timeout_micros near int64 max ("close only when full")
                    # overflowed the lock's timeout and killed the batch thread.
                    self._cv.wait(None if wait is None else min(wait, _LONGEST_WAIT_S))
            try:
                self._execute(q, batch)
            except Exception:  # noqa: BLE001 - a dead worker would stall its queue for good
                log.exception("batch worker: unexpected error")
            finally:
                with self._cv:
                    self._finished(q)

    def _execute(self, q, batch):
        tasks = [t for t in batch.tasks if not t.cancelled]
        try:
            self._run_batch(q, tasks)
        finally:
            # Whatever happened, no request may be left waiting without an answer.
            for t in tasks:
                if t.result is None and t.error is None:
                    t.error = ServingError(grpc.StatusCode.INTERNAL, "batched run ended without a result")
                t.finish()

    def _run_batch(self, q, tasks):
        if q.opts.pad_variable_length_inputs:
            tasks = drop_unpaddable(tasks)
        if not tasks:
            return
        try:
            t0 = time.monotonic()
            outputs, rows, padded = _run_padded(q, tasks)
            if self._metrics:
                self._metrics.batch(rows, padded, [t0 - t.enqueued for t in tasks])
            _hand_out(tasks, outputs, padded)
        except ServingError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT and len(tasks) > 1:
                # One bad request (e.g. an index out of range) must not fail its batch mates:
                # rerun each alone, padded as a batch of its rows would be (a model may fix
                # its batch), so only the offender gets the error.
                for t in tasks:
                    try:
                        outputs, _, padded = _run_padded(q, [t])
                        _hand_out([t], outputs, padded)
                    except ServingError as single:
                        t.error = single
                    except Exception as single:  # noqa: BLE001 - e.g. a model bug: answer, go on
                        t.error = _internal(single)
            else:
                for t in tasks:
                    t.error = e
        except Exception as e:  # noqa: BLE001 - delivered to every waiting request
            err = _internal(e)
            for t in tasks:
                t.error = err

    def stop(self, timeout=30.0) -> bool:
        """Runs what is queued, then stops the batch threads; False if one still runs after
        `timeout` seconds."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
