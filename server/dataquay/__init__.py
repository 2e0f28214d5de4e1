"""dataquay: data staging for distributed deep-learning training."""

from pkgutil import extend_path

# Folders of three source trees (protos, client, server) make up this package
# in a checkout; an install puts them in one.
__path__ = extend_path(__path__, __name__)

from dataquay.server import __version__ as __version__
