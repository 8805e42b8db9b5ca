"""Job 1, sync: a trainer publishes versions of its weights; followers pick up each one.

A versioned folder (local or on object storage) holds one file per version and a ``LATEST``
pointer written after the version is complete. Here: the pointer and the publish protocol
(:func:`publish`), reading and following it (:func:`latest`, :func:`follow`, pinning a
version while it is read), listings (:func:`list_versions`), change notifications, and the
background publisher trainers use so that a write never blocks a step
(:class:`BackgroundPublisher`), and delta versions, which store what changed since the version
before (:class:`Delta`). Applying a version to a model is the adapters' job
(``weightstore.adapters.serving``).
"""

from typing import TYPE_CHECKING

from weightstore import _lazy

if TYPE_CHECKING:
    from weightstore.sync._background import BackgroundPublisher, PublishFuture
    from weightstore.sync._delta import Delta
    from weightstore.sync._follow import PointerWatch, follow, latest
    from weightstore.sync._listing import VersionEntry, list_versions
    from weightstore.sync._pinning import Version
    from weightstore.sync._publish import PublishOptions, publish

#: each imported on first use (:mod:`weightstore._lazy`): ``ws follow`` never imports the publisher;
#: so is each submodule
__getattr__, __dir__ = _lazy.on_first_use(globals(), {
    **dict.fromkeys(["BackgroundPublisher", "PublishFuture"], "weightstore.sync._background"),
    "Delta": "weightstore.sync._delta",
    **dict.fromkeys(["PointerWatch", "follow", "latest"], "weightstore.sync._follow"),
    **dict.fromkeys(["VersionEntry", "list_versions"], "weightstore.sync._listing"),
    "Version": "weightstore.sync._pinning",
    **dict.fromkeys(["PublishOptions", "publish"], "weightstore.sync._publish"),
})
del TYPE_CHECKING  # no name of the package (dir(weightstore.sync))

__all__ = ["Delta", "Version", "VersionEntry", "PublishOptions", "PointerWatch", "publish", "latest", "follow",
           "list_versions", "BackgroundPublisher", "PublishFuture"]
