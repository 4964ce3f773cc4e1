"""The served proto: committed stubs match a fresh generation, and every message and field is
wire-compatible with the stubs the stock clients ship (tritonclient.grpc, kserve).

The clients' descriptors are read from the serialized ``FileDescriptorProto`` in their
generated ``*_pb2.py`` source, without importing them: tritonclient's and kserve's stubs
declare the same ``inference.*`` names in protobuf's default pool and cannot both be loaded
in one process.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from app.grpc.generated import grpc_service_pb2 as pb
from tests.support.gunicorn import ROOT

Fields = dict[str, tuple[int, int, int, str]]


def client_descriptors(module: str) -> list[descriptor_pb2.FileDescriptorProto]:
    """The FileDescriptorProtos a client's generated module registers, parsed from its source."""
    spec = importlib.util.find_spec(module.rsplit(".", 1)[0])
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations))) / (module.rsplit(".", 1)[1] + ".py")
    found = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            arg = node.args[0]
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, bytes)
            found.append(descriptor_pb2.FileDescriptorProto.FromString(arg.value))
    assert found, source
    return found


def messages(files: list[descriptor_pb2.FileDescriptorProto]) -> dict[str, Fields]:
    """Full message name -> {field name: (number, type, label, type name)}, nested included."""
    out: dict[str, Fields] = {}

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        out[name] = {f.name: (f.number, f.type, f.label, f.type_name) for f in message.field}
        for nested in message.nested_type:
            walk(name, nested)

    for file in files:
        for message in file.message_type:
            walk(f".{file.package}", message)
    return out


def enums(files: list[descriptor_pb2.FileDescriptorProto]) -> dict[str, dict[str, int]]:
    out = {}
    for file in files:
        for enum in file.enum_type:
            out[f".{file.package}.{enum.name}"] = {v.name: v.number for v in enum.value}
        for message in file.message_type:
            for enum in message.enum_type:
                out[f".{file.package}.{message.name}.{enum.name}"] = {v.name: v.number for v in enum.value}
    return out


OURS = [descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)]
#: Messages whose fields KServe's proto numbers otherwise than Triton's (KServe's
#: ``RepositoryModelLoadRequest`` is ``model_name = 1``, Triton's ``repository_name = 1, model_name =
#: 2``): the server speaks Triton's, which tritonclient's ``load_model``/``unload_model`` send.
TRITON_ONLY = {".inference.RepositoryModelLoadRequest", ".inference.RepositoryModelUnloadRequest"}
CLIENTS = {
    "tritonclient": ["tritonclient.grpc.service_pb2", "tritonclient.grpc.model_config_pb2"],
    "kserve": ["kserve.protocol.grpc.grpc_predict_v2_pb2"],
}


def test_committed_stubs_match_a_fresh_generation() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_grpc"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_every_field_matches_the_clients_proto(client: str) -> None:
    theirs_files = [f for module in CLIENTS[client] for f in client_descriptors(module)]
    theirs, ours = messages(theirs_files), messages(OURS)
    service = next(s for f in theirs_files for s in f.service if s.name == "GRPCInferenceService")
    served = {m.name: (m.input_type, m.output_type) for m in OURS[0].service[0].method}
    # every RPC we serve that the client knows has the same request and response types
    shared = [m for m in service.method if m.name in served]
    assert {m.name for m in shared} >= {"ServerLive", "ModelInfer", "ModelMetadata"}
    for method in shared:
        assert served[method.name] == (method.input_type, method.output_type), method.name
    # every field we declare exists there under the same number, type and label
    checked = 0
    for name, fields in ours.items():
        if name not in theirs or (client == "kserve" and name in TRITON_ONLY):
            assert client == "kserve", f"{name} is not in {client}'s proto"
            continue
        for field, spec in fields.items():
            other = theirs[name].get(field)
            # Triton's proto extends KServe's: a Triton-only field is unknown to kserve (skipped)
            assert other == spec or (client == "kserve" and other is None), f"{name}.{field}: {other}"
            checked += other is not None
    assert checked > {"tritonclient": 100, "kserve": 50}[client]
    for name, values in enums(OURS).items():
        if name in enums(theirs_files):
            assert values.items() <= enums(theirs_files)[name].items(), name
