"""Where a step's time goes: ``hvdkit run --profile [DIR]``.

Each rank records, for every optimizer step, the time in five phases (:mod:`.recorder`):

- ``data``: waiting for the next batch (a torch ``DataLoader``'s ``next``, a Keras ``fit``'s
  gap between batches on the torch backend);
- ``communication``: blocked on allreduce results (Horovod's ``synchronize``): what overlap
  with the backward pass did not hide;
- ``optimizer``: the update;
- ``other``: hvdkit's own per-step work (the sync guard, the preemption agreement, metric
  averaging);
- ``compute``: the rest of the step: forward and backward while not waiting on
  communication, and the script's own work.

At the end the launcher reads every rank's record and prints a per-rank table, the verdict
(input-, compute- or communication-bound), the straggler rank if one is consistently slower,
and advice; it writes ``DIR/profile.json`` and ``DIR/profile.png`` (:mod:`.report`).
"""
