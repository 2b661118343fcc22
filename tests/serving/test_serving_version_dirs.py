"""Which directory names under a base path are versions, as TF Serving's
file_system_storage_path_source.cc reads them: the name parsed as an int64
(strings::safe_strto64, so "007" is version 7); two names of one number ("1", "001")
log "Duplicate version directories detected. Version 1 will be loaded from 1, 001 will
be ignored." and the name that sorts last is loaded; names that are not an int64 are
skipped."""
import logging
import os

import pytest
from tensorflow_serving.apis import model_pb2

from serving_helpers import polled_manager
from test_serving_manager_fakes import FakeLoader


class PathRecorder:
    """A loader factory that records the directory each version was loaded from."""

    def __init__(self):
        self.paths, self.events = {}, []

    def __call__(self, name, version, path):
        self.paths[version] = os.path.basename(path)
        return FakeLoader(version, self.events, {}, {})


def _base(tmp_path, names):
    for n in names:
        (tmp_path / "m" / n).mkdir(parents=True)
    return tmp_path / "m"


def _served(manager):
    with manager.serving(model_pb2.ModelSpec(name="m")) as servable:
        return servable.version


def test_zero_padded_name_is_its_number(tmp_path):
    loaded = PathRecorder()
    manager = polled_manager(_base(tmp_path, ["007", "3"]), loader_factory=loaded)
    assert _served(manager) == 7 and loaded.paths == {7: "007"}


@pytest.mark.parametrize("names, kept, ignored", [
    (["001", "1"], "1", "001"),
    (["7", "007", "07"], "7", "07"),    # sorted: 007, 07, 7; each later one replaces the one before
])
def test_duplicate_version_directories_keep_the_last_name_and_warn(tmp_path, caplog, names, kept, ignored):
    loaded = PathRecorder()
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        manager = polled_manager(_base(tmp_path, names), loader_factory=loaded)
    number = int(kept)
    assert _served(manager) == number and loaded.paths == {number: kept}
    assert (f"Duplicate version directories detected. Version {number} will be loaded from {kept}, "
            f"{ignored} will be ignored.") in caplog.text


@pytest.mark.parametrize("odd", ["\u00b2", "\u0669", "99999999999999999999", "1e3", "+4", "0x10"])
def test_names_that_are_not_an_int64_are_skipped(tmp_path, odd):
    """Unicode digits ("²" made the poll raise; "٩" was read as version 9), numbers past
    int64 (GetModelStatus could not encode them), and other spellings are not versions."""
    loaded = PathRecorder()
    manager = polled_manager(_base(tmp_path, [odd, "3"]), loader_factory=loaded)
    assert _served(manager) == 3 and loaded.paths == {3: "3"}
    assert [s.version for s in manager.status(model_pb2.ModelSpec(name="m"))] == [3]


def test_spaces_and_a_minus_sign_are_read_as_tf_serving_reads_them(tmp_path):
    """safe_strto64 skips C spaces around the digits and takes a leading "-"."""
    from tensorflow_serving.config import model_server_config_pb2
    from pkm_serve.serving.manager import ModelManager
    loaded = PathRecorder()
    cfg = model_server_config_pb2.ModelServerConfig()
    c = cfg.model_config_list.config.add(name="m", base_path=str(_base(tmp_path, ["-2", " 5\t", "6 6"])),
                                         model_platform="tensorflow")
    c.model_version_policy.all.SetInParent()
    ModelManager(cfg, poll_seconds=-1, loader_factory=loaded).poll_once()
    assert loaded.paths == {-2: "-2", 5: " 5\t"}


def test_failed_version_under_a_file_url_base_path_is_retried_when_its_files_change(tmp_path):
    """A file:// base path (TF Serving reads it through its file system layer, as here
    tf.io.gfile does): the fingerprint that tells a fixed version from the failed one read
    nothing there, so a failed version was never retried."""
    from test_serving_manager_fakes import Fakes
    fakes = Fakes(tmp_path / "m")
    fakes.add_version(1)
    fakes.failures[1] = RuntimeError("half-written")
    url = "file://" + str(fakes.base)

    def factory(name, version, path):
        return fakes.factory(name, version, path[len("file://"):])
    manager = polled_manager(url, loader_factory=factory)
    assert fakes.events == [("load-start", 1), ("load-failed", 1)]
    manager.poll_once()                                   # same files: not retried
    assert fakes.events.count(("load-start", 1)) == 1
    del fakes.failures[1]
    (fakes.base / "1" / "variables.index").write_bytes(b"now complete")
    manager.poll_once()
    assert fakes.events[-2:] == [("load-start", 1), ("loaded", 1)] and _served(manager) == 1


def test_specific_version_missing_on_disk_is_named_once(tmp_path, caplog):
    """file_system_storage_path_source.cc warns of each 'specific' version it does not find
    (a typo in the policy served nothing, silently)."""
    from tensorflow_serving.config import model_server_config_pb2
    from pkm_serve.serving.manager import ModelManager
    loaded = PathRecorder()
    cfg = model_server_config_pb2.ModelServerConfig()
    c = cfg.model_config_list.config.add(name="m", base_path=str(_base(tmp_path, ["1", "2"])),
                                         model_platform="tensorflow")
    c.model_version_policy.specific.versions.extend([2, 3])
    manager = ModelManager(cfg, poll_seconds=-1, loader_factory=loaded)
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        manager.poll_once()
        manager.poll_once()
    warning = ("Version 3 of servable m, which was requested to be served as a 'specific' version in the "
               "servable's version policy, was not found in the file system")
    assert caplog.text.count(warning) == 1 and "Version 2 of servable" not in caplog.text
    assert loaded.paths == {2: "2"}


@pytest.mark.parametrize("model_file", ["saved_model.pb", "model.tflite"])
def test_base_path_that_is_a_model_itself_says_so(tmp_path, caplog, model_file):
    """--model_base_path=/models/m/1 (the version, not its parent) is the usual slip: the
    no-versions warning names it."""
    version_dir = _base(tmp_path, ["1", "1/variables"]) / "1"
    (version_dir / model_file).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        polled_manager(version_dir, loader_factory=PathRecorder())
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"No versions of servable m found under base path {version_dir}. Did you forget")
    assert message.endswith(f"{version_dir} holds a model itself ({model_file}): the base path is the "
                            f"directory above the numbered version directories, here {tmp_path / 'm'}")


def test_base_path_that_holds_an_unversioned_model_says_where_to_move_it(tmp_path, caplog):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "saved_model.pb").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        polled_manager(tmp_path / "m", loader_factory=PathRecorder())
    assert caplog.records[0].getMessage().endswith(
        f"{tmp_path / 'm'} holds a model itself (saved_model.pb): move it into a numbered version "
        f"directory, e.g. {tmp_path / 'm'}/1")


@pytest.mark.parametrize("flag, base_path", [
    ("file:///models/m", "file:///models/m"),          # was /CWD/file:/models/m: never found
    ("gs://bucket/models/m/", "gs://bucket/models/m/"),  # was /CWD/gs:/bucket/models/m
    ("models/m/", "{cwd}/models/m"),                    # relative: to the working directory
])
def test_model_base_path_flag_keeps_urls(flag, base_path):
    from pkm_serve.serving import config
    cfg = config.model_server_config(config.parse_args([f"--model_base_path={flag}"]))
    assert cfg.model_config_list.config[0].base_path == base_path.format(cwd=os.getcwd())


def test_model_config_file_wins_over_model_base_path(tmp_path, caplog):
    """tensorflow_model_server ignores --model_name/--model_base_path when
    --model_config_file is set, and tensorflow/serving's docker entrypoint always passes
    them: `docker run tensorflow/serving --model_config_file=...` was refused here."""
    from pkm_serve.serving import config
    path = tmp_path / "models.config"
    path.write_text('model_config_list { config { name: "a" base_path: "/models/a" model_platform: "tensorflow" } }')
    args = config.parse_args(["--model_name=default", "--model_base_path=/models/default",
                              f"--model_config_file={path}"])
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        cfg = config.model_server_config(args)
    assert [(c.name, c.base_path) for c in cfg.model_config_list.config] == [("a", "/models/a")]
    assert "--model_name and --model_base_path are ignored" in caplog.text
