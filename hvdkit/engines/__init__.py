"""Horovod jobs on cluster engines that place the processes themselves (Ray, Spark): the pure
world planning (:mod:`.world`) and the Gloo rendezvous both share (:mod:`.rendezvous`)."""
