"""Process topology (ParallelDims: one DeviceMesh, every group) and the one door for collectives (comm)."""
