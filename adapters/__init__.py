"""Frameworks in and out: ``tf1``, ``tf2``, ``torch`` and ``flax``, each with the same verbs
(``export``, ``export_pieces``, ``assign``, ``variables``, ``forget``) and its framework's
extras beside them; :func:`adapter_for` says which one takes an object.

Importing this package imports no framework: each adapter module imports its own, on demand.
"""

from weightstore.adapters._registry import adapter_for, register

__all__ = ["adapter_for", "register"]
