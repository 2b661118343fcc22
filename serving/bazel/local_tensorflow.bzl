"""`local_tensorflow`: a repository of the pip-installed TensorFlow's headers and
libtensorflow_framework, so the op library builds with Bazel against the very
TensorFlow that will load it (same ABI flags as tf.sysconfig reports).

The Python interpreter is $PYTHON_BIN_PATH, else <workspace>/.venv/bin/python
(what `make build` creates), else python3.
"""

_QUERY = """
import tensorflow as tf
link = tf.sysconfig.get_link_flags()
lib_name = [f[3:] for f in link if f.startswith("-l:")] or ["libtensorflow_framework.so.2"]
print(tf.sysconfig.get_include())
print(tf.sysconfig.get_lib())
print(lib_name[0])
print(" ".join(tf.sysconfig.get_compile_flags()))
"""

_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["include/**"], exclude = ["include/**/*.py", "include/**/*.pyc"]),
    defines = {defines},
    includes = ["include"],
)

cc_import(
    name = "framework",
    shared_library = "lib/{lib_name}",
)

# What an op library needs: TF's headers and libtensorflow_framework.
cc_library(
    name = "tensorflow",
    deps = [
        ":framework",
        ":headers",
    ],
)
"""

def _python(rctx):
    env = rctx.os.environ.get("PYTHON_BIN_PATH")
    if env:
        return env
    venv = rctx.path(Label("//:WORKSPACE")).dirname.get_child(".venv").get_child("bin").get_child("python")
    if venv.exists:
        return str(venv)
    found = rctx.which("python3")
    if not found:
        fail("local_tensorflow: no Python found; set PYTHON_BIN_PATH to a Python with tensorflow installed")
    return str(found)

def _local_tensorflow_impl(rctx):
    python = _python(rctx)
    res = rctx.execute([python, "-c", _QUERY], environment = {"TF_CPP_MIN_LOG_LEVEL": "3"})
    if res.return_code != 0:
        fail("local_tensorflow: `%s -c 'import tensorflow'` failed (install tensorflow there, or set " % python +
             "PYTHON_BIN_PATH):\n" + res.stderr)
    lines = [line for line in res.stdout.strip().split("\n") if line]
    include_dir, lib_dir, lib_name, cflags = lines[-4], lines[-3], lines[-2], lines[-1]
    rctx.symlink(include_dir, "include")
    rctx.symlink(lib_dir + "/" + lib_name, "lib/" + lib_name)
    defines = [f[2:] for f in cflags.split(" ") if f.startswith("-D")]
    rctx.file("BUILD", _BUILD.format(defines = repr(defines), lib_name = lib_name))

local_tensorflow = repository_rule(
    implementation = _local_tensorflow_impl,
    environ = ["PYTHON_BIN_PATH"],
    local = True,
)
