"""Moved to :mod:`corerun.testing.tiny_models` (public, for plugin tests too); re-exported here."""

from corerun.testing.tiny_models import *  # noqa: F401,F403
from corerun.testing.tiny_models import _BASE, _fresh_folder  # noqa: F401
