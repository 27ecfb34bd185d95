"""Process runtime: the communicator over torch.distributed, GC pauses and device placement."""
