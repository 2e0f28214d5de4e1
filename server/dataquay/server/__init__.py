"""The dataquay node daemon, its CLI and its operational pieces."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dataquay")
except PackageNotFoundError:
    __version__ = "0+unknown"
