"""``hvdkit doctor``: environment checks and the allreduce worker they launch."""
