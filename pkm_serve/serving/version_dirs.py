"""Which directories under a model's base path are versions, and when one changed."""
import logging
import os
import re

import tensorflow as tf

log = logging.getLogger("pkm_serve.serving")


def _os_size_and_mtime(path):
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _gfile_size_and_mtime(path):
    st = tf.io.gfile.stat(path)
    return st.length, st.mtime_nsec


def directory_fingerprint(path):
    """Names, sizes and mtimes of every file: changes whenever the directory is rewritten.
    A URL (file://, gs://, ...) is read through tf.io.gfile, as the loaders read it."""
    if "://" in path:
        walk, stat, missing = tf.io.gfile.walk, _gfile_size_and_mtime, (OSError, tf.errors.NotFoundError)
    else:
        walk, stat, missing = os.walk, _os_size_and_mtime, OSError
    entries = []
    for root, _dirs, files in walk(path):
        for f in files:
            try:
                entries.append((os.path.relpath(os.path.join(root, f), path), *stat(os.path.join(root, f))))
            except missing:
                continue
    return tuple(sorted(entries))


# TF Serving reads a version directory's name with strings::safe_strto64: C spaces around,
# an optional "-", ASCII digits, within int64.
_VERSION_NAME = re.compile(r"[ \t\n\v\f\r]*-?[0-9]+[ \t\n\v\f\r]*")
_INT64 = range(-2**63, 2**63)


def version_number(name):
    """The version a directory name stands for, or None (file_system_storage_path_source.cc)."""
    if not _VERSION_NAME.fullmatch(name):
        return None
    number = int(name)
    return number if number in _INT64 else None


def list_versions(base_path):
    """{version: directory} for the numeric subdirectories of base_path. Of two names of one
    number ("1", "001") the one that sorts last is kept, with TF Serving's warning."""
    try:
        names = tf.io.gfile.listdir(base_path)
    except tf.errors.NotFoundError:
        return None
    found = {}
    for n in sorted({n.rstrip("/") for n in names}):
        v = version_number(n)
        if v is None or not tf.io.gfile.isdir(os.path.join(base_path, n)):
            continue
        if v in found:
            log.warning("Duplicate version directories detected. Version %d will be loaded from %s, "
                        "%s will be ignored.", v, n, os.path.basename(found[v]))
        found[v] = os.path.join(base_path, n)
    return found


def is_directory(path):
    """Whether the version directory `path` (a path or a URL) still exists."""
    return tf.io.gfile.isdir(path)


def holds_model_hint(base_path):
    """When a base path holds a model itself (the usual slip: naming the version directory),
    what to name instead; '' otherwise."""
    base = base_path.rstrip("/")
    for name in ("saved_model.pb", "saved_model.pbtxt", "model.tflite"):
        if tf.io.gfile.exists(os.path.join(base, name)):
            break
    else:
        return ""
    if version_number(os.path.basename(base)) is not None:
        return (f" {base} holds a model itself ({name}): the base path is the directory above the "
                f"numbered version directories, here {os.path.dirname(base)}")
    return f" {base} holds a model itself ({name}): move it into a numbered version directory, e.g. {base}/1"
