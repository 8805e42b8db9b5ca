"""Serving and training glue on top of the adapters: the sync job's two ends in a framework.

* :mod:`~weightstore.adapters.serving.follower`: :class:`Follower` applies each new version
  to a live model (fetch and verify outside the serving lock, then swap);
* :mod:`~weightstore.adapters.serving.hooks`: ``PublishCallback`` (Keras) and
  ``PublishHook`` (TF1 ``MonitoredSession``) publish in the background while training;
* :mod:`~weightstore.adapters.serving.snapshot`: the copy of a model's variables a
  background publish writes.

The modules are imported on demand: the hooks need TensorFlow, the follower does not.
"""
