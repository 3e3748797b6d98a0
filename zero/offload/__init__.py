"""Where fp32 masters and optimizer state live: the device, host memory or nvme files (ZeRO-Offload / -Infinity)."""
