__version__ = "0.1.0"

# Bumped on any incompatible change to the protocols in corerun.protocols; plugins declare the
# version they implement when they register, and the registry refuses a mismatch.
PROTOCOL_VERSION = 1
