"""The dataquay node daemon, its CLI and its operational pieces."""

#: The package's version; pyproject.toml reads it from here.
__version__ = "0.1.0"
