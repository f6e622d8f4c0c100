__version__ = "0.1.0"

# Bumped on any incompatible change to the protocols in corerun.protocols; plugins declare the
# version they implement when they register, and the registry refuses a mismatch.
#   1: the first release.
#   2: the scheduler states its changes: KVCacheManager.new_block_ids (and trim returns the length
#      kept), ScheduledBatch.new_block_ids / resumed_ids / finished_ids, SamplingMetadata.finished_seq_ids
#      (a sampler's per-request state lives until its request finishes, not until it skips a step).
#   3: KVCacheManager.allocate_slots returns the block ids the table gained (None when blocks run out)
#      instead of a bool, and new_block_ids is gone; ScheduledBatch is plain frozen data.
PROTOCOL_VERSION = 3
