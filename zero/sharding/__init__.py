"""ZeRO proper: flat partitioned buffers (buckets), the stage 0-2 gradient reducers and optimizer, stage-3 units."""
