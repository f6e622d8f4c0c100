"""Facts about the machine corerun runs on, read in one place (:mod:`corerun.platform.host`).

The lowest layer of the package: it imports nothing of corerun, and no torch until a function needs it.
"""
