"""Package discovery (the rest of the metadata is in pyproject.toml). Every folder of the four top-level packages is
found, so a new sub-package ships without a list to update; kernels/, models/ and integrations/ go under the `moe_lst`
namespace (pyproject.toml's package-dir says where each lives)."""

from setuptools import find_namespace_packages, setup

TOP_LEVEL = ("moe", "sequence_parallel", "zero", "recipes")
NAMESPACED = {"moe_lst.kernels": "kernels", "moe_lst.models": "models", "moe_lst.data": "data",
              "moe_lst.integrations": "integrations"}
SKIP = ("__pycache__", "*.__pycache__")  # (namespace discovery would take any folder, bytecode caches too)


def discover() -> list[str]:
    # Namespace discovery also takes the data folders (recipes/conf/*, kernels/csrc), whose files package-data adds.
    found = find_namespace_packages(include=[*TOP_LEVEL, *(f"{p}.*" for p in TOP_LEVEL)], exclude=SKIP)
    for name, folder in NAMESPACED.items():
        found += [name, *(f"{name}.{sub}" for sub in find_namespace_packages(where=folder, exclude=SKIP))]
    return sorted(found)


setup(packages=discover())
