"""corerun's plugin system, one module per idea.

- :mod:`~corerun.plugin.hookspecs`: the hooks a plugin implements, each handed a ``register`` callback.
- :mod:`~corerun.plugin.capabilities`: what an implementation declares it supports, and ``Need``, what it
  must fit (plain data the protocols import, so it sits below them).
- :mod:`~corerun.plugin.registration`: one registered implementation: loading, probing, building it.
- :mod:`~corerun.plugin.registry`: discovery: the built-ins and the installed entry points, by kind and name.
- :mod:`~corerun.plugin.selection`: choosing among what was discovered (a name as given, or ``auto``).
- :mod:`~corerun.plugin.trust`: built-in, first-party or third-party, and the certificates ``auto`` reads.
- :mod:`~corerun.plugin.builtin`: corerun's own implementations, registered like any plugin's; loaded by
  name, so it may import the layers it registers.

This package is private; plugins import the same names from :mod:`corerun.sdk` (docs/plugins.md).
Importing it imports nothing.
"""
