"""wsync.vllm.compat: the one module that reads vLLM and torch past vLLM's documented ``LLM``
API. vLLM outside the supported range is refused when it is imported (a ``vllm`` module in
place of the real one says which version it is), and each reader answers from vLLM's
members, or names the one that is not there."""
from __future__ import annotations

import os
import sys
import types

import pytest

from conftest import ROOT
from wsync.vllm import compat
from wsync.vllm.server import Failure

PACKAGE = ROOT / "bindings" / "python" / "wsync"


# The version check ---------------------------------------------------------------------------


def fake_vllm(monkeypatch, version: str = "0.26.0") -> types.ModuleType:
    """A ``vllm`` module of ``version`` in sys.modules, in place of any real one."""
    module = types.ModuleType("vllm")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv(compat.UNSUPPORTED_VARIABLE, raising=False)
    return module


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.26.1rc1.dev42+g1234abc"])
def test_a_supported_vllm_is_imported(monkeypatch, version):
    module = fake_vllm(monkeypatch, version)
    assert compat.vllm() is module
    assert compat.found_version() == version


@pytest.mark.parametrize("version", ["0.25.1", "0.27.0", "1.26.0", "dev"])
def test_another_vllm_is_refused_naming_it_and_the_supported_range(monkeypatch, version):
    fake_vllm(monkeypatch, version)
    with pytest.raises(compat.VllmUnsupported) as refused:
        compat.vllm()
    assert isinstance(refused.value, Failure) and refused.value.code == "VLLM_UNSUPPORTED" and refused.value.fatal
    message = refused.value.message
    assert message.startswith(f"vLLM {version} is not one wsync supports (0.26.x: ")
    assert "set WSYNC_VLLM_UNSUPPORTED=1 to run this one anyway" in message


def test_the_check_is_made_again_for_another_vllm(monkeypatch):
    fake_vllm(monkeypatch, "0.26.0")
    compat.vllm()
    fake_vllm(monkeypatch, "0.27.0")
    with pytest.raises(compat.VllmUnsupported, match="vLLM 0.27.0"):
        compat.vllm()


@pytest.mark.parametrize("version", ["0.25.1", "0.27.0"])
def test_wsync_vllm_unsupported_turns_the_refusal_into_a_warning(monkeypatch, version):
    module = fake_vllm(monkeypatch, version)
    monkeypatch.setenv("WSYNC_VLLM_UNSUPPORTED", "1")
    with pytest.warns(compat.UnsupportedVllmWarning, match=rf"vLLM {version} is not one wsync supports \(0.26.x"):
        assert compat.vllm() is module
    fake_vllm(monkeypatch, version)
    monkeypatch.setenv("WSYNC_VLLM_UNSUPPORTED", "0")  # (only 1 says so)
    with pytest.raises(compat.VllmUnsupported):
        compat.vllm()


def test_the_range_reads_as_releases(monkeypatch):
    assert compat.supported_range() == "0.26.x"
    monkeypatch.setattr(compat, "SUPPORTED_VLLM", ((0, 26), (0, 28)))
    assert compat.supported_range() == "0.26.x to 0.28.x"
    compat.check_version("0.27.2")
    with pytest.raises(compat.VllmUnsupported, match=r"\(0.26.x to 0.28.x: "):
        compat.check_version("0.29.0")


def test_importing_the_package_imports_neither_vllm_nor_torch():
    import subprocess
    code = ("import sys, wsync.vllm.compat, wsync.vllm.engine, wsync.vllm.extension, wsync.vllm.wire; "
            "print(sorted(name for name in ('vllm', 'torch') if name in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert found.stdout.strip() == "[]"


# The readers, on vLLM's members in stand-ins ----------------------------------------------------


class MPClient:
    """vLLM's base of the clients of an EngineCore in processes of its own."""


class SyncMPClient(MPClient):
    def __init__(self, resources=None, outputs=()):
        import queue
        self.resources = resources
        self.outputs_queue = queue.Queue()
        for output in outputs:
            self.outputs_queue.put(output)
        self.shut = False

    def shutdown(self):
        self.shut = True


class InprocClient:
    """vLLM's client of an EngineCore in this process: no resources, no outputs queue."""


class CoreEngineProcManager:
    def __init__(self, pids):
        self.processes = [types.SimpleNamespace(pid=pid) for pid in pids]


@pytest.fixture
def vllm_internals(monkeypatch):
    """A vLLM 0.26 in place of the real one with the modules compat reads."""
    core_client = types.ModuleType("vllm.v1.engine.core_client")
    core_client.MPClient = MPClient
    utils = types.ModuleType("vllm.v1.engine.utils")
    utils.CoreEngineProcManager = CoreEngineProcManager
    config = types.ModuleType("vllm.config")
    config.WeightTransferConfig = lambda backend: ("WeightTransferConfig", backend)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    fake_vllm(monkeypatch)
    for name, module in (("vllm.v1.engine.core_client", core_client), ("vllm.v1.engine.utils", utils),
                         ("vllm.config", config), ("vllm.sampling_params", sampling)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(core_client=core_client, utils=utils, config=config, sampling=sampling)


def llm_with(client, **engine):
    return types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=client, **engine))


def test_the_engine_core_clients_members(vllm_internals):
    resources = types.SimpleNamespace(engine_manager=CoreEngineProcManager([11, 12]), engine_dead=False)
    client = SyncMPClient(resources, outputs=["out"])
    llm = llm_with(client)
    assert compat.engine_core_client(llm) is client
    assert compat.engine_core_pids(llm) == [11, 12]
    assert compat.engine_dead(llm) is False and compat.pending_outputs(llm) is True
    resources.engine_dead = True
    client.outputs_queue.get()
    assert compat.engine_dead(llm) is True and compat.pending_outputs(llm) is False
    compat.shutdown_engine_core(llm)
    assert client.shut
    # engines vLLM did not start here as processes: none to watch
    resources.engine_manager = None
    assert compat.engine_core_pids(llm) == []
    resources.engine_manager = object()  # (Ray's actors)
    assert compat.engine_core_pids(llm) == []


def test_an_engine_core_in_this_process_has_no_processes_nor_pending_outputs(vllm_internals):
    llm = llm_with(InprocClient())
    assert compat.engine_core_pids(llm) == [] and compat.engine_dead(llm) is False
    assert compat.pending_outputs(llm) is False


class MovedClient(MPClient):
    """An MPClient whose members moved (another vLLM)."""

    def __init__(self, **members):
        self.__dict__.update(members)


@pytest.mark.parametrize("llm, reader, missing", [
    (types.SimpleNamespace(llm_engine=types.SimpleNamespace()), compat.engine_core_client,
     "LLM.llm_engine.engine_core"),
    (llm_with(MovedClient()), compat.engine_dead, "LLM.llm_engine.engine_core.resources"),
    (llm_with(MovedClient(resources=types.SimpleNamespace())), compat.engine_dead,
     "LLM.llm_engine.engine_core.resources.engine_dead"),
    (llm_with(MovedClient(resources=types.SimpleNamespace())), compat.engine_core_pids,
     "LLM.llm_engine.engine_core.resources.engine_manager"),
    (llm_with(MovedClient(resources=types.SimpleNamespace(engine_manager=CoreEngineProcManager.__new__(
        CoreEngineProcManager)))), compat.engine_core_pids,
     "LLM.llm_engine.engine_core.resources.engine_manager.processes"),
    (llm_with(MovedClient()), compat.pending_outputs, "LLM.llm_engine.engine_core.outputs_queue"),
    (llm_with(MovedClient()), compat.shutdown_engine_core, "LLM.llm_engine.engine_core.shutdown"),
])
def test_a_missing_engine_member_is_named_with_the_vllm_found(vllm_internals, llm, reader, missing):
    sys.modules["vllm"].__version__ = "0.26.9"
    with pytest.raises(compat.VllmUnsupported) as failed:
        reader(llm)
    assert failed.value.code == "VLLM_UNSUPPORTED" and failed.value.fatal
    assert failed.value.message.startswith(f"{missing} is not there: wsync reads it as vLLM 0.26 has it, and this "
                                           "is vLLM 0.26.9 (supported: vLLM 0.26.x; ")


def test_a_missing_vllm_module_is_named(vllm_internals, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core_client", None)  # (import fails)
    with pytest.raises(compat.VllmUnsupported, match="^VLLM_UNSUPPORTED: vllm.v1.engine.core_client.MPClient is not"):
        compat.engine_dead(llm_with(SyncMPClient()))
    del vllm_internals.config.WeightTransferConfig
    with pytest.raises(compat.VllmUnsupported, match="^VLLM_UNSUPPORTED: vllm.config.WeightTransferConfig is not"):
        compat.ipc_weight_transfer_config()


def test_the_engines_requests_and_the_weight_transfer_setup(vllm_internals):
    calls = []
    engine = types.SimpleNamespace(add_request=lambda *args: calls.append(("add", args)),
                                   step=lambda: ["output"],
                                   abort_request=lambda ids: calls.append(("abort", ids)))
    llm = types.SimpleNamespace(llm_engine=engine, init_weight_transfer_engine=lambda info: calls.append(info))
    compat.add_request(llm, "wsync-1", "prompt", "params")
    assert compat.engine_step(llm) == ["output"]
    compat.abort_requests(llm, ["wsync-1"])
    compat.init_ipc_weight_transfer(llm)
    assert calls == [("add", ("wsync-1", "prompt", "params")), ("abort", ["wsync-1"]), {"init_info": {}}]
    assert compat.ipc_weight_transfer_config() == ("WeightTransferConfig", "ipc")
    assert compat.delta_output_kind() == "delta"
    for reader, member in ((compat.engine_step, "LLM.llm_engine.step"),
                           (compat.init_ipc_weight_transfer, "LLM.init_weight_transfer_engine")):
        with pytest.raises(compat.VllmUnsupported, match=f"^VLLM_UNSUPPORTED: {member} is not there"):
            reader(types.SimpleNamespace(llm_engine=types.SimpleNamespace()))


def test_the_workers_members(vllm_internals):
    calls = []
    model = types.SimpleNamespace(load_weights=lambda weights: calls.append(("load", weights)))
    worker = types.SimpleNamespace(device="cuda:0", rank=0, parallel_config=types.SimpleNamespace(
        tensor_parallel_size=2), get_model=lambda: model,
        start_weight_update=lambda: calls.append("start"), update_weights=lambda info: calls.append(info),
        finish_weight_update=lambda: calls.append("finish"))
    assert compat.worker_device(worker) == "cuda:0" and compat.worker_rank(worker) == 0
    assert compat.tensor_parallel_size(worker) == 2 and compat.worker_model(worker) is model
    compat.start_weight_update(worker)
    compat.update_weights(worker, {"names": []})
    compat.finish_weight_update(worker)
    compat.load_weights(model, [("a", 1)])
    assert calls == ["start", {"names": []}, "finish", ("load", [("a", 1)])]
    bare = types.SimpleNamespace(parallel_config=types.SimpleNamespace())
    for reader, member in ((compat.worker_device, "device"), (compat.worker_rank, "rank"),
                           (compat.tensor_parallel_size, "parallel_config.tensor_parallel_size"),
                           (compat.worker_model, "get_model"), (compat.start_weight_update, "start_weight_update"),
                           (compat.finish_weight_update, "finish_weight_update")):
        with pytest.raises(compat.VllmUnsupported, match=rf"^VLLM_UNSUPPORTED: the vLLM worker's {member} is not "
                                                         r"there: .* this is vLLM 0.26.0 "):
            reader(bare)
    with pytest.raises(compat.VllmUnsupported, match="^VLLM_UNSUPPORTED: the vLLM model's load_weights is not there"):
        compat.load_weights(bare, [])


def test_a_missing_member_names_the_installed_vllm_when_none_is_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with pytest.raises(compat.VllmUnsupported, match=r"this is vLLM \S+"):
        compat.worker_rank(types.SimpleNamespace())


def test_vllm_parameter_names_map_to_the_loader_plans():
    # vLLM 0.26 keeps a MoE layer's experts in its runner's routed_experts module.
    assert compat.resident_name("model.layers.3.mlp.experts.routed_experts.w13_weight") == \
        "model.layers.3.mlp.experts.w13_weight"
    assert compat.resident_name("model.layers.3.mlp.experts.routed_experts.w2_weight") == \
        "model.layers.3.mlp.experts.w2_weight"
    for same in ("model.layers.3.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.0.self_attn.qkv_proj.weight"):
        assert compat.resident_name(same) == same


def test_torchs_members():
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    dicts = compat.parameter_dicts(net)
    assert [sorted(held) for held in dicts] == [[], ["bias", "weight"], []]
    assert dicts[1]["weight"] is net[0].weight

    class Dispatching(torch.nn.Parameter):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            Dispatching.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})
    parameter = Dispatching(torch.zeros(2))
    with compat.plain_parameters():
        assert parameter.data_ptr() and parameter.shape == (2,) and Dispatching.calls == 0
    assert parameter.shape == (2,) and Dispatching.calls > 0
    with pytest.raises(compat.VllmUnsupported, match=r"^VLLM_UNSUPPORTED: torch.nn.Module._parameters is not there: "
                                                     r"wsync reads it as torch 2.11 has it, and this is torch 2\."):
        compat.parameter_dicts(types.SimpleNamespace(modules=lambda: [object()]))


def test_the_storage_handle_and_the_rebuild_arguments():
    torch = types.SimpleNamespace(Tensor="Tensor", Size=lambda dims: ("Size", tuple(dims)),
                                  storage=types.SimpleNamespace(TypedStorage="Typed"), uint8="uint8")
    handle = bytes(range(64))
    assert compat.storage_handle(handle) == b"\x02c" + handle
    with pytest.raises(ValueError, match="a cudaIpcMemHandle_t is 64 bytes, not 63"):
        compat.storage_handle(handle[:63])
    args = compat.cuda_ipc_rebuild_args(torch, handle, 4096, 128, 96, b"/refcount")
    assert args == ("Tensor", ("Size", (96,)), (1,), 128, "Typed", "uint8", 0, b"\x02c" + handle, 4096, 0, False,
                    b"/refcount", 0, b"", False)
