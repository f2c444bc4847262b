"""The catalog: message types, contracts, queues, services, routes, priorities, and its DDL."""

from ksb.catalog.model import *  # noqa: F403  (the model is the package's public surface)
from ksb.catalog.model import __all__ as __all__
