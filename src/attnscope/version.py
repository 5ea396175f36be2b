"""attnscope's version, in a module that imports nothing (the package, the CLI and manifests read it)."""

__version__ = "0.1.0"
