"""The committed gRPC stubs must be exactly what proto/pathways.proto generates."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generated_stubs_match_proto(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-Ipathways_torch/rpc={ROOT}/proto",
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "proto" / "pathways.proto")], check=True, cwd=ROOT)
    for name in ("pathways_pb2.py", "pathways_pb2_grpc.py"):
        fresh = (tmp_path / "pathways_torch" / "rpc" / name).read_text()
        committed = (ROOT / "pathways_torch" / "rpc" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `make proto` and commit it"
