"""`pkm-serve serve` where a module of the [serving] extra is missing but tensorflow-serving-api is
installed (a TF Serving user's environment: that package brings grpcio, not aiohttp,
prometheus_client, orjson or grpcio-health-checking). The start-up error printed the bare
"No module named 'aiohttp'"; it now says which pip extra installs it, as the other commands do."""
import sys

import pytest

from pkm_serve import cli


@pytest.mark.parametrize("missing, front_end_module, flags", [
    ("aiohttp", "pkm_serve.serving.rest_frontend", ["--port=0", "--rest_api_port=18501"]),
    ("grpc_health", "pkm_serve.serving.grpc_frontend", ["--port=18500"]),
])
def test_a_missing_serving_module_names_the_pip_extra(tmp_path, monkeypatch, capfd, missing,
                                                      front_end_module, flags):
    # None in sys.modules (the package and its submodules) makes `import aiohttp` raise
    # ModuleNotFoundError, as where it is not installed; the front end's module is imported afresh
    # so that its import statement runs (and fails before any port is bound).
    for name in [n for n in sys.modules if n == missing or n.startswith(missing + ".")] + [missing]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, front_end_module, raising=False)
    code = cli.main(["serve", "--model_name=m", f"--model_base_path={tmp_path}", *flags])
    err_lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2, err_lines
    assert err_lines[-1].startswith("pkm-serve serve: error: "), err_lines
    assert f"{missing!r}" in err_lines[-1] and "pip install 'pkm_serve[serving]'" in err_lines[-1], err_lines
