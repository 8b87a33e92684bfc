"""Generate the Python modules of the slorouter.v1 protos.

    python scripts/gen_proto.py            # regenerate in place (proto/)
    python scripts/gen_proto.py --check    # exit 1 if the committed modules are stale

The generated modules are committed so that installing the package needs no
protoc; ``--check`` (run by ``make test`` and by a test) keeps them honest.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("slorouter") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto into ``out_dir``; return the files written."""
    protos = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    # protoc-gen-mypy and protoc-gen-mypy_grpc live beside this interpreter.
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out=quiet:{out_dir}",
        f"--mypy_grpc_out=quiet:{out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT, env=env)
    return sorted(p for p in (out_dir / PACKAGE_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Names of generated modules that differ from (or are missing in) proto/."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed_dir = PROTO_ROOT / PACKAGE_DIR
        fresh_names = {p.name for p in fresh}
        committed = {p.name for p in committed_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        stale = sorted(committed - fresh_names)
        for path in fresh:
            target = committed_dir / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(path.name)
        return sorted(stale)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the committed modules are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(
                "generated protobuf modules are stale: "
                + ", ".join(stale)
                + "\nrun: python scripts/gen_proto.py",
                file=sys.stderr,
            )
            return 1
        print("generated protobuf modules are current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PROTO_ROOT / PACKAGE_DIR / path.name)
    print(f"regenerated {PROTO_ROOT / PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
