"""The process around the programs: mesh, multi-host agreement, preemption, allocator, XLA."""
