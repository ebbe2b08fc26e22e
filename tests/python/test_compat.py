"""wsync.vllm.compat: the one module that reads vLLM and torch past vLLM's documented ``LLM``
API. No other module of the package does (read from their code), vLLM outside the
supported range is refused when it is imported (a ``vllm`` module in place of the real one
says which version it is), and each reader answers from vLLM's members, or names the one
that is not there."""
from __future__ import annotations

import ast
import os
import re
import sys
import types
from pathlib import Path

import pytest

from conftest import ROOT
from wsync.vllm import compat
from wsync.vllm.failure import Failure

PACKAGE = ROOT / "bindings" / "python" / "wsync"

#: Members of vLLM's engine, EngineCore client, GPU worker and model that only compat reads.
VLLM_MEMBERS = {"llm_engine", "engine_core", "resources", "engine_dead", "engine_manager", "outputs_queue",
                "model_runner", "parallel_config", "get_model", "init_weight_transfer_engine", "start_weight_update",
                "update_weights", "finish_weight_update", "load_weights", "add_request", "abort_request",
                "RequestOutputKind", "WeightTransferConfig"}
#: torch's internals that only compat reads.
TORCH_MEMBERS = {"_C", "_parameters", "DisableTorchFunctionSubclass", "rebuild_cuda_tensor", "TypedStorage",
                 "reductions"}
#: Text that only compat holds: names of vLLM's and torch's members, and a part of vLLM's
#: parameters' names.
VLLM_TEXTS = VLLM_MEMBERS | TORCH_MEMBERS | {"routed_experts"}
#: vLLM's documented LLM API: all that is read of an ``llm`` outside compat.
LLM_API = {"generate", "collective_rpc", "sleep", "wake_up", "reset_prefix_cache"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _named(node: ast.AST, name: str) -> bool:
    """Whether ``node`` is ``name`` or ``<something>.name``."""
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def internal_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Each place in the Python file ``path`` that reaches past vLLM's documented API, as
    "file:line: what" (the file from ``root``). By its code (comments and docstrings may name anything):

    - an import of vllm (compat.vllm() checks its version) or of torch's internals;
    - a member of VLLM_MEMBERS or TORCH_MEMBERS, read as an attribute (of anything but
      ``compat``, whose readers may bear the names of what they read);
    - a string that is one of VLLM_TEXTS (``getattr(x, "resources")``), or holds one that
      reads as a name (``"engine_core"``, ``"_C"``, ``".routed_experts."``), not as a word;
    - of an ``llm`` (``llm`` or ``<x>.llm``), anything but LLM_API;
    - any member of a vLLM worker: ``<x>.worker.<member>``, and ``self.<member>`` in the
      worker extension (a class mixed into vLLM's worker) but its own ``wsync_*`` and
      ``__dict__``.
    """
    source = path.read_text()
    tree = ast.parse(source, str(path))
    docstrings = _docstrings(tree)
    where = path.relative_to(root)
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {what}")

    extensions = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "WorkerExtension"]
    in_extension = {id(node) for extension in extensions for node in ast.walk(extension)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm" or alias.name.startswith(("torch._C", "torch.multiprocessing")):
                    hit(node, f"imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "vllm" or node.module.startswith(("torch._C", "torch.multiprocessing")):
                hit(node, f"imports from {node.module}")
        elif isinstance(node, ast.Attribute) and not _named(node.value, "compat"):
            if node.attr in VLLM_MEMBERS | TORCH_MEMBERS:
                hit(node, f"reads .{node.attr}")
            elif _named(node.value, "llm") and node.attr not in LLM_API:
                hit(node, f"reads LLM.{node.attr}, which is not LLM's documented API ({', '.join(sorted(LLM_API))})")
            elif _named(node.value, "worker"):
                hit(node, f"reads the vLLM worker's .{node.attr}")
            elif (id(node) in in_extension and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and not node.attr.startswith("wsync_") and node.attr != "__dict__"):
                hit(node, f"reads the vLLM worker's .{node.attr} (self in the worker extension)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for text in sorted(VLLM_TEXTS):
                named = text.lower() != text or "_" in text
                if node.value == text or (named and re.search(rf"(?<![A-Za-z0-9_]){text}(?![A-Za-z0-9_])",
                                                              node.value)):
                    hit(node, f"names {text} in a string")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_no_module_but_compat_reaches_past_vllms_documented_api():
    files = sorted(path for path in PACKAGE.rglob("*.py") if path != PACKAGE / "vllm" / "compat.py")
    assert PACKAGE / "vllm" / "runtime" / "engine.py" in files and PACKAGE / "vllm" / "worker" / "extension.py" in files
    found = [use for path in files for use in internal_uses(path)]
    assert not found, "vLLM's or torch's internals outside wsync.vllm.compat (move them there):\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_use(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text('"""Names engine_core, routed_experts, worker.rank freely."""\n'
                    "import vllm\n"
                    "from vllm.config import WeightTransferConfig\n"
                    "import torch._C\n"
                    "core = getattr(self.llm.llm_engine, 'engine_core', None)\n"
                    "name = 'model.experts.routed_experts.w2'  # engine_dead in a comment\n"
                    "why = 'frees the resources', 'resident_parameters', hasattr(core, 'resources')\n"
                    "self.worker.device\n"
                    "off = torch._C.DisableTorchFunctionSubclass\n"
                    "llm.generate([]), compat.engine_dead(llm), compat.worker_rank(self.worker)\n"
                    "class WorkerExtension:\n"
                    "    def wsync_identity(self):\n"
                    "        return self.rank, self.wsync_channel, self.__dict__\n")
    found = internal_uses(path, tmp_path)
    assert [int(use.split(":")[1]) for use in found] == [2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 13], found
    assert "sample.py:5: names engine_core in a string" in found
    assert "sample.py:7: names resources in a string" in found
    assert "sample.py:13: reads the vLLM worker's .rank (self in the worker extension)" in found


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
    with pytest.warns(compat.UnsupportedVllmWarning, match=rf"^vLLM {version} is not one wsync supports \(0.26.x: "
                                                           r".*; running it anyway \(WSYNC_VLLM_UNSUPPORTED=1\)$"):
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
    code = ("import sys, wsync.vllm.compat, wsync.vllm.runtime.engine, wsync.vllm.worker.extension, wsync.vllm.worker.wire; "
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


def test_the_two_processes_code_imports_only_what_they_share():
    """wsync.vllm.runtime runs in the runtime's main process, wsync.vllm.worker inside
    vLLM's TP workers: neither imports the other (only wsync.vllm's shared modules), so what
    a process loads is what it runs."""
    import ast
    sides = {"runtime": "worker", "worker": "runtime"}
    for side, other in sides.items():
        for path in sorted((PACKAGE / "vllm" / side).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [alias.name for alias in node.names]
                    reached = (node.level == 2 and names[0] in (other, "")
                               and (names[0] == other or other in names[1:])) \
                        or (node.level == 0 and names[0].startswith(f"wsync.vllm.{other}"))
                elif isinstance(node, ast.Import):
                    reached = any(alias.name.startswith(f"wsync.vllm.{other}") for alias in node.names)
                else:
                    continue
                assert not reached, f"{path.relative_to(PACKAGE)}:{node.lineno} imports wsync.vllm.{other}"
