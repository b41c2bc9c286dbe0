"""The container image's version matrix (slurm/Dockerfile) agrees with the packages' own metadata: the
base image is SGLang's release of the pinned SGLang, its torch is the one that SGLang declares, Transformer
Engine lies in the range megatron-core declares, for the CUDA major SGLang's kernels are built for, and
slurm/README.md names what the image holds."""

from __future__ import annotations

import importlib.metadata as metadata
import re

from packaging.requirements import Requirement

from tests.conftest import REPO

SLURM = REPO / "slurm"


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", (SLURM / "Dockerfile").read_text(), flags=re.MULTILINE))


def declared(package: str, name: str, extra: str | None = None) -> Requirement:
    """`package`'s requirement on `name` (from its installed metadata), optionally the one under `extra`."""
    for line in metadata.requires(package) or []:
        requirement = Requirement(line)
        in_extra = requirement.marker is not None and requirement.marker.evaluate({"extra": extra or ""})
        if requirement.name.replace("_", "-") == name and (
            requirement.marker is None or (extra and in_extra)
        ):
            return requirement
    raise AssertionError(f"{package} declares no requirement on {name} (extra {extra})")


def pin(requirements: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}==(\S+)$", (REPO / requirements).read_text(), flags=re.MULTILINE)
    assert match, f"{requirements} does not pin {name}"
    return match.group(1)


def test_base_image_and_torch_are_the_ones_sglang_pins() -> None:
    args = dockerfile_args()
    sglang = metadata.version("sglang")
    assert args["SGLANG_VERSION"] == sglang == pin("requirements-sglang.txt", "sglang")
    assert args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{sglang}"
    torch_pin = declared("sglang", "torch")
    assert str(torch_pin.specifier) == f"=={args['TORCH_VERSION']}", torch_pin
    # SGLang's kernels (flashinfer) come for one CUDA major; TE is installed for the same one.
    flashinfer = declared("sglang", "flashinfer-python")
    assert flashinfer.extras == {f"cu{args['CUDA_MAJOR']}"}, flashinfer


def test_transformer_engine_and_megatron_core_agree() -> None:
    args = dockerfile_args()
    mcore = metadata.version("megatron-core")
    assert (
        args["MEGATRON_CORE_VERSION"]
        == mcore
        == pin("requirements-cluster.txt", "megatron-core")
        == pin("requirements.txt", "megatron-core")
    )
    te = declared("megatron-core", "transformer-engine", extra="dev")
    assert te.specifier.contains(args["TRANSFORMER_ENGINE_VERSION"], prereleases=True), te
    assert f"core_cu{args['CUDA_MAJOR']}" in te.extras, te
    # megatron-core's own torch floor holds for SGLang's torch.
    assert declared("megatron-core", "torch").specifier.contains(args["TORCH_VERSION"])
    # The image's transformers is SGLang's; the project's pin must be the same one.
    assert (
        str(declared("sglang", "transformers").specifier)
        == f"=={pin('requirements-cluster.txt', 'transformers')}"
    )


def test_readme_names_the_image_and_its_versions() -> None:
    args = dockerfile_args()
    text = (SLURM / "README.md").read_text()
    for name in ("SGLANG_IMAGE", "TORCH_VERSION", "TRANSFORMER_ENGINE_VERSION", "MEGATRON_CORE_VERSION"):
        assert args[name] in text, f"slurm/README.md does not name {name}={args[name]}"
    assert "enroot import" in text and "docker build -f slurm/Dockerfile" in text
