"""``hvdkit run``: hostfile parsing and command building (pure), and running the job."""
