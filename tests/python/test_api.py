"""The package's own behaviour, without a session: where it finds libwsync and what it says
when it cannot, the checks made when a tensor is registered, calls out of order, and the
fields of its exceptions. Registration runs against an endpoint that accepts connections and
never answers (opening and registering need no reply)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import wsync
from conftest import ROOT
from wsync.errors import WsyncError, from_status


@pytest.fixture
def silent_endpoint(tmp_path):
    path = str(tmp_path / "control.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    yield path
    listener.close()
    os.unlink(path)


@pytest.fixture
def agent(silent_endpoint):
    with wsync.Agent(silent_endpoint, 0, 2) as opened:
        yield opened


def import_in_subprocess(package_parent, env_changes, code="import wsync; wsync.Host().close(); "
                         "print(wsync.library_path())"):
    env = {key: value for key, value in os.environ.items() if key not in ("WSYNC_LIBRARY", "WSYNC_BUILD_DIR")}
    env.update(env_changes)
    env["PYTHONPATH"] = str(package_parent)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd="/")


def copy_package(tmp_path):
    target = tmp_path / "site"
    shutil.copytree(ROOT / "bindings" / "python" / "wsync", target / "wsync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return target


def library():
    path = os.environ.get("WSYNC_LIBRARY") or str(ROOT / "build" / "libwsync.so")
    assert os.path.exists(path), f"no libwsync at {path}: build first"
    return os.path.realpath(path)


class TestLibrary:
    def test_wsync_library_names_the_file(self, tmp_path):
        result = import_in_subprocess(copy_package(tmp_path), {"WSYNC_LIBRARY": library()})
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"WSYNC_LIBRARY={library()}")

    def test_a_wrong_wsync_library_is_the_only_place_tried(self, tmp_path):
        result = import_in_subprocess(copy_package(tmp_path), {"WSYNC_LIBRARY": str(tmp_path / "nothing.so")})
        assert result.returncode != 0
        assert f"WSYNC_LIBRARY={tmp_path / 'nothing.so'}: {tmp_path / 'nothing.so'} does not exist" in result.stderr
        assert "beside the package" not in result.stderr

    def test_beside_the_package(self, tmp_path):
        site = copy_package(tmp_path)
        os.symlink(library(), site / "wsync" / "libwsync.so")
        result = import_in_subprocess(site, {})
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("beside the package")

    def test_the_build_tree(self, tmp_path):
        result = import_in_subprocess(copy_package(tmp_path), {"WSYNC_BUILD_DIR": os.path.dirname(library())})
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("the build tree WSYNC_BUILD_DIR=")

    def test_nowhere_lists_every_place_tried(self, tmp_path):
        result = import_in_subprocess(copy_package(tmp_path), {"WSYNC_BUILD_DIR": str(tmp_path / "no-build"),
                                                               "LD_LIBRARY_PATH": ""})
        assert result.returncode != 0
        assert "wsync: cannot load libwsync; tried, in order:" in result.stderr
        assert "beside the package:" in result.stderr and "does not exist" in result.stderr
        assert f"the build tree WSYNC_BUILD_DIR={tmp_path / 'no-build'}:" in result.stderr
        assert "the system's library search path:" in result.stderr
        assert "set WSYNC_LIBRARY" in result.stderr

    def test_importing_needs_no_library(self, tmp_path):
        result = import_in_subprocess(copy_package(tmp_path), {"WSYNC_LIBRARY": "/nonexistent.so"},
                                      code="import wsync; print(sorted(wsync.__all__)[:2])")
        assert result.returncode == 0, result.stderr


class TestRegistration:
    def test_a_whole_array_and_a_shard(self, agent):
        agent.register_tensor("whole", np.zeros((4, 3), dtype=np.float32))
        agent.register_tensor("shard", np.zeros((2, 3), dtype=np.uint16), shape=(5, 3), first_row=3, dtype="bfloat16")

    def test_a_name_twice(self, agent):
        agent.register_tensor("t", np.zeros(4, dtype=np.float32))
        with pytest.raises(wsync.InvalidArgument, match="register_tensor t: registered already on this rank"):
            agent.register_tensor("t", np.zeros(4, dtype=np.float32))

    def test_a_non_contiguous_array(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="not C-contiguous"):
            agent.register_tensor("t", np.zeros((4, 4), dtype=np.float32)[:, ::2])

    def test_rows_outside_dim_0(self, agent):
        with pytest.raises(wsync.InvalidArgument, match=r"rows \[3, 5\) lie outside dim 0 of 4"):
            agent.register_tensor("t", np.zeros((2, 3), dtype=np.float32), shape=(4, 3), first_row=3)

    def test_a_shard_not_of_dim_0(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="differs from the global shape .* past dim 0"):
            agent.register_tensor("t", np.zeros((4, 2), dtype=np.float32), shape=(4, 3))

    def test_a_dtype_of_another_size(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="dtype bfloat16 has 2-byte elements; the array's float32"):
            agent.register_tensor("t", np.zeros(4, dtype=np.float32), dtype="bfloat16")

    def test_a_dtype_wsync_does_not_move(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="numpy dtype complex64 is not one wsync moves"):
            agent.register_tensor("t", np.zeros(4, dtype=np.complex64))

    def test_something_that_is_not_a_tensor(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="a list is not a tensor wsync knows"):
            agent.register_tensor("t", [1, 2, 3])

    def test_a_callable_that_returns_something_else_later(self, agent):
        arrays = {"t": np.zeros(4, dtype=np.float32)}
        agent.register_tensor("t", lambda: arrays["t"])
        arrays["t"] = np.zeros(5, dtype=np.float32)
        with pytest.raises(wsync.InvalidArgument, match=r"tensor t: it is now float32 \[5\], registered as"):
            agent._refresh()

    def test_cpu_memory_on_the_cuda_backend(self, silent_endpoint):
        with wsync.Agent(silent_endpoint, 0, 1, backend="cuda") as cuda_agent:
            with pytest.raises(wsync.InvalidArgument, match="the cuda backend moves tensors in cuda memory"):
                cuda_agent.register_tensor("t", np.zeros(4, dtype=np.float32))

    def test_an_unknown_backend(self, silent_endpoint):
        with pytest.raises(wsync.InvalidArgument, match="backend 'tpu' is neither"):
            wsync.Agent(silent_endpoint, 0, 1, backend="tpu")

    def test_a_callback_that_is_not_callable(self, agent):
        with pytest.raises(wsync.InvalidArgument, match="is not callable"):
            agent.register_callback("offload_actor", 3)


class TestOrder:
    def test_publish_before_ready(self, agent):
        with pytest.raises(wsync.StateError, match="publish: call ready first"):
            agent.publish(1)

    def test_calls_after_close(self, silent_endpoint):
        agent = wsync.Agent(silent_endpoint, 0, 1)
        agent.close()
        agent.close()  # twice is fine
        with pytest.raises(wsync.StateError, match="register_tensor: the agent is closed"):
            agent.register_tensor("t", np.zeros(4, dtype=np.float32))

    def test_an_endpoint_nobody_listens_on(self, tmp_path):
        with pytest.raises(wsync.WsyncError, match="cannot connect to") as caught:
            wsync.Agent(str(tmp_path / "missing.sock"), 0, 1)
        assert caught.value.status == "EFAILED"

    def test_the_endpoint_rank_and_world_from_a_launchers_environment(self, silent_endpoint, monkeypatch):
        monkeypatch.setenv("WSYNC_ENDPOINT", silent_endpoint)
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with wsync.Agent() as opened:
            assert (opened.rank, opened.world) == (1, 2)

    def test_no_endpoint_anywhere_names_wsync_endpoint(self, monkeypatch):
        monkeypatch.delenv("WSYNC_ENDPOINT", raising=False)
        with pytest.raises(wsync.WsyncError, match="rank 0: no endpoint given and WSYNC_ENDPOINT is not set") as caught:
            wsync.Agent(rank=0, world=1)
        assert caught.value.status == "EFAILED"

    def test_no_rank_anywhere_names_rank(self, silent_endpoint, monkeypatch):
        monkeypatch.delenv("RANK", raising=False)
        with pytest.raises(wsync.InvalidArgument, match=r"Agent: no rank given and \$RANK is not set"):
            wsync.Agent(silent_endpoint, world=1)
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "two")
        with pytest.raises(wsync.InvalidArgument, match=r"no world given and \$WORLD_SIZE is 'two', not an integer"):
            wsync.Agent(silent_endpoint)

    def test_a_rank_outside_the_world(self, silent_endpoint):
        with pytest.raises(wsync.InvalidArgument, match=r"0 <= rank < world \(rank 2, world 2\)"):
            wsync.Agent(silent_endpoint, 2, 2)

    def test_a_host_from_another_thread(self):
        host = wsync.Host()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(pytest.raises(wsync.StateError, host.run_string,
                                                                         "return 1")))
        thread.start()
        thread.join()
        assert "from the thread that opened it" in str(seen[0].value)
        host.close()

    def test_a_lua_error_in_the_host(self):
        with wsync.Host() as host:
            with pytest.raises(wsync.WsyncError, match="boom") as caught:
                host.run_string("error('boom')")
            assert caught.value.status == "ELUA"
            host.run_string("assert(1 + 1 == 2)")

    def test_a_recipe_that_does_not_load(self, tmp_path):
        recipe = tmp_path / "bad.lua"
        recipe.write_text("return { name = 'bad', backend = 'host', model = 42 }\n")
        with pytest.raises(wsync.WsyncError, match="bad.lua"):
            wsync.Host(str(recipe))

    def test_a_refused_recipe_carries_wsync_runs_code_and_message_without_a_traceback(self, tmp_path, monkeypatch):
        recipe = tmp_path / "bad.lua"
        recipe.write_text("return { name = 'bad', backend = 'host', model = { family = 'qwen3_moe', preset = 'tiny' },\n"
                          "  trainer = { kind = 'external', ranks = 1 }, runtime = { kind = 'reference', tp = 1 } }\n")
        run = subprocess.run([os.environ["WSYNC_BIN"], "run", str(recipe)], capture_output=True, text=True,
                             check=False)
        said = run.stderr.strip().splitlines()[-1]
        assert run.returncode == 3 and said.startswith("wsync: "), run.stderr
        monkeypatch.delenv("WSYNC_TRACEBACK", raising=False)
        with pytest.raises(wsync.InvalidArgument) as caught:  # (a ValueError: the caller's recipe)
            wsync.Host(str(recipe))
        assert (caught.value.status, caught.value.code) == ("EINVAL", "RECIPE_INVALID")
        assert str(caught.value) == f"Host({str(recipe)!r}): {said[len('wsync: '):]} (RECIPE_INVALID)"
        monkeypatch.setenv("WSYNC_TRACEBACK", "1")
        with pytest.raises(wsync.InvalidArgument, match="stack traceback"):
            wsync.Host(str(recipe))

    def test_call_takes_and_gives_json_and_refuses_with_a_structured_error(self, tmp_path):
        with wsync.Host() as host:
            summary = host.call("recipe", recipe="recipes/demo.lua")
            assert (summary["name"], summary["backend"], summary["runtime"]["kind"]) == ("demo", "host", "reference")
            tensors = host.call("trainer_tensors", recipe="recipes/demo.lua", overrides=["trainer.ranks=2"])
            assert tensors == [dict(name=t.name, dtype=t.dtype, shape=list(t.shape))
                               for t in wsync.trainer_tensors("recipes/demo.lua")]
            with pytest.raises(wsync.InvalidArgument) as unknown:
                host.call("nonsense")
            assert unknown.value.code == "INVALID_ARGUMENT" and "there are: device, loader_plan" in str(unknown.value)
            bad = tmp_path / "bad.lua"
            bad.write_text("return { name = 'bad', backend = 'host', model = { family = 'qwen3_moe', preset = 'tiny' },"
                           " trainer = { kind = 'external', ranks = 1 }, runtime = { kind = 'reference', tp = 1 },"
                           " buffers = { bytes = -1 } }\n")
            with pytest.raises(wsync.InvalidArgument) as refused:
                host.call("recipe", recipe=str(bad))
            assert refused.value.code == "RECIPE_INVALID" and refused.value.fields["field"] == "buffers.bytes"
            assert str(bad) in str(refused.value) and "stack traceback" not in str(refused.value)
            with pytest.raises(wsync.WsyncError) as failed:
                host.call("worker_command", cmd="load_chunk", payload={})
            assert failed.value.code == "NOT_INITIALIZED" and failed.value.fields["fatal"] is True
            assert host.call("device", backend="host", index=0)["uuid"]
            assert host.call("reports") == []  # (a list, also empty: the report's own JSON)

    def test_a_wsync_error_raised_by_a_chunk_carries_its_code(self):
        with wsync.Host() as host:
            with pytest.raises(wsync.WsyncError) as caught:
                host.run_string("require('wsync.errors').raise('X_FAILED', 'it failed', { cause = 'Y' })")
            assert (caught.value.status, caught.value.code, caught.value.cause) == ("EFAILED", "X_FAILED", "Y")
            assert str(caught.value) == "run_string: it failed (X_FAILED, cause Y)"


class TestErrors:
    def test_fields_of_a_publication_failure(self):
        err = from_status(-14, "[phase fill, rank 1] rank 1: cannot plan the fill of chunk 3: x (FILL_FAILED, "
                               "cause WS_ECUDA)\nmore", "publish")
        assert (err.status, err.code, err.phase, err.rank, err.cause) == ("EFAILED", "FILL_FAILED", "fill", 1,
                                                                         "WS_ECUDA")
        assert str(err).startswith("publish: [phase fill, rank 1]")
        assert isinstance(err, WsyncError) and not isinstance(err, ValueError)

    def test_an_invalid_argument_is_a_value_error(self):
        err = from_status(-1, "register_tensor t: bad", "register_tensor")
        assert isinstance(err, wsync.InvalidArgument) and isinstance(err, ValueError)
        assert (err.code, err.phase, err.rank) == (None, None, None)

    def test_the_version(self):
        assert wsync.version() == (ROOT / "CMakeLists.txt").read_text().split("project(wsync VERSION ")[1].split()[0]


def test_the_readme_example_runs(tmp_path):
    # The example of README.md's section "Embedding wsync in a PyTorch trainer", with numpy.
    text = (ROOT / "README.md").read_text()
    start = text.index("```python\n# embedding example") + len("```python\n")
    code = text[start:text.index("```", start)]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "verdict: OK: 3 model versions published" in result.stdout, result.stdout
