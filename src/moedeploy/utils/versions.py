"""Versions of the optional and supporting libraries, read from package metadata.

`moedeploy version` lists these beside the core libraries an artifact's manifest records.
They come from importlib.metadata, so nothing heavy (TensorRT, transformers, PyTriton) is
imported just to print a number, and a missing package reads "not installed" with the
command that installs it.
"""

from __future__ import annotations

import importlib.metadata
import platform
from collections.abc import Mapping

# import name -> (distribution name users install, how to get it)
LIBRARIES: dict[str, tuple[str, str]] = {
    "numpy": ("numpy", "pip install moedeploy"),
    "polygraphy": ("polygraphy", "pip install moedeploy"),
    "transformers": ("transformers", "pip install transformers"),
    "pytriton": ("nvidia-pytriton", "pip install 'moedeploy[serve]'"),
    "tritonclient": ("tritonclient", "pip install 'moedeploy[serve]'"),
    "tensorrt": ("tensorrt", "pip install 'moedeploy[gpu]'"),
    "triton": ("triton", "pip install 'moedeploy[gpu]'"),
    # bench's peer engines (`moedeploy bench --peers`)
    "llama_cpp": ("llama-cpp-python", "pip install 'moedeploy[peers]'"),
    "openvino": ("openvino", "pip install 'moedeploy[peers]'"),
}
NOT_INSTALLED = "not installed"


def installed_version(import_name: str, providers: Mapping[str, list[str]] | None = None) -> str | None:
    """The version of the distribution that provides `import_name`, or None when none does.

    TensorRT's module comes from differently named wheels (tensorrt, tensorrt-cu12, ...),
    so the providing distribution is looked up (importlib.metadata.packages_distributions(),
    pass it in to scan once) rather than assumed.
    """
    if providers is None:
        providers = importlib.metadata.packages_distributions()
    for distribution in [*providers.get(import_name, []), LIBRARIES.get(import_name, (import_name,))[0]]:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


#: the libraries an artifact's manifest records (export/exporter.library_versions reads them
#: off the imported modules; `moedeploy version` off their metadata, without importing torch)
CORE = ("torch", "onnx", "onnxscript", "onnxruntime")


def core_versions(providers: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    """moedeploy, then each library of CORE: its installed version (metadata), or "not installed"."""
    import moedeploy

    providers = importlib.metadata.packages_distributions() if providers is None else providers
    return {"moedeploy": moedeploy.__version__,
            **{name: installed_version(name, providers) or NOT_INSTALLED for name in CORE}}


def supporting_versions(providers: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    """Python, then each library of LIBRARIES: its version, or "not installed (<how to get it>)"."""
    versions = {"python": platform.python_version()}
    providers = importlib.metadata.packages_distributions() if providers is None else providers
    for import_name, (distribution, hint) in LIBRARIES.items():
        version = installed_version(import_name, providers)
        versions[distribution] = version or f"{NOT_INSTALLED} ({hint})"
    return versions
