"""Install pathways_torch and its ``pathways-run`` launcher.

Dependencies are pinned in requirements.txt (the one place); this file reads them.
"""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "requirements.txt")) as f:
    pins = [l.strip() for l in f if l.strip() and not l.startswith("#")]
_test = ("pytest", "pytest-timeout", "grpcio-tools", "hypothesis", "torchvision",
         "transformers", "kubernetes-validate", "jsonschema", "jsonschema-specifications",
         "referencing", "rpds-py", "attrs", "importlib_resources", "PyYAML")
_torchx = ("torchx-nightly", "kubernetes", "docker", "docstring_parser", "tabulate",
           "durationpy", "oauthlib", "requests-oauthlib", "websocket-client", "aiohappyeyeballs",
           "aiohttp", "aiohttp-retry", "aiosignal", "frozenlist", "multidict", "propcache", "yarl")


def _named(p: str, names: tuple) -> bool:
    return p.split("==")[0] in names


runtime_pins = [p for p in pins if not _named(p, _test + _torchx + ("wheel",))]

setup(
    name="pathways_torch",
    version="0.1.0",
    description="Pathways for PyTorch: one client drives sharded XLA programs on many devices",
    packages=find_packages(include=["pathways_torch", "pathways_torch.*"]),
    python_requires=">=3.10",
    install_requires=runtime_pins,
    extras_require={"test": [p for p in pins if _named(p, _test)],
                    "torchx": [p for p in pins if _named(p, _torchx)]},
    entry_points={
        "console_scripts": ["pathways-run = pathways_torch.launch:main"],
        # `torchx run pathways.cluster`. Registering any [torchx.components] entry hides
        # TorchX's builtins unless they are registered too: "_" maps them unprefixed.
        "torchx.components": ["pathways = pathways_torch.deploy.torchx",
                              "_ = torchx.components"],
    },
)
