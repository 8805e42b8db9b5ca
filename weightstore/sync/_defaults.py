"""What a publish keeps and writes, and how often a follower looks, unless told: the one default
of every publisher (publish, BackgroundPublisher, the hooks, sharded commits) and every follower
(follow, Follower, ws follow). A module of their own, importing nothing, so that the ``ws``
command's options show them without importing the publisher (``ws --help`` imports no numpy).
"""

DEFAULT_KEEP = 5


DEFAULT_FORMAT = "npz"


DEFAULT_POLL = 1.0
