"""Install pathways_torch and its ``pathways-run`` launcher.

Dependencies are pinned in requirements.txt (the one place); this file reads them.
"""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "requirements.txt")) as f:
    pins = [l.strip() for l in f if l.strip() and not l.startswith("#")]
_test = ("pytest", "grpcio-tools", "hypothesis", "torchvision", "transformers",
         "kubernetes-validate", "jsonschema", "referencing", "rpds-py", "attrs",
         "importlib_resources", "PyYAML")
runtime_pins = [p for p in pins if not p.startswith(_test + ("wheel",))]

setup(
    name="pathways_torch",
    version="0.1.0",
    description="Pathways for PyTorch: one client drives sharded XLA programs on many devices",
    packages=find_packages(include=["pathways_torch", "pathways_torch.*"]),
    python_requires=">=3.10",
    install_requires=runtime_pins,
    extras_require={"test": [p for p in pins if p.startswith(_test)]},
    entry_points={"console_scripts": ["pathways-run = pathways_torch.launch:main"]},
)
